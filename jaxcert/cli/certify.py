"""``jaxcert certify``: exact certificates of every rule at every greedy position of a model."""

from __future__ import annotations

import csv
import json
import pathlib
import sys
import time

from jaxcert._argtypes import non_negative, positive
from jaxcert.cli import DEFAULT_RULES, DEFAULT_TARGET

__all__ = ["add_parser", "run"]


def add_parser(sub) -> None:
    p = sub.add_parser(
        "certify",
        help="exact certificates of every rule at every greedy position of a real model",
        description="Greedy-decode each prompt with the target and record, per position, the "
        "target's top-1 probability, top-10 coverage, margin, entropy and the exact "
        "certificate C_p (nats) of every rule. Writes positions.parquet, summary tables and "
        "plots to --out.",
    )
    p.add_argument(
        "--target",
        default=DEFAULT_TARGET,
        help="asset name, Hugging Face checkpoint folder or .gguf file "
        f"(default: {DEFAULT_TARGET})",
    )
    p.add_argument(
        "--prompts",
        default="mtbench",
        help="'mtbench' or a JSONL file with a 'prompt' or 'turns' field",
    )
    p.add_argument(
        "--rules",
        default=DEFAULT_RULES,
        help=f"comma-separated rules (default: {DEFAULT_RULES}); tree+relaxed is "
        "written tree:4+additive:0.3",
    )
    p.add_argument(
        "--steps",
        type=positive,
        default=128,
        help="greedy continuation length per prompt (default 128)",
    )
    p.add_argument(
        "--max-prompts",
        type=positive,
        default=None,
        help="use only the first N prompts (default: all)",
    )
    p.add_argument(
        "--min-prompt-tokens",
        type=non_negative,
        default=0,
        help="skip prompts shorter than this after the chat template (default 0)",
    )
    p.add_argument("--turn", type=non_negative, default=0, help="turn of multi-turn records")
    p.add_argument("--batch-size", type=positive, default=8, help="prompts decoded together")
    p.add_argument("--no-chat", action="store_true", help="do not apply the chat template")
    p.add_argument("--system-prompt", default=None, help="explicit system message")
    p.add_argument(
        "--ignore-eos",
        action="store_true",
        help="keep recording after the end-of-turn token",
    )
    p.add_argument(
        "--dtype",
        choices=("float32", "bfloat16"),
        default="float32",
        help="model weights and compute dtype (default float32)",
    )
    p.add_argument(
        "--out",
        type=pathlib.Path,
        default=pathlib.Path("jaxcert-out/certify"),
        help="output folder (default jaxcert-out/certify)",
    )
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    p.set_defaults(func=run)


def _write_csv(path: pathlib.Path, rows: list[dict]) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def run(args) -> int:
    import jax.numpy as jnp
    import pyarrow as pa
    import pyarrow.parquet as pq
    from tqdm import tqdm

    from jaxcert import certify, certify_report, models, prompts
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
    print(
        f"[jaxcert] target {lm.path.name}: {lm.config.num_layers} layers, "
        f"V={lm.config.vocab_size}, loaded in {load_s:.1f} s; {len(prompt_set)} prompts, "
        f"rules: {', '.join(r.spec for r in rules)}",
        file=sys.stderr,
    )

    done: list[pa.Table] = []
    bar = tqdm(total=1, unit="step", desc="certify", file=sys.stderr, dynamic_ncols=True)

    def progress(step, total):
        bar.total = total
        bar.n = step
        bar.refresh()

    meta = {
        "command": " ".join(sys.argv),
        "target": str(lm.path),
        "prompts": args.prompts,
        "rules": [r.spec for r in rules],
        "options": vars(options) | {},
        "load_s": round(load_s, 2),
    }
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
            print(
                f"[jaxcert] failed; {sum(t.num_rows for t in done)} positions saved to "
                f"{out / 'positions.partial.parquet'}",
                file=sys.stderr,
            )
        raise
    bar.close()
    pq.write_table(table, out / "positions.parquet")
    rule_cols = [certify.rule_column(r) for r in rules]
    stat_cols = ["top1", f"top{options.top}_coverage", "margin", "entropy"]
    summary = certify_report.summarize_positions(table, stat_cols + rule_cols)
    runs = certify_report.run_lengths(table, rule_cols)
    _write_csv(out / "summary.csv", summary)
    _write_csv(out / "run_lengths.csv", runs)
    text = (
        f"## Positions: {table.num_rows} ({info['prompts_used']} prompts x up to "
        f"{options.steps} greedy steps)\n\n{certify_report.markdown_table(summary)}\n\n"
        f"## Mean certified run length (positions) at uniform KL budget eps\n\n"
        f"{certify_report.markdown_table(runs, digits=2)}\n"
    )
    (out / "summary.md").write_text(text)
    if not args.no_plots:
        certify_report.plot_report(table, rule_cols, out)
    meta.update(info, status="ok", total_s=round(time.perf_counter() - started, 1))
    (out / "run.json").write_text(json.dumps(meta, indent=2, default=str))
    print(text)
    print(
        f"[jaxcert] wrote {out}/positions.parquet, summary.md/.csv, run_lengths.csv"
        f"{'' if args.no_plots else ', certificate_cdf.png, certificate_vs_margin.png'} "
        f"in {meta['total_s']} s",
        file=sys.stderr,
    )
    return 0
