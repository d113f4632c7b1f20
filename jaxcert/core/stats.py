"""Per-position statistics of a target distribution (top-1, top-k coverage, margin, entropy)."""

from __future__ import annotations

import functools

import flax.struct
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxcert.base.validate import check_int
from jaxcert.core import collectives, numerics

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


def distribution_stats(
    logits: jax.typing.ArrayLike,
    *,
    top: int = 10,
    axis_name: str | tuple[str, ...] | None = None,
) -> DistributionStats:
    """Statistics of ``softmax(logits)`` over the last axis.

    Sharded inputs are handled as in :func:`jaxcert.certificates` (per-shard top-``k``
    merged exactly, collective max and sums; ``axis_name`` inside your own ``shard_map``).

    Args:
      logits: ``[..., V]`` float logits or log-probabilities (computed in float32, or
        float64 for float64 input).
      top: ``k`` of the top-``k`` coverage (clipped to ``V``).
      axis_name: mesh axis name(s) splitting the vocabulary, inside ``shard_map``.

    Returns:
      A :class:`DistributionStats` with ``[...]`` fields.

    Raises:
      ValueError: non-floating logits or ``top < 1``.

    Example:
      >>> import jax.numpy as jnp
      >>> from jaxcert import distribution_stats
      >>> s = distribution_stats(jnp.log(jnp.array([0.6, 0.3, 0.1])), top=2)
      >>> int(s.greedy_token), round(float(s.margin), 4), round(float(s.top_coverage), 4)
      (0, 0.3, 0.9)
    """
    x = logits if isinstance(logits, jax.Array) else jnp.asarray(numerics.host_logits(logits))
    if not jnp.issubdtype(x.dtype, jnp.floating) or x.ndim < 1:
        raise ValueError(f"logits must be floating [..., V], got {x.dtype} {x.shape}")
    check_int("top", top)

    def specs(lead, vocab):
        per_row = P(*lead)
        return DistributionStats(per_row, per_row, per_row, per_row, per_row)

    return collectives.route(functools.partial(_stats, top=top), x, specs, axis_name)


def _stats(x, axis_name, *, top: int) -> DistributionStats:
    x = x.astype(numerics.compute_dtype(x.dtype))
    vocab = x.shape[-1] * collectives.axis_size(axis_name)
    x_max, total, entropy, vals, idx = collectives.row_summary(
        x, min(max(top, 2), vocab), True, axis_name
    )
    # log p = (x - max) - log S: relative to the max, so a common offset cannot change it.
    log_p = (vals - x_max[..., None]) - jnp.log(total)[..., None]
    top1 = jnp.exp(log_p[..., 0])
    second = vals[..., 1] if vals.shape[-1] > 1 else jnp.full_like(top1, -jnp.inf)
    return DistributionStats(
        greedy_token=idx[..., 0],
        top1=top1,
        top_coverage=jnp.sum(jnp.exp(log_p[..., :top]), axis=-1),
        margin=jnp.abs(top1 * jnp.expm1(second - vals[..., 0])),  # abs: +0.0 for a tie
        entropy=entropy,
    )
