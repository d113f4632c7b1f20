"""``jaxcert certify-logits``: certificates of logits or top-K log-probabilities from elsewhere."""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import sys
import textwrap
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from tqdm import tqdm

from jaxcert.cli import DEFAULT_RULES
from jaxcert.cli._common import rules_arg
from jaxcert.cli.argtypes import positive

__all__ = ["add_parser", "run"]

_EPILOG = """
inputs:
  dense logits   .npy or .safetensors, [N, V] or [B, T, V], float32 / bfloat16 / float16
                 (e.g. torch.stack(generate(..., output_logits=True).logits, 1) saved with
                 safetensors); every certificate is exact; streamed --chunk-rows at a time.
                 A row with NaN / +inf logits (or none finite) gets valid = false and nan.
  records        .jsonl / .json, one response per line: OpenAI chat or completions
                 (vLLM, SGLang, TGI, llama.cpp server), the Responses API, TGI native
                 details.top_tokens, SGLang native meta_info.output_top_logprobs, llama.cpp
                 completion_probabilities (logprob or post_sampling_probs' prob/top_probs).
                 A certificate is exact where the top-K window determines it and nan
                 (determined_<rule> = false) elsewhere; typical needs --vocab-size.
                 Duplicated entries, a sampled token appended below the top N, sentinel
                 (-9999) entries and null positions are handled and counted in summary.md.
                 See docs/certificates.md section 9.
"""


def add_parser(sub) -> None:
    p = sub.add_parser(
        "certify-logits",
        help="certificates of dense logits or engines' top-K log-probabilities",
        description=textwrap.fill(
            "Certify every position of logits computed by another framework or serving "
            "engine. Writes certificates.parquet, summary.md and run.json to --out.",
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
        help="the model's vocabulary size V: records: lets typical be determined; dense: the "
        "last axis must have it (a transposed dump is refused)",
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
    p.add_argument(
        "--skip-bad-lines",
        action="store_true",
        help="records: skip lines that are no JSON (e.g. a truncated last line) and count them "
        "in the summary, instead of refusing the file",
    )
    p.set_defaults(func=run)


def run(args) -> int:
    from jaxcert.core.rules import parse_rules

    rules = parse_rules(args.rules)
    out = args.out
    target = out / "certificates.parquet"
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file, not a folder")
    if target.exists() and not args.overwrite:
        raise ValueError(f"{target} exists; pass --overwrite to replace it or choose another --out")
    started = time.perf_counter()
    dense = args.input.suffix in (".npy", ".safetensors")
    if dense:
        notes, extra = _write(out, _dense_chunks(args, rules)), {}
    else:
        notes, extra = _certify_records(args, rules, out)
    text = _summary(
        pq.read_table(target), rules, args.input.name, dense, notes, args.vocab_size is not None
    )
    (out / "summary.md").write_text(text)
    meta = {
        "command": " ".join(sys.argv),
        "input": str(args.input),
        "kind": "dense" if dense else "top-logprobs",
        "rules": [r.spec for r in rules],
        "positions": pq.read_metadata(target).num_rows,
        **extra,
        "total_s": round(time.perf_counter() - started, 2),
    }
    (out / "run.json").write_text(json.dumps(meta, indent=2))
    print(text)
    print(f"[jaxcert] wrote {target}, summary.md and run.json in {meta['total_s']} s",
          file=sys.stderr)  # fmt: skip
    return 0


def _dense_chunks(args, rules):
    """Certified chunks of a dense dump (tables), streamed."""
    from jaxcert.pipeline import logits as certify_logits

    chunks = certify_logits.iter_dense_file(
        args.input, chunk_rows=args.chunk_rows, tensor=args.tensor, vocab_size=args.vocab_size
    )
    with tqdm(unit="pos", desc="certify-logits", file=sys.stderr, dynamic_ncols=True) as bar:
        for index, logits in chunks:
            yield pa.table({**index, **certify_logits.certify_dense(logits, rules)})
            bar.update(len(logits))


def _certify_records(args, rules, out: pathlib.Path) -> tuple[list[str], dict]:
    from jaxcert.pipeline import logits as certify_logits

    records = certify_logits.read_logprob_records(args.input, skip_bad_lines=args.skip_bad_lines)
    try:
        columns = certify_logits.certify_top_logprobs(
            records.logprobs, rules, vocab_size=args.vocab_size
        )
    except ValueError as err:  # "row N: ..." names a window: name the record's line instead
        found = re.match(r"row (\d+)(.*)", str(err), re.S)
        if found is None:
            raise
        i, index = int(found.group(1)), records.index
        raise ValueError(
            f"{args.input}:{index['record'][i] + 1} (choice {index['choice'][i]}, position "
            f"{index['position'][i]}){found.group(2)}"
        ) from None
    _write(out, [pa.table({**records.index, **columns})])
    counts = records.counts.as_dict()
    notes = [f"{_COUNT_NOTES[k]}: {v}" for k, v in counts.items() if k in _COUNT_NOTES and v]
    return notes, {"records": counts}


_COUNT_NOTES = {
    "missing_positions": "positions without log-probabilities (null or empty lists), skipped",
    "duplicates_removed": "duplicated entries removed",
    "sampled_dropped": "sampled tokens left out of the window (possibly appended below the "
    "true top N)",
    "sentinel_entries": "sentinel entries (logprob <= -9999) left out",
    "bad_lines_skipped": "unreadable lines skipped",
}


def _write(out: pathlib.Path, tables) -> list[str]:
    """Writes the tables into ``out/certificates.parquet`` atomically; on failure keeps
    what was certified in ``certificates.partial.parquet``. Returns notes on invalid rows."""
    target = out / "certificates.parquet"
    partial = out / "certificates.partial.parquet"
    tmp = out / f".certificates.parquet.tmp-{os.getpid()}"
    writer, rows, invalid = None, 0, []
    try:
        for table in tables:
            if writer is None:
                out.mkdir(parents=True, exist_ok=True)
                writer = pq.ParquetWriter(tmp, table.schema)
            writer.write_table(table)
            if "valid" in table.column_names:
                bad = np.flatnonzero(~table["valid"].to_numpy(zero_copy_only=False))
                invalid += [_row_name(table, int(i)) for i in bad]
            rows += table.num_rows
        writer.close()
        os.replace(tmp, target)
        partial.unlink(missing_ok=True)  # an earlier failed run's rows are superseded
    except BaseException:
        if writer is not None:
            writer.close()
            if rows:  # keep what was certified
                os.replace(tmp, partial)
                print(f"[jaxcert] failed; {rows} positions saved in {partial}", file=sys.stderr)
        raise
    if not invalid:
        return []
    shown = ", ".join(invalid[:5]) + (", ..." if len(invalid) > 5 else "")
    print(f"[jaxcert] {len(invalid)} row(s) hold NaN or +inf logits, or no finite logit "
          f"(valid = false, certificates nan): {shown}", file=sys.stderr)  # fmt: skip
    return [f"rows that are no distribution (NaN or +inf logits, or none finite; valid = "
            f"false, certificates nan): {len(invalid)}: {shown}"]  # fmt: skip


def _row_name(table: pa.Table, i: int) -> str:
    if "sequence" in table.column_names:
        return f"(sequence {table['sequence'][i].as_py()}, position {table['position'][i].as_py()})"
    return f"row {table['row'][i].as_py()}"


def _summary(
    table: pa.Table, rules, name: str, dense: bool, notes: list[str], vocab_given: bool
) -> str:
    from jaxcert.pipeline import logits as certify_logits
    from jaxcert.pipeline import report as certify_report

    text = f"## Positions: {table.num_rows} ({name})\n\n"
    if notes:
        text += "".join(f"- {n}\n" for n in notes) + "\n"
    if not dense:
        k = table["k"].to_numpy()
        shares, hints = [], []
        for r in rules:
            det = table[certify_logits.determined_column(r)].to_numpy(zero_copy_only=False)
            shares.append(f"{r.spec} {np.mean(det):.1%}")
            if not det.all():
                hints.append(f"- {r.spec}: {_needed_k(r, vocab_given)}")
        text += f"Determined by the top-K window (share of positions): {', '.join(shares)}\n\n"
        text += f"Entries per position: K = {k.min()} to {k.max()} (median {np.median(k):g}).\n\n"
        if hints:
            text += "Where a certificate is not determined:\n\n" + "\n".join(hints) + "\n\n"
        text += "Statistics over the determined positions:\n\n"
    summary = certify_report.summarize_positions(
        table, [certify_report.rule_column(r) for r in rules]
    )
    return text + certify_report.markdown_table(summary) + "\n"


def _needed_k(rule, vocab_given: bool) -> str:
    """What top-list length determines ``rule`` (``docs/certificates.md`` §9)."""
    if rule.static_upper_size is not None:
        need = rule.static_upper_size + rule.list_size
        return f"needs K >= {need} entries per position (request top_logprobs >= {need})"
    return (
        f"needs the window to reach a token below the rule's threshold and |U| + "
        f"{rule.list_size} tokens: request a longer top_logprobs"
        + (" and pass --vocab-size" if rule.needs_entropy and not vocab_given else "")
    )
