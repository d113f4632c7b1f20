"""Small numerically careful helpers shared by the solver, the bounds and the losses."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax


def series_terms(dtype) -> int:
    """Terms of the ``h(1 + d)`` series that reach machine precision at ``|d| = 1/4``."""
    return 30 if jnp.dtype(dtype) == jnp.float64 else 14


def h_shifted(d):
    """``h(1 + d)`` with ``h(r) = r log r - r + 1``, stable for every ``d >= -1``.

    Uses the series ``sum_{k>=2} (-1)^k d^k / (k (k-1))`` for ``|d| < 1/4``
    (``docs/certificates.md`` §8) and ``(1 + d) log1p(d) - d`` elsewhere; ``h(0) = 1`` (``d = -1``).
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

    ``phi(r) = (h(1+r) + h(1-r)) / 2``, evaluated without cancellation
    (``docs/certificates.md`` §§7-8).
    """
    return 0.5 * (h_shifted(r) + h_shifted(-r))


def coverage_kl_uniform(r, m: int):
    """``L_m(r) = KL(((1+mr), (1-r), ..., (1-r))/(m+1) || Unif_{m+1})``.

    Source: ``docs/certificates.md`` §7.

    ``L_m(r) = (h(1 + m r) + m h(1 - r)) / (m + 1)``; ``L_1 = phi``.
    """
    return (h_shifted(m * r) + m * h_shifted(-r)) / (m + 1)


def compute_dtype(*dtypes) -> jnp.dtype:
    """The dtype every quantity is computed in: float64 if any input is float64, else float32.

    bfloat16 and float16 logits are promoted to float32 (their own arithmetic would make
    certificates and verification depend on rounding, e.g. on the batch size).
    """
    if any(jnp.dtype(d) == jnp.float64 for d in dtypes):
        return jnp.dtype(jnp.float64)
    return jnp.dtype(jnp.float32)


def host_logits(x):
    """Logits from the host, re-centred in float64 before JAX may round them to float32.

    A concrete NumPy array or Python sequence of float64 logits is converted to float32 by
    JAX when ``jax_enable_x64`` is off; at ``|x| = 1e8`` that rounds away 8 nats. The
    probabilities only depend on ``x - max(x)``, so each row's (finite) max is subtracted
    first, in float64, where it is exact to the input's own resolution. JAX arrays, tracers
    and non-float64 input are returned unchanged (their values are already what they are).
    Rows holding NaN or ``+inf``, or no finite logit, are left as they are.

    Source: ``docs/certificates.md``, section "Numerics".
    """
    if isinstance(x, jax.Array | jax.core.Tracer) or jax.config.jax_enable_x64:
        return x
    if not isinstance(x, np.ndarray | list | tuple):
        return x
    a = np.asarray(x)
    if a.dtype != np.float64 or a.ndim < 1 or a.size == 0:
        return x
    with np.errstate(invalid="ignore"):
        top = np.max(a, axis=-1, keepdims=True)
    return a - np.where(np.isfinite(top), top, 0.0)


def normalizer(x):
    """``(max, S)`` over the last axis: ``S = sum(exp(x - max))``, ``log Z = max + log S``.

    The one home of the softmax normaliser (solver, statistics, policies, verification).
    """
    x_max = jnp.max(x, axis=-1)
    return x_max, jnp.sum(jnp.exp(x - x_max[..., None]), axis=-1)


_GROUP = 64  # tokens per group of the grouped top-k
_GROUPED_MIN_VOCAB = 8192  # below this a plain top_k is cheap whatever XLA does with it


def _groups(x):
    """``(grouped, size)``: ``x: [..., V]`` as ``[..., G, size]`` groups of 8-64 tokens (the
    widest size dividing ``V``, else 64 with ``-inf`` padding at the end), or ``None`` when a
    row is too narrow for groups to pay (``V < 8192``)."""
    v = x.shape[-1]
    if v < _GROUPED_MIN_VOCAB:
        return None, 0
    # The widest group of 8-64 tokens that divides V (no padding copy), else 64 and pad.
    size = next((g for g in (_GROUP, _GROUP // 2, _GROUP // 4, _GROUP // 8) if v % g == 0), _GROUP)
    groups = -(-v // size)
    if groups * size != v:  # pad with -inf: never chosen before a real token (higher ids)
        pad = [(0, 0)] * (x.ndim - 1) + [(0, groups * size - v)]
        x = jnp.pad(x, pad, constant_values=-jnp.inf)
    return x.reshape(*x.shape[:-1], groups, size), size


def _top_k_of_groups(grouped, group_max, k: int):
    """The exact top-``k`` of ``grouped: [..., G, size]`` given its group maxima ``[..., G]``.

    The ``k`` groups with the largest maxima contain the top-``k`` tokens (each group ranked
    above the group of a top-``k`` token holds a token ranked above it, so there are fewer
    than ``k`` such groups); only those ``k * size`` candidates are read again and ranked.
    """
    lead, size = grouped.shape[:-2], grouped.shape[-1]
    probe = group_max[(0,) * group_max.ndim]  # one probe for both fusions (unfused)
    _, best = _unfused_top_k(group_max, k, probe)  # [..., k] group ids
    best = jnp.sort(best, axis=-1).astype(jnp.int32)  # candidates in id order: ties to lower
    candidates = jnp.take_along_axis(grouped, best[..., None], axis=-2)  # [..., k, size]
    values, pos = _unfused_top_k(candidates.reshape(*lead, k * size), k, probe)
    group = jnp.take_along_axis(best, pos // size, axis=-1)
    return values, group * size + pos % size


def top_k(x, k: int):
    """Exact ``lax.top_k`` over the last axis, fast on CPU, sharding-transparent.

    Ties go to the lower index, as in ``lax.top_k`` (``-0.0`` and ``+0.0`` are a tie, as
    for ``argmax``). On CPU, XLA may turn a ``top_k`` whose
    outputs are fused with their consumers into a sort of the whole row (measured 25x
    slower at V = 151,936), and on GPU a wide ``top_k`` is slow too. An optimisation
    barrier prevented the former, but XLA's SPMD partitioner aborts on barriers under
    sharding; instead, for wide rows this takes the top-``k`` in two exact stages with
    nothing to sort but short rows: the maxima of groups of 8-64 tokens, then a ``top_k``
    of the tokens of the ``k`` best groups. Narrow rows use ``lax.top_k`` directly.

    Args:
      x: ``[..., V]`` floating.
      k: ``1 <= k <= V``.

    Returns:
      ``(values, indices)``: ``[..., k]``, decreasing, and their int32 indices.
    """
    grouped, _ = _groups(x)
    if grouped is None or k >= grouped.shape[-2]:
        return _unfused_top_k(x, k)
    return _top_k_of_groups(grouped, jnp.max(grouped, axis=-1), k)


def row_summary(x, k: int, need_entropy: bool):
    """Max, normaliser, entropy sum and top-``k`` of each row in two passes over ``x``.

    Pass 1 takes the maxima of groups of 8-64 tokens (which also select the top-``k``
    window, :func:`top_k`); pass 2 sums ``exp(x - group max)`` per group, and the groups
    are combined at the row's maximum, the window's first value:
    ``S = sum_g exp(max_g - max) S_g``. No pass waits for the row's maximum, so nothing reads
    the row a third time (a row maximum folded from the group maxima would be re-read by
    XLA's simplifier as a reduction of its own). The entropy sum
    ``W = sum exp(x - max) (x - max) = sum_g exp(max_g - max) (W_g + (max_g - max) S_g)``
    is a reduction of its own on CPU (XLA there fuses no sibling reductions), one more pass
    only when asked for. Rows narrower than 8192 use the plain reductions.

    Args:
      x: ``[..., V]`` floating (the compute dtype).
      k: ``1 <= k <= V``.
      need_entropy: also return ``W``.

    Returns:
      ``(x_max, total, weighted, values, ids)``: ``[...]`` max (NaN, ``+inf`` and all
      ``-inf`` rows give a non-finite max or ``total``), ``[...]`` ``S``, ``[...]`` ``W`` or
      ``None``, ``[..., k]`` the top-``k`` logits (decreasing) and their int32 ids.
    """
    grouped, _ = _groups(x)
    if grouped is None or k >= grouped.shape[-2]:
        return separate_summary(x, k, need_entropy)
    group_max = jnp.max(grouped, axis=-1)  # pass 1
    values, ids = _top_k_of_groups(grouped, group_max, k)
    # No mask on the groups: XLA:CPU may give -inf as the maximum of a group whose last
    # entry is NaN, so the NaN must reach S through the group's own sum. A group of -inf
    # sums to 0 at base 0 and its scale exp(-inf) is 0; NaN anywhere poisons S.
    base = jnp.where(group_max == -jnp.inf, 0.0, group_max)
    group_sum = jnp.sum(jnp.exp(grouped - base[..., None]), axis=-1)  # pass 2
    x_max = values[..., 0]
    gap = group_max - jnp.where(x_max == -jnp.inf, 0.0, x_max)[..., None]  # <= 0, or NaN
    scale = jnp.exp(gap)
    total = jnp.sum(scale * group_sum, axis=-1)  # an all -inf row: 0
    weighted = None
    if need_entropy:
        group_w = entropy_sum(grouped, base, group_max[(0,) * group_max.ndim])
        # exp(-1e4) = 0: clamping the gap changes no term and keeps 0 * -inf out.
        terms = scale * (group_w + jnp.maximum(gap, -1e4) * group_sum)
        weighted = jnp.sum(terms, axis=-1)
    return x_max, total, weighted, values, ids


def separate_summary(x, k: int, need_entropy: bool):
    """:func:`row_summary`'s outputs from separate reductions (maximum, normaliser, entropy
    sum, then :func:`top_k` with its own group maxima): what narrow rows use, and the
    baseline ``scripts/bench_certify.py --baseline`` times against the two passes."""
    x_max = jnp.max(x, axis=-1)
    base = jnp.where(x_max == -jnp.inf, 0.0, x_max)  # an all -inf row sums to 0, not NaN
    total = jnp.sum(jnp.exp(x - base[..., None]), axis=-1)
    weighted = entropy_sum(x, base) if need_entropy else None
    return (x_max, total, weighted, *top_k(x, k))


def unfused(fn, probe):
    """``fn()`` in a fusion of its own on CPU (elsewhere just ``fn()``).

    XLA on CPU fuses work that hurts there: a ``top_k`` whose outputs are fused into later
    elementwise work becomes a full sort (measured 67 ms instead of 2 ms for ``[64, 4096]``),
    and the entropy reduction fused with the normaliser's materialises ``exp(x - max)``. A
    conditional is a fusion boundary that XLA's SPMD partitioner handles (an optimisation
    barrier is not: it aborts): both branches are ``fn``; the predicate, ``isnan(probe)``
    for a scalar ``probe``, only has to be data-dependent. Under ``jax.vmap`` with a
    batched probe the conditional becomes a select and ``fn`` runs twice (same result).
    """
    if jax.default_backend() != "cpu":
        return fn()
    return lax.cond(jnp.isnan(probe), fn, fn)


def _unfused_top_k(x, k: int, probe=None):
    """``lax.top_k`` with int32 indices, in a fusion of its own on CPU (:func:`unfused`;
    ``probe`` a scalar computed anyway, else ``x``'s first entry)."""

    def run():
        # -0.0 and +0.0 are one value: lax.top_k orders +0.0 first, while argmax and the
        # verifier's accepted set compare them equal and take the lower id. Canonical zeros
        # make the window agree with them (ties to the lower id).
        canonical = jnp.where(x == 0, jnp.zeros_like(x), x)
        values, indices = lax.top_k(canonical, k)
        return values, indices.astype(jnp.int32)

    return unfused(run, x[(0,) * x.ndim] if probe is None else probe)


def entropy(x, x_max, total):
    """Entropy in nats of ``softmax(x)`` over the last axis, given its max and normaliser.

    ``H = log S - sum(e s) / S`` with ``s = x - max``, ``e = exp(s)``, ``S = sum(e)``
    (``total``); ``0 log 0 = 0`` for ``-inf`` logits.
    """
    return jnp.log(total) - entropy_sum(x, x_max) / total


def entropy_sum(x, x_max, probe=None):
    """``sum(e s)`` over the last axis, ``s = x - max``, ``e = exp(s)`` (its own fusion;
    ``probe`` as for :func:`unfused`, else ``x_max``'s first entry)."""

    def run():
        shifted = jnp.maximum(x - x_max[..., None], -1e4)  # exp(-1e4) = 0: no 0 * -inf
        return jnp.sum(jnp.exp(shifted) * shifted, axis=-1)

    return unfused(run, x_max[(0,) * x_max.ndim] if probe is None else probe)
