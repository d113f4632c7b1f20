"""Distillation objectives and the optimisation of a :class:`~jaxcert.training.DraftHead`."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jaxcert import losses
from jaxcert.core import rules as rules_lib
from jaxcert.training.features import FeatureSet
from jaxcert.training.heads import DraftHead, LmHead, project

__all__ = ["Objective", "train_head"]


@dataclasses.dataclass(frozen=True)
class Objective:
    """``KL(p||q) + weight * mean(certificate_violation(q, p, rule, margin))``.

    Attributes:
      name: label in tables.
      rule: the rule of the violation term, or ``None`` for plain KL distillation.
      weight: ``lambda``, the weight of the violation term.
      margin: nats of slack asked below the certificate.
      tv_weight: weight of the total-variation term ``TV(p, q) = 1 - sum_x min(p, q)``,
        the chance that speculative sampling at T = 1 rejects a drafted token (Leviathan
        et al. 2023, Theorem 3.5): the acceptance-aware term of draft-head training
        (`jaxcert.training.eagle.window_terms`; 0 elsewhere).
    """

    name: str
    rule: rules_lib.Rule | None = None
    weight: float = 1.0
    margin: float = 0.0
    tv_weight: float = 0.0


def _loss(
    head: DraftHead,
    d_graphdef: nnx.GraphDef,
    d_params: nnx.State,
    h_q: jax.Array,
    target_logits: jax.Array,
    objective: Objective,
) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    """The objective on one batch: ``(loss, (mean KL, mean violation))``."""
    drafter_logits = project(d_graphdef, d_params, head(h_q))
    kl = losses.kl_divergence(drafter_logits=drafter_logits, target_logits=target_logits)
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


def _step_fn(
    objective: Objective,
) -> Callable[..., tuple[jax.Array, jax.Array, jax.Array]]:
    """One Adam step on a batch: ``step(head, optimizer, d_graphdef, d_params, h_q, p_logits)``
    -> ``(loss, mean KL, mean violation)`` (updates ``head`` and ``optimizer`` in place)."""

    @nnx.jit(static_argnames="d_graphdef")
    def step(
        head: DraftHead,
        optimizer: nnx.Optimizer,
        d_graphdef: nnx.GraphDef,
        d_params: nnx.State,
        h_q: jax.Array,
        p_logits: jax.Array,
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        grad_fn = nnx.value_and_grad(_loss, has_aux=True)
        (loss, (kl, violation)), grads = grad_fn(
            head, d_graphdef, d_params, h_q, p_logits, objective
        )
        optimizer.update(head, grads)
        return loss, kl, violation

    return step


def train_head(
    objective: Objective,
    train: FeatureSet,
    train_target_logits: np.ndarray,
    drafter_model: LmHead,
    *,
    steps: int = 150,
    batch_size: int = 64,
    learning_rate: float = 1e-3,
    width: int = 1024,
    seed: int = 0,
    progress: Callable[[int, int], None] | None = None,
) -> tuple[DraftHead, list[dict[str, float]]]:
    """Trains a :class:`DraftHead` on cached features with Adam.

    Args:
      objective: what to minimise.
      train: training features.
      train_target_logits: ``[N, V]`` target logits of ``train``
        (:func:`~jaxcert.training.target_logits`).
      drafter_model: the drafter ``models.Transformer`` (or compatible, e.g. its
        :class:`~jaxcert.training.Projection`; its ``project`` maps hidden states to
        logits); it stays frozen.
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
    d_graphdef, d_params = nnx.split(drafter_model)
    step = _step_fn(objective)
    rng = np.random.default_rng(seed)
    history = []
    for i in range(steps):
        idx = rng.integers(0, len(train), batch_size)
        start = time.perf_counter()
        loss, kl, violation = step(
            head, optimizer, d_graphdef, d_params,
            jnp.asarray(train.drafter_hidden[idx]), jnp.asarray(train_target_logits[idx]),
        )  # fmt: skip
        history.append({"step": i, "loss": float(loss), "kl": float(kl),
                        "violation": float(violation),
                        "seconds": time.perf_counter() - start})  # fmt: skip
        if progress is not None:
            progress(i + 1, steps)
    return head, history
