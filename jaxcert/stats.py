"""Per-position statistics of a target distribution (top-1, top-k coverage, margin, entropy)."""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from jaxcert import _numerics

__all__ = ["DistributionStats", "distribution_stats"]


@flax.struct.dataclass
class DistributionStats:
    """Summary of target distributions ``p = softmax(logits)``; every field is ``[...]``.

    Attributes:
      greedy_token: int32 ``x0 = argmax p`` (lowest index among ties).
      top1: ``p(x0)``.
      top_coverage: total probability of the ``top`` most probable tokens.
      margin: ``gamma``, the top-1 probability minus the runner-up's (not the third's).
      entropy: ``H(p)`` in nats.
    """

    greedy_token: jax.Array
    top1: jax.Array
    top_coverage: jax.Array
    margin: jax.Array
    entropy: jax.Array


def distribution_stats(logits: jax.typing.ArrayLike, *, top: int = 10) -> DistributionStats:
    """Statistics of ``softmax(logits)`` over the last axis.

    Args:
      logits: ``[..., V]`` float logits or log-probabilities (computed in float32, or
        float64 for float64 input).
      top: ``k`` of the top-``k`` coverage (clipped to ``V``).

    Returns:
      A :class:`DistributionStats` with ``[...]`` fields.

    Raises:
      ValueError: non-floating logits or ``top < 1``.
    """
    x = jnp.asarray(logits)
    if not jnp.issubdtype(x.dtype, jnp.floating) or x.ndim < 1:
        raise ValueError(f"logits must be floating [..., V], got {x.dtype} {x.shape}")
    if top < 1:
        raise ValueError(f"top must be >= 1, got {top}")
    x = x.astype(_numerics.compute_dtype(x.dtype))
    vals, idx = _numerics.top_k(x, min(max(top, 2), x.shape[-1]))
    x_max, total = _numerics.normalizer(x)
    lse = x_max + jnp.log(total)
    entropy = _numerics.entropy(x, x_max, total)
    top1 = jnp.exp(vals[..., 0] - lse)
    second = vals[..., 1] if vals.shape[-1] > 1 else jnp.full_like(top1, -jnp.inf)
    return DistributionStats(
        greedy_token=idx[..., 0].astype(jnp.int32),
        top1=top1,
        top_coverage=jnp.sum(jnp.exp(vals[..., :top] - lse[..., None]), axis=-1),
        margin=-top1 * jnp.expm1(second - vals[..., 0]),
        entropy=entropy,
    )
