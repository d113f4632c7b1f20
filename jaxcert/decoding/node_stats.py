"""Per-round statistics of every drafted node, computed on device in the verification pass.

Certificates in the statistics (documented choice): at every drafted node, ``cert`` is the exact
certificate ``C_p`` of the verification rule (list size 1) of the target distribution at the
node's position, and ``cert_list`` the tree certificate ``TreeCoverage(m, base=rule)`` with
``m`` = the number of drafted children of the node's parent (for chains ``m = 1``, so both
agree). With ``KL = KL(p||q)`` at that position, the certificate theorem says: if the drafter
proposed its argmax and ``KL < cert``, that token passes the rule; if the parent's children are
the drafter's top-``m`` and ``KL < cert_list``, one of them passes. Speculative sampling has no
such certificate: ``cert`` is ``nan`` there.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxcert.core import rules as rules_lib
from jaxcert.core.solver import certificates
from jaxcert.decoding import policies as policies_lib
from jaxcert.decoding.state import NodeStats, RoundStats
from jaxcert.losses import kl_divergence

__all__ = ["node_stats", "pad_nodes", "no_nodes", "empty_round_stats"]


def _gather_positions(x: jax.Array, index: jax.Array) -> jax.Array:
    """``x`` ``[B, T, ...]`` at ``index`` ``[B, N]`` -> ``[B, N, ...]``."""
    idx = index.reshape(index.shape + (1,) * (x.ndim - 2))
    return jnp.take_along_axis(x, idx, axis=1)


def _scatter_any(values: jax.Array, index: jax.Array, size: int) -> jax.Array:
    """``out[b, t] = any(values[b, i] for index[b, i] == t)``: ``[B, N]`` -> ``[B, size]``."""
    rows = jnp.arange(values.shape[0])[:, None]
    return jnp.zeros((values.shape[0], size), jnp.int32).at[rows, index].max(values.astype(int)) > 0


def node_stats(
    target_logits: jax.Array,
    q_logits: jax.Array,
    *,
    tokens_valid: jax.Array,
    parent: jax.Array,
    depth: jax.Array,
    rank: jax.Array,
    q_index: jax.Array,
    passes: jax.Array,
    on_path: jax.Array,
    rule,
    max_children: int,
    certify: bool,
    one_hot: bool = False,
) -> NodeStats:
    """Statistics of ``N`` drafted nodes verified against ``T = N + 1`` target positions.

    Args:
      target_logits: ``[B, T, V]`` target logits (root first).
      q_logits: ``[B, E, V]`` drafter logits at expanded nodes.
      tokens_valid, parent, depth, rank, q_index: ``[B, N]`` the tree (see ``DraftTree``).
      passes, on_path: ``[B, N]`` bool verification results.
      rule: the single-token rule (``None``: sampling, no certificates).
      max_children: ``M``, the most children a node can have (static).
      certify: compute certificates (static; otherwise ``cert`` is ``nan``).
      one_hot: the drafter proposes tokens, ``q`` is one-hot (static;
        :class:`~jaxcert.decoding.ngram.NgramDrafter`): ``KL(p || q)`` is infinite and
        ``KL < C_p`` means nothing, so ``kl``, ``cert``, ``cert_list`` and the drafter
        features (``entropy``, ``q_top``, ``q_cert``) are ``nan``.

    Returns:
      A :class:`NodeStats` with ``[B, N]`` fields.
    """
    b, t, _ = target_logits.shape
    parent_pos = parent + 1
    p_par = _gather_positions(target_logits, parent_pos)  # [B, N, V]
    q_par = _gather_positions(q_logits, q_index)  # [B, N, V]
    nan = jnp.full(parent.shape, jnp.nan, jnp.float32)
    if one_hot:
        kl = nan
        feats = policies_lib.DrafterFeatures(
            top=nan, entropy=nan, cert=nan, match=jnp.zeros(parent.shape, jnp.int32)
        )
    else:
        kl = kl_divergence(drafter_logits=q_par, target_logits=p_par)  # KL(p || q)
        feats = policies_lib.drafter_features(q_par)
    n_children = (
        jnp.zeros((b, t), jnp.int32)
        .at[jnp.arange(b)[:, None], parent_pos]
        .add(tokens_valid.astype(jnp.int32))
    )
    m_par = jnp.take_along_axis(n_children, parent_pos, axis=1)  # [B, N]
    cert = cert_list = nan
    if certify and rule is not None and not one_hot:
        base = None if isinstance(rule, rules_lib.StrictGreedy) else rule
        extra = tuple(rules_lib.TreeCoverage(m, base=base) for m in range(2, max_children + 1))
        values = [c.value for c in certificates(target_logits, (rule,) + extra)]  # [B, T] each
        by_m = jnp.stack(values, axis=-1)  # [B, T, M]
        at_parent = _gather_positions(by_m, parent_pos)  # [B, N, M]
        cert = at_parent[..., 0]
        pick = jnp.clip(m_par - 1, 0, max_children - 1)[..., None]
        cert_list = jnp.take_along_axis(at_parent, pick, axis=-1)[..., 0]
    parent_on_path = jnp.take_along_axis(
        jnp.concatenate([jnp.ones((b, 1), bool), on_path], axis=1), parent_pos, axis=1
    )
    child_passes = _scatter_any(passes & tokens_valid, parent_pos, t)
    return NodeStats(
        valid=tokens_valid,
        depth=depth,
        rank=rank,
        passes=passes & tokens_valid,
        accepted=on_path,
        reached=tokens_valid & parent_on_path,
        kl=kl,
        cert=cert,
        cert_list=cert_list,
        covered=jnp.take_along_axis(child_passes, parent_pos, axis=1),
        entropy=feats.entropy,
        q_top=feats.top,
        q_cert=feats.cert,
    )


def pad_nodes(stats: NodeStats, n: int) -> NodeStats:
    """Pads every ``[B, N']`` field to ``[B, n]`` (``False`` / 0 / ``nan``)."""

    def pad(x):
        fill = np.nan if jnp.issubdtype(x.dtype, jnp.floating) else 0
        return jnp.pad(x, ((0, 0), (0, n - x.shape[1])), constant_values=fill)

    return jax.tree.map(pad, stats)


def no_nodes(shape: tuple[int, ...]) -> NodeStats:
    """Statistics of ``shape`` node slots none of which was drafted (``False`` / 0 /
    ``nan``)."""
    zn = lambda dtype: jnp.zeros(shape, dtype)  # noqa: E731
    f = jnp.full(shape, jnp.nan, jnp.float32)
    return NodeStats(
        valid=zn(bool),
        depth=zn(jnp.int32),
        rank=zn(jnp.int32),
        passes=zn(bool),
        accepted=zn(bool),
        reached=zn(bool),
        kl=f,
        cert=f,
        cert_list=f,
        covered=zn(bool),
        entropy=f,
        q_top=f,
        q_cert=f,
    )


def empty_round_stats(rounds: int, batch: int, nodes: int) -> RoundStats:
    """Buffers for ``rounds`` rounds (``active`` all ``False``)."""
    z = lambda dtype: jnp.zeros((rounds, batch), dtype)  # noqa: E731
    return RoundStats(
        active=z(bool),
        drafted=z(jnp.int32),
        depth=z(jnp.int32),
        accepted=z(jnp.int32),
        emitted=z(jnp.int32),
        nodes=no_nodes((rounds, batch, nodes)),
    )
