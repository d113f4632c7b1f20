"""Runs a Python snippet in a subprocess with virtual CPU devices, for the sharding tests.

XLA reads ``--xla_force_host_platform_device_count`` once, when jax initialises its backend,
so a multi-device test cannot share the pytest process (which has 1 device); and an XLA abort
in a sharded computation would kill pytest. Each snippet runs in its own interpreter with the
repository root on ``sys.path`` (``tests.helpers``); it reports by printing one JSON object
as its last line.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import tempfile
import textwrap

_ROOT = pathlib.Path(__file__).resolve().parents[2]
_PATHS = [_ROOT]

#: Imports every snippet gets: 8 devices, Auto meshes and the tiny model builders.
PRELUDE = """
import json
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcert import models

# One program at a time on the simulated devices (see tests/helpers/sharded_cases.py: asynchronous
# dispatch let two programs' collectives wait on each other on loaded cores). Set before the
# backend starts.
jax.config.update("jax_cpu_enable_async_dispatch", False)
assert jax.device_count() == 8, jax.devices()
AUTO = (AxisType.Auto, AxisType.Auto)


def spec_of(x):
    '''A sharded array's spec as a list of length ndim (trailing ``None``s filled in).'''
    spec = list(x.sharding.spec)
    return [list(e) if isinstance(e, tuple) else e for e in spec + [None] * (x.ndim - len(spec))]


def local_shape(x):
    '''The shape of the first device's shard, checked to be the same on every device.'''
    shapes = {tuple(s.data.shape) for s in x.addressable_shards}
    assert len(shapes) == 1, shapes
    assert len(x.addressable_shards) == len(x.sharding.device_set), x.sharding
    return list(shapes.pop())
"""


def run(snippet: str, *, devices: int = 8, timeout: float = 300.0) -> dict:
    """Runs `PRELUDE` + `snippet` in a fresh interpreter with `devices` CPU devices.

    Returns:
      The JSON object the snippet printed on its last stdout line.

    Raises:
      AssertionError: the process exited with a non-zero status (an exception or an XLA
        abort) or printed no JSON; the message carries the end of its output.
    """
    env = dict(os.environ)
    flags = [f for f in env.get("XLA_FLAGS", "").split() if "host_platform_device_count" not in f]
    env["XLA_FLAGS"] = " ".join(flags + [f"--xla_force_host_platform_device_count={devices}"])
    env["JAX_PLATFORMS"] = "cpu"
    paths = [env["PYTHONPATH"]] if env.get("PYTHONPATH") else []
    env["PYTHONPATH"] = os.pathsep.join(paths + [str(p) for p in _PATHS])
    code = PRELUDE.replace("== 8", f"== {devices}") + "\n" + textwrap.dedent(snippet)
    proc = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=tempfile.gettempdir(),
    )
    tail = f"stdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-6000:]}"
    assert proc.returncode == 0, f"subprocess exited with {proc.returncode}\n{tail}"
    lines = proc.stdout.strip().splitlines()
    assert lines, f"subprocess printed nothing\n{tail}"
    try:
        return json.loads(lines[-1])
    except json.JSONDecodeError as e:
        raise AssertionError(f"last line is not JSON ({e})\n{tail}") from e
