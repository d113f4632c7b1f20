"""The drafter's side of a round: re-read the new tokens, then draft a chain or a tree.

The drafter's cache has ``B * M`` rows, one per tree branch ("virtual rows", ``M = 1`` for
chains): a branch's row holds its own ancestors, so every draft step is a plain one-token
forward of ``B * M`` rows (the model's cache API lets a token see all committed entries of its
row, so branches of one row cannot share a cache row). All virtual rows of a row share the
committed prefix. Dynamic trees re-point a frontier slot to another parent by copying that
parent's row segment (``K`` slots) before the step.

Step 0 re-reads ``s[drafter_start:n)`` (the narrowest of ``DecodeConfig.reread_widths``) on one
virtual row per row, copies it to the others, and projects only the last real position
through the lm-head. Then, while a row's policy says continue, the frontier (depth ``d``
nodes) is fed and its children drafted.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

from jaxcert.decoding import policies as policies_lib
from jaxcert.decoding import tree as tree_lib
from jaxcert.decoding.drafters.base import Drafter
from jaxcert.decoding.protocols import Cache
from jaxcert.decoding.state import DraftTree, PolicyState
from jaxcert.decoding.verify import sampling_log_probs

__all__ = ["draft"]


def _reread(drafter, params, cache, tokens, start, length, widths, m, context):
    """Step 0: rolls back to ``start``, reads ``s[start:length)``; root logits ``[B, V]`` and
    the last real position's hidden state ``[B, E]``.

    The pass takes the narrowest of the static ``widths`` that holds every row's tokens:
    one token after a rejection, the usual re-read after a round that drafted, the widest
    after rounds that skipped the drafter. Only the last real position goes through the
    lm-head (the drafter's ``read`` and ``project``). A drafter that reads the target's
    states reads each token with those before it (``context`` ``[B, width, Z]``).
    """
    count = length - start
    if m > 1:  # one virtual row per row reads; the others get copies
        cache = cache.take_rows(jnp.arange(tokens.shape[0], dtype=jnp.int32) * m)
    cache = cache.rollback(start)

    def read(w):
        def run(cache):
            window = jax.vmap(lambda row, s: lax.dynamic_slice_in_dim(row, s, w))(tokens, start)
            states = None if context is None else context[:, :w]
            hidden, cache = drafter.read(params, window, cache, states)
            return jnp.take_along_axis(hidden, (count - 1)[:, None, None], axis=1)[:, 0], cache

        return run

    if len(widths) > 1:
        index = jnp.searchsorted(jnp.asarray(widths), jnp.max(count))
        index = jnp.minimum(index, len(widths) - 1)
        last, cache = lax.switch(index, [read(w) for w in widths], cache)
    else:
        last, cache = read(widths[0])(cache)
    cache = cache.commit(count)
    return drafter.project(params, last), last, (cache.repeat(m) if m > 1 else cache)


def _log_q(q):
    """``log softmax(q)`` with ``-inf`` (not ``nan``) where a row's logits are all ``-inf``
    (a drafter that proposes nothing, :class:`~jaxcert.decoding.ngram.NgramDrafter`)."""
    logq = jax.nn.log_softmax(q.astype(jnp.float32), axis=-1)
    return jnp.where(jnp.isnan(logq), -jnp.inf, logq)


def _first_children(key, q_root, m, sampling, temperature, top_p):
    """Top-``m`` children of the root (``m`` draws without replacement when sampling); a
    child of probability 0 (a one-hot or empty ``q``) is not drafted."""
    logq = _log_q(q_root)
    if sampling:
        lp = sampling_log_probs(q_root, temperature, top_p)
        lp = jnp.where(jnp.isnan(lp), -jnp.inf, lp)
        _, tok = lax.top_k(lp + jax.random.gumbel(key, lp.shape), m)
        valid = jnp.isfinite(jnp.take_along_axis(lp, tok, axis=-1))
    else:
        _, tok = lax.top_k(logq, m)
        valid = jnp.isfinite(jnp.take_along_axis(logq, tok, axis=-1))
    return tok.astype(jnp.int32), jnp.take_along_axis(logq, tok, axis=-1), valid


def _next_token(key, q, sampling, temperature, top_p):
    """One child per frontier node: ``q`` ``[B, M, V]`` -> tokens and raw log-probs ``[B, M]``
    (``-inf``: no proposal)."""
    logq = _log_q(q)
    if sampling:
        tok = jax.random.categorical(key, sampling_log_probs(q, temperature, top_p), axis=-1)
    else:
        tok = jnp.argmax(q, axis=-1)
    tok = tok.astype(jnp.int32)
    return tok, jnp.take_along_axis(logq, tok[..., None], axis=-1)[..., 0]


def _init_nodes(q_root, tok, logq, valid, shape, max_depth):
    """Node buffers holding the root's children, and the ``[B, X, V]`` drafter-logit buffer."""
    b, v = q_root.shape
    m = tok.shape[1]
    dynamic = isinstance(shape, tree_lib.DynamicTree)
    q_buf = jnp.zeros((b, 1 + (max_depth - 1) * m, v), jnp.float32).at[:, 0].set(q_root)
    pool = shape.pool_size if dynamic else m * max_depth
    nodes = {
        "tokens": jnp.zeros((b, pool), jnp.int32).at[:, :m].set(tok),
        "valid": jnp.zeros((b, pool), bool).at[:, :m].set(valid),
        "cum": jnp.full((b, pool), -jnp.inf, jnp.float32).at[:, :m].set(logq),
    }
    if dynamic:
        nodes |= {
            "parent": jnp.full((b, pool), -1, jnp.int32),
            "depth": jnp.ones((b, pool), jnp.int32),
            "rank": jnp.zeros((b, pool), jnp.int32).at[:, :m].set(jnp.arange(m, dtype=jnp.int32)),
            "q_index": jnp.zeros((b, pool), jnp.int32),
        }
    return q_buf, nodes


def _grow_static(key, q, frontier, go, nodes, depth, sampling, temperature, top_p):
    """Chain / static tree: every frontier node gets one child (its top token, or a draw)."""
    _, f_node, _, f_cum = frontier
    m = q.shape[1]
    c_tok, c_logq = _next_token(key, q, sampling, temperature, top_p)
    new = {"tokens": c_tok, "valid": go & jnp.isfinite(c_logq), "cum": f_cum + c_logq}
    nodes = {k: lax.dynamic_update_slice_in_dim(nodes[k], new[k], depth * m, axis=1) for k in new}
    return nodes, (c_tok, f_node + m, go, new["cum"])


def _grow_dynamic(q, frontier, go, nodes, depth):
    """EAGLE-2: every frontier node gets its top-``m`` children; the best ``m`` form the frontier.

    Returns the nodes, the new frontier and each new frontier slot's parent slot.
    """
    _, f_node, _, f_cum = frontier
    b, m, _ = q.shape
    c_logq, c_tok = lax.top_k(_log_q(q), m)  # [B, M, M]
    c_cum = f_cum[..., None] + c_logq
    c_valid = go[..., None] & jnp.isfinite(c_logq)
    at = m + (depth - 1) * m * m
    flat = lambda x: jnp.broadcast_to(x, c_cum.shape).reshape(b, m * m)  # noqa: E731
    updates = {
        "tokens": flat(c_tok.astype(jnp.int32)),
        "valid": flat(c_valid),
        "cum": flat(jnp.where(c_valid, c_cum, -jnp.inf)),
        "parent": flat(f_node[..., None]),
        "depth": jnp.full((b, m * m), depth + 1, jnp.int32),
        "rank": flat(jnp.arange(m, dtype=jnp.int32)),
        "q_index": flat(1 + (depth - 1) * m + jnp.arange(m, dtype=jnp.int32)[:, None]),
    }
    nodes = {k: lax.dynamic_update_slice_in_dim(nodes[k], updates[k], at, axis=1) for k in nodes}
    _, pick = lax.top_k(updates["cum"], m)  # [B, M]
    take = lambda x: jnp.take_along_axis(x, pick, axis=1)  # noqa: E731
    frontier = (take(updates["tokens"]), at + pick, take(updates["valid"]), take(updates["cum"]))
    return nodes, frontier, (pick // m).astype(jnp.int32)


def draft(
    drafter: Drafter,
    params: nnx.State,
    cache: Cache,
    *,
    tokens: jax.Array,
    length: jax.Array,
    start: jax.Array,
    limit: jax.Array,
    policy: policies_lib.PolicyParams,
    policy_state: PolicyState,
    key: jax.Array,
    shape: tree_lib.TreeShape,
    max_depth: int,
    widths: tuple[int, ...],
    sampling: bool,
    temperature: jax.typing.ArrayLike,
    top_p: jax.typing.ArrayLike,
    context: jax.Array | None = None,
    need: jax.Array | None = None,
) -> tuple[DraftTree, Cache]:
    """Drafts one tree (or chain) per row.

    Args:
      drafter, params: the drafter (:class:`~jaxcert.decoding.drafters.base.Drafter`) and
        its parameters.
      cache: the drafter's cache, ``B * M`` rows.
      tokens: ``[B, S]`` the sequences; ``length`` ``[B]`` their lengths ``n``.
      start: ``[B]`` first index to re-read (``n - start <= width``).
      limit: ``[B]`` int32 deepest useful depth (the token budget; at least 1).
      policy, policy_state: the draft-length policy.
      key: PRNG key (sampling).
      shape: chain, static or dynamic tree; ``max_depth`` its depth ``K``.
      widths: the static widths of the re-read (``DecodeConfig.reread_widths``, sorted;
        the last, the widest, ``DecodeConfig.reread``); each round takes the narrowest
        that holds every row's new tokens.
      sampling, temperature, top_p: draw instead of taking the drafter's top choices
        (temperature and top-p: scalars, traced).
      context: ``[B, width, Z]`` the target's states before the re-read tokens
        (``DecodeState.drafter_context``) for a drafter that reads them, else ``None``.
      need: ``[B]`` float32 tokens each row still has to write (0: done): ``goodput`` then
        weighs the batch's finishing time (``docs/goodput.md``); ``None``: its total
        tokens per second.

    Returns:
      ``(tree, cache)``: the :class:`DraftTree` and the drafter cache (garbage past ``n``).
    """
    m = 1 if isinstance(shape, tree_lib.Chain) else shape.m
    dynamic = isinstance(shape, tree_lib.DynamicTree)
    b = tokens.shape[0]
    rows = jnp.arange(b)
    proposes = drafter.proposes_tokens  # the policy reads a proposal's match length
    q_root, h_root, cache = _reread(
        drafter, params, cache, tokens, start, length, widths, m, context
    )
    # Each drafted token's step gets its parent's hidden output ([B, M, E]): a head reads
    # it, a language model ignores it.
    f_ctx = jnp.broadcast_to(h_root[:, None], (b, m, h_root.shape[-1]))
    key, sub = jax.random.split(key)
    tok, logq, valid = _first_children(sub, q_root, m, sampling, temperature, top_p)
    feats = policies_lib.drafter_features(q_root, proposes)
    valid = valid & policies_lib.draft_any(policy, policy_state, feats, need)  # goodput may not
    q_buf, nodes = _init_nodes(q_root, tok, logq, valid, shape, max_depth)
    one = jnp.ones((b,), jnp.int32)
    cont, survival = policies_lib.should_continue(
        policy, policy_state, feats, one, policies_lib.Survival.start(b), jnp.any(valid, -1),
        need,
    )  # fmt: skip
    frontier = (tok, jnp.broadcast_to(jnp.arange(m, dtype=jnp.int32), (b, m)), valid, logq)
    seg_start = jnp.repeat(length, m)

    def cond(carry):
        depth, cont = carry[0], carry[1]
        return (depth < max_depth) & jnp.any(cont)

    def body(carry):
        depth, cont, survival, frontier, parent_slot, f_ctx, nodes, q_buf, cache, key = carry
        if dynamic:  # each frontier slot's row takes its parent's ancestors
            src = (rows[:, None] * m + parent_slot).reshape(-1)
            cache = cache.copy_segments(src, seg_start, max_depth)
        parent = f_ctx.reshape(b * m, -1)
        logits, hidden, cache = drafter.step(params, frontier[0].reshape(b * m), cache, parent)
        cache = cache.commit(1)
        q = logits.reshape(b, m, -1)
        q_buf = lax.dynamic_update_slice_in_dim(q_buf, q, 1 + (depth - 1) * m, axis=1)
        key, sub = jax.random.split(key)
        go = cont[:, None] & frontier[2]
        # The policy reads the distribution of the most probable branch.
        best = jnp.argmax(jnp.where(frontier[2], frontier[3], -jnp.inf), axis=-1)
        if dynamic:
            nodes, frontier, parent_slot = _grow_dynamic(q, frontier, go, nodes, depth)
        else:
            nodes, frontier = _grow_static(
                sub, q, frontier, go, nodes, depth, sampling, temperature, top_p
            )
        # The new frontier's parents: slot i (static trees), parent_slot (dynamic).
        hidden = hidden.reshape(b, m, -1)
        f_ctx = jnp.take_along_axis(hidden, parent_slot[..., None], axis=1) if dynamic else hidden
        feats = policies_lib.drafter_features(q[rows, best], proposes)
        more, survival = policies_lib.should_continue(
            policy, policy_state, feats, one * (depth + 1), survival, jnp.any(frontier[2], -1),
            need,
        )  # fmt: skip
        cont = cont & more & (depth + 1 < limit)
        return depth + 1, cont, survival, frontier, parent_slot, f_ctx, nodes, q_buf, cache, key

    parent_slot = jnp.broadcast_to(jnp.arange(m, dtype=jnp.int32), (b, m))
    depth = jnp.asarray(1, jnp.int32)
    go = cont & (1 < limit)
    init = (depth, go, survival, frontier, parent_slot, f_ctx, nodes, q_buf, cache, key)
    _, _, _, _, _, _, nodes, q_buf, cache, _ = lax.while_loop(cond, body, init)
    if isinstance(shape, tree_lib.DynamicTree):
        return _select_dynamic(nodes, q_buf, shape.nodes), cache
    st = tree_lib.static_structure(m, max_depth)
    full = lambda a: jnp.broadcast_to(jnp.asarray(a, jnp.int32), (b, a.shape[0]))  # noqa: E731
    tree = DraftTree(
        tokens=nodes["tokens"],
        parent=full(st.parent),
        depth=full(st.depth),
        rank=full(st.rank),
        valid=nodes["valid"],
        q_index=full(st.q_index),
        q_logits=q_buf,
    )
    return tree, cache


def _select_dynamic(nodes: dict, q_buf: jax.Array, n: int) -> DraftTree:
    """EAGLE-2 re-ranking: keep the ``n`` best nodes by cumulative log-probability.

    A child never scores above its parent and ties go to the lower pool index (parents come
    first), so the kept set is closed under taking parents. Kept nodes are listed in pool order
    (topological), drafted ones first.
    """
    b, pool = nodes["tokens"].shape
    _, pick = lax.top_k(nodes["cum"], n)  # valid nodes first (invalid ones are -inf)
    kept_valid = jnp.take_along_axis(nodes["valid"], pick, axis=1)
    order = jnp.argsort(jnp.where(kept_valid, pick, pool + pick), axis=1)
    pick = jnp.take_along_axis(pick, order, axis=1)  # [B, N] pool indices, topological
    take = lambda x: jnp.take_along_axis(x, pick, axis=1)  # noqa: E731
    rows = jnp.arange(b)[:, None]
    order = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), (b, n))
    new_index = jnp.full((b, pool), -1, jnp.int32).at[rows, pick].set(order)
    parent_pool = take(nodes["parent"])
    parent = jnp.where(
        parent_pool >= 0,
        jnp.take_along_axis(new_index, jnp.maximum(parent_pool, 0), axis=1),
        DraftTree.NO_PARENT,
    )
    valid = take(nodes["valid"]) & ((parent_pool < 0) | (parent >= 0))
    return DraftTree(
        tokens=take(nodes["tokens"]),
        parent=parent,
        depth=take(nodes["depth"]),
        rank=take(nodes["rank"]),
        valid=valid,
        q_index=take(nodes["q_index"]),
        q_logits=q_buf,
    )
