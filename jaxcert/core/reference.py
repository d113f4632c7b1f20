"""Plain NumPy (float64) reference of the certificate spec, one distribution at a time.

This is the slow, obviously-correct implementation that the JAX solver is tested
against, and the NumPy baseline of ``scripts/bench_certify.py``. It follows the spec
literally: stable sort, the rule's sets ``U`` and ``L``, ``T* = top-m(L)`` (Lemma 2)
and the pooling loop of Lemma 1, with the stable evaluation of ``docs/certificates.md`` §8.
:func:`certificate_enumerate` drops Lemma 2 and minimises over every ``m``-subset
``T`` of ``L`` instead (for small vocabularies).

Source: ``docs/certificates.md`` §§2-5 and 8.
"""

from __future__ import annotations

import dataclasses
import itertools
import math

import numpy as np

from jaxcert.core import rules as rules_lib

__all__ = ["ReferenceResult", "certificate_np", "certificate_enumerate", "stable_h"]


@dataclasses.dataclass(frozen=True)
class ReferenceResult:
    """Result of the reference solver for one distribution.

    Attributes:
      value: the certificate ``C_p`` in nats (``inf`` if rejection is impossible).
      greedy_token: ``x0``, the lowest index among the maximisers of ``p``.
      upper_set: sorted indices of ``U``.
      competitor: indices of ``T*`` (most probable first), empty if ``|L| < m``.
      pool: sorted indices of the pool ``P``.
      level: the common level ``c`` of the pool (``nan`` if the pool is empty).
      q_star: ``[V]`` the minimiser (``p`` itself if the pool is empty or ``C = inf``).
    """

    value: float
    greedy_token: int
    upper_set: np.ndarray
    competitor: np.ndarray
    pool: np.ndarray
    level: float
    q_star: np.ndarray


def stable_h(r: np.ndarray) -> np.ndarray:
    """``h(r) = r log r - r + 1 >= 0``, by a series near ``r = 1`` (``docs/certificates.md`` §8)."""
    r = np.asarray(r, dtype=np.float64)
    d = r - 1.0
    out = np.empty_like(r)
    small = np.abs(d) < 0.25
    ds = d[small]
    # h(1 + d) = sum_{k >= 2} (-1)^k d^k / (k (k - 1)); 30 terms reach 1e-19 at |d| = 1/4.
    acc = np.zeros_like(ds)
    for k in range(31, 1, -1):
        acc = (-1.0) ** k / (k * (k - 1)) + ds * acc
    out[small] = ds * ds * acc
    rl = r[~small]
    with np.errstate(divide="ignore", invalid="ignore"):
        out[~small] = np.where(rl > 0, rl * np.log(np.where(rl > 0, rl, 1.0)), 0.0) - rl + 1.0
    return out


def _upper_set(p: np.ndarray, order: np.ndarray, rule) -> np.ndarray:
    base = rule.upper_rule
    x0 = order[0]
    if isinstance(base, rules_lib.StrictGreedy):
        return order[:1]
    if isinstance(base, rules_lib.TargetTopK):
        return order[: base.k]
    if isinstance(base, rules_lib.Additive):
        return np.flatnonzero(p >= p[x0] - base.t)
    if isinstance(base, rules_lib.Multiplicative):
        return np.flatnonzero(p >= base.alpha * p[x0])
    if isinstance(base, rules_lib.Typical):
        pos = p[p > 0]
        entropy = -np.sum(pos * np.log(pos))
        threshold = min(base.eps, base.delta * math.exp(-entropy))
        return np.flatnonzero(p > threshold)
    raise TypeError(f"unknown rule {rule!r}")


def _project(p: np.ndarray, upper: np.ndarray, competitor: np.ndarray):
    """Lemma 1: the KL projection of ``p`` onto ``R_T``. Returns (value, pool, c, q*)."""
    u_order = upper[np.argsort(-p[upper], kind="stable")]
    t_order = competitor[np.argsort(p[competitor], kind="stable")]
    q = p.copy()
    if p[u_order[0]] <= p[t_order[0]]:
        return 0.0, np.array([], dtype=np.int64), math.nan, q
    pool = [u_order[0], t_order[0]]
    total = p[u_order[0]] + p[t_order[0]]
    iu, it = 1, 1
    while True:
        c = total / len(pool)
        if iu < len(u_order) and p[u_order[iu]] > c:
            pool.append(u_order[iu])
            total += p[u_order[iu]]
            iu += 1
        elif it < len(t_order) and p[t_order[it]] < c:
            pool.append(t_order[it])
            total += p[t_order[it]]
            it += 1
        else:
            break
    members = np.sort(np.array(pool, dtype=np.int64))
    value = float(np.sum(c * stable_h(p[members] / c)))
    q[members] = c
    return value, members, c, q


def certificate_np(p: np.ndarray, rule) -> ReferenceResult:
    """Exact certificate of one distribution, straight from the spec.

    Args:
      p: ``[V]`` probabilities (normalised here; zeros allowed).
      rule: a rule from :mod:`jaxcert.core.rules`.

    Returns:
      A :class:`ReferenceResult`.

    Raises:
      ValueError: ``p`` is not a non-negative finite vector with positive sum.
    """
    p = np.asarray(p, dtype=np.float64)
    if p.ndim != 1 or not np.all(np.isfinite(p)) or np.any(p < 0) or p.sum() <= 0:
        raise ValueError("p must be a 1-D, finite, non-negative vector with a positive sum")
    p = p / p.sum()
    order = np.argsort(-p, kind="stable")
    x0 = int(order[0])
    upper = np.sort(_upper_set(p, order, rule))
    in_upper = np.zeros(p.shape, bool)
    in_upper[upper] = True
    lower_sorted = order[~in_upper[order]]
    m = rule.list_size
    empty = np.array([], dtype=np.int64)
    if len(lower_sorted) < m:
        return ReferenceResult(math.inf, x0, upper, empty, empty, math.nan, p.copy())
    competitor = lower_sorted[:m]
    if len(upper) == 0:
        return ReferenceResult(0.0, x0, upper, competitor, empty, math.nan, p.copy())
    value, pool, c, q = _project(p, upper, competitor)
    return ReferenceResult(value, x0, upper, competitor, pool, c, q)


def certificate_enumerate(p: np.ndarray, rule) -> float:
    """``min`` over every ``m``-subset ``T`` of ``L`` of the Lemma-1 projection value.

    Checks Lemma 2 (the optimal ``T`` is the top-``m`` of ``L``). Exponential in ``m``:
    only for small vocabularies.
    """
    p = np.asarray(p, dtype=np.float64)
    p = p / p.sum()
    order = np.argsort(-p, kind="stable")
    upper = _upper_set(p, order, rule)
    lower = np.setdiff1d(np.arange(p.size), upper)
    m = rule.list_size
    if len(lower) < m:
        return math.inf
    if len(upper) == 0:
        return 0.0
    return min(
        _project(p, upper, np.array(t))[0] for t in itertools.combinations(lower.tolist(), m)
    )
