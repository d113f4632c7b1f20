"""Training an EAGLE draft head (`jaxcert.models.EagleHead`) on a target's own states.

Teacher forcing, as the decoder drafts (``docs/design.md``, "Draft heads"): over a token
sequence ``x_0 .. x_{T-1}`` the target returns its logits and the states the head fuses;
the head reads ``x_t`` with the target's states at ``t - 1`` (``x_0`` with a zero feature)
and its distribution ``q_t`` over ``x_{t+1}`` is trained towards the target's ``p_t`` with
an :class:`~jaxcert.training.train.Objective` (``KL(p_t || q_t)``, plus a certificate
violation term if the objective has a rule). Only the head's `TRAINABLE` parameters move
(the embedding and lm-head it shares with the target stay).

Shape letters: ``B`` sequences, ``T`` positions, ``V`` vocabulary, ``C`` the head's input
width (``len(taps) * E``, or ``E`` for the target's final-norm states).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx, struct

from jaxcert import losses
from jaxcert.decoding.protocols import context_before
from jaxcert.models import EagleHead, Transformer
from jaxcert.models.eagle import TRAINABLE
from jaxcert.training.train import Objective

__all__ = ["TargetStates", "head_loss", "target_states", "train_eagle_head"]


@struct.dataclass
class TargetStates:
    """What the head trains on, from one teacher-forced target pass.

    Attributes:
      tokens: ``[B, T]`` int32 sequences.
      states: ``[B, T, C]`` the target's states the head fuses (position ``t``: after reading
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
    hidden, logits, states = _target_pass(graphdef, params, ids, taps)
    mask = jnp.arange(t)[None, :] < jnp.asarray(lengths)[:, None] - 1
    return TargetStates(ids, hidden if not taps else states, logits, mask)


@jax.jit(static_argnums=(0, 3))
def _target_pass(graphdef, params, tokens, taps):
    model = nnx.merge(graphdef, params)
    cache = model.init_cache(tokens.shape[0], tokens.shape[1])
    hidden, _, states = model.tapped_features(tokens, cache, taps)
    return hidden, model.project(hidden), states


def head_loss(
    head: EagleHead, batch: TargetStates, objective: Objective
) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    """The objective over a batch's valid positions: ``(loss, (mean KL, mean violation))``.

    ``q_t`` is the head reading ``x_t`` with the target's states at ``t - 1``; KL in nats.
    """
    b, t = batch.tokens.shape
    context = context_before(head, batch.states)  # as the decoder's prefill reads
    q_logits, _ = head(batch.tokens, head.init_cache(b, t), context=context)
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
