"""Held-out evaluation: certified fractions, greedy agreement and acceptance length, offline
(exact, from cached features) and in the speculative decoder."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxcert import losses
from jaxcert.base.validate import round_up
from jaxcert.core import numerics
from jaxcert.core import rules as rules_lib
from jaxcert.core.solver import certificates
from jaxcert.training.features import FeatureSet
from jaxcert.training.heads import DraftHead, LmHead, project

if TYPE_CHECKING:
    from jaxcert.models import LoadedModel

__all__ = [
    "chain_acceptance_length",
    "decoder_acceptance",
    "decoder_acceptance_by_prompt",
    "evaluate",
]


def chain_acceptance_length(match: np.ndarray, draft_length: int) -> tuple[int, int]:
    """Exact greedy chain decoding on a sequence, offline.

    With greedy verification a drafted token is accepted iff it equals the target's
    greedy token, and while drafts are accepted the drafter reads the target's own
    greedy prefix, so its proposals are its argmax at teacher-forced positions.

    Args:
      match: ``[n]`` bool, drafter argmax == target greedy token at each position.
      draft_length: ``K``, drafted tokens per round (constant policy).

    Returns:
      ``(tokens, rounds)``: tokens emitted (accepted drafts plus one target token per
      round) and verification rounds to produce the ``n`` positions.
    """
    n, t, rounds = len(match), 0, 0
    while t < n:
        run = 0
        while run < draft_length and t + run < n and match[t + run]:
            run += 1
        rounds += 1
        t += run + 1
    return n, rounds


def _metrics(
    head: DraftHead | None,
    data: FeatureSet,
    target_model: LmHead,
    drafter_model: LmHead,
    rules: tuple[rules_lib.Rule, ...],
    k: int,
    chunk: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(kl [N], certified [N, rules], drafter top-k ids [N, k])`` of every position."""
    d_graphdef, d_params = nnx.split(drafter_model)
    t_graphdef, t_params = nnx.split(target_model)
    h_graphdef, h_params = nnx.split(head) if head is not None else (None, None)

    # Weights are arguments, not closed-over constants: they are gigabytes.
    @functools.partial(jax.jit, static_argnames=("d_graphdef", "t_graphdef", "h_graphdef"))
    def metrics(
        d_graphdef: nnx.GraphDef,
        d_params: nnx.State,
        t_graphdef: nnx.GraphDef,
        t_params: nnx.State,
        h_graphdef: nnx.GraphDef | None,
        h_params: nnx.State | None,
        h_q: jax.Array,
        h_p: jax.Array,
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        p_logits = project(t_graphdef, t_params, h_p)
        q_in = h_q if h_graphdef is None else nnx.merge(h_graphdef, h_params)(h_q)
        q_logits = project(d_graphdef, d_params, q_in)
        kl = losses.kl_divergence(drafter_logits=q_logits, target_logits=p_logits)
        certs = certificates(p_logits, rules)
        certified = jnp.stack([kl < c.value for c in certs], axis=-1)
        return kl, certified, numerics.top_k(q_logits, k)[1]

    kls, certs, tops = [], [], []
    for start in range(0, len(data), chunk):
        sl = slice(start, start + chunk)
        kl, certified, q_top = metrics(
            d_graphdef, d_params, t_graphdef, t_params, h_graphdef, h_params,
            jnp.asarray(data.drafter_hidden[sl]), jnp.asarray(data.target_hidden[sl]),
        )  # fmt: skip
        kls.append(np.asarray(kl))
        certs.append(np.asarray(certified))
        tops.append(np.asarray(q_top))
    return np.concatenate(kls), np.concatenate(certs), np.concatenate(tops)


def _offline_acceptance_length(match: np.ndarray, data: FeatureSet, draft_length: int) -> float:
    """Tokens per round of :func:`chain_acceptance_length` over every prompt of ``data``."""
    tokens = rounds = 0
    for prompt in np.unique(data.prompt):
        order = np.argsort(data.position[data.prompt == prompt])
        n, r = chain_acceptance_length(match[data.prompt == prompt][order], draft_length)
        tokens, rounds = tokens + n, rounds + r
    return tokens / max(rounds, 1)


def evaluate(
    head: DraftHead | None,
    data: FeatureSet,
    target_model: LmHead,
    drafter_model: LmHead,
    *,
    rules: Sequence[rules_lib.Rule] = (rules_lib.StrictGreedy(), rules_lib.TreeCoverage(4)),
    draft_length: int = 5,
    chunk: int = 256,
) -> dict[str, float]:
    """Held-out metrics of a head (``None``: the plain drafter).

    Returns:
      ``mean_kl`` (nats), ``certified[<rule>]`` (fraction of positions with
      KL(p||q) < C_p), ``agreement`` (drafter argmax == target greedy token),
      ``top{m}_coverage`` (target token in the drafter's top-m, for tree rules) and
      ``acceptance_length`` (tokens per round of exact offline greedy chain decoding
      with ``draft_length`` drafted tokens per round).
    """
    rules = tuple(rules)
    tree_sizes = sorted({r.list_size for r in rules if r.list_size > 1})
    kl, certified, top = _metrics(
        head, data, target_model, drafter_model, rules, max(tree_sizes + [1]), chunk
    )
    match = top[:, 0] == data.token
    out: dict[str, float] = {"positions": len(data), "mean_kl": float(kl.mean())}
    for i, rule in enumerate(rules):
        out[f"certified[{rule.spec}]"] = float(certified[:, i].mean())
    out["agreement"] = float(match.mean())
    for m in tree_sizes:
        out[f"top{m}_coverage"] = float(np.mean(np.any(top[:, :m] == data.token[:, None], 1)))
    out["acceptance_length"] = _offline_acceptance_length(match, data, draft_length)
    return out


def decoder_acceptance_by_prompt(
    target: LoadedModel | nnx.Module,
    drafter: LoadedModel | nnx.Module,
    prompt_ids: Sequence[Sequence[int]],
    *,
    draft_length: int = 5,
    max_new_tokens: int = 64,
    temperature: float = 0.0,
    eos_ids: Sequence[int] = (),
    batch_size: int = 4,
    seed: int = 0,
) -> dict[str, np.ndarray]:
    """Per prompt, a drafter's acceptance in the speculative decoder: a chain with
    ``constant:K``, greedy verification at ``temperature == 0``, speculative sampling
    otherwise.

    Args:
      target: the target (``models.LoadedModel`` or ``nnx.Module``).
      drafter: the drafter, e.g. a :class:`~jaxcert.training.HeadedDrafter` or a
        :class:`jaxcert.models.EagleHead` (same vocabulary).
      prompt_ids: ``P`` prompts' token ids (chat template applied), each of length >= 2.
      draft_length: ``K``, drafted tokens per round (``constant:K`` policy).
      max_new_tokens: output tokens per prompt.
      temperature: ``0`` for greedy, ``> 0`` to sample (the same key for every batch).
      eos_ids: tokens that end a row.
      batch_size: prompts decoded together (one compilation for all batches).
      seed: the sampling key's seed.

    Returns:
      ``{"tokens", "accepted", "rounds"}``, each ``[P]`` float64: emitted tokens, accepted
      drafted tokens and rounds of each prompt.

    Raises:
      ValueError: mismatched vocabularies or prompts shorter than 2 tokens.
    """
    import jax

    from jaxcert import decoding

    config = decoding.DecodeConfig(
        verification=decoding.parse_verify("sample" if temperature > 0 else "greedy"),
        temperature=temperature,
        max_new_tokens=max_new_tokens,
        max_draft=draft_length,
        eos_ids=tuple(eos_ids),
        collect_stats=False,
    )
    policy = decoding.Constant(k=draft_length)
    width = round_up(max(len(p) for p in prompt_ids), 16)
    out: dict[str, list] = {"tokens": [], "accepted": [], "rounds": []}
    for start in range(0, len(prompt_ids), batch_size):
        batch = [list(p) for p in prompt_ids[start : start + batch_size]]
        batch += [batch[-1]] * (batch_size - len(batch))  # same shape for every batch
        real = min(batch_size, len(prompt_ids) - start)
        result = decoding.speculative_decode(
            target, drafter, batch, policy=policy, config=config, prompt_width=width,
            key=jax.random.key(seed),
        )  # fmt: skip
        stats = result.stats
        assert stats is not None  # a drafter was given: per-round statistics exist
        active = np.asarray(stats.active)[:, :real]
        out["tokens"] += list((np.asarray(stats.emitted)[:, :real] * active).sum(0))
        out["accepted"] += list((np.asarray(stats.accepted)[:, :real] * active).sum(0))
        out["rounds"] += list(active.sum(0))
    return {k: np.asarray(v, np.float64) for k, v in out.items()}


def decoder_acceptance(
    target: LoadedModel | nnx.Module,
    drafter: LoadedModel | nnx.Module,
    prompt_ids: Sequence[Sequence[int]],
    *,
    draft_length: int = 5,
    max_new_tokens: int = 64,
    eos_ids: Sequence[int] = (),
    batch_size: int = 4,
) -> dict[str, float]:
    """Acceptance of a drafter in the speculative decoder (greedy chain, constant ``K``),
    over all prompts (:func:`decoder_acceptance_by_prompt`, whose arguments these are).

    Returns:
      ``decoder_acceptance_length``: mean tokens per round (accepted drafts plus the
      target's token; the quantity the offline ``acceptance_length`` computes exactly),
      ``decoder_accepted_per_round``, ``decoder_rounds`` and ``decoder_tokens``.

    Raises:
      ValueError: mismatched vocabularies or prompts shorter than 2 tokens.
    """
    per = decoder_acceptance_by_prompt(
        target, drafter, prompt_ids, draft_length=draft_length,
        max_new_tokens=max_new_tokens, eos_ids=eos_ids, batch_size=batch_size,
    )  # fmt: skip
    tokens, accepted, rounds = (int(per[k].sum()) for k in ("tokens", "accepted", "rounds"))
    return {
        "decoder_acceptance_length": tokens / max(rounds, 1),
        "decoder_accepted_per_round": accepted / max(rounds, 1),
        "decoder_rounds": rounds,
        "decoder_tokens": tokens,
    }
