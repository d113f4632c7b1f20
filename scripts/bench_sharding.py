"""Benchmark: certificates of sharded logits on 1, 2, 4 and 8 devices.

For ``[B, V]`` float32 logits (default ``[64, 151936]``, the benchmark profile of
``bench_certify.py``) placed batch-sharded (``P("shard", None)``) or vocabulary-sharded
(``P(None, "shard")``) on meshes of 1, 2, 4 and 8 devices, reports per layout and size:

* the time per batch of ``jaxcert.certificates`` (all rules, under ``jax.jit``; explicit
  mesh axes, so the solver runs inside ``shard_map``) as a ratio to the single-device run
  in the same process;
* the collectives XLA compiled and the bytes they bring to each device per row: those every
  row pays (the row summary, and the exact path of the threshold rules, counted as if every
  row took it: an upper bound), and the whole-row gather of the rare overflow fallback (a
  row whose pool holds more than ``top_k`` accepted tokens), reported separately;
* the largest per-device buffer: argument + temporaries from XLA's memory analysis.

On CPU, ``--devices 8`` makes 8 virtual devices that share the machine's cores, so the
ratio measures overhead (collectives, per-shard work), not speed-up.

Usage: python scripts/bench_sharding.py [--batch 64] [--vocab 151936] [--rules ...]
       [--repeats 5] [--devices 8] [--json FILE]
"""

from __future__ import annotations

import argparse
import os
import re
import sys

if __name__ == "__main__":  # before jax is imported
    count = next((a.split("=")[1] for a in sys.argv if a.startswith("--devices=")), None)
    if count is None and "--devices" in sys.argv:
        count = sys.argv[sys.argv.index("--devices") + 1]
    os.environ.setdefault("XLA_FLAGS", f"--xla_force_host_platform_device_count={count or 8}")

import json  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_certify import RULES, synthetic_logits, timed  # noqa: E402

import jaxcert  # noqa: E402
from jaxcert.core.rules import parse_rules  # noqa: E402

_COLLECTIVE = re.compile(
    r"= (\w+)\[([\d,]*)\][^=]*? (all-gather|all-reduce|reduce-scatter|all-to-all|"
    r"collective-permute)(?:-start)?\("
)
_BYTES = {"f32": 4, "s32": 4, "u32": 4, "f64": 8, "s64": 8, "pred": 1, "bf16": 2, "f16": 2}


def collectives(hlo: str, vocab: int) -> tuple[dict[str, int], int]:
    """Bytes of the collective results in an optimised HLO module (per device).

    Returns ``(by_kind, whole_rows)``: the bytes of each kind of collective except whole-row
    gathers (a last dimension of ``vocab``), and the bytes of those whole-row gathers.
    """
    out: dict[str, int] = {}
    whole = 0
    for dtype, dims, kind in _COLLECTIVE.findall(hlo):
        shape = [int(d) for d in dims.split(",") if d]
        size = int(np.prod(shape)) if shape else 1
        if shape and shape[-1] == vocab:
            whole += size * _BYTES.get(dtype, 4)
        else:
            out[kind] = out.get(kind, 0) + size * _BYTES.get(dtype, 4)
    return out, whole


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=151_936)
    parser.add_argument("--rules", default=RULES)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--devices", type=int, default=8, help="largest mesh (virtual on CPU)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--json", help="also write the rows to this JSON file")
    args = parser.parse_args()

    rules = parse_rules(args.rules)
    x_host = synthetic_logits(args.batch, args.vocab).astype(args.dtype)
    sizes = [n for n in (1, 2, 4, 8, 16, 32) if n <= min(args.devices, len(jax.devices()))]
    print(
        f"device: {jax.devices()[0].device_kind} x {len(jax.devices())}; "
        f"B={args.batch}, V={args.vocab}, {args.dtype}; rules: {args.rules}"
    )
    rows = []
    base = None
    for layout, spec in (("batch", P("shard", None)), ("vocab", P(None, "shard"))):
        for n in sizes:
            mesh = jax.make_mesh(
                (n,), ("shard",), axis_types=(AxisType.Explicit,), devices=jax.devices()[:n]
            )
            x = jax.device_put(x_host, NamedSharding(mesh, spec))
            fn = jax.jit(lambda a: tuple(c.value for c in jaxcert.certificates(a, rules)))
            with jax.set_mesh(mesh):
                t = timed(fn, x, repeats=args.repeats)
                compiled = fn.lower(x).compile()
            if base is None:
                base = t
            moved, whole = collectives(compiled.as_text(), args.vocab)
            mem = compiled.memory_analysis()
            per_device = (mem.argument_size_in_bytes + mem.temp_size_in_bytes) if mem else 0
            local_rows = args.batch // n if layout == "batch" else args.batch
            rows.append({
                "layout": layout, "devices": n, "ms": round(t * 1e3, 2),
                "x_one_device": round(t / base, 3),
                "collective_bytes_per_row": round(sum(moved.values()) / local_rows, 1),
                "collectives": moved,
                "fallback_bytes_per_overflow_row": whole,
                "per_device_buffer_mb": round(per_device / 2**20, 2),
            })  # fmt: skip
    print(
        "| layout | devices | ms / batch | x one device | collective bytes / row "
        "| fallback bytes / overflow row | largest per-device buffer (MB) |\n"
        "|---|---|---|---|---|---|---|"
    )
    for r in rows:
        print(
            f"| {r['layout']} | {r['devices']} | {r['ms']:.1f} | {r['x_one_device']:.2f} | "
            f"{r['collective_bytes_per_row']:.0f} | {r['fallback_bytes_per_overflow_row']} | "
            f"{r['per_device_buffer_mb']:.1f} |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
