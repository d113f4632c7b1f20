"""Training an EAGLE draft head (`jaxcert.models.EagleHead`) on a target's own states.

Teacher forcing, as the decoder drafts (``docs/design.md``, "Draft heads"): over a token
sequence ``x_0 .. x_{T-1}`` the target returns its logits and the states the head fuses;
the head reads ``x_t`` with the target's states at ``t - 1`` (``x_0`` with a zero feature)
and its distribution ``q_t`` over ``x_{t+1}`` is trained towards the target's ``p_t`` with
an :class:`~jaxcert.training.train.Objective` (``KL(p_t || q_t)``, plus a certificate
violation term if the objective has a rule). Only the head's `TRAINABLE` parameters move
(the embedding and lm-head it shares with the target stay).

Shape letters: ``B`` sequences, ``T`` positions, ``V`` vocabulary, ``Z`` the head's input
width (``len(taps) * E``, or ``E`` for the target's final-norm states).
"""

from __future__ import annotations

import json
import math
import os
import pathlib
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx, struct

from jaxcert import losses
from jaxcert.base.folders import atomic_write
from jaxcert.base.validate import check_int, check_probability
from jaxcert.core import rules as rules_lib
from jaxcert.decoding.protocols import context_before, shifted_right
from jaxcert.models import EagleHead, Transformer
from jaxcert.models.eagle import TRAINABLE, target_features
from jaxcert.training.head_data import HeadRecords, batch_rows
from jaxcert.training.train import Objective

__all__ = [
    "TargetStates",
    "head_loss",
    "target_states",
    "train_eagle_head",
    "train_head_on_records",
    "unroll_mask",
    "unrolled_features",
    "unrolled_window_terms",
    "window_loss",
    "window_terms",
]


@struct.dataclass
class TargetStates:
    """What the head trains on, from one teacher-forced target pass.

    Attributes:
      tokens: ``[B, T]`` int32 sequences.
      states: ``[B, T, Z]`` the target's states the head fuses (position ``t``: after reading
        ``x_t``).
      logits: ``[B, T, V]`` float32 target logits (position ``t`` predicts ``x_{t+1}``).
      mask: ``[B, T]`` bool, positions whose next token is part of the sequence.
    """

    tokens: jax.Array
    states: jax.Array
    logits: jax.Array
    mask: jax.Array


def target_states(
    target: Transformer, tokens: jax.typing.ArrayLike, lengths: np.ndarray, taps: tuple[int, ...]
) -> TargetStates:
    """The target's teacher-forced states and logits over right-padded sequences.

    Args:
      target: the target model.
      tokens: ``[B, T]`` int sequences, right-padded; ``lengths`` ``[B]`` their lengths.
      taps: the head's taps (``()``: final-norm hidden states).

    Raises:
      ValueError: shapes that disagree, or a length outside ``[2, T]``.
    """
    ids = jnp.asarray(tokens, jnp.int32)
    lengths = np.asarray(lengths)
    b, t = ids.shape
    if lengths.shape != (b,) or lengths.min(initial=t) < 2 or lengths.max(initial=0) > t:
        raise ValueError(f"lengths must be [B={b}] in [2, T={t}], got {lengths.tolist()}")
    graphdef, params = nnx.split(target)
    logits, states = _target_pass(graphdef, params, ids, taps)
    mask = jnp.arange(t)[None, :] < jnp.asarray(lengths)[:, None] - 1
    return TargetStates(ids, states, logits, mask)


@jax.jit(static_argnums=(0, 3))
def _target_pass(graphdef, params, tokens, taps):
    model = nnx.merge(graphdef, params)
    cache = model.init_cache(tokens.shape[0], tokens.shape[1])
    hidden, _, states = target_features(model, tokens, cache, taps)
    return model.project(hidden), states


def head_loss(
    head: EagleHead, batch: TargetStates, objective: Objective
) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    """The objective over a batch's valid positions: ``(loss, (mean KL, mean violation))``.

    ``q_t`` is the head reading ``x_t`` with the target's states at ``t - 1``; KL in nats.
    """
    b, t = batch.tokens.shape
    context = context_before(head, batch.states)  # as the decoder's prefill reads
    q_logits, _ = head(batch.tokens, head.init_cache(b, t), context=context, outside="oov")
    mask = batch.mask
    count = jnp.maximum(jnp.sum(mask), 1)
    kl = losses.kl_divergence(drafter_logits=q_logits, target_logits=batch.logits, where=mask)
    mean_kl = jnp.sum(kl) / count
    violation = jnp.zeros(())
    if objective.rule is not None:
        v = losses.certificate_violation(
            q_logits, batch.logits, objective.rule, margin=objective.margin, where=mask
        )
        violation = jnp.sum(v) / count
    return mean_kl + objective.weight * violation, (mean_kl, violation)


def train_eagle_head(
    head: EagleHead,
    data: TargetStates,
    objective: Objective,
    *,
    steps: int,
    batch_size: int = 8,
    learning_rate: float = 1e-3,
    seed: int = 0,
    log: Callable[[int, float, float], None] | None = None,
) -> tuple[EagleHead, list[tuple[float, float]]]:
    """Trains ``head``'s `TRAINABLE` parameters with Adam on random batches of ``data``.

    Args:
      head: the head (modified in place and returned).
      data: :func:`target_states` of the training sequences.
      objective: the loss.
      steps, batch_size, learning_rate, seed: the optimisation.
      log: called as ``log(step, kl, violation)`` after every step.

    Returns:
      ``(head, history)``: the trained head and ``(kl, violation)`` per step.
    """
    optimizer = nnx.Optimizer(head, optax.adam(learning_rate), wrt=TRAINABLE)

    @nnx.jit
    def step(head, optimizer, batch):
        diff = nnx.DiffState(0, TRAINABLE)
        grad_fn = nnx.value_and_grad(head_loss, argnums=diff, has_aux=True)
        (_, (kl, violation)), grads = grad_fn(head, batch, objective)
        optimizer.update(head, grads)
        return kl, violation

    rng = np.random.default_rng(seed)
    n = data.tokens.shape[0]
    history = []
    for i in range(steps):
        rows = jnp.asarray(rng.choice(n, size=min(batch_size, n), replace=False))
        batch = jax.tree.map(lambda x: x[rows], data)  # noqa: B023
        kl, violation = (float(x) for x in step(head, optimizer, batch))
        history.append((kl, violation))
        if log is not None:
            log(i, kl, violation)
    return head, history


# Training from a record store (`jaxcert.training.head_data`): the target is not in memory;
# its distribution is the stored top-K window.


def _window_log_q(
    head: EagleHead, hidden: jax.Array, ids: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """``(log q [..., K], argmax [...])`` of the full-vocabulary ids ``[..., K]`` from the
    head's hidden ``[..., E]``, without materialising ``[..., V]`` logits when the head has a
    draft vocabulary. ``argmax`` is the head's greedy token (``-1``: a token outside the draft
    vocabulary, whose shared logit is the largest)."""
    v = head.config.vocab_size
    z = head.draft_logits(hidden).astype(jnp.float32)  # [..., V']
    if head.draft_vocab is None or head.oov_logit is None:
        log_q = jnp.take_along_axis(jax.nn.log_softmax(z, axis=-1), ids, axis=-1)
        return log_q, jnp.argmax(z, axis=-1).astype(jnp.int32)
    draft = head.draft_vocab[...]
    b = head.oov_logit[...].astype(jnp.float32)
    log_z = jnp.logaddexp(jax.nn.logsumexp(z, axis=-1), b + math.log(v - draft.shape[0]))
    index = jnp.full((v,), -1, jnp.int32).at[draft].set(jnp.arange(draft.shape[0], dtype=jnp.int32))
    at = index[ids]
    inside = jnp.take_along_axis(z, jnp.maximum(at, 0), axis=-1)
    best = jnp.argmax(z, axis=-1)
    top = jnp.where(jnp.max(z, axis=-1) >= b, draft[best], -1).astype(jnp.int32)
    return jnp.where(at >= 0, inside, b) - log_z[..., None], top


def unroll_mask(length: int, depth: int) -> np.ndarray:
    """``[D*T, D*T]`` bool: which of the unrolled tokens each one attends to.

    Row and column ``k * T + t`` is pass ``k`` at position ``t``: the head reading ``x_t``
    as the ``(k + 1)``-th token it drafts in a round whose last accepted token is
    ``x_{t-k}``. As the decoder's cache holds it then, that token sees pass 0 (the slots
    read with the target's states) at positions ``u <= t - k``, and pass ``j`` in
    ``1..k`` only at ``t - k + j`` (its own earlier drafts of the round, itself last).
    Pass 0 alone is the causal mask. ``docs/training.md``, "Training-time test".

    Raises:
      ValueError: ``length`` or ``depth`` below 1.
    """
    check_int("length", length)
    check_int("depth", depth)
    t = np.arange(length)
    rows = []
    for k in range(depth):
        cols = [t[None, :] <= t[:, None] - k]  # pass 0
        cols += [t[None, :] == t[:, None] - k + j if j <= k else np.zeros((length, length), bool)
                 for j in range(1, depth)]  # fmt: skip
        rows.append(np.concatenate(cols, axis=1))
    return np.concatenate(rows, axis=0)


def unrolled_features(
    head: EagleHead, tokens: jax.Array, states: jax.Array, depth: int
) -> jax.Array:
    """The head's hidden states ``[D, b, T, E]`` when it drafts ``depth`` tokens a round.

    Pass 0 is teacher forcing (``x_t`` with the target's states at ``t - 1``); pass ``k``
    reads ``x_t`` with pass ``k - 1``'s hidden state at ``t - 1``, attending as
    :func:`unroll_mask` says: what the decoder computes for its ``(k + 1)``-th drafted token
    when its drafts before it in the round were ``x_{t-k+1} .. x_t`` ("training-time test"). Pass
    ``k`` at ``t < k`` has no such round (its values are not meaningful). Gradients flow
    through the earlier passes' states. ``D`` calls of the head, over ``T, 2T, .., D*T``
    tokens (each call recomputes the passes before it: the same values).

    Args:
      head: the head.
      tokens: ``[b, T]`` int ids; ``states`` ``[b, T, Z]`` the target's states after each.
      depth: ``D >= 1``, drafted tokens a round.

    Raises:
      ValueError: ``depth`` below 1.
    """
    check_int("depth", depth)
    b, t = tokens.shape
    contexts = [context_before(head, states)]
    if depth == 1:
        hidden, _ = head.features(tokens, head.init_cache(b, t), context=contexts[0])
        return hidden[None]
    for k in range(1, depth + 1):
        n = k * t
        mask = jnp.broadcast_to(jnp.asarray(unroll_mask(t, k)), (b, n, n))
        positions = jnp.broadcast_to(jnp.tile(jnp.arange(t, dtype=jnp.int32), k), (b, n))
        hidden, _ = head.features(
            jnp.tile(tokens, (1, k)),
            head.init_cache(b, n),
            context=jnp.concatenate(contexts, axis=1),
            positions=positions,
            attention_mask=mask,
        )
        hidden = hidden.reshape(b, k, t, -1)
        contexts.append(shifted_right(hidden[:, k - 1]))
    return jnp.moveaxis(hidden, 1, 0)


def unrolled_window_terms(
    head: EagleHead, batch: dict[str, jax.Array], depth: int
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """:func:`window_terms` for each of ``depth`` drafted tokens a round
    (:func:`unrolled_features`): ``kl`` ``[D, b, T]`` nats, ``tv`` ``[D, b, T]``,
    ``certificate`` ``[b, T, R]`` nats, ``argmax`` ``[D, b, T]`` int32. Pass ``k`` at
    ``t`` is scored against the target's window at ``t`` (its next token is ``x_{t+1}``
    whichever pass drafts it); positions ``t < k`` are not meaningful for pass ``k``.

    Raises:
      ValueError: ``depth`` below 1.
    """
    hidden = unrolled_features(head, batch["tokens"], batch["states"], depth)  # [D, b, T, E]
    ids = jnp.broadcast_to(batch["top_ids"], (depth, *batch["top_ids"].shape))
    log_q, top = _window_log_q(head, hidden, ids)  # [D, b, T, K], [D, b, T]
    kl, tv = coarse_terms(batch["top_logp"], log_q)
    return kl, tv, batch["certificate"], top


def coarse_terms(log_p: jax.Array, log_q: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(KL(p'||q'), TV(p', q'))`` ``[...]`` of two distributions coarsened to a window of
    ``K`` tokens plus one bucket for the rest (``p_rest = 1 - sum_K p``, likewise ``q``).

    Args:
      log_p: ``[..., K]`` the target's log-probabilities at the window (normalised over the
        full vocabulary).
      log_q: ``[..., K]`` the drafter's at the same ids.

    Returns:
      ``kl`` (nats, clipped at 0 against rounding) and ``tv``, both ``[...]``.
    """
    p, q = jnp.exp(log_p), jnp.exp(log_q)
    p_rest = jnp.clip(1.0 - jnp.sum(p, axis=-1), 0.0, 1.0)
    q_rest = jnp.clip(1.0 - jnp.sum(q, axis=-1), 1e-30, 1.0)
    rest = jnp.where(
        p_rest > 0, p_rest * (jnp.log(jnp.maximum(p_rest, 1e-30)) - jnp.log(q_rest)), 0
    )
    kl = jnp.maximum(jnp.sum(p * (log_p - log_q), axis=-1) + rest, 0.0)
    tv = 1.0 - jnp.sum(jnp.minimum(p, q), axis=-1) - jnp.minimum(p_rest, q_rest)
    return kl, tv


def window_terms(
    head: EagleHead, batch: dict[str, jax.Array]
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Per-position ``(KL, TV, certificate, argmax)`` of the head against a stored target
    window.

    Both distributions are coarsened to the target's top-K ids plus one bucket for the rest
    (``p_rest = 1 - sum_K p``, likewise ``q_rest``): ``KL`` is ``KL(p'||q')`` of the
    coarsened pair, a lower bound on ``KL(p||q)`` (equal when ``p`` has no mass outside its
    window), and ``TV = 1 - sum min(p', q')``. ``certificate`` is the stored exact ``C_p``
    ``[..., R]`` (full vocabulary). ``docs/training.md``, "Training a draft head at scale".

    Args:
      head: the head.
      batch: `HeadRecords` fields as arrays: ``tokens`` ``[b, T]``, ``states``
        ``[b, T, Z]``, ``top_logp`` / ``top_ids`` ``[b, T, K]``, ``certificate``.

    Returns:
      ``kl`` ``[b, T]`` nats, ``tv`` ``[b, T]``, ``certificate`` ``[b, T, R]`` nats and
      ``argmax`` ``[b, T]`` int32, the head's greedy token (``-1``: outside the draft
      vocabulary).
    """
    kl, tv, cert, top = unrolled_window_terms(head, batch, 1)
    return kl[0], tv[0], cert, top[0]


def window_loss(
    head: EagleHead,
    batch: dict[str, jax.Array],
    objective: Objective,
    rule_index: int | None,
    depth: int = 1,
    decay: float = 0.8,
) -> tuple[jax.Array, tuple[jax.Array, jax.Array, jax.Array]]:
    """``mean KL + weight * mean relu(KL - C_p + margin) + tv_weight * mean TV`` over the
    batch's ``mask``: ``(loss, (kl, violation, tv))``, means in nats (TV unitless).

    With ``depth > 1`` ("training-time test", :func:`unrolled_window_terms`) the loss is
    the mean over passes ``k < depth`` of that objective, weighted ``decay**k`` (pass ``k``
    only over positions ``t >= k``); the returned terms stay pass 0's, so that runs of any
    depth log comparable figures.
    """
    kl, tv, cert, _ = unrolled_window_terms(head, batch, depth)  # [D, b, T]
    positions = jnp.arange(batch["tokens"].shape[1])
    total, weights = jnp.zeros(()), 0.0
    terms = []
    for k in range(depth):
        mask = batch["mask"] & (positions >= k)[None, :]
        count = jnp.maximum(jnp.sum(mask), 1)
        mean = lambda x, mask=mask, count=count: jnp.sum(jnp.where(mask, x, 0.0)) / count  # noqa: E731
        violation = jnp.zeros(())
        if rule_index is not None:
            c = cert[..., rule_index]
            hinge = jnp.where(jnp.isfinite(c), jax.nn.relu(kl[k] - c + objective.margin), 0.0)
            violation = mean(hinge)
        kl_k, tv_k = mean(kl[k]), mean(tv[k])
        loss = kl_k + objective.weight * violation + objective.tv_weight * tv_k
        total, weights = total + decay**k * loss, weights + decay**k
        terms.append((kl_k, violation, tv_k))
    return total / weights, terms[0]


def train_head_on_records(
    head: EagleHead,
    records: HeadRecords,
    objective: Objective,
    *,
    rule_names: tuple[str, ...],
    steps: int,
    batch_size: int = 4,
    learning_rate: float = 3e-4,
    seed: int = 0,
    checkpoint: str | os.PathLike | None = None,
    every: int = 25,
    log: Callable[[int, dict[str, float]], None] | None = None,
    depth: int = 1,
    decay: float = 0.8,
) -> tuple[EagleHead, list[dict[str, float]]]:
    """Trains ``head``'s `TRAINABLE` parameters on stored records, resumable.

    Adam with a linear warm-up over the first 5% of ``steps`` and cosine decay; the batch of
    step ``i`` depends only on ``(seed, i)``. With ``checkpoint`` (a folder), the head
    (`save_head`), the optimiser state and the history are written every ``every`` steps and
    at the end, and a run that finds a checkpoint there continues from its step.

    Args:
      head: the initial head (ignored when a checkpoint is resumed; modified in place).
      records: `HeadRecords` (``Store.load``).
      objective: the loss; its ``rule`` must be one of the store's rules.
      rule_names: the store's rule specs, in the order of ``records.certificate``.
      steps: total optimisation steps (a resumed run does the remaining ones).
      batch_size: sequences per step.
      learning_rate: the peak rate.
      seed: batch order.
      checkpoint: the folder of checkpoints, or ``None``.
      every: steps between checkpoints.
      log: called as ``log(step, {"loss", "kl", "violation", "tv", "seconds"})``.
      depth, decay: training-time test: the loss over ``depth`` drafted tokens a round,
        pass ``k`` weighted ``decay**k`` (:func:`window_loss`); ``depth=1`` is teacher
        forcing.

    Returns:
      ``(head, history)``, one dict per step done (all steps when resumed).

    Raises:
      ValueError: the objective's rule is not among the store's rules, ``depth`` below 1 or
        ``decay`` not in ``(0, 1]``.
    """
    import time

    from jaxcert.models.eagle import load_head, save_head

    check_int("depth", depth)
    check_probability("decay", decay)
    rule_index = None
    if objective.rule is not None:
        parsed = [rules_lib.parse_rule(r) for r in rule_names]
        if objective.rule not in parsed:
            raise ValueError(f"rule {objective.rule} is not among the store's rules {rule_names}")
        rule_index = parsed.index(objective.rule)
    warmup = max(steps // 20, 1)
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, learning_rate, warmup, max(steps, warmup + 1)
    )
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(schedule))
    history: list[dict[str, float]] = []
    start = 0
    folder = None if checkpoint is None else pathlib.Path(checkpoint)
    if folder is not None and (folder / "progress.json").is_file():
        head = load_head(folder / "head")
        history = json.loads((folder / "progress.json").read_text())["history"]
        start = len(history)
    optimizer = nnx.Optimizer(head, tx, wrt=TRAINABLE)
    if start:
        from safetensors.numpy import load_file

        saved = load_file(folder / "optimizer.safetensors")  # type: ignore[operator]
        opt_state = nnx.state(optimizer, nnx.optimizer.OptState)
        leaves, treedef = jax.tree.flatten(opt_state)
        restored = [jnp.asarray(saved[f"{i:05d}"], x.dtype) for i, x in enumerate(leaves)]
        nnx.update(optimizer, jax.tree.unflatten(treedef, restored))

    @nnx.jit
    def step(head, optimizer, batch):
        diff = nnx.DiffState(0, TRAINABLE)
        grad_fn = nnx.value_and_grad(window_loss, argnums=diff, has_aux=True)
        (loss, aux), grads = grad_fn(head, batch, objective, rule_index, depth, decay)
        optimizer.update(head, grads)
        return (loss, *aux)

    def save(done: int) -> None:
        from safetensors.numpy import save_file

        assert folder is not None
        folder.mkdir(parents=True, exist_ok=True)
        save_head(head, folder / "head")
        leaves = jax.tree.leaves(nnx.state(optimizer, nnx.optimizer.OptState))
        arrays = {f"{i:05d}": np.asarray(x) for i, x in enumerate(leaves)}
        save_file(arrays, folder / "optimizer.safetensors")
        atomic_write(folder / "progress.json", json.dumps({"step": done, "history": history}))

    n = records.tokens.shape[0]
    size = min(batch_size, n)
    for i in range(start, steps):
        batch = records.batch(batch_rows(n, size, seed, i))
        t0 = time.perf_counter()
        loss, kl, violation, tv = (float(x) for x in step(head, optimizer, batch))
        entry = dict(loss=loss, kl=kl, violation=violation, tv=tv)
        entry["seconds"] = time.perf_counter() - t0
        history.append(entry)
        if log is not None:
            log(i, entry)
        if folder is not None and ((i + 1) % every == 0 or i + 1 == steps):
            save(i + 1)
    return head, history
