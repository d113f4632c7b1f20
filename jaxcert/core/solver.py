"""Exact acceptance certificates over full vocabularies.

For a verification rule with rejection region ``R_p`` (``docs/certificates.md`` §§1-2), the
certificate is ``C_p = min_{q in R_p} KL(p || q)`` in nats: if the drafter satisfies
``KL(p || q) < C_p``, its choice is guaranteed to be accepted. The minimiser ``q*``
(the KL projection of ``p`` onto ``R_p``) is a rejected drafter at KL exactly ``C_p``.

Algorithm (``docs/certificates.md`` §§3-5): ``U`` is a prefix of the tokens sorted by decreasing
``p``, the optimal competitor set ``T*`` is the next ``m`` tokens (Lemma 2), and the
projection pools the largest ``U``-tokens with the smallest ``T*``-tokens at their
mean ``c`` (Lemma 1). Pool membership is read off the sign of the water-filling
function ``g(c) = sum_U (p - c)_+ - sum_T (c - p)_+`` at every breakpoint, and the
value is evaluated as ``sum_P c h(p_i / c)`` from logit differences (``expm1``), which
is stable for near-tied pools (``docs/certificates.md`` §8).

Speed: every rule of a call shares one row summary (maximum, normaliser, entropy, the top
``W`` logits), read in two passes over the logits (``numerics.row_summary``;
``docs/certificates.md`` §8, "Reading the logits"); only the top ``W`` logits are sorted.
When ``U`` or ``T*``
could reach past them (``|U| + m > W``, possible for the threshold rules), those rows
take an exact path over the full vocabulary: a full-row count and a masked top-``m``
for ``T*``, and, only if more than ``W`` tokens of ``U`` are pooled, a full sort. The
exact path runs behind a ``lax.cond``; on CPU in a loop over the hard rows alone, so a batch
only pays for its hard rows (under a user's ``jax.vmap`` the condition becomes a select and
both branches run: still exact, slower).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import NamedTuple

import flax.struct
import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from jaxcert.base.validate import check_int
from jaxcert.core import collectives, numerics
from jaxcert.core import rules as rules_lib

__all__ = ["Certificate", "certificate", "certificates", "DEFAULT_TOP_K", "window_certificate"]

DEFAULT_TOP_K = 64


@flax.struct.dataclass
class Certificate:
    """Certificate of one rule for a batch of target distributions.

    Shapes: ``[...]`` is the input's leading (batch) shape, ``M`` the rule's list size
    ``m``, ``V`` the vocabulary size. Floats are float32 (float64 for float64 input).

    Attributes:
      value: ``[...]`` the certificate ``C_p`` in nats; ``+inf`` where rejection is
        impossible (``|L| < m``); ``nan`` where the input row was invalid.
      margin: ``[...]`` the target margin ``gamma``: the top-1 probability minus the
        runner-up's, ``p(x0) - max_{x != x0} p(x)``.
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
    """Per-row quantities shared by every rule. ``B`` (flattened) rows, window of ``W`` tokens."""

    x: jax.Array  # [B, V] logits in the compute dtype
    valid: jax.Array  # [B] bool
    top_x: jax.Array  # [B, W] largest logits, decreasing
    top_i: jax.Array  # [B, W] int32 their token ids (ties: lower id first)
    log_p_max: jax.Array  # [B] log p(x0)
    entropy: jax.Array | None  # [B] H(p) in nats, only if a rule needs it


class _Solution(NamedTuple):
    """Solver state for one rule; leading shape ``[B]`` (or none, per row)."""

    value_rel: jax.Array  # [B] C_p / p(x0)
    level_rel: jax.Array  # [B] c / p(x0)
    impossible: jax.Array  # [B] bool, |L| < m
    pooled_u: jax.Array  # [B] int32 number of pooled U tokens (a prefix of U)
    u_cut: jax.Array  # [B] logit of the last pooled U token
    comp_x: jax.Array  # [B, M] logits of T*, decreasing
    comp_i: jax.Array  # [B, M] int32 token ids of T*
    pooled_t: jax.Array  # [B, M] bool, T* tokens lifted to the level


def _prepare(x: jax.Array, window: int, need_entropy: bool, axis_name) -> _Prepared:
    x = x.astype(numerics.compute_dtype(x.dtype))
    # Keep the normalisation independent of top_k's outputs: on CPU, XLA fuses a reduction
    # that reads top_k's result into a loop that recomputes it (100x slower).
    x_max, total, entropy, top_x, top_i = collectives.row_summary(
        x, window, need_entropy, axis_name
    )
    # Everything is relative to the row's max: log p(x0) = (x0 - max) - log S, never
    # (max + log S) formed and subtracted again, which loses log S at large |max| (the
    # results must not depend on a common offset of the logits). NaN propagates into the
    # max and S; +inf and an all -inf row make the max non-finite.
    log_total = jnp.log(total)
    valid = jnp.isfinite(log_total) & jnp.isfinite(x_max)
    return _Prepared(x, valid, top_x, top_i, (top_x[:, 0] - x_max) - log_total, entropy)


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
    h_u = jnp.where(in_pool_u, numerics.h_shifted((eu - e_bar[..., None]) / scale[..., None]), 0)
    h_t = jnp.where(pooled_t, numerics.h_shifted((et - e_bar[..., None]) / scale[..., None]), 0)
    value_rel = scale * (jnp.sum(h_u, axis=-1) + jnp.sum(h_t, axis=-1))
    value_rel = jnp.where(count > 0, value_rel, 0.0)
    return value_rel, scale, pooled_u, pooled_t


def _cut(ux, pooled_u):
    """Logit of the last pooled ``U`` entry (``+inf`` when none is pooled)."""
    last = jnp.take_along_axis(ux, jnp.maximum(pooled_u - 1, 0)[..., None], axis=-1)[..., 0]
    return jnp.where(pooled_u > 0, last, jnp.inf)


def _solve_window(prep: _Prepared, rule, window: int, vocab: int):
    """Top-``W`` path for every row. Returns ``(solution, exact)``; ``exact`` is ``[B]``."""
    m = rule.list_size
    x0 = prep.top_x[:, 0]
    positions = jnp.arange(window)
    if rule.static_upper_size is not None:
        upper = jnp.full(x0.shape, min(rule.static_upper_size, vocab), jnp.int32)
        exact = jnp.ones(x0.shape, bool)
    else:
        member = rules_lib.in_upper_set(
            rule,
            prep.top_x - x0[:, None],
            prep.log_p_max[:, None],
            None if prep.entropy is None else prep.entropy[:, None],
        )
        # Membership grows with the logit: a rule that accepts a -inf logit accepts every
        # token (additive with t >= p(x0)), and no row of it needs the exact path.
        everything = rules_lib.in_upper_set(
            rule,
            jnp.asarray(-jnp.inf, prep.top_x.dtype),
            prep.log_p_max,
            None if prep.entropy is None else prep.entropy,
        )
        upper = jnp.where(everything, vocab, jnp.sum(member, axis=-1, dtype=jnp.int32))
        exact = (upper + m <= window) | (window == vocab) | everything
    impossible = upper > vocab - m
    comp_pos = jnp.minimum(upper[:, None] + jnp.arange(m), window - 1)
    comp_x = jnp.take_along_axis(prep.top_x, comp_pos, axis=-1)
    comp_i = jnp.take_along_axis(prep.top_i, comp_pos, axis=-1)
    u_valid = positions < upper[:, None]
    value_rel, level_rel, pooled_u, pooled_t = _water_fill(prep.top_x, u_valid, comp_x, x0)
    u_cut = _cut(prep.top_x, pooled_u)
    sol = _Solution(value_rel, level_rel, impossible, pooled_u, u_cut, comp_x, comp_i, pooled_t)
    return sol, exact


def _solve_exact(x, top_x, log_p_max, entropy, rule, window: int, vocab: int, axis_name):
    """Exact path for rows ``x: [..., V]`` (or their shards) whose ``U`` or ``T*`` passes the
    window: a full-row count of ``U`` and a masked top-``m`` for ``T*``; a full sort only for
    rows that pool more than ``W`` tokens of ``U``. Any leading shape (one row on CPU)."""
    m = rule.list_size
    x0 = top_x[..., 0]
    member = rules_lib.in_upper_set(
        rule, x - x0[..., None], log_p_max[..., None], entropy[..., None]
    )
    # T* = top-m of L; -inf logits of L stay above the mask of U (whose key is -inf).
    key = jnp.where(member, -jnp.inf, jnp.maximum(x, jnp.finfo(x.dtype).min))
    upper, comp_key, comp_i = collectives.count_and_top_k(member, key, m, axis_name)
    impossible = upper > vocab - m
    comp_x = jnp.where(comp_key == jnp.finfo(x.dtype).min, -jnp.inf, comp_key)
    u_valid = jnp.arange(window) < upper[..., None]
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
    overflow = (~impossible) & (upper > window) & (pooled_u >= window)

    def full_sort():
        # More than `window` tokens of U are pooled: sort the whole row (rare, slow; with a
        # split vocabulary the row is gathered first).
        row = collectives.gather_row(x, axis_name)
        ids = jnp.broadcast_to(jnp.arange(vocab), row.shape)
        neg_sorted, _ = lax.sort((-row, ids), num_keys=1, is_stable=True)
        sx = -neg_sorted
        valid = jnp.arange(vocab) < upper[..., None]
        v, c, pu, pt = _water_fill(sx, valid, comp_x, x0)
        sorted_sol = _Solution(v, c, impossible, pu, _cut(sx, pu), comp_x, comp_i, pt)
        return _select(overflow, sorted_sol, windowed)

    return lax.cond(jnp.any(overflow), full_sort, lambda: windowed)


def _select(flag, a: _Solution, b: _Solution) -> _Solution:
    """Row-wise ``a if flag else b`` (``flag`` of the rows' leading shape)."""

    def pick(u, v):
        f = jnp.reshape(flag, flag.shape + (1,) * (u.ndim - flag.ndim))
        return jnp.where(f, u, v)

    return jax.tree.map(pick, a, b)


def _solve(
    prep: _Prepared, rule, window: int, vocab: int, axis_name, rows: bool, fallback: bool = True
) -> _Solution:
    sol, exact = _solve_window(prep, rule, window, vocab)
    if rule.static_upper_size is not None or window == vocab or not fallback:
        return sol
    need = ~exact & prep.valid
    entropy = prep.entropy if prep.entropy is not None else jnp.zeros_like(prep.log_p_max)
    args = (prep.x, prep.top_x, prep.log_p_max, entropy, rule, window, vocab, axis_name)

    if rows:
        # CPU: only the hard rows, one at a time (a loop over their indices: the other rows
        # are not even sliced out).
        def fix_rows():
            hard = jnp.nonzero(need, size=need.shape[0], fill_value=0)[0]

            def one(i, acc: _Solution) -> _Solution:
                r = hard[i]
                row = _solve_exact(prep.x[r], prep.top_x[r], prep.log_p_max[r], entropy[r],
                                   *args[4:])  # fmt: skip
                return jax.tree.map(lambda a, v: a.at[r].set(v), acc, row)

            return lax.fori_loop(0, jnp.sum(need, dtype=jnp.int32), one, sol)

    else:
        # Accelerators: every row at once (a sequential loop over rows would idle the device).
        def fix_rows():
            return _select(need, _solve_exact(*args), sol)

    return lax.cond(jnp.any(need), fix_rows, lambda: sol)


def _finish(prep: _Prepared, sol: _Solution, return_q: bool, axis_name) -> Certificate:
    dtype = prep.x.dtype
    p_max = jnp.exp(prep.log_p_max)
    ok = prep.valid
    nan = jnp.asarray(jnp.nan, dtype)
    value = jnp.where(sol.impossible, jnp.inf, p_max * sol.value_rel)
    value = jnp.where(ok, value, nan)
    pool_size = jnp.where(sol.impossible, 0, sol.pooled_u + jnp.sum(sol.pooled_t, -1))
    level = jnp.where((pool_size > 0) & ok, p_max * sol.level_rel, nan)
    if prep.top_x.shape[-1] > 1:
        # abs: a tie gives -0.0 otherwise (the value is >= 0 by construction).
        margin = jnp.abs(p_max * jnp.expm1(prep.top_x[:, 1] - prep.top_x[:, 0]))
    else:
        margin = p_max
    competitor = jnp.where(sol.impossible[:, None], -1, sol.comp_i)
    q_star = None
    if return_q:
        x = prep.x
        # log p = (x - x0) + log p(x0): relative to the max, whatever the offset.
        p = jnp.exp((x - prep.top_x[:, :1]) + prep.log_p_max[:, None])
        rows = jnp.arange(x.shape[0])[:, None]
        # T* ids are global: this shard's entries are at id - offset (others are dropped).
        local = sol.comp_i - collectives.shard_offset(x.shape[-1], axis_name)
        local = jnp.where((local >= 0) & (local < x.shape[-1]), local, x.shape[-1])
        is_comp = jnp.zeros(x.shape, bool).at[rows, local].set(True, mode="drop")
        lift = jnp.zeros(x.shape, bool).at[rows, local].set(sol.pooled_t, mode="drop")
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


@functools.partial(jax.jit, static_argnames=("rule", "vocab_size"))
def window_certificate(top_logprobs, rule, *, vocab_size: int, entropy=None) -> jax.Array:
    """``C_p`` of each row from its ``K`` largest log-probabilities alone (the window path).

    The value is the certificate of any distribution on ``vocab_size`` tokens with these
    top ``K`` whenever the window holds ``U`` and ``T*`` (``docs/certificates.md`` §9);
    deciding whether it does (``jaxcert.pipeline.logits.certify_top_logprobs``) is the
    caller's part. Padding entries (``-inf``) rank last.

    Args:
      top_logprobs: ``[N, K]`` float32 natural-log probabilities, decreasing along ``K``.
      rule: the rule.
      vocab_size: ``V`` (static), at least ``K``.
      entropy: ``[N]`` float32 ``H(p)`` in nats, for rules that need it (``typical``).

    Returns:
      ``[N]`` float32 nats (``inf`` where rejection is impossible).
    """
    top_x = jnp.asarray(top_logprobs)
    n, window = top_x.shape
    if entropy is None:
        entropy = jnp.zeros((n,), top_x.dtype)
    prep = _Prepared(
        x=top_x,
        valid=jnp.ones((n,), bool),
        top_x=top_x,
        top_i=jnp.broadcast_to(jnp.arange(window, dtype=jnp.int32), top_x.shape),
        log_p_max=top_x[:, 0],
        entropy=jnp.asarray(entropy, top_x.dtype),
    )
    sol, _ = _solve_window(prep, rule, window, vocab_size)
    return _finish(prep, sol, False, None).value


def _window_size(rules: Sequence, vocab: int, top_k: int) -> int:
    need = [top_k] + [(r.static_upper_size or 1) + r.list_size for r in rules]
    return max(1, min(vocab, max(need)))


def _certificates_local(x, axis_name, *, rules, return_q, top_k, exact_rows, fallback=True):
    """Certificates of ``x: [..., V_local]``, a whole row or one shard of the vocabulary.

    ``fallback=False`` leaves out the exact path of rows whose ``U`` or ``T*`` pass the
    window (their values are then wrong): only to count what the common path reads
    (:mod:`jaxcert.base.reads`), since XLA charges a conditional its dearest branch."""
    lead = x.shape[:-1]
    flat = jnp.reshape(x, (-1, x.shape[-1]))
    vocab = x.shape[-1] * collectives.axis_size(axis_name)
    window = _window_size(rules, vocab, top_k)
    prep = _prepare(flat, window, any(r.needs_entropy for r in rules), axis_name)
    rows = jax.default_backend() == "cpu" if exact_rows is None else exact_rows
    outs = tuple(
        _finish(
            prep, _solve(prep, r, window, vocab, axis_name, rows, fallback), return_q, axis_name
        )
        for r in rules
    )

    def unflatten(a):
        return jnp.reshape(a, lead + a.shape[1:])

    return tuple(jax.tree_util.tree_map(unflatten, out) for out in outs)


@functools.partial(
    jax.jit, static_argnames=("rules", "return_q", "top_k", "axis_name", "exact_rows")
)
def _certificates_jit(x, *, rules, return_q, top_k, axis_name, exact_rows):
    return _certificates_local(
        x, axis_name, rules=rules, return_q=return_q, top_k=top_k, exact_rows=exact_rows
    )


def _out_specs(rules, return_q):
    def specs(lead, vocab):
        per_row = P(*lead)
        return tuple(
            Certificate(
                value=per_row,
                margin=per_row,
                greedy_token=per_row,
                competitor=P(*lead, None),
                pool_size=per_row,
                level=per_row,
                valid=per_row,
                q_star=P(*lead, vocab) if return_q else None,
            )
            for _ in rules
        )

    return specs


def _check_inputs(logits, rules, top_k):
    if not hasattr(logits, "dtype") or not hasattr(logits, "shape"):
        logits = jnp.asarray(logits)
    if not jnp.issubdtype(logits.dtype, jnp.floating):
        raise ValueError(f"logits must be floating point, got dtype {logits.dtype}")
    if logits.ndim < 1 or logits.shape[-1] < 1:
        raise ValueError(f"logits must have shape [..., V] with V >= 1, got {logits.shape}")
    bad = [r for r in rules if not isinstance(r, rules_lib.ALL_RULES)]
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
    axis_name: str | tuple[str, ...] | None = None,
    exact_rows: bool | None = None,
) -> tuple[Certificate, ...]:
    """Exact certificates of several rules, sharing one normalisation and one top-``W``.

    Sharding: a sharded ``logits`` (a concrete array with a ``NamedSharding``, or any array
    whose type carries explicit mesh axes, also under ``jax.jit``) is certified where it
    lives, inside ``jax.shard_map``: batch shards independently, vocabulary shards with the
    collectives of ``docs/scaling.md`` (a per-shard top-``W`` merged exactly,
    collective max / sums / counts), never gathering a whole row except in the rare overflow
    fallback. The outputs keep the input's batch sharding (``q_star`` its full sharding).
    Inside your own ``shard_map`` whose mesh axes split the vocabulary, pass them as
    ``axis_name``; elsewhere XLA's partitioner splits the plain computation.

    Args:
      logits: ``[..., V]`` logits or log-probabilities of the target ``p`` (normalised
        here; ``-inf`` marks a zero-probability token, which stays in the vocabulary).
        float32/bfloat16/float16 are computed in float32, float64 (with ``jax_enable_x64``)
        in float64.
      rules: the rules, e.g. ``(StrictGreedy(), Additive(0.3), TreeCoverage(4))``.
      return_q: also return the minimiser ``q*`` (``[..., V]``; costs a few passes).
      top_k: size ``W`` of the sorted window (static). Rows whose ``U`` or ``T*`` reach
        past it are solved exactly over the full vocabulary; ``W`` only trades speed.
      axis_name: mesh axis name(s) splitting the last axis of ``logits``, when called
        inside ``shard_map`` (``logits`` is then this device's ``[..., V / n]`` shard).
      exact_rows: how rows past the window are solved (static; same results): one row at
        a time, so a batch pays only for its hard rows (``True``), or every row at once,
        which keeps an accelerator busy (``False``). ``None``: rows on CPU, else at once.

    Returns:
      One :class:`Certificate` per rule, in order.

    Raises:
      ValueError: non-floating logits, a shape without a vocabulary axis, no rules or an
        object that is not a rule, or an invalid ``top_k``. Rows with NaN/``+inf`` do not
        raise: they come back with ``valid=False`` and ``value=nan``.

    Source: ``docs/certificates.md`` §§1-5 and 8 (precision: §8).
    """
    rules = tuple(rules)
    logits = _check_inputs(numerics.host_logits(logits), rules, top_k)
    kw = dict(rules=rules, return_q=return_q, top_k=top_k, exact_rows=exact_rows)

    def run(x, vocab_axes):
        if vocab_axes is None and not isinstance(x, jax.core.Tracer):
            return _certificates_jit(x, axis_name=None, **kw)
        return _certificates_local(x, vocab_axes, **kw)

    return collectives.route(run, logits, _out_specs(rules, return_q), axis_name)


def certificate(
    logits: jax.typing.ArrayLike,
    rule: rules_lib.Rule,
    *,
    return_q: bool = False,
    top_k: int = DEFAULT_TOP_K,
    axis_name: str | tuple[str, ...] | None = None,
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

    Source: ``docs/certificates.md`` §§1-5 and 8.
    """
    return certificates(logits, (rule,), return_q=return_q, top_k=top_k, axis_name=axis_name)[0]
