"""Device meshes of one process and placement onto them (``--mesh data=D,model=M``).

One process drives a mesh of its *local* devices with two axes: ``data`` splits the batch,
``model`` (tensor parallelism) splits the weights (:func:`jaxcert.models.shard`). The one
home of meshes and placement: the models, the decoder and the certify pipeline all use it.

Example::

  >>> parse_mesh("data=2,model=4")
  {'data': 2, 'model': 4}
  >>> mesh = make_mesh(None)  # every local device on "data"
  >>> mesh.axis_names, mesh.shape["model"]
  (('data', 'model'), 1)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

__all__ = ["AXES", "data_size", "describe", "make_mesh", "parse_mesh", "place", "shard_model"]

#: Mesh axis names, in mesh order: ``data`` splits the batch, ``model`` the weights.
AXES = ("data", "model")


def parse_mesh(spec: str) -> dict[str, int]:
    """Parses ``"data=2,model=4"`` into ``{"data": 2, "model": 4}`` (axes in the given order).

    Raises:
      ValueError: an empty spec, an entry that is not ``AXIS=SIZE``, an axis other than
        ``data``/``model``, an axis given twice, or a size that is not a positive integer.
    """
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"--mesh must look like data=2,model=4, got {spec!r}")
    axes: dict[str, int] = {}
    for entry in spec.split(","):
        name, sep, size = (part.strip() for part in entry.partition("="))
        if not sep or not name or not size:
            raise ValueError(f"--mesh entry {entry.strip()!r} is not AXIS=SIZE (e.g. data=2)")
        if name not in AXES:
            raise ValueError(f"--mesh axis {name!r} is unknown; the axes are {', '.join(AXES)}")
        if name in axes:
            raise ValueError(f"--mesh axis {name!r} is given twice")
        try:
            value = int(size)
        except ValueError:
            value = 0
        if value < 1:
            raise ValueError(f"--mesh {name}={size}: the size must be a positive integer")
        axes[name] = value
    return axes


def _describe(axes: Mapping[str, int]) -> str:
    return ",".join(f"{k}={v}" for k, v in axes.items())


def describe(mesh) -> str:
    """``"data=2,model=4"``: a mesh's shape as ``--mesh`` spells it."""
    return _describe(dict(mesh.shape))


def make_mesh(spec: str | Mapping[str, int] | None = None, *, devices: Sequence | None = None):
    """A ``("data", "model")`` mesh over this process's devices (``Auto`` axes).

    Args:
      spec: ``"data=2,model=4"`` (:func:`parse_mesh`), the same as a mapping, or ``None``:
        every device on ``data``. An omitted ``model`` is 1; an omitted ``data`` takes the
        devices ``model`` leaves (``model=4`` on 8 devices is ``data=2,model=4``).
      devices: the devices (default ``jax.local_devices()``: a process drives only its own).

    Returns:
      A ``jax.sharding.Mesh`` of shape ``(data, model)``.

    Raises:
      ValueError: the sizes do not multiply to the number of devices.
    """
    import jax
    import numpy as np
    from jax.sharding import AxisType, Mesh

    devices = list(jax.local_devices() if devices is None else devices)
    n = len(devices)
    axes = dict(parse_mesh(spec) if isinstance(spec, str) else (spec or {}))
    given = _describe(axes) if axes else None
    model = axes.get("model", 1)
    if "data" not in axes:
        if n % model:
            raise ValueError(
                f"--mesh {given}: {n} devices do not split into groups of model={model} "
                f"(this process sees {n} devices)"
            )
        axes["data"] = n // model
    data = axes["data"]
    if data * model != n:
        raise ValueError(
            f"--mesh {given} needs {data * model} devices, this process sees {n}; the sizes "
            "must multiply to the number of local devices (set them with --mesh, e.g. "
            f"--mesh data={n})"
        )
    grid = np.asarray(devices, dtype=object).reshape(data, model)
    return Mesh(grid, AXES, axis_types=(AxisType.Auto,) * len(AXES))


def data_size(mesh) -> int:
    """Size of the mesh's ``data`` axis, after checking its axes are ``data`` and ``model``.

    Raises:
      ValueError: other axes.
    """
    shape = dict(mesh.shape)
    if set(shape) - set(AXES):
        raise ValueError(f"mesh axes must be {' and '.join(AXES)}, got {tuple(shape)}")
    return shape.get("data", 1)


def place(tree, mesh, spec):
    """``tree`` on ``NamedSharding(mesh, spec)``: ``P()`` replicates, ``P("data")`` splits
    the leading (batch) axis over ``data``. The identity without a mesh."""
    if mesh is None:
        return tree
    import jax
    from jax.sharding import NamedSharding

    return jax.device_put(tree, NamedSharding(mesh, spec))


def shard_model(model, mesh):
    """``model`` (an ``nnx`` module) on ``mesh`` by ``jaxcert.models.shard``: weights split
    over ``model`` (tensor parallelism), activations and cache rows constrained to ``data``.
    The model itself when it already lives there, or without a mesh."""
    from jaxcert.models import sharding

    layout = sharding.layout_of(model)
    if mesh is None or (layout is not None and layout.mesh == mesh):
        return model
    return sharding.shard(model, mesh)
