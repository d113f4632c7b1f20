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
are kept out (one untimed run of both first). docs/benchmarks.md ("Draft heads") has a
measured table.

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
import tempfile

import jax
import numpy as np

from jaxcert import decoding
from jaxcert.base import prompts
from jaxcert.base.folders import atomic_write
from jaxcert.cli._common import (
    check_vocabularies,
    load_drafter,
    load_model,
    load_prompt_set,
    policy_arg,
    verify_arg,
)
from jaxcert.cli.argtypes import positive
from jaxcert.decoding.config import bucket

PROGRAMS = ("steps", "rounds")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    p.add_argument(
        "--drafter",
        default="qwen2.5-coder-0.5b-instruct",
        help="a language model, a draft-head folder or ngram:N",
    )
    p.add_argument(
        "--policy", type=policy_arg, default="goodput", help="as jaxcert decode --policy"
    )
    p.add_argument(
        "--verify",
        type=verify_arg,
        default=None,
        help="as jaxcert decode --verify (default: greedy at --temperature 0, else sample)",
    )
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--prompts", default="mtbench", help="prompt set (as jaxcert decode's)")
    p.add_argument("--prompt-indices", default="70,40", help="indices into --prompts")
    p.add_argument("--max-new-tokens", type=positive, default=128)
    p.add_argument("--max-draft", type=positive, default=40, help="deepest chain (policy cap)")
    p.add_argument("--repeats", type=positive, default=2)
    p.add_argument("--keep-eos", action="store_true", help="stop at end tokens (default: not)")
    p.add_argument(
        "--out", type=pathlib.Path, default=None, help="also write JSON here, after every run"
    )
    args = p.parse_args(argv)
    try:
        args.indices = [int(i) for i in args.prompt_indices.split(",")]
    except ValueError:
        p.error(f"--prompt-indices: comma-separated integers, got {args.prompt_indices!r}")
    if args.verify is None:
        args.verify = "greedy" if args.temperature == 0 else "sample"
    try:  # the rule and the temperature agree (sampling rules need T > 0)
        decoding.DecodeConfig(verification=args.verify, temperature=args.temperature)
    except ValueError as err:
        p.error(f"--verify / --temperature: {err}")
    if args.out is not None:
        # A path that cannot be written fails now, not after the decodes.
        try:
            args.out.parent.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            p.error(f"--out {args.out}: {err.strerror or err}")
        if args.out.is_dir():
            p.error(f"--out {args.out}: a folder, not a file")
        try:  # the results are written next to it, then moved over it
            tempfile.TemporaryFile(dir=args.out.parent).close()
        except OSError as err:
            p.error(f"--out {args.out}: cannot write in {args.out.parent}: {err.strerror or err}")
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


def total_excess(rows: list[dict]) -> dict:
    """Per program, the excess seconds of every run in ``rows`` summed."""
    return {n: round(sum(r["programs"][n]["excess_s"] for r in rows), 3) for n in PROGRAMS}


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        prompt_set = load_prompt_set(args.prompts)
        check_vocabularies(args.target, args.drafter)  # from the configs, before loading
    except ValueError as err:
        raise SystemExit(str(err)) from None
    bad = [i for i in args.indices if not 0 <= i < len(prompt_set)]
    if bad:
        raise SystemExit(f"--prompt-indices {bad}: {args.prompts} has {len(prompt_set)} prompts")
    try:
        target = load_model("--target", args.target)
        drafter = load_drafter(args.drafter, target)
    except ValueError as err:
        raise SystemExit(str(err)) from None
    encoded = prompts.encode_prompts(target.tokenizer, [prompt_set[i] for i in args.indices])
    width = bucket(max(len(e) for e in encoded))
    eos = tuple(target.eos_ids) if args.keep_eos else ()
    config = decoding.DecodeConfig(
        verification=args.verify,
        max_new_tokens=args.max_new_tokens,
        max_draft=args.max_draft,
        temperature=args.temperature,
        eos_ids=eos,
        collect_stats=False,
    )
    policy = decoding.parse_policy(args.policy)
    kw = dict(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        eos_ids=eos,
        prompt_width=width,
    )

    def target_only(p):
        return decoding.target_decode(target, [p], key=jax.random.key(0), **kw)

    def speculative(p):
        return decoding.speculative_decode(
            target, drafter, [p], config=config, policy=policy, prompt_width=width,
            key=jax.random.key(0),
        )  # fmt: skip

    def save(rows):
        """The JSON so far (after every run: an interrupted run keeps what it measured)."""
        if args.out is None:
            return
        record = {
            "command": " ".join(["scripts/bench_decode_calls.py", *(argv or sys.argv[1:])]),
            "cpu_count": os.cpu_count(),
            "rows": rows,
            "excess_s": total_excess(rows),
            "mean_speedup": round(float(np.mean([r["speedup"] for r in rows])), 4),
        }
        atomic_write(args.out, json.dumps(record, indent=1))

    target_only(encoded[0])  # compile and run each program once, untimed
    speculative(encoded[0])
    rows: list[dict] = []
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
            save(rows)
            cells = "; ".join(
                f"{name}: {s['tokens']} tokens, {s['excess_s']:+.2f} s"
                for name, s in row["programs"].items()
            )
            print(
                f"prompt {index} run {run + 1}: target-only {base.decode_s:.2f} s "
                f"({per_token * 1000:.1f} ms a token), speculative {out.decode_s:.2f} s "
                f"({row['speedup']:.3f}x); {cells}",
                flush=True,
            )
    print(f"excess over target-only, all runs: {total_excess(rows)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
