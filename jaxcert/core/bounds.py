"""Margin-only certificate bounds and certified run lengths.

When only the target margin ``gamma`` (the top-1 probability minus the runner-up's,
``p(x0) - max_{x != x0} p(x)``) is known, the certificate is
bracketed by closed forms (``docs/certificates.md`` §7):

* strict greedy: ``phi(gamma) <= C_1 <= s_V phi(gamma / s_V)``, ``s_V = gamma + 2(1-gamma)/V``,
  both tight;
* tree coverage with list size ``m``: ``C_m >= L_m(gamma)``, tight (the infimum). The
  supremum is ``O(1)`` even as ``gamma -> 0`` for ``m >= 2``, so only the lower bound is
  informative; it is provided for completeness.

Source: "When Is a Draft Accepted?" (2026), section on margin bounds; ``docs/certificates.md`` §7.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.scipy.special import xlogy

from jaxcert.base.validate import check_int, check_mask_shape
from jaxcert.core import numerics

__all__ = [
    "greedy_margin_bounds",
    "tree_margin_lower_bound",
    "tree_margin_upper_bound",
    "certified_run_length",
]


def _margin(margin):
    """The margin as a float array; ``nan`` outside ``[0, 1]`` (an error if it is concrete).

    Clipping would turn a wrong input (a log-probability, a percentage) into a plausible
    bound; a traced margin cannot raise, so it gives ``nan`` there instead.
    """
    margin = jnp.asarray(margin)
    if not jnp.issubdtype(margin.dtype, jnp.floating):
        margin = margin.astype(jnp.float32)
    outside = (margin < 0) | (margin > 1)
    if not isinstance(margin, jax.core.Tracer) and bool(jnp.any(outside)):
        bad = float(margin.ravel()[jnp.argmax(outside.ravel())])
        raise ValueError(
            f"margin must be in [0, 1] (a probability difference p(x0) - p(x1)), got {bad!r}"
        )
    return jnp.where(outside, jnp.nan, margin)


def greedy_margin_bounds(margin: jax.typing.ArrayLike, vocab_size: int):
    """Tight bounds on the strict-greedy certificate from the margin alone.

    Args:
      margin: ``[...]`` target margin ``gamma`` in ``[0, 1]``: the top-1 probability minus
        the runner-up's, ``p(x0) - max_{x != x0} p(x)``.
      vocab_size: ``V >= 2``.

    Returns:
      ``(lower, upper)``, each ``[...]`` in nats: ``lower = phi(gamma)`` (attained only at
      ``V = 2``, approached for larger ``V``), ``upper = s_V phi(gamma / s_V)`` (attained at
      the flattest ``p``); ``upper < gamma log 2``. Leading terms ``gamma^2 / 2`` and
      ``V gamma^2 / 4``.

    Raises:
      ValueError: ``vocab_size < 2``, or a concrete margin outside ``[0, 1]`` (under ``jit``
        such a margin gives ``nan`` bounds; ``nan`` margins give ``nan`` too).

    Example:
      >>> from jaxcert import greedy_margin_bounds
      >>> lower, upper = greedy_margin_bounds(0.1, vocab_size=151_936)
      >>> round(float(lower), 4), round(float(upper), 4)
      (0.005, 0.0693)

    Source: ``docs/certificates.md`` §7, rule 1.
    """
    check_int("vocab_size", vocab_size, 2)
    gamma = _margin(margin)
    lower = numerics.binary_kl_uniform(gamma)
    s = gamma + 2.0 * (1.0 - gamma) / vocab_size
    upper = s * numerics.binary_kl_uniform(gamma / s)
    return lower, upper


def tree_margin_lower_bound(margin: jax.typing.ArrayLike, m: int):
    """Tight lower bound ``L_m(gamma)`` on the tree-coverage certificate (list size ``m``).

    ``L_m(r) = ((1+mr)/(m+1)) log(1+mr) + (m(1-r)/(m+1)) log(1-r)``; leading term
    ``m gamma^2 / 2``. The infimum is attained at ``p = (b + gamma, b, ..., b)`` on ``m+1``
    tokens. For ``m = 1`` it equals the strict-greedy lower bound.

    Args:
      margin: ``[...]`` target margin in ``[0, 1]``.
      m: list size, ``>= 1``.

    Returns:
      ``[...]`` lower bound in nats.

    Raises:
      ValueError: ``m < 1``, or a concrete margin outside ``[0, 1]`` (``nan`` under ``jit``).

    Source: ``docs/certificates.md`` §7, rule 6.
    """
    check_int("m", m, 1)
    return numerics.coverage_kl_uniform(_margin(margin), m)


def tree_margin_upper_bound(margin: jax.typing.ArrayLike, m: int, vocab_size: int):
    """Supremum of the tree-coverage certificate over ``p`` with margin ``gamma``.

    ``sup = max{A_V, B_1, ..., B_{m-1}}`` (the vertices of the margin polytope). For
    ``m >= 2`` it stays ``O(1)`` as ``gamma -> 0`` (e.g. 0.35 at ``gamma = 0.01, m = 2``),
    which is why only the lower bound is useful in practice.

    Args:
      margin: ``[...]`` target margin in ``[0, 1]``.
      m: list size, ``>= 1``.
      vocab_size: ``V >= m + 1``.

    Returns:
      ``[...]`` upper bound in nats (attained for ``A_V``, approached for ``B_k``).

    Raises:
      ValueError: ``m < 1``, ``vocab_size < m + 1``, or a concrete margin outside
        ``[0, 1]`` (``nan`` under ``jit``).

    Source: ``docs/certificates.md`` §7, rule 6.
    """
    check_int("m", m, 1)
    check_int("vocab_size", vocab_size, m + 1)
    gamma = _margin(margin)
    s = gamma + (m + 1) * (1.0 - gamma) / vocab_size
    best = s * numerics.coverage_kl_uniform(gamma / s, m)
    for k in range(1, m):
        t = (1.0 - gamma) / (k + 1)
        top = gamma + t
        flat = top * jnp.log(m - k + 1.0)
        # xlogy: at gamma = 1 the k tied tokens have t = 0 (0 log 0 = 0, not NaN).
        tilted = xlogy(top, (m + 1) * top) + xlogy(k * t, (m + 1) * t)
        best = jnp.maximum(best, jnp.where((m - k) * t >= gamma, flat, tilted))
    return best


def certified_run_length(
    certificate_values: jax.typing.ArrayLike,
    budget: jax.typing.ArrayLike,
    *,
    where: jax.typing.ArrayLike | None = None,
) -> jax.Array:
    """Number of consecutive certified positions from each start.

    A position is certified when its KL budget is strictly below its certificate,
    ``budget < C``: any drafter with ``KL(p||q) <= budget`` is then accepted there.

    Args:
      certificate_values: ``[..., T]`` certificates ``C_p`` in nats (``+inf`` allowed;
        ``nan``, an invalid row's certificate, is never certified).
      budget: per-position KL budget ``epsilon >= 0`` in nats, a scalar or ``[..., T]``
        (same rank; axes of size 1 broadcast). ``KL >= 0``, so a negative budget means
        nothing: it would "certify" even ``C = 0`` positions.
      where: optional ``[..., T]`` bool mask of real positions (same rank; axes of size 1
        broadcast); a masked position ends a run and has run length 0.

    Returns:
      ``[..., T]`` int32: ``r_t = 1 + r_{t+1}`` if position ``t`` is certified, else 0;
      ``-1`` where the budget is negative or ``nan`` (only possible under ``jit``).

    Raises:
      ValueError: ``certificate_values`` has no time axis; ``budget`` or ``where`` has
        another rank or does not broadcast; a concrete budget that is negative or ``nan``.

    Source: "When Is a Draft Accepted?" (2026), certified runs; ``docs/certificates.md`` §7.
    """
    values = jnp.asarray(certificate_values)
    if values.ndim < 1:
        raise ValueError(f"certificate_values must have shape [..., T], got {values.shape}")
    # Compare in at least float32: a bfloat16 budget would round (0.2000001 -> 0.2002).
    values = values.astype(jnp.promote_types(values.dtype, jnp.float32))
    budget = jnp.asarray(budget, values.dtype)
    if budget.ndim:
        check_mask_shape("budget", budget.shape, values.shape, what="a scalar or [..., T] =")
    budget = jnp.broadcast_to(budget, values.shape)
    bad = ~(budget >= 0)  # negative or nan
    if not isinstance(budget, jax.core.Tracer) and bool(jnp.any(bad)):
        first = float(budget.ravel()[jnp.argmax(bad.ravel())])
        raise ValueError(f"budget must be a KL in nats >= 0, got {first!r}")
    certified = budget < values
    if where is not None:
        where = jnp.asarray(where, bool)
        check_mask_shape("where", where.shape, values.shape, what="[..., T] =")
        certified = certified & jnp.broadcast_to(where, values.shape)

    def step(carry, ok):
        run = jnp.where(ok, carry + 1, 0)
        return run, run

    moved = jnp.moveaxis(certified, -1, 0)
    _, runs = lax.scan(step, jnp.zeros(moved.shape[1:], jnp.int32), moved, reverse=True)
    return jnp.where(bad, -1, jnp.moveaxis(runs, 0, -1))
