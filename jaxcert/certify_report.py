"""Summary tables, certified run lengths and plots of a certification run."""

from __future__ import annotations

import math
import pathlib
from collections.abc import Sequence

import numpy as np
import pyarrow as pa

from jaxcert import bounds

__all__ = ["rule_column", "summarize_positions", "run_lengths", "markdown_table", "plot_report"]

RUN_BUDGETS = (0.01, 0.05, 0.1, 0.3)


def rule_column(rule) -> str:
    """Column name of a rule's certificate, e.g. ``cert_tree:4`` (also
    ``jaxcert.certify.rule_column``)."""
    return f"cert_{rule.spec}"


def _percentile(values: np.ndarray, q: float) -> float:
    """``np.percentile`` where ``+inf`` ranks above everything (two infinite neighbours
    interpolate to ``inf``, not ``nan``); ``values`` hold no NaN."""
    if not values.size:
        return math.nan
    with np.errstate(invalid="ignore"):
        out = float(np.percentile(values, q))
    return math.inf if math.isnan(out) else out


def summarize_positions(table: pa.Table, columns: Sequence[str]) -> list[dict]:
    """Mean, median and 5th percentile of each column (the seed paper's section 4 table).

    ``+inf`` values (rule cannot reject) count as larger than everything in the median and
    percentile; the mean is over finite values, and ``inf_share`` reports how many were
    infinite. ``nan`` values (certificates a top-``K`` window does not determine) are left
    out: ``n`` counts the others.

    Returns:
      One dict per column: ``column, n, mean, median, p5, inf_share``.
    """
    rows = []
    for name in columns:
        values = np.asarray(table.column(name).to_numpy(zero_copy_only=False), np.float64)
        values = values[~np.isnan(values)]
        finite = values[np.isfinite(values)]
        rows.append(
            {
                "column": name,
                "n": int(values.size),
                "mean": float(finite.mean()) if finite.size else math.nan,
                "median": _percentile(values, 50),
                "p5": _percentile(values, 5),
                "inf_share": float(np.mean(np.isinf(values))) if values.size else math.nan,
            }
        )
    return rows


def run_lengths(
    table: pa.Table, columns: Sequence[str], budgets: Sequence[float] = RUN_BUDGETS
) -> list[dict]:
    """Mean certified run length from each position, for uniform KL budgets ``eps``.

    A run is the number of consecutive positions (within one prompt's continuation)
    whose certificate exceeds ``eps`` (:func:`jaxcert.certified_run_length`). Prompts are
    told apart by ``prompt_index`` when the table has it (else ``prompt_id``); rows must be
    in prompt, then position order.
    """
    if "prompt_index" in table.column_names:
        prompt = table.column("prompt_index").to_numpy()
    else:
        prompt = np.asarray(table.column("prompt_id").to_pylist(), dtype=object)
    position = table.column("position").to_numpy()
    starts = np.r_[True, (prompt[1:] != prompt[:-1]) | (np.diff(position) != 1)]
    segment = np.cumsum(starts) - 1  # consecutive positions of one prompt
    offset = np.arange(len(prompt)) - np.flatnonzero(starts)[segment]
    shape = (
        len(budgets),
        int(segment.max()) + 1 if len(prompt) else 0,
        int(offset.max(initial=0)) + 1,
    )
    mask = np.zeros(shape[1:], bool)
    mask[segment, offset] = True
    eps = np.asarray(budgets, np.float64)[:, None, None]
    out = []
    for name in columns:
        values = np.zeros(shape, np.float64)
        values[:, segment, offset] = table.column(name).to_numpy(zero_copy_only=False)
        runs = np.asarray(bounds.certified_run_length(values, eps, where=mask[None]))  # [E, P, T]
        row = {"column": name}
        for e, budget in enumerate(budgets):
            row[f"eps={budget:g}"] = float(runs[e][mask].mean()) if mask.any() else math.nan
        out.append(row)
    return out


def markdown_table(rows: Sequence[dict], digits: int = 3) -> str:
    """Renders dict rows as a GitHub markdown table."""
    if not rows:
        return ""
    keys = list(rows[0])

    def cell(v):
        if isinstance(v, float):
            return "inf" if math.isinf(v) else f"{v:.{digits}f}"
        return str(v)

    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(cell(r[k]) for k in keys) + " |" for r in rows]
    return "\n".join(lines)


def plot_report(table: pa.Table, rule_columns: Sequence[str], out_dir: pathlib.Path) -> list:
    """Writes ``certificate_cdf.png`` and ``certificate_vs_margin.png``; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir = pathlib.Path(out_dir)
    margin = table.column("margin").to_numpy()
    paths = []

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name in rule_columns:
        v = np.sort(np.asarray(table.column(name).to_numpy(zero_copy_only=False), np.float64))
        ax.step(
            np.where(np.isinf(v), np.nan, v),
            np.arange(1, v.size + 1) / v.size,
            where="post",
            label=name.removeprefix("cert_"),
        )
    ax.set_xscale("log")
    ax.set_xlabel("certificate C_p (nats, log scale; +inf not drawn)")
    ax.set_ylabel("fraction of positions <= x")
    ax.set_title("CDF of exact certificates")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    paths.append(out_dir / "certificate_cdf.png")
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name in rule_columns:
        v = np.asarray(table.column(name).to_numpy(zero_copy_only=False), np.float64)
        ax.scatter(margin, v, s=3, alpha=0.4, label=name.removeprefix("cert_"))
    grid = np.geomspace(max(float(np.min(margin[margin > 0], initial=1e-6)), 1e-6), 1.0, 200)
    ax.plot(
        grid,
        np.asarray(bounds.greedy_margin_bounds(grid, 2)[0]),
        "k--",
        lw=1,
        label="greedy lower bound phi(gamma)",
    )
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("target margin gamma = p(x0) - p(runner-up)")
    ax.set_ylabel("certificate C_p (nats)")
    ax.set_title("Certificate vs margin")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, markerscale=3)
    fig.tight_layout()
    paths.append(out_dir / "certificate_vs_margin.png")
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)
    return paths
