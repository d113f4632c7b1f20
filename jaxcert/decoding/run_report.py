"""Host-side tables and summaries of decoding runs (numpy / pyarrow, no device work).

The ``jaxcert decode`` report: :func:`summarize_runs` merges the batches of a run and
summarizes them, :func:`markdown_summary` renders that summary, :func:`write_tables` and
:func:`write_outputs` write ``rounds.parquet``, ``nodes.parquet`` and ``outputs.jsonl``;
:func:`check_output` and :func:`remove_outputs` guard the output folder (``--overwrite``).

Shapes are ``jaxcert.decoding``'s: ``R`` rounds, ``B`` batch rows, ``N`` drafted nodes.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from jaxcert.base.folders import check_writable
from jaxcert.base.tables import markdown_table
from jaxcert.decoding.state import RoundStats

__all__ = [
    "OUTPUT_FILES",
    "check_output",
    "remove_outputs",
    "round_table",
    "node_table",
    "summarize_run",
    "summarize_runs",
    "acceptance_by_depth",
    "bootstrap_speedup",
    "pad_batch",
    "markdown_summary",
    "write_tables",
    "write_outputs",
]


#: The files a decode run writes into its output folder (what ``--overwrite`` replaces).
OUTPUT_FILES = ("summary.json", "rounds.parquet", "nodes.parquet", "outputs.jsonl")


def check_output(out: str | os.PathLike, *, overwrite: bool) -> bool:
    """Checks that the folder ``out`` may receive a decode run, before anything is loaded.

    Args:
      out: the output folder (it need not exist).
      overwrite: a previous run in ``out`` may be replaced (``--overwrite``).

    Returns:
      Whether ``out`` already holds a run (any of :data:`OUTPUT_FILES`); with
      ``overwrite``, call :func:`remove_outputs` before writing the new one.

    Raises:
      ValueError: ``out`` is a file; the nearest existing folder of ``out`` is not writable;
        one of :data:`OUTPUT_FILES` is a folder; ``out`` holds a run and not ``overwrite``.
    """
    out = pathlib.Path(out)
    check_writable(out, "--out")
    held = [name for name in OUTPUT_FILES if (out / name).exists()]
    for name in held:
        if (out / name).is_dir():
            raise ValueError(f"{out / name} is a folder, not a decode output; move it away")
    if held and not overwrite:
        raise ValueError(
            f"{out} already holds a decode run ({', '.join(held)}); pass --overwrite to "
            "replace it (or choose another --out)"
        )
    return bool(held)


def remove_outputs(out: str | os.PathLike) -> None:
    """Removes a previous run's :data:`OUTPUT_FILES` from ``out``; other files stay."""
    for name in OUTPUT_FILES:
        (pathlib.Path(out) / name).unlink(missing_ok=True)


def round_table(stats: RoundStats, prompt_ids: Sequence[str], *, start_round: int = 0) -> pa.Table:
    """One row per (round, batch row) that took part: drafted, depth, accepted, emitted."""
    r, b = np.nonzero(stats.active)
    return pa.table(
        {
            "prompt_id": [prompt_ids[int(i)] for i in b],
            "round": (r + start_round).astype(np.int32),
            "drafted": stats.drafted[r, b],
            "depth": stats.depth[r, b],
            "accepted": stats.accepted[r, b],
            "emitted": stats.emitted[r, b],
        }
    )


def node_table(stats: RoundStats, prompt_ids: Sequence[str], *, start_round: int = 0) -> pa.Table:
    """One row per drafted node: its depth, rank, verdicts, KL, certificates and entropy."""
    ns = stats.nodes
    r, b, i = np.nonzero(ns.valid)
    kl, cert = ns.kl[r, b, i], ns.cert[r, b, i]
    return pa.table(
        {
            "prompt_id": [prompt_ids[int(x)] for x in b],
            "round": (r + start_round).astype(np.int32),
            "node": i.astype(np.int32),
            "depth": ns.depth[r, b, i],
            "rank": ns.rank[r, b, i],
            "passes": ns.passes[r, b, i],
            "accepted": ns.accepted[r, b, i],
            "reached": ns.reached[r, b, i],
            "kl": kl,
            "cert": cert,
            "certified": kl < cert,
            "cert_list": ns.cert_list[r, b, i],
            "covered": ns.covered[r, b, i],
            "entropy": ns.entropy[r, b, i],
            "q_top": ns.q_top[r, b, i],
            "q_cert": ns.q_cert[r, b, i],
        }
    )


def acceptance_by_depth(stats: RoundStats, max_depth: int = 8) -> list[float]:
    """Per-position acceptance rate: P(depth-``d`` draft accepted | it was tested).

    Depth ``d`` was tested in a round when ``d`` tokens were drafted and at least ``d`` were
    emitted or the round stopped by rejecting depth ``d``: ``depth >= d`` and
    ``emitted >= d``. After an end token (or at the budget) the later depths were never
    tested and do not count. For trees a depth is accepted when the accepted path reaches
    it. ``nan`` where no round tested depth ``d``.
    """
    active = stats.active
    drafted, accepted = stats.depth[active], stats.accepted[active]
    emitted = stats.emitted[active]
    rates = []
    for d in range(1, max_depth + 1):
        tested = (drafted >= d) & (emitted >= d)
        rates.append(float(np.mean(accepted[tested] >= d)) if tested.any() else float("nan"))
    return rates


def summarize_run(stats: RoundStats | None, num_tokens: int, decode_s: float) -> dict:
    """Throughput and acceptance summary of one run (``stats=None``: target-only).

    ``stats`` holds numpy ``[R, B]`` round fields and ``[R, B, N]`` node fields.
    """
    out: dict[str, Any] = {"tokens": int(num_tokens), "decode_s": round(decode_s, 3)}
    out["tokens_per_s"] = round(num_tokens / decode_s, 3) if decode_s > 0 else float("nan")
    if stats is None or not np.any(stats.active):
        return out
    a = stats.active
    ns = stats.nodes
    valid = ns.valid
    first = valid & (ns.rank == 0)
    with np.errstate(invalid="ignore"):
        certified = ns.kl < ns.cert
    out |= {
        "rounds": int(a.sum()),
        "mean_drafted": round(float(stats.drafted[a].mean()), 3),
        "mean_depth": round(float(stats.depth[a].mean()), 3),
        "mean_accepted": round(float(stats.accepted[a].mean()), 3),
        "tokens_per_round": round(float(stats.emitted[a].mean()), 3),
        "acceptance_rate": round(
            int(stats.accepted[a].sum()) / max(int(stats.depth[a].sum()), 1), 4
        ),
        "acceptance_by_depth": [  # None where no round drafted that deep (JSON has no NaN)
            None if np.isnan(x) else round(x, 4) for x in acceptance_by_depth(stats)
        ],
        # None where no drafted node has one (a one-hot drafter: n-gram lookup).
        "mean_kl": _finite_mean(ns.kl[first]),
        "mean_drafter_entropy": _finite_mean(ns.entropy[first]),
    }
    if not np.all(np.isnan(ns.cert[valid])):
        rejected = first & ~ns.passes
        out |= {
            "certified_fraction": round(float(np.mean(certified[first])), 4),
            "certified_then_rejected": int(np.sum(certified & rejected)),
        }
    return out


def _finite_mean(values) -> float | None:
    """The mean of ``values`` rounded to 4 digits, ``None`` when it has no finite value."""
    x = np.asarray(values, np.float64)
    x = x[np.isfinite(x)]
    return round(float(np.mean(x)), 4) if x.size else None


def pad_batch(stats: RoundStats, batch: int) -> RoundStats:
    """Pads numpy stats ``[R, B, ...]`` to ``[R, batch, ...]`` along the batch axis.

    Floating fields are padded with ``nan``, the others with 0 (``active`` and ``valid``
    with ``False``), so batches of different sizes concatenate over rounds.
    """

    def pad(x):
        extra = [(0, 0)] * x.ndim
        extra[1] = (0, batch - x.shape[1])
        fill = np.nan if np.issubdtype(x.dtype, np.floating) else 0
        return np.pad(x, extra, constant_values=fill)

    return jax.tree.map(pad, stats)


MIN_UNITS = 3  # fewer paired units than this: no interval, the run says it is too short


def bootstrap_speedup(
    base_tokens, base_s, new_tokens, new_s, *, samples: int = 4000, seed: int = 0
) -> tuple[float, float, float]:
    """Speedup (ratio of tokens/s) with a 95% bootstrap interval over paired units.

    Each unit (a prompt, or a batch of prompts decoded together) was run both ways; the
    units are resampled with replacement and the ratio of *total* throughputs recomputed,
    so long and short prompts weigh by their tokens and seconds, as in the point estimate.

    Args:
      base_tokens, base_s: ``[units]`` tokens and decode seconds of the baseline per unit.
      new_tokens, new_s: ``[units]`` the same for the method measured.
      samples: bootstrap resamples.
      seed: of the resampling.

    Returns:
      ``(speedup, low, high)``; ``low = high = nan`` with fewer than 2 units.
    """
    bt, bs, nt, ns = (np.asarray(x, np.float64) for x in (base_tokens, base_s, new_tokens, new_s))
    speedup = float((nt.sum() / ns.sum()) / (bt.sum() / bs.sum()))
    if bt.size < 2:
        return speedup, float("nan"), float("nan")
    idx = np.random.default_rng(seed).integers(0, bt.size, (samples, bt.size))
    ratios = (nt[idx].sum(1) / ns[idx].sum(1)) / (bt[idx].sum(1) / bs[idx].sum(1))
    low, high = np.percentile(ratios, [2.5, 97.5])
    return speedup, float(low), float(high)


def summarize_runs(runs: Mapping[str, Sequence]) -> dict:
    """Summary of ``jaxcert decode``: the speculative run, the target-only run and both.

    Args:
      runs: ``{"speculative": [...], "target": [...]}``, one ``DecodeOutput`` per batch
        (``target`` empty without the target-only run). The speculative batches' numpy stats
        ``[R_i, B_i, ...]`` are padded to the largest ``B`` and concatenated over rounds.

    Returns:
      ``{"speculative": summarize_run(...) | {"compile_s"}}``, plus, with a target-only run,
      ``"target_only"`` (its :func:`summarize_run`), ``"speedup"`` (the ratio of tokens/s),
      ``"speedup_ci95"`` (a bootstrap interval over the batches, with at least
      :data:`MIN_UNITS` of them; else ``None``), ``"speedup_note"`` (why no interval) and
      ``"identical_outputs"`` (``"same/rows"``). Compilation and prefill are excluded from
      every time.
    """

    def total(name, attr):
        return sum(getattr(r, attr) for r in runs[name])

    spec = runs["speculative"]
    stats = [r.stats for r in spec]
    merged: RoundStats | None = None
    if stats:
        batch = max(s.active.shape[1] for s in stats)
        merged = jax.tree.map(
            lambda *xs: np.concatenate(xs, axis=0) if xs[0].ndim else xs[0],
            *[pad_batch(s, batch) for s in stats],
        )
    out: dict[str, Any] = {
        "speculative": summarize_run(
            merged, total("speculative", "num_tokens"), total("speculative", "decode_s")
        )
    }
    out["speculative"]["compile_s"] = round(total("speculative", "compile_s"), 1)
    if runs["target"]:
        base = summarize_run(None, total("target", "num_tokens"), total("target", "decode_s"))
        out["target_only"] = base
        out["speedup"] = round(out["speculative"]["tokens_per_s"] / base["tokens_per_s"], 3)
        units = len(spec)
        out["speedup_ci95"] = None
        out["speedup_batches"] = units
        if units >= MIN_UNITS:
            _, low, high = bootstrap_speedup(
                [r.num_tokens for r in runs["target"]], [r.decode_s for r in runs["target"]],
                [r.num_tokens for r in spec], [r.decode_s for r in spec],
            )  # fmt: skip
            out["speedup_ci95"] = [round(low, 3), round(high, 3)]
        else:
            out["speedup_note"] = (
                f"{units} batch(es): too few to measure the noise of a speedup (one short "
                f"prompt can be off by 2x); decode at least {MIN_UNITS} batches (more prompts, "
                "or a smaller --batch-size) for an interval"
            )
        pairs = [
            (a, b)
            for s, t in zip(spec, runs["target"], strict=True)
            for a, b in zip(s.tokens, t.tokens, strict=True)
        ]
        same = sum(len(a) == len(b) and bool((a == b).all()) for a, b in pairs)
        out["identical_outputs"] = f"{same}/{len(pairs)}"
    return out


def _rate(x) -> str:
    """An acceptance rate with 3 decimals; ``n/a`` for a depth no round tested."""
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.3f}"


_SUMMARY_COLUMNS = (
    "run", "tokens", "tokens/s", "speedup", "accepted/round", "tokens/round", "acceptance",
    "certified",
)  # fmt: skip


def _summary_row(*cells) -> dict[str, str | None]:
    """A row of the summary table; every value as ``str`` (``None``: a blank cell)."""
    return {k: None if v is None else f"{v}" for k, v in zip(_SUMMARY_COLUMNS, cells, strict=True)}


def markdown_summary(summary: dict) -> str:
    """A markdown table of a :func:`summarize_runs` summary, then acceptance by position.

    Args:
      summary: a :func:`summarize_runs` summary; with ``compile_s`` (seconds) and
        ``programs_compiled`` at its top level (``jaxcert decode``'s ``summary.json``),
        a line gives the compile time too.

    Returns:
      The table, then one line each: acceptance by position (``n/a`` where no round tested
      that depth), compile time and programs, identical outputs, the speedup's interval.
    """
    s = summary["speculative"]
    rows = []
    if "target_only" in summary:
        b = summary["target_only"]
        rows.append(
            _summary_row(
                "target only", b["tokens"], f"{b['tokens_per_s']:.2f}", "1.00", *[None] * 4
            )
        )
    rows.append(
        _summary_row(
            "speculative",
            s["tokens"],
            f"{s['tokens_per_s']:.2f}",
            f"{summary.get('speedup', float('nan')):.2f}",
            s.get("mean_accepted", float("nan")),
            s.get("tokens_per_round", ""),
            s.get("acceptance_rate", ""),
            s.get("certified_fraction", ""),
        )
    )
    text = markdown_table(rows, blank_none=True)
    if "acceptance_by_depth" in s:
        rates = s["acceptance_by_depth"]
        text += (
            f"\n\nacceptance by position (depth 1-{len(rates)}; n/a = never tested): "
            + " ".join(_rate(x) for x in rates)
        )
    if "programs_compiled" in summary:
        n = summary["programs_compiled"]
        text += (
            f"\ncompiled {n} program{'' if n == 1 else 's'} in {summary['compile_s']:.1f} s "
            "(excluded from tokens/s)"
        )
    if "identical_outputs" in summary:
        text += f"\noutputs identical to target-only: {summary['identical_outputs']}"
    if summary.get("speedup_ci95"):
        low, high = summary["speedup_ci95"]
        text += (
            f"\nspeedup {summary['speedup']:.2f}, 95% interval [{low:.2f}, {high:.2f}] over "
            f"{summary['speedup_batches']} batches (bootstrap; compile and prefill excluded)"
        )
    elif "speedup_note" in summary:
        text += f"\nspeedup {summary['speedup']:.2f}: {summary['speedup_note']}"
    return text


def write_tables(
    out_dir: pathlib.Path, runs: Sequence, prompt_ids: Sequence[str], batch_size: int
) -> None:
    """Writes ``rounds.parquet`` and ``nodes.parquet`` of the speculative ``runs``.

    Args:
      out_dir: the output folder.
      runs: one ``DecodeOutput`` per batch, in order, with numpy stats ``[R_i, B_i, ...]``.
      prompt_ids: ``[P]`` the prompts' ids, batch ``i`` holding
        ``prompt_ids[i * batch_size : (i + 1) * batch_size]``.
      batch_size: prompts per batch.

    Rounds are numbered consecutively over the batches.
    """
    tables: dict[str, list[pa.Table]] = {"rounds": [], "nodes": []}
    offset = 0
    for i, run in enumerate(runs):
        batch_ids = prompt_ids[i * batch_size : (i + 1) * batch_size]
        tables["rounds"].append(round_table(run.stats, batch_ids, start_round=offset))
        tables["nodes"].append(node_table(run.stats, batch_ids, start_round=offset))
        offset += len(run.stats.active)
    for name, parts in tables.items():
        pq.write_table(pa.concat_tables(parts), pathlib.Path(out_dir) / f"{name}.parquet")


def write_outputs(
    path: pathlib.Path,
    runs: Mapping[str, Sequence],
    prompt_ids: Sequence[str],
    decode: Callable[[np.ndarray], str],
) -> None:
    """Writes ``outputs.jsonl``: per prompt, the decoded speculative (and target-only) text.

    Args:
      path: the file to write.
      runs: as for :func:`summarize_runs`; each batch's ``tokens`` is one ``[T_b]`` array
        of output ids per row.
      prompt_ids: ``[P]`` the prompts' ids, in the order of the batches' rows.
      decode: token ids -> text (the tokenizer's ``decode``).

    Each line: ``prompt_id``, ``speculative`` and, with a target-only run, ``target_only``
    and ``identical`` (the token ids agree).
    """
    with open(path, "w", encoding="utf-8") as f:
        spec = [t for r in runs["speculative"] for t in r.tokens]
        base = [t for r in runs["target"] for t in r.tokens] or [None] * len(spec)
        for pid, s_tok, b_tok in zip(prompt_ids, spec, base, strict=True):
            record: dict[str, str | bool] = {"prompt_id": pid, "speculative": decode(s_tok)}
            if b_tok is not None:
                record["target_only"] = decode(b_tok)
                record["identical"] = bool(len(s_tok) == len(b_tok) and (s_tok == b_tok).all())
            f.write(json.dumps(record) + "\n")
