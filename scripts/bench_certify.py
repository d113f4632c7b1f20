"""Benchmark: exact certificates of every rule on ``[B, V]`` logits, in time and in reads.

Times, in one process and on the same logits (median of ``--repeats``):
  * the floor: one jitted ``jax.nn.logsumexp`` (the maximum, then the sum of ``exp``: the
    least any exact solver reads), and ``jax.nn.log_softmax`` beside it;
  * ``jaxcert.certificate`` for each rule alone, and all rules in one ``certificates`` call;
  * with ``--baseline``, the same calls with the row summary of separate reductions
    (maximum, normaliser, entropy, group maxima for the window: the solver before its
    two-pass summary), for old and new side by side;
  * the plain NumPy reference of the same spec (``jaxcert.core.reference``), per row;
and, from XLA's cost analysis of the same compiled programs (``jaxcert.base.reads``), how
many times each reads the logits (``xla``, and ``gathered``: the window's gather counted by
what it gathers). Target: all rules together at most 2x the ``logsumexp`` floor.

The logits mimic a language model's: a long Gaussian tail plus a few boosted tokens
whose boost sets how peaked each row is (top-1 probability from ~0.05 to ~1).

With ``--peak-gbps`` (the device's memory bandwidth in GB/s; known for a few accelerators)
it also reports positions per second against the memory-bandwidth bound: one read of the
logits (``B * V * itemsize`` bytes) at peak bandwidth, the floor of any exact solver.

Usage: python scripts/bench_certify.py [--batch 64] [--vocab 151936] [--repeats 15]
       [--dtype float32|bfloat16] [--baseline] [--peak-gbps GB/s] [--json FILE]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import jaxcert
from jaxcert.base.reads import compiled_reads
from jaxcert.core import numerics, reference
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


def compiled(fn, x):
    """``fn`` compiled for ``x`` (the cost analysis and the timing share the program)."""
    return jax.jit(fn).lower(x).compile()


def timed(fn, *args, repeats: int) -> float:
    jax.block_until_ready(fn(*args))  # warm up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


@contextlib.contextmanager
def separate_reductions():
    original = numerics.row_summary
    numerics.row_summary = numerics.separate_summary
    try:
        yield
    finally:
        numerics.row_summary = original


def measure(fn, x, repeats: int) -> dict:
    program = compiled(fn, x)
    reads = compiled_reads(program, x.size * x.dtype.itemsize)
    return {"ms": timed(program, x, repeats=repeats) * 1e3, "reads": reads.gathered,
            "reads_xla": reads.xla}  # fmt: skip


def loss_rows(target, repeats: int) -> list[dict]:
    """``value_and_grad`` (w.r.t. the drafter) of the mean certificate violation (greedy,
    margin 0.05) and of the mean KL, the drafter's logits the target's plus noise."""
    noise = jax.random.normal(jax.random.key(0), target.shape, jnp.float32)
    drafter = (target.astype(jnp.float32) + noise).astype(target.dtype)
    greedy = parse_rules("greedy")[0]
    losses = {
        "loss: KL, value and grad": jaxcert.losses.kl_divergence,
        "loss: certificate_violation (greedy), value and grad": lambda d, t: (
            jaxcert.losses.certificate_violation(d, t, greedy, margin=0.05)
        ),
    }
    rows = []
    for name, loss in losses.items():
        step = jax.jit(jax.value_and_grad(lambda d, t, loss=loss: loss(d, t).mean()))
        program = step.lower(drafter, target).compile()
        reads = compiled_reads(program, target.size * target.dtype.itemsize)
        ms = timed(program, drafter, target, repeats=repeats) * 1e3
        rows.append({"rule": name, "ms": ms, "reads": reads.gathered, "reads_xla": reads.xla})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=151_936)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--numpy-rows", type=int, default=8, help="rows timed for NumPy")
    parser.add_argument("--rules", default=RULES)
    parser.add_argument(
        "--each", default=None, help="the rules timed alone (default: every rule of --rules)"
    )
    parser.add_argument("--losses", action="store_true",
                        help="also value_and_grad of certificate_violation (greedy) and of "
                        "the KL loss w.r.t. drafter logits of the same shape")  # fmt: skip
    parser.add_argument("--measure-bandwidth", action="store_true",
                        help="measure the device's copy bandwidth (x + 1 on the logits) and "
                        "report each program against one read at it")  # fmt: skip
    parser.add_argument("--profile", choices=("llm", "flat"), default="llm",
                        help="shape of the synthetic logits (see synthetic_logits)")  # fmt: skip
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument(
        "--baseline",
        action="store_true",
        help="also time the row summary of separate reductions (old vs new)",
    )
    parser.add_argument("--peak-gbps", type=float, default=None,
                        help="memory bandwidth (GB/s) for the bandwidth bound; default: known "
                        "for H100/H200, else not reported")  # fmt: skip
    parser.add_argument("--json", help="also write the results to this JSON file")
    args = parser.parse_args()
    for name in ("batch", "vocab", "repeats", "numpy_rows"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")

    rules = parse_rules(args.rules)
    x_np = synthetic_logits(args.batch, args.vocab, args.profile)
    x = jnp.asarray(x_np, dtype=args.dtype)
    p_rows = np.exp(x_np[: args.numpy_rows] - x_np[: args.numpy_rows].max(-1, keepdims=True))
    floor = measure(lambda a: jax.nn.logsumexp(a, axis=-1), x, args.repeats)
    softmax = measure(jax.nn.log_softmax, x, args.repeats)
    top1 = np.asarray(jax.nn.softmax(x.astype(jnp.float32)).max(-1))
    print(f"device: {jax.devices()[0].device_kind}; B={args.batch}, V={args.vocab}, "
          f"{args.dtype}, profile {args.profile}; top-1 probability of the rows: "
          f"min {top1.min():.3f}, median {np.median(top1):.3f}, max {top1.max():.3f}")  # fmt: skip
    print(f"floor, logsumexp: {floor['ms']:.2f} ms ({floor['reads']:.2f} reads); "
          f"log_softmax: {softmax['ms']:.2f} ms ({softmax['reads']:.2f} reads)\n")  # fmt: skip

    alone = rules if args.each is None else parse_rules(args.each)
    calls = [(rule.spec, (rule,)) for rule in alone] + [(f"all {len(rules)} together", rules)]
    numpy_times: dict = {}

    def numpy_ms(rule) -> float:
        """The NumPy reference's time for the batch (ms), from ``--numpy-rows`` rows."""
        if rule not in numpy_times:
            start = time.perf_counter()
            for p in p_rows:
                reference.certificate_np(p, rule)
            elapsed = time.perf_counter() - start
            numpy_times[rule] = elapsed / len(p_rows) * args.batch * 1e3
        return numpy_times[rule]

    rows = []
    for name, group in calls:

        def certify(a, group=group):
            return tuple(c.value for c in jaxcert.certificates(a, group))

        row = {"rule": name, **measure(certify, x, args.repeats)}
        if args.baseline:
            with separate_reductions():  # a new function: jit would reuse certify's trace
                old = measure(lambda a, certify=certify: certify(a), x, args.repeats)
            row.update(old_ms=old["ms"], old_reads=old["reads"])
        row["numpy_ms"] = sum(numpy_ms(rule) for rule in group)
        row.update(x_logsumexp=row["ms"] / floor["ms"], x_log_softmax=row["ms"] / softmax["ms"],
                   speedup_vs_numpy=row["numpy_ms"] / row["ms"])  # fmt: skip
        rows.append(row)
    old = " | before: ms, reads" if args.baseline else ""
    print(f"| rule | ms / batch | x logsumexp | x log_softmax | reads (XLA) | NumPy ms{old} |")
    print("|---|---|---|---|---|---|" + ("---|" if args.baseline else ""))
    for r in rows:
        before = f" | {r['old_ms']:.2f}, {r['old_reads']:.2f}" if args.baseline else ""
        print(f"| {r['rule']} | {r['ms']:.2f} | {r['x_logsumexp']:.2f} | "
              f"{r['x_log_softmax']:.2f} | {r['reads']:.2f} ({r['reads_xla']:.2f}) | "
              f"{r['numpy_ms']:.0f}{before} |")  # fmt: skip
    every = rows[-1]
    print(f"\nall rules together: {every['x_logsumexp']:.2f}x the logsumexp floor (target <= 2)")
    losses = loss_rows(x, args.repeats) if args.losses else []
    for r in losses:
        print(f"{r['rule']}: {r['ms']:.2f} ms, {r['reads']:.2f} reads of one [B, V] array "
              f"({r['reads_xla']:.2f} XLA)")  # fmt: skip
    bandwidth = None
    if args.measure_bandwidth:
        copy = compiled(lambda a: a + 1, x)
        bandwidth = 2 * x.size * x.dtype.itemsize / timed(copy, x, repeats=args.repeats)
        print(f"measured copy bandwidth: {bandwidth / 1e9:,.0f} GB/s (x + 1: one read, one write)")
        for r in [floor, softmax, *rows, *losses]:
            r["of_bandwidth"] = x.size * x.dtype.itemsize / (r["ms"] / 1e3) / bandwidth
        print("one read of the logits at that bandwidth, as a fraction of each program's time: "
              + "; ".join(f"{r.get('rule', name)} {r['of_bandwidth']:.1%}"
                          for name, r in [("logsumexp", floor), ("log_softmax", softmax)]
                          + [("", r) for r in rows + losses]))  # fmt: skip
    kind = jax.devices()[0].device_kind
    peak = args.peak_gbps or next((v for k, v in _PEAK_GBPS.items() if k in kind), None)
    positions = args.batch / (every["ms"] / 1e3)
    print(f"all rules together: {positions:,.0f} positions/s ({args.dtype})")
    if peak:
        bound = peak * 1e9 / (args.vocab * x.dtype.itemsize)
        print(f"memory-bandwidth bound (one read of the logits at {peak:.0f} GB/s): "
              f"{bound:,.0f} positions/s; achieved {positions / bound:.1%} of it")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"floor": floor, "log_softmax": softmax, "batch": args.batch,
                       "vocab": args.vocab, "dtype": args.dtype, "profile": args.profile,
                       "copy_gbps": bandwidth and bandwidth / 1e9, "rows": rows,
                       "losses": losses}, f, indent=2)  # fmt: skip


if __name__ == "__main__":
    main()
