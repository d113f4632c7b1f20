"""Speculative decoding benchmark on real models: target-only vs policies x draft shapes.

Loads the target and the drafter once, encodes MT-Bench first turns with the chat template and,
for every temperature, decodes each prompt with the target alone and with every (draft shape,
policy) pair, interleaved prompt by prompt so that all configurations see the same machine
state (the target-only run is repeated before and after each prompt's speculative runs and
averaged). Compilation is ahead of time and excluded from the timings.

Temperature 0 uses strict greedy verification (the outputs must equal target-only greedy
decoding: checked and reported); temperature > 0 uses speculative sampling.

Example (the README table)::

  python scripts/bench_decode.py --max-new-tokens 96 --temperatures 0,1

Prints a markdown table and writes a JSON file (``--out``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import sys
import time

import jax
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from jaxcert import decoding, models, prompts
from jaxcert._validate import round_up
from jaxcert.decoding import run_report

DEFAULT_POLICIES = "constant:4,heuristic,confidence:0.4,svip:0.3,cert"


def _args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    p.add_argument("--drafter", default="qwen2.5-coder-0.5b-instruct")
    p.add_argument("--prompts", default="mtbench")
    p.add_argument(
        "--prompt-indices",
        default="0,20,40,60",
        help="prompts to use, by index (MT-Bench: writing, reasoning, coding, STEM; the "
        "cert policy was tuned on other prompts)",
    )
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--temperatures", default="0,1")
    p.add_argument("--policies", default=DEFAULT_POLICIES)
    p.add_argument("--shapes", default="chain,tree:2x4", help="chain, tree:MxD, dyntree:MxDxN")
    p.add_argument("--max-draft", type=int, default=40, help="deepest chain (policy cap)")
    p.add_argument(
        "--buckets",
        default="1,2,3,4,5,6,7,8,10,12,16,24,32,40",
        help="chain verification widths (drafted tokens); trees use their levels",
    )
    p.add_argument("--certificates", action="store_true", help="also compute certificates")
    p.add_argument("--nodes", type=pathlib.Path, default=None,
                   help="write every drafted node's statistics to this Parquet file")  # fmt: skip
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=pathlib.Path, default=pathlib.Path("jaxcert-out/bench.json"),
                   help="JSON results (default jaxcert-out/bench.json)")  # fmt: skip
    return p.parse_args(argv)


def _config(shape: str, temperature: float, args, eos) -> decoding.DecodeConfig:
    rule = "greedy" if temperature == 0 else "sample"
    verify = rule if shape == "chain" else f"{shape}+{rule}"
    buckets = None
    if shape == "chain":
        buckets = tuple(b for b in map(int, args.buckets.split(",")) if b < args.max_draft)
        buckets += (args.max_draft,)
    return decoding.DecodeConfig(
        verification=decoding.parse_verify(verify),
        max_new_tokens=args.max_new_tokens,
        max_draft=args.max_draft,
        temperature=temperature,
        eos_ids=eos,
        collect_stats=args.certificates,
        buckets=buckets,
    )


@dataclasses.dataclass
class _Tally:
    tokens: int = 0
    decode_s: float = 0.0
    compile_s: float = 0.0
    identical: int = 0
    runs: int = 0
    stats: list = dataclasses.field(default_factory=list)

    def add(self, out, reference=None):
        self.tokens += out.num_tokens
        self.decode_s += out.decode_s
        self.compile_s += out.compile_s
        self.runs += 1
        if out.stats is not None:
            self.stats.append(out.stats)
        if reference is not None:
            self.identical += int(np.array_equal(out.tokens[0], reference))

    @property
    def rate(self) -> float:
        return self.tokens / self.decode_s

    def summary(self) -> dict:
        merged = None
        if self.stats:
            merged = jax.tree.map(lambda *xs: np.concatenate(xs, axis=0), *self.stats)
        return run_report.summarize_run(merged, self.tokens, self.decode_s)


def main(argv=None) -> int:
    args = _args(argv)
    temperatures = [float(t) for t in args.temperatures.split(",")]
    policies = [decoding.parse_policy(s) for s in args.policies.split(",")]
    shapes = args.shapes.split(",")
    t0 = time.perf_counter()
    target = models.load(args.target)
    drafter = models.load(args.drafter)
    decoding.check_pair(target, drafter)
    load_s = time.perf_counter() - t0
    eos = target.eos_ids
    prompt_set = prompts.load_prompts(args.prompts)
    prompt_set = [prompt_set[int(i)] for i in args.prompt_indices.split(",")]
    encoded = prompts.encode_prompts(target.tokenizer, prompt_set)
    width = round_up(max(len(e) for e in encoded), 16)
    log = lambda *a: print(*a, file=sys.stderr, flush=True)  # noqa: E731
    log(f"[bench] loaded in {load_s:.0f} s; {len(encoded)} prompts ({[len(e) for e in encoded]} "
        f"tokens); {len(shapes)} shapes x {len(policies)} policies x {temperatures}")  # fmt: skip
    key = jax.random.key(args.seed)
    results: dict = {}
    drafter_only = _Tally()
    node_tables = []
    for temperature in temperatures:
        base = results.setdefault((temperature, "target", "-"), _Tally())
        configs = {shape: _config(shape, temperature, args, eos) for shape in shapes}
        for i, prompt in enumerate(encoded):
            key, sub = jax.random.split(key)
            kw = dict(max_new_tokens=args.max_new_tokens, temperature=temperature,
                      eos_ids=eos, prompt_width=width)  # fmt: skip
            first = decoding.target_decode(target, [prompt], key=sub, **kw)
            base.add(first)
            if temperature == temperatures[0]:
                drafter_only.add(decoding.target_decode(drafter, [prompt], key=sub, **kw))
            for shape in shapes:
                for policy in policies:
                    key, sub = jax.random.split(key)
                    out = decoding.speculative_decode(
                        target, drafter, [prompt], policy=policy, config=configs[shape],
                        key=sub, prompt_width=width,
                    )  # fmt: skip
                    tally = results.setdefault((temperature, shape, policy.spec), _Tally())
                    tally.add(out, first.tokens[0] if temperature == 0 else None)
                    if args.nodes is not None:
                        table = run_report.node_table(out.stats, [prompt_set[i].id])
                        extra = {"temperature": temperature, "shape": shape,
                                 "policy": policy.spec}  # fmt: skip
                        for name, value in extra.items():
                            table = table.append_column(name, pa.array([value] * len(table)))
                        node_tables.append(table)
                    log(f"[bench] T={temperature} prompt {i} {shape} {policy.spec}: "
                        f"{out.num_tokens / out.decode_s:.2f} tok/s "
                        f"(target {first.num_tokens / first.decode_s:.2f}), "
                        f"compile {out.compile_s:.0f} s")  # fmt: skip
            base.add(decoding.target_decode(target, [prompt], key=sub, **kw))
    rows = []
    for (temperature, shape, policy), tally in results.items():
        base = results[(temperature, "target", "-")]
        s = tally.summary()
        rows.append({
            "temperature": temperature, "shape": shape, "policy": policy,
            "tokens_per_s": round(tally.rate, 3), "speedup": round(tally.rate / base.rate, 3),
            "identical": f"{tally.identical}/{tally.runs}" if temperature == 0 and shape != "target"
            else "", "compile_s": round(tally.compile_s, 1), **{k: v for k, v in s.items()
            if k not in ("tokens_per_s",)},
        })  # fmt: skip
    t_tok = results[(temperatures[0], "target", "-")]
    cost_ratio = (drafter_only.decode_s / drafter_only.tokens) / (t_tok.decode_s / t_tok.tokens)
    print(_table(rows, cost_ratio))
    meta = {"command": " ".join(sys.argv), "target": str(target.path), "drafter": str(drafter.path),
            "prompts": [p.id for p in prompt_set], "max_new_tokens": args.max_new_tokens,
            "drafter_target_cost_ratio": round(cost_ratio, 3),
            "drafter_tokens_per_s": round(drafter_only.rate, 3), "load_s": round(load_s, 1),
            "total_s": round(time.perf_counter() - t0, 1)}  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    if args.nodes is not None:
        pq.write_table(pa.concat_tables(node_tables), args.nodes)
    args.out.write_text(json.dumps(meta | {"rows": rows}, indent=2, default=str))
    log(f"[bench] wrote {args.out} in {meta['total_s']:.0f} s")
    return 0


def _table(rows, cost_ratio) -> str:
    head = ("| T | draft | policy | tokens/s | speedup | accepted/round | tokens/round | "
            "acceptance | drafted/round | identical |")  # fmt: skip
    lines = [head, "|" + "---|" * 10]
    for r in rows:
        lines.append(
            f"| {r['temperature']:g} | {r['shape']} | {r['policy']} | {r['tokens_per_s']:.2f} | "
            f"{r['speedup']:.2f} | {r.get('mean_accepted', '')} | {r.get('tokens_per_round', '')} "
            f"| {r.get('acceptance_rate', '')} | {r.get('mean_drafted', '')} | {r['identical']} |"
        )
    return "\n".join(lines) + f"\n\ndrafter/target per-token cost ratio: {cost_ratio:.3f}"


if __name__ == "__main__":
    sys.exit(main())
