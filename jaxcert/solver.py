"""Exact acceptance certificates over full vocabularies.

For a verification rule with rejection region ``R_p`` (spec section 0), the
certificate is ``C_p = min_{q in R_p} KL(p || q)`` in nats: if the drafter satisfies
``KL(p || q) < C_p``, its choice is guaranteed to be accepted. The minimiser ``q*``
(the KL projection of ``p`` onto ``R_p``) is a rejected drafter at KL exactly ``C_p``.

Algorithm (spec sections 1-3): ``U`` is a prefix of the tokens sorted by decreasing
``p``, the optimal competitor set ``T*`` is the next ``m`` tokens (Lemma 2), and the
projection pools the largest ``U``-tokens with the smallest ``T*``-tokens at their
mean ``c`` (Lemma 1). Pool membership is read off the sign of the water-filling
function ``g(c) = sum_U (p - c)_+ - sum_T (c - p)_+`` at every breakpoint, and the
value is evaluated as ``sum_P c h(p_i / c)`` from logit differences (``expm1``), which
is stable for near-tied pools (spec section 6).

Speed: only the top ``K`` logits are sorted (``lax.top_k``). When ``U`` or ``T*``
could reach past them (``|U| + m > K``, possible for the threshold rules), those rows
take an exact path over the full vocabulary: a full-row count and a masked top-``m``
for ``T*``, and, only if more than ``K`` tokens of ``U`` are pooled, a full sort. The
exact path runs row by row behind a ``lax.cond``, so a batch only pays for its hard
rows (under a user's ``jax.vmap`` both branches run: still exact, slower).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import NamedTuple

import flax.struct
import jax
import jax.numpy as jnp
from jax import lax

from jaxcert import _numerics
from jaxcert import rules as rules_lib
from jaxcert._validate import check_int

__all__ = ["Certificate", "certificate", "certificates", "DEFAULT_TOP_K"]

DEFAULT_TOP_K = 64


@flax.struct.dataclass
class Certificate:
    """Certificate of one rule for a batch of target distributions.

    Shapes: ``[...]`` is the input's leading (batch) shape, ``M`` the rule's list size
    ``m``, ``V`` the vocabulary size. Floats are float32 (float64 for float64 input).

    Attributes:
      value: ``[...]`` the certificate ``C_p`` in nats; ``+inf`` where rejection is
        impossible (``|L| < m``); ``nan`` where the input row was invalid.
      margin: ``[...]`` the target margin ``gamma = p(x0) - p(x2)`` (a probability).
      greedy_token: ``[...]`` int32 ``x0 = argmax p`` (lowest index among ties).
      competitor: ``[..., M]`` int32 ``T*``, the ``m`` most probable tokens of ``L``
        (most probable first, ties to the lower index); ``-1`` where ``|L| < m``.
      pool_size: ``[...]`` int32 ``|P|``, the number of tokens moved to the common level.
      level: ``[...]`` the common level ``c`` (a probability); ``nan`` if the pool is empty.
      valid: ``[...]`` bool; ``False`` where the row held a NaN or ``+inf``, or no finite
        logit. Every other field of such a row is meaningless (``value`` is ``nan``).
      q_star: ``[..., V]`` the minimiser ``q*`` (probabilities), or ``None`` unless
        requested with ``return_q=True``. ``q* = p`` where ``C_p`` is ``0`` or ``+inf``.
    """

    value: jax.Array
    margin: jax.Array
    greedy_token: jax.Array
    competitor: jax.Array
    pool_size: jax.Array
    level: jax.Array
    valid: jax.Array
    q_star: jax.Array | None = None


class _Prepared(NamedTuple):
    """Per-row quantities shared by every rule. ``N`` rows, window of ``K`` tokens."""

    x: jax.Array  # [N, V] logits in the compute dtype
    valid: jax.Array  # [N] bool
    top_x: jax.Array  # [N, K] largest logits, decreasing
    top_i: jax.Array  # [N, K] int32 their token ids (ties: lower id first)
    log_p_max: jax.Array  # [N] log p(x0)
    entropy: jax.Array | None  # [N] H(p) in nats, only if a rule needs it


class _Solution(NamedTuple):
    """Solver state for one rule; leading shape ``[N]`` (or none, per row)."""

    value_rel: jax.Array  # [N] C_p / p(x0)
    level_rel: jax.Array  # [N] c / p(x0)
    impossible: jax.Array  # [N] bool, |L| < m
    pooled_u: jax.Array  # [N] int32 number of pooled U tokens (a prefix of U)
    u_cut: jax.Array  # [N] logit of the last pooled U token
    comp_x: jax.Array  # [N, M] logits of T*, decreasing
    comp_i: jax.Array  # [N, M] int32 token ids of T*
    pooled_t: jax.Array  # [N, M] bool, T* tokens lifted to the level


def _compute_dtype(dtype) -> jnp.dtype:
    return jnp.dtype(jnp.float64) if jnp.dtype(dtype) == jnp.float64 else jnp.dtype(jnp.float32)


def _prepare(x: jax.Array, window: int, need_entropy: bool) -> _Prepared:
    dtype = _compute_dtype(x.dtype)
    x = x.astype(dtype)
    # Keep the normalisation independent of top_k's outputs: on CPU, XLA fuses a reduction
    # that reads top_k's result into a loop that recomputes it (100x slower).
    x_max = jnp.max(x, axis=-1)
    total = jnp.sum(jnp.exp(x - x_max[:, None]), axis=-1)
    lse = x_max + jnp.log(total)
    # NaN propagates into lse, +inf and an all -inf row make x_max non-finite.
    valid = jnp.isfinite(lse) & jnp.isfinite(x_max)
    entropy = None
    if need_entropy:
        entropy = _numerics.entropy(x, x_max, total)
    top_x, top_i = _numerics.top_k(x, window)
    return _Prepared(x, valid, top_x, top_i.astype(jnp.int32), top_x[:, 0] - lse, entropy)


def _water_fill(ux, u_valid, tx, x0) -> tuple:
    """Lemma 1 on sorted candidates, for any leading shape ``[...]``.

    Args:
      ux: ``[..., J]`` logits of (a prefix of) ``U``, decreasing.
      u_valid: ``[..., J]`` bool, which entries of ``ux`` belong to ``U``.
      tx: ``[..., M]`` logits of ``T*``, decreasing.
      x0: ``[...]`` logit of the greedy token.

    Returns:
      ``(value_rel, level_rel, pooled_u, pooled_t)``: ``C/p(x0)``, ``c/p(x0)``, the
      number of pooled ``U`` entries (a prefix) and the ``[..., M]`` mask of pooled
      ``T*`` entries. Work is ``O(J M + M^2)``.
    """
    # e = p / p(x0) - 1 in [-1, 0], exact for near-ties with x0 thanks to expm1.
    eu = jnp.where(u_valid, jnp.expm1(ux - x0[..., None]), -2.0)
    et = jnp.expm1(tx - x0[..., None])
    j = jnp.arange(eu.shape[-1], dtype=eu.dtype)
    before = jnp.cumsum(eu, axis=-1) - eu  # sum of the entries before j
    # g at each U value: sum_{r<j} (u_r - u_j) - sum_T (u_j - t)_+ ; pooled iff g < 0.
    g_u = (before - j * eu) - jnp.sum(jax.nn.relu(eu[..., :, None] - et[..., None, :]), axis=-1)
    pooled_u = jnp.sum(u_valid & (g_u < 0), axis=-1, dtype=jnp.int32)
    # g at each T* value: sum_U (u - t_i)_+ - sum_T (t_i - t)_+ ; pooled iff g > 0.
    g_t = jnp.sum(jax.nn.relu(eu[..., None, :] - et[..., :, None]), axis=-1) - jnp.sum(
        jax.nn.relu(et[..., :, None] - et[..., None, :]), axis=-1
    )
    pooled_t = g_t > 0
    in_pool_u = jnp.arange(eu.shape[-1]) < pooled_u[..., None]
    count = pooled_u + jnp.sum(pooled_t, axis=-1, dtype=jnp.int32)
    total = jnp.sum(jnp.where(in_pool_u, eu, 0.0), axis=-1) + jnp.sum(
        jnp.where(pooled_t, et, 0.0), axis=-1
    )
    e_bar = total / jnp.maximum(count, 1).astype(eu.dtype)
    scale = 1.0 + e_bar  # c / p(x0)
    h_u = jnp.where(in_pool_u, _numerics.h_shifted((eu - e_bar[..., None]) / scale[..., None]), 0)
    h_t = jnp.where(pooled_t, _numerics.h_shifted((et - e_bar[..., None]) / scale[..., None]), 0)
    value_rel = scale * (jnp.sum(h_u, axis=-1) + jnp.sum(h_t, axis=-1))
    value_rel = jnp.where(count > 0, value_rel, 0.0)
    return value_rel, scale, pooled_u, pooled_t


def _cut(ux, pooled_u):
    """Logit of the last pooled ``U`` entry (``+inf`` when none is pooled)."""
    last = jnp.take_along_axis(ux, jnp.maximum(pooled_u - 1, 0)[..., None], axis=-1)[..., 0]
    return jnp.where(pooled_u > 0, last, jnp.inf)


def _upper_member(rule, rel, log_p_max, entropy):
    """Membership in a threshold rule's ``U`` from logits relative to ``x0`` (no ``exp``)."""
    threshold, inclusive = rule.upper_threshold(jnp.exp(log_p_max), entropy)
    positive = threshold > 0
    log_threshold = jnp.where(positive, jnp.log(jnp.where(positive, threshold, 1.0)), -jnp.inf)
    return rel >= log_threshold if inclusive else rel > log_threshold


def _solve_window(prep: _Prepared, rule, window: int):
    """Top-``K`` path for every row. Returns ``(solution, exact)``; ``exact`` is ``[N]``."""
    vocab = prep.x.shape[-1]
    m = rule.list_size
    x0 = prep.top_x[:, 0]
    positions = jnp.arange(window)
    if rule.static_upper_size is not None:
        upper = jnp.full(x0.shape, min(rule.static_upper_size, vocab), jnp.int32)
        exact = jnp.ones(x0.shape, bool)
    else:
        member = _upper_member(
            rule,
            prep.top_x - x0[:, None],
            prep.log_p_max[:, None],
            None if prep.entropy is None else prep.entropy[:, None],
        )
        upper = jnp.sum(member, axis=-1, dtype=jnp.int32)
        exact = (upper + m <= window) | (window == vocab)
    impossible = upper > vocab - m
    comp_pos = jnp.minimum(upper[:, None] + jnp.arange(m), window - 1)
    comp_x = jnp.take_along_axis(prep.top_x, comp_pos, axis=-1)
    comp_i = jnp.take_along_axis(prep.top_i, comp_pos, axis=-1)
    u_valid = positions < upper[:, None]
    value_rel, level_rel, pooled_u, pooled_t = _water_fill(prep.top_x, u_valid, comp_x, x0)
    u_cut = _cut(prep.top_x, pooled_u)
    sol = _Solution(value_rel, level_rel, impossible, pooled_u, u_cut, comp_x, comp_i, pooled_t)
    return sol, exact


def _solve_row_exact(x, top_x, log_p_max, entropy, rule, window: int) -> _Solution:
    """Exact path for one row ``x: [V]`` whose ``U`` or ``T*`` reaches past the window."""
    vocab = x.shape[-1]
    m = rule.list_size
    x0 = top_x[0]
    member = _upper_member(rule, x - x0, log_p_max, entropy)
    upper = jnp.sum(member, dtype=jnp.int32)
    impossible = upper > vocab - m
    # T* = top-m of L; -inf logits of L stay above the mask of U.
    key = jnp.where(member, -jnp.inf, jnp.maximum(x, jnp.finfo(x.dtype).min))
    _, comp_i = _numerics.top_k(key, m)
    comp_i = comp_i.astype(jnp.int32)
    comp_x = x[comp_i]
    u_valid = jnp.arange(window) < upper
    value_rel, level_rel, pooled_u, pooled_t = _water_fill(top_x, u_valid, comp_x, x0)
    windowed = _Solution(
        value_rel,
        level_rel,
        impossible,
        pooled_u,
        _cut(top_x, pooled_u),
        comp_x,
        comp_i,
        pooled_t,
    )

    def full_sort():
        # More than `window` tokens of U are pooled: sort the whole row (rare, slow).
        neg_sorted, _ = lax.sort((-x, jnp.arange(vocab)), num_keys=1, is_stable=True)
        sx = -neg_sorted
        valid = jnp.arange(vocab) < upper
        v, c, pu, pt = _water_fill(sx, valid, comp_x, x0)
        return _Solution(v, c, impossible, pu, _cut(sx, pu), comp_x, comp_i, pt)

    overflow = (~impossible) & (upper > window) & (pooled_u >= window)
    return lax.cond(overflow, full_sort, lambda: windowed)


def _solve(prep: _Prepared, rule, window: int) -> _Solution:
    sol, exact = _solve_window(prep, rule, window)
    if rule.static_upper_size is not None or window == prep.x.shape[-1]:
        return sol
    need = ~exact & prep.valid
    entropy = prep.entropy if prep.entropy is not None else jnp.zeros_like(prep.log_p_max)

    def fix_rows():
        def one(args):
            flag, x, top_x, log_p_max, ent, row = args
            return lax.cond(
                flag,
                lambda: _solve_row_exact(x, top_x, log_p_max, ent, rule, window),
                lambda: row,
            )

        return lax.map(one, (need, prep.x, prep.top_x, prep.log_p_max, entropy, sol))

    return lax.cond(jnp.any(need), fix_rows, lambda: sol)


def _finish(prep: _Prepared, sol: _Solution, return_q: bool) -> Certificate:
    dtype = prep.x.dtype
    p_max = jnp.exp(prep.log_p_max)
    ok = prep.valid
    nan = jnp.asarray(jnp.nan, dtype)
    value = jnp.where(sol.impossible, jnp.inf, p_max * sol.value_rel)
    value = jnp.where(ok, value, nan)
    pool_size = jnp.where(sol.impossible, 0, sol.pooled_u + jnp.sum(sol.pooled_t, -1))
    level = jnp.where((pool_size > 0) & ok, p_max * sol.level_rel, nan)
    if prep.top_x.shape[-1] > 1:
        margin = -p_max * jnp.expm1(prep.top_x[:, 1] - prep.top_x[:, 0])
    else:
        margin = p_max
    competitor = jnp.where(sol.impossible[:, None], -1, sol.comp_i)
    q_star = None
    if return_q:
        x = prep.x
        lse = prep.top_x[:, 0] - prep.log_p_max
        p = jnp.exp(x - lse[:, None])
        rows = jnp.arange(x.shape[0])[:, None]
        is_comp = jnp.zeros(x.shape, bool).at[rows, sol.comp_i].set(True)
        lift = jnp.zeros(x.shape, bool).at[rows, sol.comp_i].set(sol.pooled_t)
        lower = (x >= sol.u_cut[:, None]) & ~is_comp
        pool = (lift | lower) & (pool_size > 0)[:, None]
        q_star = jnp.where(pool, level[:, None], p)
        q_star = jnp.where(ok[:, None], q_star, nan)
    return Certificate(
        value=value,
        margin=jnp.where(ok, margin, nan),
        greedy_token=prep.top_i[:, 0],
        competitor=competitor,
        pool_size=pool_size.astype(jnp.int32),
        level=level,
        valid=ok,
        q_star=q_star,
    )


def _window_size(rules: Sequence, vocab: int, top_k: int) -> int:
    need = [top_k] + [(r.static_upper_size or 1) + r.list_size for r in rules]
    return max(1, min(vocab, max(need)))


@functools.partial(jax.jit, static_argnames=("rules", "return_q", "top_k"))
def _certificates_flat(x, rules, return_q, top_k):
    window = _window_size(rules, x.shape[-1], top_k)
    prep = _prepare(x, window, any(r.needs_entropy for r in rules))
    return tuple(_finish(prep, _solve(prep, r, window), return_q) for r in rules)


def _check_inputs(logits, rules, top_k):
    if not hasattr(logits, "dtype") or not hasattr(logits, "shape"):
        logits = jnp.asarray(logits)
    if not jnp.issubdtype(logits.dtype, jnp.floating):
        raise ValueError(f"logits must be floating point, got dtype {logits.dtype}")
    if logits.ndim < 1 or logits.shape[-1] < 1:
        raise ValueError(f"logits must have shape [..., V] with V >= 1, got {logits.shape}")
    bad = [r for r in rules if not isinstance(r, rules_lib._SINGLE + (rules_lib.TreeCoverage,))]
    if bad or not rules:
        raise ValueError(f"expected one or more jaxcert rules, got {bad or rules!r}")
    check_int("top_k", top_k)
    return logits


def certificates(
    logits: jax.typing.ArrayLike,
    rules: Sequence[rules_lib.Rule],
    *,
    return_q: bool = False,
    top_k: int = DEFAULT_TOP_K,
) -> tuple[Certificate, ...]:
    """Exact certificates of several rules, sharing one normalisation and one top-K.

    Args:
      logits: ``[..., V]`` logits or log-probabilities of the target ``p`` (normalised
        here; ``-inf`` marks a zero-probability token, which stays in the vocabulary).
        float32/bfloat16/float16 are computed in float32, float64 (with ``jax_enable_x64``)
        in float64.
      rules: the rules, e.g. ``(StrictGreedy(), Additive(0.3), TreeCoverage(4))``.
      return_q: also return the minimiser ``q*`` (``[..., V]``; costs a few passes).
      top_k: size ``K`` of the sorted window (static). Rows whose ``U`` or ``T*`` reach
        past it are solved exactly over the full vocabulary; ``K`` only trades speed.

    Returns:
      One :class:`Certificate` per rule, in order.

    Raises:
      ValueError: non-floating logits, a shape without a vocabulary axis, no rules or an
        object that is not a rule, or an invalid ``top_k``. Rows with NaN/``+inf`` do not
        raise: they come back with ``valid=False`` and ``value=nan``.

    Source: spec sections 0-3 and 6 (``../shared/spec/certificates.md``).
    """
    rules = tuple(rules)
    logits = _check_inputs(logits, rules, top_k)
    lead, vocab = logits.shape[:-1], logits.shape[-1]
    flat = jnp.reshape(logits, (-1, vocab))
    outs = _certificates_flat(flat, rules, return_q, top_k)

    def unflatten(a):
        return jnp.reshape(a, lead + a.shape[1:])

    return tuple(jax.tree_util.tree_map(unflatten, out) for out in outs)


def certificate(
    logits: jax.typing.ArrayLike,
    rule: rules_lib.Rule,
    *,
    return_q: bool = False,
    top_k: int = DEFAULT_TOP_K,
) -> Certificate:
    """Exact certificate ``C_p = min_{q in R_p} KL(p || q)`` of one rule.

    If a drafter ``q`` has ``KL(p || q) < value``, the rule is guaranteed to accept its
    choice (its top-``m`` list meets ``U``); ``q_star`` is a rejected drafter at KL
    exactly ``value``. See :func:`certificates` for arguments, errors and precision.

    Example:
      >>> import jax.numpy as jnp
      >>> from jaxcert import certificate, StrictGreedy
      >>> c = certificate(jnp.log(jnp.array([0.7, 0.3])), StrictGreedy())
      >>> round(float(c.value), 6)  # 0.7 log(1.4) + 0.3 log(0.6)
      0.082283

    Source: spec sections 0-3 and 6 (``../shared/spec/certificates.md``).
    """
    return certificates(logits, (rule,), return_q=return_q, top_k=top_k)[0]
