"""Where a speculative decode spends its time: per program, against target-only decoding.

For each prompt (``--prompt-indices`` into ``--prompts``) and each of ``--repeats`` runs,
decodes target-only, then speculatively with ``--drafter`` (a language model, a draft-head
folder or ``ngram:N``) and ``--policy``, one after the other at batch 1, and splits the
speculative decode's time by the program that ran it (`decoding.DecodeOutput.calls`):
``steps`` (target-only steps that ``goodput`` runs instead of rounds) and ``rounds`` (the
round loop). For each it prints the tokens, the seconds a token, and the excess: the
calls' seconds less their tokens at that run's target-only seconds a token. A program
with no excess costs what target-only decoding costs; the decode's loss against
target-only is the sum of the excesses. Compilation and a first decode of each program
are kept out (one untimed run of both first). docs/benchmarks.md ("The best head at 128
tokens") has a measured table.

Example::

  python scripts/bench_decode_calls.py --drafter jaxcert-out/train-head/kl+tv-seed0/head \\
      --prompt-indices 70,40 --out jaxcert-out/calls.json
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys

import jax
import numpy as np

from jaxcert import decoding
from jaxcert.base import prompts
from jaxcert.cli._common import load_drafter, load_model

PROGRAMS = ("steps", "rounds")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    p.add_argument(
        "--drafter",
        default="qwen2.5-coder-0.5b-instruct",
        help="a language model, a draft-head folder or ngram:N",
    )
    p.add_argument("--policy", default="goodput", help="as jaxcert decode --policy")
    p.add_argument("--verify", default="greedy", help="as jaxcert decode --verify")
    p.add_argument("--prompts", default="mtbench", help="prompt set (as jaxcert decode's)")
    p.add_argument("--prompt-indices", default="70,40", help="indices into --prompts")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--max-draft", type=int, default=40, help="deepest chain (policy cap)")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--keep-eos", action="store_true", help="stop at end tokens (default: not)")
    p.add_argument("--out", type=pathlib.Path, default=None, help="also write JSON here")
    args = p.parse_args(argv)
    if args.max_new_tokens < 1 or args.repeats < 1 or args.max_draft < 1:
        p.error("--max-new-tokens, --max-draft and --repeats must be >= 1")
    try:
        args.indices = [int(i) for i in args.prompt_indices.split(",")]
    except ValueError:
        p.error(f"--prompt-indices: comma-separated integers, got {args.prompt_indices!r}")
    return args


def split_by_program(out: decoding.DecodeOutput, per_token_s: float) -> dict:
    """Per program of ``out.calls``: calls, tokens, seconds, seconds a token and the excess
    over ``per_token_s`` (seconds a token of target-only decoding) for those tokens."""
    split = {}
    for name in PROGRAMS:
        calls = [c for c in out.calls if c.program == name]
        tokens = sum(c.tokens for c in calls)
        seconds = sum(c.seconds for c in calls)
        split[name] = {
            "calls": len(calls),
            "tokens": tokens,
            "seconds": round(seconds, 4),
            "s_per_token": round(seconds / tokens, 4) if tokens else None,
            "excess_s": round(seconds - tokens * per_token_s, 4),
        }
    return split


def main(argv=None) -> int:
    args = parse_args(argv)
    prompt_set = prompts.load_prompts(args.prompts)
    bad = [i for i in args.indices if not 0 <= i < len(prompt_set)]
    if bad:
        raise SystemExit(f"--prompt-indices {bad}: {args.prompts} has {len(prompt_set)} prompts")
    target = load_model("--target", args.target)
    drafter = load_drafter(args.drafter, target)
    encoded = prompts.encode_prompts(target.tokenizer, [prompt_set[i] for i in args.indices])
    width = decoding.bucket(max(len(e) for e in encoded))
    eos = tuple(target.eos_ids) if args.keep_eos else ()
    config = decoding.DecodeConfig(
        verification=decoding.parse_verify(args.verify),
        max_new_tokens=args.max_new_tokens,
        max_draft=args.max_draft,
        eos_ids=eos,
        collect_stats=False,
    )
    policy = decoding.parse_policy(args.policy)

    def target_only(p):
        kw = dict(max_new_tokens=args.max_new_tokens, eos_ids=eos, prompt_width=width)
        return decoding.target_decode(target, [p], key=jax.random.key(0), **kw)

    def speculative(p):
        return decoding.speculative_decode(
            target, drafter, [p], config=config, policy=policy, prompt_width=width
        )

    target_only(encoded[0])  # compile and run each program once, untimed
    speculative(encoded[0])
    rows = []
    for index, p in zip(args.indices, encoded, strict=True):
        for run in range(args.repeats):
            base, out = target_only(p), speculative(p)
            per_token = base.decode_s / base.num_tokens
            row = {
                "prompt": index,
                "run": run + 1,
                "target_s": round(base.decode_s, 4),
                "target_tokens": base.num_tokens,
                "speculative_s": round(out.decode_s, 4),
                "speculative_tokens": out.num_tokens,
                "speedup": round(per_token / (out.decode_s / out.num_tokens), 4),
                "programs": split_by_program(out, per_token),
            }
            rows.append(row)
            cells = "; ".join(
                f"{name}: {s['tokens']} tokens, {s['excess_s']:+.2f} s"
                for name, s in row["programs"].items()
            )
            print(
                f"prompt {index} run {run + 1}: target-only {base.decode_s:.2f} s "
                f"({per_token * 1000:.0f} ms a token), speculative {out.decode_s:.2f} s "
                f"({row['speedup']:.3f}x); {cells}",
                flush=True,
            )
    total = {
        name: round(sum(r["programs"][name]["excess_s"] for r in rows), 3) for name in PROGRAMS
    }
    print(f"excess over target-only, all runs: {total}")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        record = {
            "command": " ".join(["scripts/bench_decode_calls.py", *(argv or sys.argv[1:])]),
            "cpu_count": os.cpu_count(),
            "rows": rows,
            "excess_s": total,
            "mean_speedup": round(float(np.mean([r["speedup"] for r in rows])), 4),
        }
        args.out.write_text(json.dumps(record, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
