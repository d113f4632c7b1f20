"""End-to-end benchmark of ``jaxcert certify``: wall time against plain batched
greedy generation, prefill share and padding, positions/s, compile time with the persistent
cache, and peak memory against run size.

Modes (each prints one JSON line per measurement and a Markdown row; combine with --json):

  ratio     jaxcert certify and plain batched greedy generation (``jaxcert.decoding.
            target_decode``: batches of --batch-size prompts sorted by length, one padded
            width, stop at end of turn) of the same prompts and steps by the same model, in
            one process. Also reports what the previous engine's scheme would pad (every
            batch at the longest prompt of the whole set).
  compile   two identical small certify runs in fresh subprocesses sharing an empty
            persistent compilation cache: compile seconds of the first and of the second.
  memory    certify runs of growing size on a tiny random model (built here) in fresh
            subprocesses: peak RSS against the number of positions.

Examples:
  python scripts/bench_certify_e2e.py ratio --prompts mtbench --steps 128
  python scripts/bench_certify_e2e.py ratio --prompts sharegpt --max-prompts 500 --skip-baseline
  python scripts/bench_certify_e2e.py compile
  python scripts/bench_certify_e2e.py memory --sizes 10000,30000,100000

Time it on an otherwise idle machine; docs/benchmarks.md says under which load each figure
was taken.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import resource
import subprocess
import sys
import tempfile
import time

HERE = pathlib.Path(__file__).resolve().parent


def _emit(record: dict) -> None:
    print(json.dumps(record), flush=True)


def ratio(args) -> None:
    import numpy as np

    from jaxcert import cli, decoding, models
    from jaxcert.base import prompts
    from jaxcert.base.validate import round_up

    prompt_set = prompts.load_prompts(args.prompts, max_prompts=args.max_prompts)
    if args.max_prompt_tokens and not args.skip_baseline:
        raise SystemExit("--max-prompt-tokens is for --skip-baseline runs")
    out = pathlib.Path(tempfile.mkdtemp(prefix="bench-certify-")) / "run"
    t0 = time.perf_counter()
    argv = ["certify", "--target", args.target, "--prompts", args.prompts, "--steps",
            str(args.steps), "--batch-size", str(args.batch_size), "--out", str(out),
            "--no-plots"]  # fmt: skip
    if args.max_prompts:
        argv += ["--max-prompts", str(args.max_prompts)]
    if args.max_prompt_tokens:
        argv += ["--max-prompt-tokens", str(args.max_prompt_tokens)]
    assert cli.main(argv) == 0
    certify_s = time.perf_counter() - t0
    run = json.loads((out / "run.json").read_text())
    record = {
        "mode": "certify",
        "prompts": args.prompts,
        "n_prompts": run["prompts_used"],
        "skipped_long": run.get("prompts_skipped_long", 0),
        "steps": args.steps,
        "batch_size": args.batch_size,
        "wall_s": round(certify_s, 1),
        "load_s": run["load_s"],
        "compile_s": run["compile_s"],
        "prefill_s": run["prefill_s"],
        "decode_s": run["decode_s"],
        "positions": run["positions"],
        "positions_per_s": round(run["positions"] / certify_s, 1),
        "positions_per_s_after_load": round(run["positions"] / (certify_s - run["load_s"]), 1),
        "prefill_share": round(run["prefill_s"] / (run["prefill_s"] + run["decode_s"]), 3),
        "padding": round(1 - run["prefill_tokens"] / run["prefill_padded_tokens"], 3),
        "slot_use": round(run["decode_active_steps"] / run["decode_slot_steps"], 3),
        "peak_rss_gb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6, 2),
    }
    lm = models.load(args.target)
    encoded = prompts.encode_prompts(lm.tokenizer, prompt_set)
    lengths = np.array([len(e) for e in encoded])
    # The previous engine padded every batch to the longest prompt of the whole set.
    width = round_up(int(lengths.max()), 16)
    batches = -(-len(lengths) // args.batch_size)
    record["padding_previous_scheme"] = round(
        1 - lengths.sum() / (batches * args.batch_size * width), 3
    )
    _emit(record)
    if args.skip_baseline:
        return
    order = np.argsort(lengths, kind="stable")
    t0 = time.perf_counter()
    tokens = 0
    for start in range(0, len(order), args.batch_size):
        batch = [encoded[i] for i in order[start : start + args.batch_size]]
        batch += [batch[0]] * (args.batch_size - len(batch))  # one shape: one compile
        result = decoding.target_decode(
            lm, batch, max_new_tokens=args.steps, eos_ids=lm.eos_ids, prompt_width=width
        )
        tokens += int(np.sum(result.lengths)) if hasattr(result, "lengths") else 0
    generate_s = time.perf_counter() - t0
    _emit({
        "mode": "generate",
        "wall_s_after_load": round(generate_s, 1),
        "certify_wall_s_after_load": round(certify_s - run["load_s"], 1),
        "ratio": round((certify_s - run["load_s"]) / generate_s, 3),
    })  # fmt: skip


def _child(code: str, env: dict) -> dict:
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=os.environ | env, timeout=3600)  # fmt: skip
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-3000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


_COMPILE_RUN = """
import json, resource, sys, time
from jaxcert import cli
t0 = time.perf_counter()
assert cli.main({argv!r}) == 0
run = json.load(open({out!r} + "/run.json"))
print(json.dumps({{"wall_s": round(time.perf_counter() - t0, 1), "compile_s": run["compile_s"],
                  "load_s": run["load_s"]}}))
"""


def compile_cache(args) -> None:
    cache = tempfile.mkdtemp(prefix="bench-xla-")
    for attempt in ("first", "second"):
        out = tempfile.mkdtemp(prefix="bench-compile-") + "/run"
        argv = ["certify", "--target", args.target, "--prompts", args.prompts,
                "--max-prompts", "4", "--steps", "16", "--out", out, "--no-plots"]  # fmt: skip
        got = _child(_COMPILE_RUN.format(argv=argv, out=out), {"JAXCERT_COMPILE_CACHE": cache})
        _emit({"mode": "compile", "run": attempt, **got})


_MEMORY_RUN = """
import json, resource, sys, time
from tests.helpers import tiny_lm
from jaxcert import cli
from jaxcert.cli import certify as command
report = command._write_report
streamed = []
def measured(*a, **k):  # peak RSS of the streaming phase, before the report reads columns
    streamed.append(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024)
    return report(*a, **k)
command._write_report = measured
ckpt = tiny_lm.save_tiny_checkpoint(__import__("pathlib").Path({tmp!r}) / "ckpt")
lines = [json.dumps({{"id": str(i), "prompt": tiny_lm.TEXTS[i % len(tiny_lm.TEXTS)]}})
         for i in range({prompts})]
open({tmp!r} + "/p.jsonl", "w").write("\\n".join(lines) + "\\n")
t0 = time.perf_counter()
assert cli.main(["certify", "--target", str(ckpt), "--prompts", {tmp!r} + "/p.jsonl",
                 "--steps", "100", "--batch-size", "64", "--ignore-eos", "--no-plots",
                 "--shard-rows", "20000", "--out", {tmp!r} + "/out"]) == 0
run = json.load(open({tmp!r} + "/out/run.json"))
print(json.dumps({{"positions": run["positions"], "wall_s": round(time.perf_counter() - t0, 1),
                  "peak_rss_mb_streaming": streamed[0],
                  "peak_rss_mb_with_report":
                      resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024}}))
"""


def memory(args) -> None:
    for size in (int(s) for s in args.sizes.split(",")):
        tmp = tempfile.mkdtemp(prefix="bench-mem-")
        code = _MEMORY_RUN.format(tmp=tmp, prompts=size // 100)
        # The repository root on the child's path, for tests.helpers.
        path = os.pathsep.join(filter(None, [str(HERE.parent), os.environ.get("PYTHONPATH")]))
        _emit({"mode": "memory", **_child(code, {"PYTHONPATH": path})})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="mode", required=True)
    p = sub.add_parser("ratio")
    p.add_argument("--target", default="qwen2.5-coder-0.5b-instruct")
    p.add_argument("--prompts", default="mtbench")
    p.add_argument("--max-prompts", type=int, default=None)
    p.add_argument("--max-prompt-tokens", type=int, default=None)
    p.add_argument("--steps", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--skip-baseline", action="store_true")
    p.set_defaults(func=ratio)
    p = sub.add_parser("compile")
    p.add_argument("--target", default="qwen2.5-coder-0.5b-instruct")
    p.add_argument("--prompts", default="mtbench")
    p.set_defaults(func=compile_cache)
    p = sub.add_parser("memory")
    p.add_argument("--sizes", default="10000,30000,100000")
    p.set_defaults(func=memory)
    args = parser.parse_args()
    args.func(args)


if __name__ == "__main__":
    main()
