"""Compile time of the decoder programs, per draft shape, without loading any weights.

Builds the target and drafter from their configs only (abstract parameters: ``nnx.eval_shape``),
lowers and compiles the programs ``jaxcert decode`` runs (target-only prefill and steps,
speculative prefill and rounds) with JAX's persistent cache off, and prints seconds spent
tracing + lowering and compiling each one. The default pair is ``jaxcert decode``'s.

Example::

  python scripts/bench_compile.py --shapes chain,tree:2x4,dyntree:4x6x24
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time

os.environ.setdefault("JAXCERT_COMPILE_CACHE", "0")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from jaxcert.base import assets  # noqa: E402
from jaxcert.decoding import config as config_lib  # noqa: E402
from jaxcert.decoding import loop, policies  # noqa: E402
from jaxcert.decoding.drafters import ModelDrafter
from jaxcert.decoding.state import Settings  # noqa: E402
from jaxcert.models import ModelConfig, Transformer  # noqa: E402
from jaxcert.models.gguf import read_gguf  # noqa: E402


def _abstract(name: str, layers: int | None = None):
    _, metadata = read_gguf(assets.fetch(name))
    cfg = ModelConfig.from_gguf(metadata)
    if layers:
        cfg = dataclasses.replace(cfg, num_layers=layers)
    model = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
    return nnx.split(model)


def _timed(fn, options: dict, *args, **static) -> tuple[float, float, object]:
    """``(lower seconds, compile seconds, compiled)`` of ``fn`` (a ``jax.jit``)."""
    t0 = time.perf_counter()
    lowered = fn.lower(*args, **static)
    t1 = time.perf_counter()
    compiled = lowered.compile(compiler_options=options or None)
    return t1 - t0, time.perf_counter() - t1, compiled


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    p.add_argument("--drafter", default="qwen2.5-coder-0.5b-instruct")
    p.add_argument("--shapes", default="chain,tree:2x4,dyntree:4x6x24")
    p.add_argument("--buckets", default=None, help="chain verification widths, e.g. 2,4,8,16,40")
    p.add_argument("--max-draft", type=int, default=40)
    p.add_argument("--prompt-width", type=int, default=128)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--target-layers", type=int, default=None, help="keep the first N layers")
    p.add_argument("--drafter-layers", type=int, default=None, help="keep the first N layers")
    p.add_argument("--no-target-only", action="store_true")
    p.add_argument("--no-stats", action="store_true", help="decode without certificates")
    p.add_argument("--xla-option", action="append", default=[], help="NAME=VALUE, repeatable")
    args = p.parse_args(argv)
    options = dict(opt.split("=", 1) for opt in args.xla_option)

    t_graphdef, t_params = _abstract(args.target, args.target_layers)
    d_graphdef, d_params = _abstract(args.drafter, args.drafter_layers)
    b, w = args.batch, args.prompt_width
    prompt = jnp.zeros((b, w), jnp.int32)
    lengths = jnp.full((b,), w // 2, jnp.int32)
    key = jax.random.key(0)
    settings = Settings.create(args.max_new_tokens, 0.0, 1.0, ())
    params = policies.PolicyParams.from_policy(policies.parse_policy("svip:0.3"))
    rows = []
    if not args.no_target_only:
        sizes = config_lib.Sizes.for_prompts(w, None, config_lib.bucket(args.max_new_tokens))
        lo1, c1, pre = _timed(
            loop.prefill_target, options, t_params, prompt, lengths, key, settings,
            graphdef=t_graphdef, sizes=sizes,
        )  # fmt: skip
        lo2, c2, _ = _timed(
            loop.run_target_steps, options, t_params, pre.out_info, graphdef=t_graphdef, steps=16,
            sampling=False,
        )  # fmt: skip
        rows.append(dict(shape="target-only", lower_s=lo1 + lo2, compile_s=c1 + c2))
    for shape in args.shapes.split(","):
        verify = "greedy" if shape == "chain" else f"{shape}+greedy"
        buckets = None
        if shape == "chain" and args.buckets:
            buckets = tuple(int(x) for x in args.buckets.split(","))
        cfg = config_lib.DecodeConfig(
            verification=verify,
            max_draft=args.max_draft,
            buckets=buckets,
            collect_stats=not args.no_stats,
        ).shape_only()
        sizes = config_lib.Sizes.for_prompts(w, cfg, config_lib.bucket(args.max_new_tokens))
        graphdefs = dict(t_graphdef=t_graphdef, drafter=ModelDrafter(d_graphdef), config=cfg)
        lo1, c1, pre = _timed(
            loop.prefill, options, t_params, d_params, prompt, lengths, params, key, settings,
            sizes=sizes, **graphdefs,
        )  # fmt: skip
        lo2, c2, _ = _timed(
            loop.run_rounds, options, t_params, d_params, pre.out_info, params, **graphdefs
        )
        rows.append(
            dict(
                shape=shape,
                buckets=list(cfg.verify_buckets()),
                prefill_lower_s=round(lo1, 2),
                prefill_compile_s=round(c1, 2),
                rounds_lower_s=round(lo2, 2),
                rounds_compile_s=round(c2, 2),
                lower_s=lo1 + lo2,
                compile_s=c1 + c2,
            )
        )
        jax.clear_caches()
    for r in rows:
        r["total_s"] = round(r["lower_s"] + r["compile_s"], 1)
        r["lower_s"], r["compile_s"] = round(r["lower_s"], 1), round(r["compile_s"], 1)
        print(json.dumps(r))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
