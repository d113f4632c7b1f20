"""Training drafters that are accepted more often: distillation with certificate losses.

Recipe (``jaxcert train-drafter``, ``scripts/train_drafter.py``):

1. The target greedy-decodes real prompts; both models then read prompt + continuation
   once (teacher forcing) and their final hidden states at every continuation position
   are cached (:func:`collect_features`). At these positions the drafter sees exactly
   what it sees inside an accepted greedy run of speculative decoding.
2. The student is a :class:`DraftHead`, a residual MLP between the drafter's final norm
   and its frozen lm_head, trained on the cached states with optax
   (:func:`train_head`): KL(p||q) alone, or KL plus a certificate-violation term.
3. :func:`evaluate` reports on held-out prompts the mean KL, the certified fraction
   (KL < C_p) per rule, greedy agreement, and the exact offline acceptance length of
   greedy chain decoding with a constant draft length; :func:`decoder_acceptance` runs
   the speculative decoder of :mod:`jaxcert.decoding` with the trained drafter.

Why a head on the drafter: it trains in minutes on 2 CPU cores (only ~2M parameters;
the cost is the two full-vocabulary projections per position, which the certificate
needs anyway), the trunk stays frozen so features are computed once, and the result,
:class:`HeadedDrafter`, is an ordinary drafter for :mod:`jaxcert.decoding` (same call
signature as ``models.Transformer``).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jaxcert import _numerics, certify, losses, prompts
from jaxcert import rules as rules_lib
from jaxcert.solver import certificates

__all__ = [
    "DraftHead",
    "HeadedDrafter",
    "FeatureSet",
    "Continuations",
    "Projection",
    "greedy_continuations",
    "teacher_forced_states",
    "feature_set",
    "check_vocabularies",
    "Objective",
    "collect_features",
    "target_logits",
    "train_head",
    "evaluate",
    "chain_acceptance_length",
    "decoder_acceptance",
]


class DraftHead(nnx.Module):
    """``h + W_out silu(W_in h)`` on ``[..., E]`` hidden states; ``W_out`` starts at zero.

    At initialisation the head is the identity, so a headed drafter starts exactly as
    the plain drafter.
    """

    def __init__(self, hidden_size: int, width: int, *, rngs: nnx.Rngs):
        scale = hidden_size**-0.5
        self.w_in = nnx.Param(jax.random.normal(rngs.params(), (hidden_size, width)) * scale)
        self.w_out = nnx.Param(jnp.zeros((width, hidden_size)))  # [F, E]

    def __call__(self, hidden: jax.Array) -> jax.Array:
        h = hidden.astype(jnp.float32)
        out = h + jax.nn.silu(h @ self.w_in[...]) @ self.w_out[...]
        return out.astype(hidden.dtype)


class HeadedDrafter(nnx.Module):
    """A drafter ``models.Transformer`` with a :class:`DraftHead` before its lm_head.

    Same call signature and ``config`` as the base model, so it works with
    ``models.forward`` and the speculative decoder.
    """

    def __init__(self, base, head: DraftHead):
        self.base = base
        self.head = head
        self.config = base.config
        self.dtype = base.dtype

    def features(self, tokens, cache, **kwargs):
        hidden, cache = self.base.features(tokens, cache, **kwargs)
        return self.head(hidden), cache

    def project(self, hidden):
        return self.base.project(hidden)

    def __call__(self, tokens, cache, *, positions=None, attention_mask=None, return_hidden=False):
        hidden, cache = self.features(
            tokens, cache, positions=positions, attention_mask=attention_mask
        )
        logits = self.project(hidden)
        return (logits, cache, hidden) if return_hidden else (logits, cache)


@dataclasses.dataclass(frozen=True)
class FeatureSet:
    """Cached teacher-forced features, one row per continuation position.

    Attributes:
      drafter_hidden: ``[N, Eq]`` float32 final-norm hidden states of the drafter.
      target_hidden: ``[N, Ep]`` float32 final-norm hidden states of the target.
      prompt: ``[N]`` int32 index of the prompt.
      position: ``[N]`` int32 position in the continuation (0 = first generated token).
      token: ``[N]`` int32 the target's greedy token at that position.
    """

    drafter_hidden: np.ndarray
    target_hidden: np.ndarray
    prompt: np.ndarray
    position: np.ndarray
    token: np.ndarray

    def __len__(self) -> int:
        return int(self.token.shape[0])

    def select(self, mask: np.ndarray) -> FeatureSet:
        return FeatureSet(*(getattr(self, f.name)[mask] for f in dataclasses.fields(self)))


@dataclasses.dataclass(frozen=True)
class Continuations:
    """Prompts and the target's greedy continuations, by prompt index.

    Attributes:
      prompt_ids: prompt index -> token ids of the prompt (chat template applied).
      generated: prompt index -> the target's greedy continuation (token ids).
    """

    prompt_ids: dict[int, list[int]]
    generated: dict[int, list[int]]


def greedy_continuations(
    target_lm,
    prompt_set: Sequence[prompts.Prompt],
    *,
    steps: int = 96,
    batch_size: int = 8,
    progress: Callable[[int, int], None] | None = None,
) -> Continuations:
    """The target's greedy continuation of every prompt (up to ``steps`` tokens or EOS)."""
    options = certify.CertifyOptions(steps=steps, batch_size=batch_size)
    table, _ = certify.certify_prompts(
        target_lm, prompt_set, (rules_lib.StrictGreedy(),), options, progress=progress
    )
    encoded = prompts.encode_prompts(target_lm.tokenizer, prompt_set)
    rows = table.select(["prompt_id", "token"]).to_pydict()
    index = {p.id: i for i, p in enumerate(prompt_set)}
    generated: dict[int, list[int]] = {}
    for pid, token in zip(rows["prompt_id"], rows["token"], strict=True):
        generated.setdefault(index[pid], []).append(int(token))
    return Continuations({i: encoded[i] for i in generated}, dict(sorted(generated.items())))


def _features_fn(graphdef, state, tokens, cache):
    return nnx.merge(graphdef, state).features(tokens, cache)[0]


_features = jax.jit(_features_fn, static_argnums=0)


def teacher_forced_states(lm, continuations: Continuations) -> np.ndarray:
    """``[N, E]`` float32 final hidden states of ``lm`` at every continuation position.

    One prefill of prompt + continuation per prompt (one padded width, so one compile);
    row order is prompt index, then position.
    """
    from jaxcert import models

    graphdef, state = nnx.split(lm.model)
    lengths = [len(continuations.prompt_ids[i]) + len(g) for i, g in
               continuations.generated.items()]  # fmt: skip
    width = -(-max(lengths) // 64) * 64
    out = []
    for i, generated in continuations.generated.items():
        ids = continuations.prompt_ids[i] + generated
        tokens = np.zeros((1, width), np.int32)
        tokens[0, : len(ids)] = ids
        cache = models.KVCache.create(lm.config, 1, width, dtype=lm.model.dtype)
        hidden = _features(graphdef, state, jnp.asarray(tokens), cache)[0]
        first = len(continuations.prompt_ids[i]) - 1  # predicts the first generated token
        out.append(np.asarray(hidden[first : first + len(generated)], np.float32))
    return np.concatenate(out)


def feature_set(
    continuations: Continuations, target_hidden: np.ndarray, drafter_hidden: np.ndarray
) -> FeatureSet:
    """Assembles a :class:`FeatureSet` from :func:`teacher_forced_states` of both models."""
    generated = continuations.generated
    return FeatureSet(
        drafter_hidden=drafter_hidden,
        target_hidden=target_hidden,
        prompt=np.concatenate([np.full(len(g), i, np.int32) for i, g in generated.items()]),
        position=np.concatenate([np.arange(len(g), dtype=np.int32) for g in generated.values()]),
        token=np.concatenate([np.asarray(g, np.int32) for g in generated.values()]),
    )


def check_vocabularies(target_config, drafter_config) -> None:
    """Raises ``ValueError`` when target and drafter vocabulary sizes differ."""
    if target_config.vocab_size != drafter_config.vocab_size:
        raise ValueError(
            f"vocabulary mismatch: target V={target_config.vocab_size}, "
            f"drafter V={drafter_config.vocab_size}"
        )


def collect_features(
    target_lm,
    drafter_lm,
    prompt_set: Sequence[prompts.Prompt],
    *,
    steps: int = 96,
    batch_size: int = 8,
    progress: Callable[[int, int], None] | None = None,
) -> FeatureSet:
    """Greedy continuations of the target, then teacher-forced hidden states of both models.

    Raises:
      ValueError: the two models have different vocabulary sizes.
    """
    check_vocabularies(target_lm.config, drafter_lm.config)
    conts = greedy_continuations(
        target_lm, prompt_set, steps=steps, batch_size=batch_size, progress=progress
    )
    return feature_set(
        conts, teacher_forced_states(target_lm, conts), teacher_forced_states(drafter_lm, conts)
    )


class Projection(nnx.Module):
    """Only the lm_head of a model (``project`` and ``config``): frees the trunk's memory."""

    def __init__(self, model):
        tied = model.lm_head is None
        self.weight = nnx.Param(model.embedding[...] if tied else model.lm_head[...])
        self.spec = "...E,VE->...V" if tied else "...E,EV->...V"
        self.config = model.config

    def project(self, hidden: jax.Array) -> jax.Array:
        w = self.weight[...]
        return jnp.einsum(self.spec, hidden.astype(w.dtype), w, preferred_element_type=jnp.float32)


@dataclasses.dataclass(frozen=True)
class Objective:
    """``KL(p||q) + weight * mean(certificate_violation(q, p, rule, margin))``.

    Attributes:
      name: label in tables.
      rule: the rule of the violation term, or ``None`` for plain KL distillation.
      weight: ``lambda``, the weight of the violation term.
      margin: nats of slack asked below the certificate.
    """

    name: str
    rule: rules_lib.Rule | None = None
    weight: float = 1.0
    margin: float = 0.0


def _project_fn(graphdef, state, hidden):
    return nnx.merge(graphdef, state).project(hidden)


def _loss(head, d_graph, d_state, h_q, target_logits, objective: Objective):
    drafter_logits = _project_fn(d_graph, d_state, head(h_q))
    kl = losses.kl_divergence(target_logits, drafter_logits)
    loss = jnp.mean(kl)
    violation = jnp.zeros(())
    if objective.rule is not None:
        violation = jnp.mean(
            losses.certificate_violation(
                drafter_logits, target_logits, objective.rule, margin=objective.margin
            )
        )
        loss = loss + objective.weight * violation
    return loss, (jnp.mean(kl), violation)


def target_logits(data: FeatureSet, target_model, *, chunk: int = 256) -> np.ndarray:
    """``[N, V]`` float32 target logits of every position (computed once for training).

    The target's projection is the costliest part of a training step (``E_p x V``
    multiply-adds per position); precomputing it makes each step read a batch instead.
    """
    graph, state = nnx.split(target_model)
    project = jax.jit(_project_fn, static_argnums=0)
    return np.concatenate([
        np.asarray(project(graph, state, jnp.asarray(data.target_hidden[i : i + chunk])))
        for i in range(0, len(data), chunk)
    ])  # fmt: skip


def train_head(
    objective: Objective,
    train: FeatureSet,
    train_target_logits: np.ndarray,
    drafter_model,
    *,
    steps: int = 150,
    batch_size: int = 64,
    learning_rate: float = 1e-3,
    width: int = 1024,
    seed: int = 0,
    progress: Callable[[int, int], None] | None = None,
) -> tuple[DraftHead, list[dict]]:
    """Trains a :class:`DraftHead` on cached features with Adam.

    Args:
      objective: what to minimise.
      train: training features.
      train_target_logits: ``[N, V]`` target logits of ``train`` (:func:`target_logits`).
      drafter_model: the drafter ``models.Transformer`` (or compatible; its ``project``
        maps hidden states to logits); it stays frozen.
      steps, batch_size, learning_rate, width, seed: optimisation settings (Adam, linear
        warm-up over the first 10% of steps to ``learning_rate``, then cosine decay); the
        same seed gives the same initial head and the same batches for every objective.

    Returns:
      ``(head, history)``; ``history`` has one dict per step (loss, kl, violation, seconds).

    Raises:
      ValueError: the target logits do not match the features or the drafter's vocabulary.
    """
    vocab = drafter_model.config.vocab_size
    if train_target_logits.shape != (len(train), vocab):
        raise ValueError(
            f"target logits have shape {train_target_logits.shape}, expected "
            f"{(len(train), vocab)} (positions, drafter vocabulary)"
        )
    head = DraftHead(train.drafter_hidden.shape[-1], width, rngs=nnx.Rngs(seed))
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, learning_rate, warmup_steps=max(1, steps // 10), decay_steps=max(steps, 2)
    )
    optimizer = nnx.Optimizer(head, optax.adam(schedule), wrt=nnx.Param)
    d_graph, d_state = nnx.split(drafter_model)

    @nnx.jit(static_argnums=2)
    def step(head, optimizer, d_graph, d_state, h_q, p_logits):
        grad_fn = nnx.value_and_grad(_loss, has_aux=True)
        (loss, (kl, violation)), grads = grad_fn(head, d_graph, d_state, h_q, p_logits, objective)
        optimizer.update(head, grads)
        return loss, kl, violation

    rng = np.random.default_rng(seed)
    history = []
    for i in range(steps):
        idx = rng.integers(0, len(train), batch_size)
        start = time.perf_counter()
        loss, kl, violation = step(
            head, optimizer, d_graph, d_state,
            jnp.asarray(train.drafter_hidden[idx]), jnp.asarray(train_target_logits[idx]),
        )  # fmt: skip
        history.append({"step": i, "loss": float(loss), "kl": float(kl),
                        "violation": float(violation),
                        "seconds": time.perf_counter() - start})  # fmt: skip
        if progress is not None:
            progress(i + 1, steps)
    return head, history


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


def evaluate(
    head: DraftHead | None,
    data: FeatureSet,
    target_model,
    drafter_model,
    *,
    rules: Sequence[rules_lib.Rule] = (rules_lib.StrictGreedy(), rules_lib.TreeCoverage(4)),
    draft_length: int = 5,
    chunk: int = 256,
) -> dict:
    """Held-out metrics of a head (``None``: the plain drafter).

    Returns:
      ``mean_kl`` (nats), ``certified[<rule>]`` (fraction of positions with
      KL(p||q) < C_p), ``agreement`` (drafter argmax == target greedy token),
      ``top{m}_coverage`` (target token in the drafter's top-m, for tree rules) and
      ``acceptance_length`` (tokens per round of exact offline greedy chain decoding
      with ``draft_length`` drafted tokens per round).
    """
    d_graph, d_state = nnx.split(drafter_model)
    t_graph, t_state = nnx.split(target_model)
    h_graph, h_state = nnx.split(head) if head is not None else (None, None)
    rules = tuple(rules)
    tree_sizes = sorted({r.list_size for r in rules if r.list_size > 1})
    k = max(tree_sizes + [1])

    # Weights are arguments, not closed-over constants: they are gigabytes.
    @functools.partial(jax.jit, static_argnums=(0, 2, 4))
    def metrics(d_graph, d_state, t_graph, t_state, h_graph, h_state, h_q, h_p):
        p_logits = _project_fn(t_graph, t_state, h_p)
        q_in = h_q if h_graph is None else nnx.merge(h_graph, h_state)(h_q)
        q_logits = _project_fn(d_graph, d_state, q_in)
        kl = losses.kl_divergence(p_logits, q_logits)
        certs = certificates(p_logits, rules)
        certified = jnp.stack([kl < c.value for c in certs], axis=-1)
        return kl, certified, _numerics.top_k(q_logits, k)[1]

    kls, certs, tops = [], [], []
    for start in range(0, len(data), chunk):
        sl = slice(start, start + chunk)
        kl, certified, q_top = metrics(
            d_graph, d_state, t_graph, t_state, h_graph, h_state,
            jnp.asarray(data.drafter_hidden[sl]), jnp.asarray(data.target_hidden[sl]),
        )  # fmt: skip
        kls.append(np.asarray(kl))
        certs.append(np.asarray(certified))
        tops.append(np.asarray(q_top))
    kl, certified, top = np.concatenate(kls), np.concatenate(certs), np.concatenate(tops)
    match = top[:, 0] == data.token
    tokens = rounds = 0
    for prompt in np.unique(data.prompt):
        order = np.argsort(data.position[data.prompt == prompt])
        n, r = chain_acceptance_length(match[data.prompt == prompt][order], draft_length)
        tokens, rounds = tokens + n, rounds + r
    out = {"positions": len(data), "mean_kl": float(kl.mean())}
    for i, rule in enumerate(rules):
        out[f"certified[{rule.spec}]"] = float(certified[:, i].mean())
    out["agreement"] = float(match.mean())
    for m in tree_sizes:
        out[f"top{m}_coverage"] = float(np.mean(np.any(top[:, :m] == data.token[:, None], 1)))
    out["acceptance_length"] = tokens / max(rounds, 1)
    return out


def decoder_acceptance(
    target,
    drafter,
    prompt_ids: Sequence[Sequence[int]],
    *,
    draft_length: int = 5,
    max_new_tokens: int = 64,
    eos_ids: Sequence[int] = (),
    batch_size: int = 4,
) -> dict:
    """Acceptance of a drafter in the speculative decoder (greedy chain, constant ``K``).

    Args:
      target: the target (``models.LoadedModel`` or ``nnx.Module``).
      drafter: the drafter, e.g. a :class:`HeadedDrafter` (same vocabulary).
      prompt_ids: token ids of each prompt (chat template applied), each of length >= 2.
      draft_length: ``K``, drafted tokens per round (``constant:K`` policy).
      max_new_tokens: output tokens per prompt.
      eos_ids: tokens that end a row.
      batch_size: prompts decoded together (one compilation for all batches).

    Returns:
      ``decoder_acceptance_length``: mean tokens per round (accepted drafts plus the
      target's token; the quantity the offline ``acceptance_length`` computes exactly),
      ``decoder_accepted_per_round``, ``decoder_rounds`` and ``decoder_tokens``.

    Raises:
      ValueError: mismatched vocabularies or prompts shorter than 2 tokens.
    """
    from jaxcert import decoding

    config = decoding.DecodeConfig(
        verification=decoding.parse_verify("greedy"),
        max_new_tokens=max_new_tokens,
        max_draft=draft_length,
        eos_ids=tuple(eos_ids),
        collect_stats=False,
    )
    policy = decoding.Constant(k=draft_length)
    width = 16 * -(-max(len(p) for p in prompt_ids) // 16)
    tokens = rounds = accepted = 0
    for start in range(0, len(prompt_ids), batch_size):
        batch = [list(p) for p in prompt_ids[start : start + batch_size]]
        batch += [batch[-1]] * (batch_size - len(batch))  # same shape for every batch
        real = min(batch_size, len(prompt_ids) - start)
        out = decoding.speculative_decode(
            target, drafter, batch, policy=policy, config=config, prompt_width=width
        )
        active = np.asarray(out.stats.active)[:, :real]
        tokens += int(np.asarray(out.stats.emitted)[:, :real][active].sum())
        accepted += int(np.asarray(out.stats.accepted)[:, :real][active].sum())
        rounds += int(active.sum())
    return {
        "decoder_acceptance_length": tokens / max(rounds, 1),
        "decoder_accepted_per_round": accepted / max(rounds, 1),
        "decoder_rounds": rounds,
        "decoder_tokens": tokens,
    }
