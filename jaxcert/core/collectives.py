"""Reductions over a vocabulary axis that may be split across devices, and the routing of the
public functions onto a mesh.

Every public array function of jaxcert is written once, for a row of logits that is either
whole (``axis_name=None``) or one shard of the vocabulary inside a ``shard_map`` over the mesh
axes ``axis_name``. The helpers below are the only places where the two differ:

==================  ============================  =========================================
quantity            whole row                     vocabulary split over ``n`` shards
==================  ============================  =========================================
max, normaliser     ``max``, ``sum``              local, then ``pmax`` / ``psum`` (1 scalar)
top-``k``           ``top_k``                     local top-``k``, ``all_gather`` of the
                                                  ``n k`` (value, id) pairs, top-``k`` again
counts              ``sum``                       local, then ``psum``
whole row (rare)    the row                       ``all_gather`` of the row
==================  ============================  =========================================

The merge is exact: the global top-``k`` lies in the union of the shards' top-``k``, and the
candidates are gathered in shard order, so ties still go to the lower token id.

:func:`route` decides, for the public functions, whether an input is sharded and how: from
the sharding in its type (explicit mesh axes, under ``jax.jit`` or not) or from a concrete
array's ``NamedSharding``. A sharded input runs inside ``jax.shard_map`` over its own mesh
and partition spec (each device works on its shard, outputs keep the input's batch sharding);
anything else runs as plain code, which XLA's partitioner may still split (``Auto`` axes).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcert.core import numerics

__all__ = [
    "AxisName",
    "axis_size",
    "count_and_top_k",
    "entropy",
    "gather_row",
    "log_softmax",
    "normalizer",
    "route",
    "row_summary",
    "shard_offset",
    "top_k",
    "vocab_max",
    "vocab_sum",
]

AxisName = str | tuple[str, ...] | None


def axis_size(axis_name: AxisName) -> int:
    """Number of vocabulary shards (1 when the row is whole)."""
    if axis_name is None:
        return 1
    names = axis_name if isinstance(axis_name, tuple) else (axis_name,)
    size = 1
    for name in names:
        size *= lax.axis_size(name)
    return size


def shard_offset(local_vocab: int, axis_name: AxisName):
    """Global id of this shard's first token (``0`` when the row is whole)."""
    if axis_name is None:
        return 0
    return lax.axis_index(axis_name).astype(jnp.int32) * local_vocab


def vocab_max(x, axis_name: AxisName):
    """``max`` over the (possibly split) last axis: ``[..., V] -> [...]``."""
    m = jnp.max(x, axis=-1)
    return m if axis_name is None else lax.pmax(m, axis_name)


def vocab_sum(x, axis_name: AxisName):
    """``sum`` over the (possibly split) last axis: ``[..., V] -> [...]``."""
    s = jnp.sum(x, axis=-1)
    return s if axis_name is None else lax.psum(s, axis_name)


def normalizer(x, axis_name: AxisName):
    """``(max, S)`` with ``S = sum(exp(x - max))`` over the whole (possibly split) row."""
    x_max = vocab_max(x, axis_name)
    return x_max, vocab_sum(jnp.exp(x - x_max[..., None]), axis_name)


def log_softmax(x, axis_name: AxisName):
    """``log softmax(x)`` over the whole (possibly split) last axis."""
    if axis_name is None:
        return jax.nn.log_softmax(x, axis=-1)
    x_max = vocab_max(lax.stop_gradient(x), axis_name)
    shifted = x - x_max[..., None]  # relative to the max first: offset-free
    return shifted - jnp.log(vocab_sum(jnp.exp(shifted), axis_name))[..., None]


def entropy(x, x_max, total, axis_name: AxisName):
    """``H(softmax(x))`` in nats over the whole row, given its global max and normaliser."""
    if axis_name is None:
        return numerics.entropy(x, x_max, total)
    weighted = lax.psum(numerics.entropy_sum(x, x_max), axis_name)
    return jnp.log(total) - weighted / total


def top_k(x, k: int, axis_name: AxisName):
    """Exact top-``k`` of the whole row: ``(values, global int32 ids)``, ties to the lower id.

    With a split row each shard takes its own top-``min(k, V_local)``; the ``n`` candidate
    lists are gathered (``n k`` values and ids per row) and merged by one more top-``k``.
    """
    local = x.shape[-1]
    values, ids = numerics.top_k(x, min(k, local))
    if axis_name is None:
        return values, ids
    ids = ids + shard_offset(local, axis_name)
    values, ids = _gather_last((values, ids), axis_name)
    values, pos = lax.top_k(values, k)
    return values, jnp.take_along_axis(ids, pos, axis=-1)


def row_summary(x, k: int, need_entropy: bool, axis_name: AxisName):
    """Max, normaliser, entropy and top-``k`` of each row, with one collective when split.

    Each shard sends ``(max_i, S_i, W_i, its top-k values and ids)`` with
    ``S_i = sum exp(x - max_i)`` and ``W_i = sum exp(x - max_i) (x - max_i)`` in one
    ``all_gather`` of ``3 + 2k`` numbers per row; then ``M = max_i max_i``,
    ``S = sum_i S_i e^(max_i - M)``, ``H = log S - sum_i e^(max_i - M) (W_i + (max_i - M) S_i)
    / S`` and the top-``k`` of the ``n k`` candidates (ids travel as floats: exact below
    ``2^24`` tokens in float32).

    Args:
      x: ``[B, V_local]`` in the compute dtype.
      k: ``1 <= k <= V`` (the whole row's ``V``).
      need_entropy: also return ``H(p)`` (else ``None``).
      axis_name: the mesh axes splitting the row, or ``None``.

    Returns:
      ``(x_max, total, entropy, top_values, top_ids)``: ``[B]``, ``[B]``, ``[B]`` or ``None``,
      ``[B, k]`` decreasing, ``[B, k]`` int32 global ids (ties to the lower id).
    """
    if axis_name is not None and x.shape[-1] * axis_size(axis_name) >= 2**24:
        x_max, total = normalizer(x, axis_name)
        ent = entropy(x, x_max, total, axis_name) if need_entropy else None
        values, ids = top_k(x, k, axis_name)
        return x_max, total, ent, values, ids
    local = x.shape[-1]
    # Two passes over this row or shard (numerics.row_summary).
    m, s_local, w_local, values, ids = numerics.row_summary(x, min(k, local), need_entropy)
    if axis_name is None:
        ent = jnp.log(s_local) - w_local / s_local if need_entropy else None
        return m, s_local, ent, values, ids
    if w_local is None:
        w_local = jnp.zeros_like(m)
    ids = ids + shard_offset(local, axis_name)
    packed = jnp.concatenate(
        [m[..., None], s_local[..., None], w_local[..., None], values, ids.astype(x.dtype)], -1
    )
    gathered = _gather_last(packed[..., None, :], axis_name, axis=-2)  # [B, n, 3 + 2k']
    m_all, s_all, w_all = gathered[..., 0], gathered[..., 1], gathered[..., 2]
    kk = values.shape[-1]
    x_max = jnp.max(m_all, axis=-1)
    scale = jnp.where(m_all > -jnp.inf, jnp.exp(m_all - x_max[..., None]), 0.0)
    total = jnp.sum(scale * s_all, axis=-1)
    ent = None
    if need_entropy:
        gap = jnp.where(m_all > -jnp.inf, m_all - x_max[..., None], 0.0)
        weighted = jnp.sum(scale * (w_all + gap * s_all), axis=-1)
        ent = jnp.log(total) - weighted / total
    cand_v = gathered[..., 3 : 3 + kk].reshape(*x.shape[:-1], -1)
    cand_i = gathered[..., 3 + kk :].reshape(*x.shape[:-1], -1).astype(jnp.int32)
    top_v, pos = lax.top_k(cand_v, k)
    return x_max, total, ent, top_v, jnp.take_along_axis(cand_i, pos, axis=-1)


def count_and_top_k(mask, key, k: int, axis_name: AxisName):
    """``sum(mask)`` and the top-``k`` of ``key`` over the whole row, one collective when split.

    Args:
      mask: ``[..., V_local]`` bool.
      key: ``[..., V_local]`` floating.
      k: ``1 <= k <= V``.
      axis_name: the mesh axes splitting the row, or ``None``.

    Returns:
      ``(count, values, ids)``: ``[...]`` int32, ``[..., k]``, ``[..., k]`` int32 global ids.
    """
    local = key.shape[-1]
    if axis_name is None or local * axis_size(axis_name) >= 2**24:
        return vocab_sum(mask.astype(jnp.int32), axis_name), *top_k(key, k, axis_name)
    count = jnp.sum(mask, axis=-1, dtype=jnp.int32)
    values, ids = numerics.top_k(key, min(k, local))
    ids = ids + shard_offset(local, axis_name)
    packed = jnp.concatenate(
        [count[..., None].astype(key.dtype), values, ids.astype(key.dtype)], -1
    )
    gathered = _gather_last(packed[..., None, :], axis_name, axis=-2)  # [..., n, 1 + 2k']
    kk = values.shape[-1]
    total = jnp.sum(gathered[..., 0], axis=-1).astype(jnp.int32)
    cand_v = gathered[..., 1 : 1 + kk].reshape(*key.shape[:-1], -1)
    cand_i = gathered[..., 1 + kk :].reshape(*key.shape[:-1], -1).astype(jnp.int32)
    top_v, pos = lax.top_k(cand_v, k)
    return total, top_v, jnp.take_along_axis(cand_i, pos, axis=-1)


def gather_row(x, axis_name: AxisName):
    """The whole row (an ``all_gather`` of every shard: only for rare fallbacks)."""
    if axis_name is None:
        return x
    return _gather_last(x, axis_name)


def _gather_last(tree, axis_name, axis: int = -1):
    """``all_gather`` along the last axis; the result is typed invariant over ``axis_name``
    inside a ``shard_map`` that checks varying axes (every shard holds the same result)."""
    names = set(axis_name if isinstance(axis_name, tuple) else (axis_name,))

    def gather(x):
        varying = jax.typeof(x).manual_axis_type.varying
        to = "invarying" if names <= set(varying) else "varying"
        return lax.all_gather(x, axis_name, axis=axis % x.ndim, tiled=True, to=to)

    return jax.tree.map(gather, tree)


def _spec_of(x) -> tuple[Any, tuple] | None:
    """``(mesh, spec)`` of a sharded input, or ``None`` for an unsharded / unknown one."""
    mesh = spec = None
    if isinstance(x, jax.core.Tracer):
        sharding = getattr(jax.typeof(x), "sharding", None)
        if isinstance(sharding, NamedSharding) and not sharding.mesh.empty:
            explicit = jax.sharding.AxisType.Explicit
            if any(kind == explicit for kind in sharding.mesh.axis_types):
                mesh, spec = sharding.mesh, sharding.spec
    elif isinstance(x, jax.Array) and isinstance(x.sharding, NamedSharding):
        mesh, spec = x.sharding.mesh, x.sharding.spec
    if mesh is None:
        return None
    assert spec is not None  # set together with mesh
    entries = tuple(spec) + (None,) * (x.ndim - len(spec))
    entries = tuple(None if e is P.UNCONSTRAINED else e for e in entries)
    if all(e is None for e in entries):
        return None
    return mesh, entries


def route(fn: Callable, x, out_specs: Callable[[tuple, Any], Any], axis_name: AxisName = None):
    """Runs ``fn(x, axis_name)`` where ``x`` lives.

    Args:
      fn: ``fn(x, axis_name)``, written for a local array whose last axis is the whole
        vocabulary (``axis_name=None``) or one shard of it.
      x: ``[..., V]``.
      out_specs: ``out_specs(lead_spec, vocab_spec)``: the partition specs of ``fn``'s outputs
        given the input's spec split into its leading entries and its vocabulary entry.
      axis_name: set when the caller already runs inside a ``shard_map`` whose mesh axes
        ``axis_name`` split the vocabulary (then ``x`` is this device's shard).

    Returns:
      ``fn``'s outputs, sharded like the input on its leading axes.
    """
    if axis_name is not None:
        return fn(x, axis_name)
    found = _spec_of(x)
    if found is None:
        return fn(x, None)
    mesh, spec = found
    lead, vocab = spec[:-1], spec[-1]
    vocab_axes = vocab if vocab is None or isinstance(vocab, str) else tuple(vocab)
    names = (
        ()
        if vocab_axes is None
        else (vocab_axes if isinstance(vocab_axes, tuple) else (vocab_axes,))
    )
    if all(mesh.shape[name] == 1 for name in names):
        vocab_axes = None  # one shard: the whole row is local
    mapped = jax.shard_map(
        lambda a: fn(a, vocab_axes),
        mesh=mesh,
        in_specs=P(*spec),
        out_specs=out_specs(lead, vocab),
        check_vma=False,
    )
    if isinstance(x, jax.core.Tracer):
        return mapped(x)
    return jax.jit(mapped)(x)
