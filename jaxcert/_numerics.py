"""Small numerically careful helpers shared by the solver, the bounds and the losses."""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax


def series_terms(dtype) -> int:
    """Terms of the ``h(1 + d)`` series that reach machine precision at ``|d| = 1/4``."""
    return 30 if jnp.dtype(dtype) == jnp.float64 else 14


def h_shifted(d):
    """``h(1 + d)`` with ``h(r) = r log r - r + 1``, stable for every ``d >= -1``.

    Uses the series ``sum_{k>=2} (-1)^k d^k / (k (k-1))`` for ``|d| < 1/4`` (spec
    section 6) and ``(1 + d) log1p(d) - d`` elsewhere; ``h(0) = 1`` (``d = -1``).
    """
    d = jnp.asarray(d)
    small = jnp.abs(d) < 0.25
    ds = jnp.where(small, d, 0.0)
    acc = jnp.zeros_like(ds)
    for k in range(series_terms(d.dtype) + 1, 1, -1):
        acc = (-1.0) ** k / (k * (k - 1)) + ds * acc
    series = ds * ds * acc
    r = 1.0 + d
    safe = jnp.where(r > 0, d, 0.0)
    direct = jnp.where(r > 0, r * jnp.log1p(safe), 0.0) - d
    return jnp.where(small, series, direct)


def binary_kl_uniform(r):
    """``phi(r) = ((1+r)/2) log(1+r) + ((1-r)/2) log(1-r)`` for ``r`` in ``[0, 1]``.

    ``phi(r) = (h(1+r) + h(1-r)) / 2``, evaluated without cancellation (spec section 5).
    """
    return 0.5 * (h_shifted(r) + h_shifted(-r))


def coverage_kl_uniform(r, m: int):
    """``L_m(r) = KL(((1+mr), (1-r), ..., (1-r))/(m+1) || Unif_{m+1})`` (spec section 5).

    ``L_m(r) = (h(1 + m r) + m h(1 - r)) / (m + 1)``; ``L_1 = phi``.
    """
    return (h_shifted(m * r) + m * h_shifted(-r)) / (m + 1)


def top_k(x, k: int):
    """``lax.top_k`` that stays a top-k on CPU.

    If a slice of ``top_k``'s output (say ``values[..., 0]``) is fused with the op, XLA on
    CPU may fall back to sorting the whole row (measured 100x slower at V = 151,936); the
    optimisation barrier keeps the top-k pattern intact.
    """
    return lax.optimization_barrier(lax.top_k(x, k))


def entropy(x, x_max, total):
    """Entropy in nats of ``softmax(x)`` over the last axis, given its max and normaliser.

    ``H = log S - sum(e s) / S`` with ``s = x - max``, ``e = exp(s)``, ``S = sum(e)``
    (``total``). The barrier keeps this reduction in a fusion of its own: on CPU, sharing
    ``exp(s)`` with the normaliser's reduction materialises it and runs 4x slower than
    recomputing it.
    """
    x, x_max = lax.optimization_barrier((x, x_max))
    shifted = jnp.maximum(x - x_max[..., None], -1e4)  # exp(-1e4) = 0: no 0 * -inf
    weighted = jnp.sum(jnp.exp(shifted) * shifted, axis=-1)
    return jnp.log(total) - weighted / total
