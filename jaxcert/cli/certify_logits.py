"""``jaxcert certify-logits``: certificates of logits or top-K log-probabilities from elsewhere."""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import textwrap
import time

from jaxcert.base.tables import counted
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
  drafter        --drafter-logits FILE: a dense dump of a drafter's logits at the same
                 positions (same shape, same vocabulary), streamed beside INPUT; adds
                 kl, tv, drafter_token, certified_<rule> and accepted_<rule> per position,
                 the drafter's section of summary.md, drafter.csv and kl_vs_certificate.png.
                 Records cannot be paired: a top-K window without token ids does not
                 determine KL(p||q).
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
            "engine. Writes certificates.parquet, summary.md and run.json to --out. With "
            "--drafter-logits, a drafter's dense logits at the same positions are compared "
            "with the target's: KL(p||q), TV, and per rule certified and accepted.",
            width=90,
        ),
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "input",
        type=pathlib.Path,
        help="a .npy/.safetensors dump, or a .jsonl/.json file of records",
    )
    p.add_argument(
        "--rules", type=rules_arg, default=DEFAULT_RULES, help=f"rules (default: {DEFAULT_RULES})"
    )
    p.add_argument(
        "--drafter-logits",
        type=pathlib.Path,
        default=None,
        metavar="FILE",
        help="a drafter's dense logits (.npy/.safetensors) at INPUT's positions, of its shape: "
        "adds KL(p||q), TV, and per rule certified and accepted (INPUT must be dense too)",
    )
    p.add_argument(
        "--tensor", default=None, help="tensor name in a .safetensors dump (and in the drafter's)"
    )
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
    import pyarrow.parquet as pq

    from jaxcert.core.rules import parse_rules
    from jaxcert.pipeline import logits as certify_logits
    from jaxcert.pipeline import report

    rules = parse_rules(args.rules)
    out = args.out
    target = certify_logits.check_output(out, overwrite=args.overwrite)
    started = time.perf_counter()
    dense = args.input.suffix in _DENSE
    if args.drafter_logits is not None:
        _check_drafter_logits(args, dense)  # before anything is certified or written
    notes, extra = _certify_dense(args, rules) if dense else _certify_records(args, rules)
    table = pq.read_table(target)
    text = certify_logits.summary_markdown(
        table, rules, name=args.input.name, dense=dense, notes=notes,
        vocab_given=args.vocab_size is not None,
    )  # fmt: skip
    written = "summary.md and run.json"
    if args.drafter_logits is not None:
        _warn_bad_drafter_rows(table)
        section, extra["drafter_summary"] = report.drafter_report(
            out, table, rules, name=args.drafter_logits.name, plots=True
        )
        text += "\n" + section
        extra["drafter_logits"] = str(args.drafter_logits)
        written = "summary.md, run.json, drafter.csv and kl_vs_certificate.png"
    else:  # an overwritten run's drafter files would describe another drafter
        for name in ("drafter.csv", "kl_vs_certificate.png"):
            (out / name).unlink(missing_ok=True)
    (out / "summary.md").write_text(text)
    meta = {
        "command": " ".join(sys.argv),
        "input": str(args.input),
        "kind": "dense" if dense else "top-logprobs",
        "rules": [r.spec for r in rules],
        "positions": table.num_rows,
        **extra,
        "total_s": round(time.perf_counter() - started, 2),
    }
    (out / "run.json").write_text(json.dumps(meta, indent=2))
    print(text)
    print(f"[jaxcert] wrote {target}, {written} in {meta['total_s']} s",
          file=sys.stderr)  # fmt: skip
    return 0


_DENSE = (".npy", ".safetensors")


def _warn_bad_drafter_rows(table) -> None:
    """The warning line (:func:`warn_undefined_drafter`) naming the positions whose target
    row is a distribution but whose drafter row is not: their ``kl`` is ``nan`` and they
    are neither certified nor accepted there, as for a proposal the target cannot score."""
    import numpy as np

    from jaxcert.cli._common import warn_undefined_drafter
    from jaxcert.pipeline import logits as certify_logits

    kl = table["kl"].to_numpy(zero_copy_only=False)
    valid = table["valid"].to_numpy(zero_copy_only=False) if "valid" in table.column_names else 1
    scored = np.broadcast_to(valid != 0, kl.shape)
    bad = np.flatnonzero(np.isnan(kl) & scored)
    names = [certify_logits.row_name(table, int(i)) for i in bad[:6]]  # row_list shows 5
    warn_undefined_drafter(len(bad), int(scored.sum()), certify_logits.row_list(names))


def _check_drafter_logits(args, dense: bool) -> None:
    """Refuses a ``--drafter-logits`` that cannot be paired with ``INPUT``, from the
    headers alone."""
    from jaxcert.pipeline import logits as certify_logits

    path = args.drafter_logits
    if path.suffix not in _DENSE:
        raise ValueError(
            f"--drafter-logits: {path} is not a dense dump: give a .npy or .safetensors file"
        )
    if not dense:
        raise ValueError(
            "--drafter-logits pairs two dense dumps (.npy or .safetensors): top-K records "
            "carry no full distribution, so they do not determine KL(p||q)"
        )
    try:
        certify_logits.dense_shape(args.drafter_logits, tensor=args.tensor)
    except ValueError as err:
        raise ValueError(f"--drafter-logits: {err}") from None
    certify_logits.check_drafter_dump(args.input, args.drafter_logits, tensor=args.tensor)


def _kept(rows: int, path: pathlib.Path) -> None:
    print(f"[jaxcert] failed; {counted(rows, 'position')} saved in {path}", file=sys.stderr)


def _certify_dense(args, rules) -> tuple[list[str], dict]:
    """Certifies a dense dump into ``--out``, streamed, with a progress bar."""
    from tqdm import tqdm

    from jaxcert.pipeline import logits as certify_logits

    tables = certify_logits.certify_dense_file(
        args.input, rules, drafter=args.drafter_logits, chunk_rows=args.chunk_rows,
        tensor=args.tensor, vocab_size=args.vocab_size,
    )  # fmt: skip
    with tqdm(unit="pos", desc="certify-logits", file=sys.stderr, dynamic_ncols=True) as bar:

        def shown(tables):
            for table in tables:
                yield table
                bar.update(table.num_rows)

        invalid = certify_logits.write_certificates(args.out, shown(tables), kept=_kept)
    if invalid:
        verb = "holds" if len(invalid) == 1 else "hold"
        print(f"[jaxcert] {counted(len(invalid), 'row')} {verb} NaN or +inf logits, or no "
              "finite logit "
              f"(valid = false, certificates nan): {certify_logits.row_list(invalid)}",
              file=sys.stderr)  # fmt: skip
    return certify_logits.summary_notes(invalid=invalid), {}


def _certify_records(args, rules) -> tuple[list[str], dict]:
    """Certifies a file of engine responses into ``--out``."""
    from jaxcert.pipeline import logits as certify_logits

    table, counts = certify_logits.certify_records(
        args.input, rules, vocab_size=args.vocab_size, skip_bad_lines=args.skip_bad_lines
    )
    certify_logits.write_certificates(args.out, [table], kept=_kept)
    return certify_logits.summary_notes(counts=counts), {"records": counts}
