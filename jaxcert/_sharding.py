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

from jaxcert import _numerics

__all__ = [
    "AxisName",
    "axis_size",
    "entropy",
    "gather_row",
    "log_softmax",
    "normalizer",
    "route",
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
    return x - (x_max + jnp.log(vocab_sum(jnp.exp(x - x_max[..., None]), axis_name)))[..., None]


def entropy(x, x_max, total, axis_name: AxisName):
    """``H(softmax(x))`` in nats over the whole row, given its global max and normaliser."""
    if axis_name is None:
        return _numerics.entropy(x, x_max, total)
    shifted = jnp.maximum(x - x_max[..., None], -1e4)
    weighted = lax.psum(jnp.sum(jnp.exp(shifted) * shifted, axis=-1), axis_name)
    return jnp.log(total) - weighted / total


def top_k(x, k: int, axis_name: AxisName):
    """Exact top-``k`` of the whole row: ``(values, global int32 ids)``, ties to the lower id.

    With a split row each shard takes its own top-``min(k, V_local)``; the ``n`` candidate
    lists are gathered (``n k`` values and ids per row) and merged by one more top-``k``.
    """
    local = x.shape[-1]
    values, ids = _numerics.top_k(x, min(k, local))
    if axis_name is None:
        return values, ids
    ids = ids + shard_offset(local, axis_name)
    values, ids = _gather_last((values, ids), axis_name)
    values, pos = lax.top_k(values, k)
    return values, jnp.take_along_axis(ids, pos, axis=-1)


def gather_row(x, axis_name: AxisName):
    """The whole row (an ``all_gather`` of every shard: only for rare fallbacks)."""
    if axis_name is None:
        return x
    return _gather_last(x, axis_name)


def _gather_last(tree, axis_name):
    """``all_gather`` along the last axis; the result is typed invariant over ``axis_name``
    inside a ``shard_map`` that checks varying axes (every shard holds the same result)."""
    names = set(axis_name if isinstance(axis_name, tuple) else (axis_name,))

    def gather(x):
        varying = jax.typeof(x).manual_axis_type.varying
        to = "invarying" if names <= set(varying) else "varying"
        return lax.all_gather(x, axis_name, axis=x.ndim - 1, tiled=True, to=to)

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
