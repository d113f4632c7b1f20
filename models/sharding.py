"""Placing a model, its KV cache and its activations on a device mesh (GSPMD, ``Auto`` axes).

Every parameter of `Transformer` carries logical axis names (``nnx.with_partitioning``
metadata, read back here); a rule set maps them to the axes of a `jax.sharding.Mesh`:

=============  ==============================================  ===========================
logical name   dimension                                       mesh axis (`LOGICAL_RULES`)
=============  ==============================================  ===========================
``batch``      B, batch rows of activations and of the cache   ``data``
``vocab``      V, embedding rows and lm_head columns           ``model``
``heads``      H (Q = H*D), q_proj columns, o_proj rows        ``model``
``kv_heads``   G (G*D), k/v_proj columns, cache heads          ``model``
``mlp``        F, gate/up columns, down rows                   ``model``
``embed``      E, the residual stream, norms                   replicated
``head_dim``   D, q/k norms                                    replicated
=============  ==============================================  ===========================

That is Megatron-style tensor parallelism over ``model`` (attention heads and the MLP split
column- then row-wise, one all-reduce after o_proj and after down_proj), a vocabulary-parallel
embedding and lm_head (logits stay split over the vocabulary), and data parallelism over
``data``. A dimension falls back to replication, for that tensor only, when its size (or its
head count for ``heads`` / ``kv_heads``) is not divisible by the size of its mesh axes, when
the mesh has no such axis, or when an earlier dimension of the same tensor already uses the
axis. So 2 KV heads on a 4-way ``model`` axis keep k/v_proj and the cache whole on every
``model`` device (still split over ``data``), while q_proj is split.

Only meshes whose axes are all ``jax.sharding.AxisType.Auto`` are supported (the GSPMD
partitioner propagates the shardings; `jax.make_mesh` makes ``Explicit`` axes by default in
jax 0.10, pass ``axis_types=(AxisType.Auto,) * n``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any, Protocol, TypeGuard

import jax
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

__all__ = [
    "LOGICAL_RULES",
    "Layout",
    "axis_names",
    "axis_size",
    "check_mesh",
    "check_rules",
    "constrain",
    "layout_of",
    "logical_spec",
    "mesh_of",
    "place",
    "shard",
    "shardings",
]

Rules = tuple[tuple[str, str | tuple[str, ...] | None], ...]

#: The default logical -> mesh axis rules: data parallel over ``data``, tensor parallel over
#: ``model``. Names missing from a rule set are replicated.
LOGICAL_RULES: Rules = (
    ("batch", "data"),
    ("vocab", "model"),
    ("heads", "model"),
    ("kv_heads", "model"),
    ("mlp", "model"),
    ("embed", None),
    ("head_dim", None),
)


def _units(config) -> tuple[tuple[str, int], ...]:
    """The head counts of a `ModelConfig`, for `Layout.units`."""
    return (("heads", config.num_heads), ("kv_heads", config.num_kv_heads))


def check_mesh(mesh) -> Mesh:
    """Returns `mesh` if it is a `jax.sharding.Mesh` with only ``Auto`` axes.

    Raises:
      ValueError: not a `Mesh`, or some axis is ``Explicit`` / ``Manual``.
    """
    if not isinstance(mesh, Mesh):
        raise ValueError(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}.")
    if any(kind != AxisType.Auto for kind in mesh.axis_types):
        raise ValueError(
            f"mesh axes {mesh.axis_names} have types {mesh.axis_types}; jaxcert.models needs "
            "Auto axes (jax.make_mesh(..., axis_types=(jax.sharding.AxisType.Auto,) * n))."
        )
    return mesh


def check_rules(rules) -> Rules:
    """`rules` as a tuple of ``(logical name, mesh axis | tuple of axes | None)`` pairs.

    Raises:
      ValueError: not such pairs, or a logical name given twice.
    """
    as_axes = lambda axes: axes if axes is None or isinstance(axes, str) else tuple(axes)
    try:
        out = tuple((name, as_axes(axes)) for name, axes in rules)
    except (TypeError, ValueError) as e:
        raise ValueError(f"rules must be (logical name, mesh axes) pairs, got {rules!r}.") from e
    names = [name for name, _ in out]
    if any(not isinstance(n, str) for n in names) or len(set(names)) != len(names):
        raise ValueError(f"rules must name each logical axis once (a str), got {names}.")
    return out


def axis_size(name: str, mesh: Mesh, rules: Rules = LOGICAL_RULES) -> int:
    """How many ways `rules` split the logical axis `name` on `mesh` (1: replicated)."""
    axes = dict(check_rules(rules)).get(name)
    axes = () if axes is None else (axes,) if isinstance(axes, str) else axes
    return math.prod(mesh.shape[a] for a in axes if a in mesh.shape)


def logical_spec(
    names: Sequence[str | None],
    shape: Sequence[int],
    mesh: Mesh,
    rules: Rules = LOGICAL_RULES,
    units: Mapping[str, int] | None = None,
) -> P:
    """The mesh `PartitionSpec` of an array of `shape` whose dimensions are `names`.

    Dimension ``i`` is split over the mesh axes its name maps to, unless it must replicate:
    the name is ``None`` or has no rule; none of the axes are in `mesh`; an earlier dimension
    uses one of them; or ``shape[i]`` (and ``units[name]``, e.g. the head count of a flattened
    ``H * D`` dimension) is not divisible by the product of their sizes.

    Raises:
      ValueError: ``len(names) != len(shape)``.
    """
    if len(names) != len(shape):
        raise ValueError(f"{len(names)} axis names {tuple(names)} for shape {tuple(shape)}.")
    table = dict(rules)
    units = units or {}
    used: set[str] = set()
    entries: list[str | tuple[str, ...] | None] = []
    for name, size in zip(names, shape, strict=True):
        if name is None:
            entries.append(None)
            continue
        axes = table.get(name)
        axes = () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
        axes = tuple(a for a in axes if a in mesh.shape and a not in used)
        n = math.prod(mesh.shape[a] for a in axes)
        if not axes or size % n or units.get(name, n) % n:
            entries.append(None)
            continue
        used.update(axes)
        entries.append(axes[0] if len(axes) == 1 else axes)
    return P(*entries)


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where one model's arrays live: a mesh, logical rules and the head counts.

    A static (hashable) attribute of a sharded `Transformer` (``model.layout``), so each
    layout compiles its own program. ``None`` there means one device and no constraints.

    Attributes:
      mesh: a `Mesh` with ``Auto`` axes.
      rules: logical -> mesh axis rules (`LOGICAL_RULES` by default).
      units: ``(("heads", H), ("kv_heads", G))``: a flattened ``H * D`` (``G * D``) dimension
        is split only if the head count is divisible (heads are never cut).
    """

    mesh: Mesh
    rules: Rules = LOGICAL_RULES
    units: tuple[tuple[str, int], ...] = ()

    @classmethod
    def create(cls, mesh: Mesh, rules=LOGICAL_RULES, config=None) -> Layout:
        """Checks `mesh` and `rules`; head counts from `config` (a `ModelConfig`) if given.

        Raises:
          ValueError: see `check_mesh` and `check_rules`.
        """
        units = () if config is None else _units(config)
        return cls(check_mesh(mesh), check_rules(rules), units)

    def spec(self, names: Sequence[str | None], shape: Sequence[int]) -> P:
        """`logical_spec` on this layout."""
        return logical_spec(names, shape, self.mesh, self.rules, dict(self.units))

    def sharding(self, names: Sequence[str | None], shape: Sequence[int]) -> NamedSharding:
        """The `NamedSharding` of an array of `shape` with dimensions `names`."""
        return NamedSharding(self.mesh, self.spec(names, shape))

    def constrain(self, x: jax.Array, names: Sequence[str | None]) -> jax.Array:
        """`jax.lax.with_sharding_constraint` of `x` to its logical `names`."""
        return jax.lax.with_sharding_constraint(x, self.sharding(names, x.shape))


def constrain(layout: Layout | None, x: jax.Array, names: Sequence[str | None]) -> jax.Array:
    """`x` itself when `layout` is ``None`` (one device), else `Layout.constrain`."""
    return x if layout is None else layout.constrain(x, names)


def axis_names(variable: nnx.Variable) -> tuple | None:
    """The logical axis names of an `nnx.Variable` (its ``out_sharding`` metadata), or None."""
    names = variable.get_metadata().get("out_sharding")
    return tuple(names) if names else None


class _Model(Protocol):
    """What `_is_model` looks for: a ``layout`` slot and a ``config`` with head counts."""

    layout: Layout | None
    config: Any


def _is_model(module: object) -> TypeGuard[_Model]:
    """A `Transformer` (duck-typed: a ``layout`` slot and a ``config`` with head counts)."""
    return hasattr(module, "layout") and hasattr(getattr(module, "config", None), "num_kv_heads")


def _attach(module: nnx.Module, layout: Layout | None) -> None:
    """Sets ``layout`` (with its own head counts) on every `Transformer` inside `module`."""
    for _, sub in nnx.iter_modules(module):
        if _is_model(sub):
            sub.layout = None if layout is None else replace(layout, units=_units(sub.config))


def shardings(module: nnx.Module, layout: Layout) -> nnx.State:
    """A `NamedSharding` per parameter of `module` (``nnx.state(module)``'s structure).

    A parameter with logical axis names is split by `layout` (with the head counts of the
    `Transformer` it belongs to); one without names is replicated.
    """
    units = {path: _units(sub.config) for path, sub in nnx.iter_modules(module) if _is_model(sub)}
    flat = []
    for path, v in nnx.to_flat_state(nnx.state(module)):
        owner = max((p for p in units if path[: len(p)] == p), key=len, default=None)
        here = layout if owner is None else replace(layout, units=units[owner])
        value = v.get_value()
        names = axis_names(v) or (None,) * value.ndim
        flat.append((path, v.replace(here.sharding(names, value.shape))))
    return nnx.from_flat_state(flat)


def shard(model: nnx.Module, mesh: Mesh, rules=LOGICAL_RULES) -> nnx.Module:
    """A copy of `model` with every parameter placed on `mesh` by its logical axis names.

    Each array is `jax.device_put` onto its `NamedSharding` (each device receives only its
    shard); arrays without axis names (e.g. of a module that is not a `Transformer`) are
    replicated. Every `Transformer` inside gets ``layout`` set, so its forward pass
    constrains its activations and cache to the mesh too. `model` itself is left as it was.

    Args:
      model: a `Transformer`, or any NNX module containing some (e.g. a drafter with a head).
      mesh: a `Mesh` with ``Auto`` axes, e.g. ``("data", "model")``.
      rules: logical -> mesh axis rules (see `LOGICAL_RULES`).

    Returns:
      The sharded copy (same graph, same values).

    Raises:
      ValueError: an ``Explicit`` mesh, malformed rules, or `model` is not an NNX module.
    """
    if not isinstance(model, nnx.Module):
        raise ValueError(f"shard needs an nnx.Module, got {type(model).__name__}.")
    layout = Layout.create(mesh, rules)
    graphdef, params = nnx.split(model)
    placed = jax.device_put(params, shardings(model, layout))
    new = nnx.merge(graphdef, placed)
    _attach(new, layout)
    return new


def layout_of(model) -> Layout | None:
    """The `Layout` of a sharded `Transformer` (or of the first one inside a module)."""
    module = getattr(model, "model", model)
    if not isinstance(module, nnx.Module):
        return None
    for _, sub in nnx.iter_modules(module):
        layout = getattr(sub, "layout", None)
        if isinstance(layout, Layout):
            return layout
    return None


def mesh_of(tree) -> Mesh | None:
    """The mesh of the first array in `tree` that lives on more than one device, or None."""
    for leaf in jax.tree.leaves(tree):
        sharding = getattr(leaf, "sharding", None)
        mesh = sharding.mesh if isinstance(sharding, NamedSharding) else None
        if isinstance(mesh, Mesh) and mesh.size > 1:  # a concrete array's mesh is a Mesh
            return mesh
    return None


def place(
    host: np.ndarray,
    sharding: NamedSharding,
    dtype,
    *,
    transpose: bool = False,
) -> jax.Array:
    """A host array put directly on its shards: each device receives only its slice.

    Args:
      host: the whole tensor in host memory (numpy, possibly ``ml_dtypes.bfloat16``).
      sharding: where it goes; its shape is ``host.T.shape`` if `transpose` else ``host.shape``.
      dtype: the array's dtype (each slice is converted on the host).
      transpose: place ``host.T`` (a 2-D ``[out, in]`` checkpoint matrix as ``[in, out]``).
    """
    view = host.T if transpose else host
    np_dtype = np.dtype(dtype)
    callback: Callable = lambda index: np.ascontiguousarray(view[index], dtype=np_dtype)
    return jax.make_array_from_callback(view.shape, sharding, callback)
