"""Seconds of one target forward pass by width (tokens scored at once) on a KV cache.

The cost curve behind ``DecodeConfig``'s default verification buckets and the check of the
``goodput`` policy's cost model: it times the passes with the same code as
``jaxcert.decoding.costs.measure`` (compiled, warmed up, the median of ``--repeats`` runs),
at any batch size, and with ``--drafter`` one drafter step too. Padding a pass to the next
bucket is cheap where the pass is memory-bound and costly where it is compute-bound.

Example::

  python scripts/bench_pass_width.py --model qwen2.5-coder-1.5b-instruct --rows 1,4,8 \
      --drafter qwen2.5-coder-0.5b-instruct --json jaxcert-out/pass_width.json

With ``--random-weights`` only the models' configs are read (a model name, a ``.gguf`` file's
header, or a folder holding just a ``config.json``) and the weights are drawn at random in
``--dtype``: a pass's time depends on the shapes alone, so this times a model's passes on a
machine its weights cannot reach (``scripts/device_check.sh``).
"""

from __future__ import annotations

import argparse
import json
import pathlib

import jax.numpy as jnp
from flax import nnx

from jaxcert import decoding, models
from jaxcert.decoding import costs


def _model(name: str, random_weights: bool, dtype: str):
    """The model to time: loaded, or built from its config with random weights in ``dtype``."""
    if not random_weights:
        return models.load(name)
    dt = jnp.dtype(dtype)
    config = models.read_config(name)
    return models.Transformer(config, rngs=nnx.Rngs(0), dtype=dt, param_dtype=dt)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    p.add_argument("--drafter", default=None, help="also time one step of this drafter")
    p.add_argument("--widths", default="1,2,3,4,5,6,8,10,12,16,20,24,32,40")
    p.add_argument("--rows", default="1", help="batch sizes, comma-separated")
    p.add_argument("--context", type=int, default=200, help="tokens already in the cache")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", type=pathlib.Path, default=None, help="write the costs here")
    p.add_argument(
        "--random-weights",
        action="store_true",
        help="read only the configs; draw the weights at random (a pass's time is the shapes')",
    )
    p.add_argument(
        "--dtype",
        default="float32",
        choices=("float32", "bfloat16", "float16"),
        help="weights' dtype with --random-weights",
    )
    args = p.parse_args(argv)
    try:
        lm = _model(args.model, args.random_weights, args.dtype)
        drafter = _model(args.drafter, args.random_weights, args.dtype) if args.drafter else None
    except ValueError as e:  # a model that cannot be loaded or read: named, no traceback
        p.error(str(e))
    widths = [int(x) for x in args.widths.split(",")]
    config = decoding.DecodeConfig(max_draft=max(widths))
    results = {}
    for rows in (int(x) for x in args.rows.split(",")):
        measured = costs.measure(
            lm, drafter, rows=rows, config=config, context=args.context,
            repeats=args.repeats, widths=widths, log=print,
        )  # fmt: skip
        one = measured.target_s[widths[0]]
        print(
            f"rows {rows}: "
            + ", ".join(f"{w}: {measured.target_s[w] / one:.2f}" for w in widths)
            + f" single-token steps; drafter step {measured.drafter_s / one:.2f}",
            flush=True,
        )
        results[rows] = measured.to_json()
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
