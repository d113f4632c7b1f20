"""Benchmark: exact certificates of every rule on ``[B, V]`` logits.

Times, in one run and on the same logits:
  * the floor: one jitted ``jax.nn.log_softmax`` pass (``p`` must be read and normalised
    once whatever the solver does);
  * ``jaxcert.certificate`` for each rule alone, and all rules in one ``certificates`` call;
  * the plain NumPy reference of the same spec (``jaxcert.core.reference``), per row.
and reports the ratios. Targets: single-token rules <= 2x the log_softmax pass,
tree rules <= 3x, and every rule >= 3x faster than NumPy.

The logits mimic a language model's: a long Gaussian tail plus a few boosted tokens
whose boost sets how peaked each row is (top-1 probability from ~0.05 to ~1).

With ``--peak-gbps`` (the device's memory bandwidth in GB/s; known for a few accelerators)
it also reports positions per second against the memory-bandwidth bound: one read of the
logits (``B * V * itemsize`` bytes) at peak bandwidth, the floor of any exact solver.

Usage: python scripts/bench_certify.py [--batch 64] [--vocab 151936] [--repeats 10]
       [--dtype float32|bfloat16] [--peak-gbps GB/s] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import jaxcert
from jaxcert.core import reference
from jaxcert.core.rules import parse_rules

RULES = "greedy,additive:0.3,multiplicative:0.1,typical,topk:2,tree:2,tree:4,tree:8"
_PEAK_GBPS = {"H200": 4800.0, "H100": 3350.0, "A100": 2039.0}  # vendors' datasheets


def synthetic_logits(batch: int, vocab: int, profile: str = "llm", seed: int = 0) -> np.ndarray:
    """Logits shaped like a language model's: a Gaussian tail plus a few boosted tokens.

    ``profile='llm'`` draws the boost so that the top-1 probability matches what
    ``jaxcert certify`` measured on Qwen2.5-Coder-0.5B / MT-Bench (median ~0.9, 5th
    percentile ~0.2); ``'flat'`` makes most rows high-entropy, the worst case for the
    threshold rules (their ``U`` outgrows the sorted window and takes the exact path).
    """
    rng = np.random.default_rng(seed)
    x = rng.normal(0.0, 2.0, (batch, vocab)).astype(np.float32)
    for row in range(batch):
        heads = rng.choice(vocab, 5, replace=False)
        if profile == "llm":
            top = 16.0 + 2.0 * rng.normal()
            x[row, heads] = top - np.concatenate([[0.0], np.sort(rng.uniform(0.5, 8.0, 4))])
        else:
            x[row, heads] += rng.uniform(0, 1, 5) * rng.choice([4.0, 12.0, 20.0, 30.0])
    return x


def timed(fn, *args, repeats: int) -> float:
    jax.block_until_ready(fn(*args))  # compile + warm up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=151_936)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--numpy-rows", type=int, default=8, help="rows timed for NumPy")
    parser.add_argument("--rules", default=RULES)
    parser.add_argument("--profile", choices=("llm", "flat"), default="llm",
                        help="shape of the synthetic logits (see synthetic_logits)")  # fmt: skip
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--peak-gbps", type=float, default=None,
                        help="memory bandwidth (GB/s) for the bandwidth bound; default: known "
                        "for H100/H200, else not reported")  # fmt: skip
    parser.add_argument("--json", help="also write the results to this JSON file")
    args = parser.parse_args()

    rules = parse_rules(args.rules)
    x_np = synthetic_logits(args.batch, args.vocab, args.profile)
    x = jnp.asarray(x_np, dtype=args.dtype)
    p_rows = np.exp(x_np[: args.numpy_rows] - x_np[: args.numpy_rows].max(-1, keepdims=True))
    floor = timed(jax.jit(jax.nn.log_softmax), x, repeats=args.repeats)
    top1 = np.asarray(jax.nn.softmax(x).max(-1))
    print(f"device: {jax.devices()[0].device_kind}; B={args.batch}, V={args.vocab}, "
          f"profile {args.profile}; "
          f"top-1 probability of the rows: min {top1.min():.3f}, median {np.median(top1):.3f}, "
          f"max {top1.max():.3f}")  # fmt: skip
    print(f"log_softmax floor: {floor * 1e3:.2f} ms per batch\n")
    rows = []
    for rule in rules:
        jitted = jax.jit(lambda a, rule=rule: jaxcert.certificate(a, rule).value)
        t = timed(jitted, x, repeats=args.repeats)
        start = time.perf_counter()
        for row in p_rows:
            reference.certificate_np(row, rule)
        t_np = (time.perf_counter() - start) / len(p_rows) * args.batch
        limit = 3.0 if rule.list_size > 1 else 2.0
        rows.append({
            "rule": rule.spec, "ms": t * 1e3, "x_log_softmax": t / floor, "target_x": limit,
            "numpy_ms": t_np * 1e3, "speedup_vs_numpy": t_np / t,
        })  # fmt: skip
    every = jax.jit(lambda a: tuple(c.value for c in jaxcert.certificates(a, rules)))
    t_all = timed(every, x, repeats=args.repeats)
    rows.append({
        "rule": f"all {len(rules)} together", "ms": t_all * 1e3, "x_log_softmax": t_all / floor,
        "target_x": float("nan"), "numpy_ms": sum(r["numpy_ms"] for r in rows),
        "speedup_vs_numpy": sum(r["numpy_ms"] for r in rows) / (t_all * 1e3),
    })  # fmt: skip
    header = "| rule | ms / batch | x log_softmax (target) | NumPy ms / batch | speed-up vs NumPy |"
    print(header + "\n|---|---|---|---|---|")
    for r in rows:
        target = "" if np.isnan(r["target_x"]) else f" (<= {r['target_x']:.0f})"
        print(f"| {r['rule']} | {r['ms']:.2f} | {r['x_log_softmax']:.2f}{target} | "
              f"{r['numpy_ms']:.0f} | {r['speedup_vs_numpy']:.0f}x |")  # fmt: skip
    kind = jax.devices()[0].device_kind
    peak = args.peak_gbps or next((v for k, v in _PEAK_GBPS.items() if k in kind), None)
    positions = args.batch / t_all
    print(f"\nall rules together: {positions:,.0f} positions/s ({args.dtype})")
    if peak:
        bound = peak * 1e9 / (args.vocab * x.dtype.itemsize)
        print(f"memory-bandwidth bound (one read of the logits at {peak:.0f} GB/s): "
              f"{bound:,.0f} positions/s; achieved {positions / bound:.1%} of it")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"floor_ms": floor * 1e3, "batch": args.batch, "vocab": args.vocab,
                       "rows": rows}, f, indent=2)  # fmt: skip


if __name__ == "__main__":
    main()
