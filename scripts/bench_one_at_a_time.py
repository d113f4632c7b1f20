"""Prompts decoded one at a time: programs compiled and tokens per second, compiles included.

Decodes each of the first ``--max-prompts`` prompts alone (batch 1, no shared prompt width:
each call chooses its own), target-only and speculatively with each ``--policies`` entry in
turn, in one process, as a caller that decodes requests as they come would. ``goodput`` is
given one :class:`jaxcert.decoding.GoodputController` held across the prompts (calibrated
once, not saved). Prints, per method, the programs it compiled, its tokens per second with
compiles included and without them, and its speed-up over target-only. Figures and their
conditions: docs/benchmarks.md ("Compile time").

Example::

  python scripts/bench_one_at_a_time.py --max-prompts 8 --max-new-tokens 64
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import jax

from jaxcert import decoding
from jaxcert.base import prompts
from jaxcert.cli._common import load_drafter, load_model, load_prompt_set
from jaxcert.cli.argtypes import positive


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    p.add_argument("--drafter", default="qwen2.5-coder-0.5b-instruct")
    p.add_argument("--prompts", default="mtbench")
    p.add_argument("--max-prompts", type=positive, default=8)
    p.add_argument("--max-new-tokens", type=positive, default=64)
    p.add_argument("--policies", default="cert:0.55,goodput")
    p.add_argument("--out", default=None, help="also write the figures as JSON here")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    prompt_set = load_prompt_set(args.prompts, max_prompts=args.max_prompts)
    target = load_model("--target", args.target)
    drafter = load_drafter(args.drafter, target)
    encoded = prompts.encode_prompts(target.tokenizer, prompt_set)
    print(f"[bench] prompt lengths {[len(e) for e in encoded]}", file=sys.stderr)
    n = args.max_new_tokens
    config = decoding.DecodeConfig(
        verification="greedy", max_new_tokens=n, max_draft=8, eos_ids=target.eos_ids
    )
    rows = {}

    def timed(name, decode):
        programs = decoding.Programs()
        t0, tokens, decode_s = time.perf_counter(), 0, 0.0
        for prompt in encoded:
            out = decode([prompt], programs)
            tokens += out.num_tokens
            decode_s += out.prefill_s + out.decode_s
        wall = time.perf_counter() - t0
        rows[name] = {
            "programs_compiled": programs.compiled,
            "tokens": tokens,
            "tokens_per_s_with_compiles": round(tokens / wall, 3),
            "tokens_per_s": round(tokens / decode_s, 3),
        }
        print(f"[bench] {name}: {rows[name]}", file=sys.stderr)

    timed("target-only", lambda p, programs: decoding.target_decode(
        target, p, max_new_tokens=n, eos_ids=target.eos_ids, programs=programs,
    ))  # fmt: skip
    for spec in args.policies.split(","):
        policy = decoding.parse_policy(spec)
        costs = None
        if isinstance(policy, decoding.Goodput):
            costs = decoding.GoodputController.calibrate(target, drafter, config=config, rows=1)
        timed(spec, lambda p, programs, policy=policy, costs=costs: decoding.speculative_decode(
            target, drafter, p, policy=policy, config=config, programs=programs, costs=costs,
        ))  # fmt: skip
    base = rows["target-only"]
    for row in rows.values():
        for key in ("tokens_per_s_with_compiles", "tokens_per_s"):
            row["speedup" + key[len("tokens_per_s") :]] = round(row[key] / base[key], 3)
    report = {
        "command": " ".join(sys.argv),
        "device": str(jax.devices()[0]),
        "prompt_lengths": [len(e) for e in encoded],
        "methods": rows,
    }
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
