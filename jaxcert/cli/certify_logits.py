"""``jaxcert certify-logits``: certificates of logits or top-K log-probabilities from elsewhere."""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import textwrap
import time

from jaxcert._argtypes import positive
from jaxcert.cli import DEFAULT_RULES
from jaxcert.cli._common import rules_arg

__all__ = ["add_parser", "run"]

_EPILOG = """
inputs:
  dense logits   .npy or .safetensors, [N, V] or [B, T, V], float32 / bfloat16 / float16
                 (e.g. torch.stack(generate(..., output_logits=True).logits, 1) saved with
                 safetensors); every certificate is exact; streamed --chunk-rows at a time.
  records        .jsonl / .json: OpenAI-compatible responses with logprobs (vLLM, SGLang,
                 TGI, llama.cpp server: choices[].logprobs.content[].top_logprobs[].logprob),
                 completions-style top_logprobs, TGI details.top_tokens or llama.cpp
                 completion_probabilities. A certificate is exact where the top-K window
                 determines it and nan (determined_<rule> = false) elsewhere; typical needs
                 --vocab-size. See the README's "Certificates of logits from elsewhere".
"""


def add_parser(sub) -> None:
    p = sub.add_parser(
        "certify-logits",
        help="certificates of dense logits or engines' top-K log-probabilities",
        description=textwrap.fill(
            "Certify every position of logits computed by another framework or serving "
            "engine. Writes certificates.parquet and summary.md to --out.",
            width=90,
        ),
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("input", type=pathlib.Path, help="a .npy/.safetensors dump or a .jsonl file")
    p.add_argument(
        "--rules", type=rules_arg, default=DEFAULT_RULES, help=f"rules (default: {DEFAULT_RULES})"
    )
    p.add_argument("--tensor", default=None, help="tensor name in a .safetensors dump")
    p.add_argument(
        "--vocab-size",
        type=positive,
        default=None,
        help="the model's vocabulary size V (records only; lets typical be determined)",
    )
    p.add_argument(
        "--chunk-rows", type=positive, default=64, help="dense rows per step (default 64)"
    )
    p.add_argument(
        "--out",
        type=pathlib.Path,
        default=pathlib.Path("jaxcert-out/certify-logits"),
        help="output folder (default jaxcert-out/certify-logits)",
    )
    p.add_argument("--overwrite", action="store_true", help="replace an existing output")
    p.set_defaults(func=run)


def run(args) -> int:
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq
    from tqdm import tqdm

    from jaxcert import certify_logits, certify_report
    from jaxcert.rules import parse_rules

    rules = parse_rules(args.rules)
    out = args.out
    target = out / "certificates.parquet"
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file, not a folder")
    if target.exists() and not args.overwrite:
        raise ValueError(f"{target} exists; pass --overwrite to replace it or choose another --out")
    started = time.perf_counter()
    rule_cols = [certify_report.rule_column(r) for r in rules]
    dense = args.input.suffix in (".npy", ".safetensors")
    tmp = out / f".certificates.parquet.tmp-{os.getpid()}"
    writer = None
    rows = 0
    try:
        if dense:
            chunks = certify_logits.iter_dense_file(
                args.input, chunk_rows=args.chunk_rows, tensor=args.tensor
            )
            bar = tqdm(unit="pos", desc="certify-logits", file=sys.stderr, dynamic_ncols=True)
            for index, logits in chunks:
                columns = certify_logits.certify_dense(logits, rules, first_row=rows)
                chunk = pa.table({**index, **columns})
                if writer is None:
                    out.mkdir(parents=True, exist_ok=True)
                    writer = pq.ParquetWriter(tmp, chunk.schema)
                writer.write_table(chunk)
                rows += chunk.num_rows
                bar.update(chunk.num_rows)
            bar.close()
        else:
            index, logprobs = certify_logits.read_logprob_records(args.input)
            columns = certify_logits.certify_top_logprobs(
                logprobs, rules, vocab_size=args.vocab_size
            )
            chunk = pa.table({**index, **columns})
            out.mkdir(parents=True, exist_ok=True)
            writer = pq.ParquetWriter(tmp, chunk.schema)
            writer.write_table(chunk)
            rows = chunk.num_rows
        writer.close()
        os.replace(tmp, target)
    except BaseException:
        if writer is not None:
            writer.close()
            if rows:  # keep what was certified
                kept = out / "certificates.partial.parquet"
                os.replace(tmp, kept)
                print(f"[jaxcert] failed; {rows} positions saved in {kept}", file=sys.stderr)
        raise
    table = pq.read_table(target)
    summary = certify_report.summarize_positions(table, rule_cols)
    text = f"## Positions: {table.num_rows} ({args.input.name})\n\n"
    if not dense:
        shares = [
            f"{r.spec} {np.mean(table[certify_logits.determined_column(r)].to_numpy()):.1%}"
            for r in rules
        ]
        text += f"Determined by the top-K window (share of positions): {', '.join(shares)}\n\n"
        text += "Statistics over the determined positions:\n\n"
    text += certify_report.markdown_table(summary) + "\n"
    (out / "summary.md").write_text(text)
    meta = {
        "command": " ".join(sys.argv),
        "input": str(args.input),
        "kind": "dense" if dense else "top-logprobs",
        "rules": [r.spec for r in rules],
        "positions": table.num_rows,
        "total_s": round(time.perf_counter() - started, 2),
    }
    (out / "run.json").write_text(json.dumps(meta, indent=2))
    print(text)
    print(f"[jaxcert] wrote {target} and summary.md in {meta['total_s']} s", file=sys.stderr)
    return 0
