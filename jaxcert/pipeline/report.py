"""Summary tables, certified run lengths and plots of a certification run."""

from __future__ import annotations

import csv
import json
import math
import pathlib
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa

from jaxcert.base.tables import counted, markdown_table
from jaxcert.core import bounds

if TYPE_CHECKING:  # matplotlib is imported by the plotting functions only
    from matplotlib.figure import Figure

__all__ = [
    "rule_column",
    "certified_column",
    "accepted_column",
    "drafter_summary",
    "drafter_markdown",
    "kl_figure",
    "drafter_report",
    "summarize_positions",
    "run_lengths",
    "markdown_table",
    "cdf_range",
    "cdf_figure",
    "margin_figure",
    "plot_report",
    "write_csv",
    "write_report",
]

RUN_BUDGETS = (0.01, 0.05, 0.1, 0.3)


def rule_column(rule) -> str:
    """Column name of a rule's certificate, e.g. ``cert_tree:4`` (also
    ``jaxcert.pipeline.engine.rule_column``)."""
    return f"cert_{rule.spec}"


def certified_column(rule) -> str:
    """Column name of whether a drafter is certified under a rule (``KL(p‖q) < C_p``), e.g.
    ``certified_tree:4``."""
    return f"certified_{rule.spec}"


def accepted_column(rule) -> str:
    """Column name of whether a rule's verifier accepts a drafter's proposal, e.g.
    ``accepted_tree:4``."""
    return f"accepted_{rule.spec}"


def _percentile(values: np.ndarray, q: float) -> float | None:
    """``np.percentile`` where ``+inf`` ranks above everything (two infinite neighbours
    interpolate to ``inf``, not ``nan``); ``values`` hold no NaN. ``None`` without values."""
    if not values.size:
        return None
    with np.errstate(invalid="ignore"):
        out = float(np.percentile(values, q))
    return math.inf if math.isnan(out) else out


def summarize_positions(table: pa.Table, columns: Sequence[str]) -> list[dict]:
    """Mean, median and 5th percentile of each column (the seed paper's section 4 table).

    ``+inf`` values (rule cannot reject) count as larger than everything in the median and
    percentile (so these are ``inf`` when enough values are). A mean with an ``inf`` in it
    says nothing, so ``finite_mean`` is the mean of the finite values alone, beside
    ``inf_share``, the share of infinite ones; it is ``None`` (a blank cell) when no value
    is finite. ``nan`` values (certificates a top-``K`` window does not determine) are left
    out: ``n`` counts the others; with none, every statistic is ``None``. No statistic is
    ever ``nan``.

    Returns:
      One dict per column: ``column, n, finite_mean, median, p5, inf_share``.
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
                "finite_mean": float(finite.mean()) if finite.size else None,
                "median": _percentile(values, 50),
                "p5": _percentile(values, 5),
                "inf_share": float(np.mean(np.isinf(values))) if values.size else None,
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
        row: dict[str, str | float] = {"column": name}
        for e, budget in enumerate(budgets):
            row[f"eps={budget:g}"] = float(runs[e][mask].mean()) if mask.any() else math.nan
        out.append(row)
    return out


def _values(table: pa.Table, name: str) -> np.ndarray:
    return np.asarray(table.column(name).to_numpy(zero_copy_only=False), np.float64)


def _decade_below(x: float) -> float:
    return float(10.0 ** math.floor(math.log10(x)))


def cdf_range(
    values: Sequence[np.ndarray], *, quantile: float = 0.005
) -> tuple[float, float, int] | None:
    """A log x-range for certificate CDFs that one outlier does not stretch.

    The left end is the ``quantile`` (default 0.5%) of the positive finite certificates of
    all rules together, rounded down to a power of ten; the right end the largest of them,
    rounded up to one. Outliers such as a single ``1e-11`` among certificates of ``1e-3``
    and above are left of the range, and counted.

    Args:
      values: one ``[P]`` array of certificates (nats) per rule; ``nan`` is ignored.
      quantile: the share of the positive finite certificates that may fall left.

    Returns:
      ``(low, high, left)``: the range and how many finite certificates (zeros included)
      lie left of ``low``; ``None`` when no certificate is positive and finite.
    """
    pooled = np.concatenate([np.asarray(v, np.float64).ravel() for v in values])
    finite = pooled[np.isfinite(pooled)]
    positive = finite[finite > 0]
    if not positive.size:
        return None
    low = _decade_below(float(np.quantile(positive, quantile)))
    high = float(10.0 ** math.ceil(math.log10(float(positive.max()))))
    return low, max(high, low * 10), int(np.sum(finite < low))


def cdf_figure(table: pa.Table, rule_columns: Sequence[str]) -> Figure:
    """The CDF of each rule's certificates on one log axis (``certificate_cdf.png``).

    The x-range is :func:`cdf_range`'s; the x-axis label says how many certificates lie left
    of it. ``+inf`` certificates (the rule cannot reject) are not drawn: each curve ends
    below 1 by its share of them.

    Args:
      table: one row per position, with the ``rule_columns`` (certificates in nats).
      rule_columns: the ``cert_<rule>`` columns to draw.

    Returns:
      A `matplotlib.figure.Figure` (no pyplot state), one axes.
    """
    from matplotlib.figure import Figure  # no pyplot: no backend or global figure state

    fig = Figure(figsize=(7, 4.5))
    ax = fig.add_subplot()
    columns = {name: _values(table, name) for name in rule_columns}
    for name, v in columns.items():
        v = np.sort(v[~np.isnan(v)])
        ax.step(
            np.where(np.isinf(v), np.nan, v),
            np.arange(1, v.size + 1) / max(v.size, 1),
            where="post",
            label=name.removeprefix("cert_"),
        )
    ax.set_xscale("log")
    label = "certificate C_p (nats, log scale; +inf not drawn)"
    span = cdf_range(list(columns.values()))
    if span is not None:
        low, high, left = span
        ax.set_xlim(low, high)
        finite = sum(int(np.isfinite(v).sum()) for v in columns.values())
        label += f"\n{left} of {finite} finite certificates (all rules) lie left of {low:g}"
    ax.set_xlabel(label)
    ax.set_ylabel("fraction of positions <= x")
    ax.set_title("CDF of exact certificates")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def margin_figure(table: pa.Table, rule_columns: Sequence[str]) -> Figure:
    """Certificate against target margin, one panel per rule (``certificate_vs_margin.png``).

    Small multiples with shared log axes, each with the greedy lower bound ``phi(gamma)``.
    Ties (margin ``gamma = 0``, no place on a log axis) are drawn at the panel's left edge
    with their own marker, and each panel's title counts them: ``"<rule>: <n> ties"``, and on
    a second line ``"<k> not drawn (C = 0 or inf)"`` for the panel's points a log axis
    cannot show (certificates ``<= 0`` or ``+inf``, ties or not). ``nan`` certificates
    (undetermined) are left out.

    Args:
      table: one row per position, with ``margin`` and the ``rule_columns``.
      rule_columns: the ``cert_<rule>`` columns, one panel each.

    Returns:
      A `matplotlib.figure.Figure` with one axes per rule, in order.
    """
    from matplotlib.figure import Figure

    margin = _values(table, "margin")
    positive = margin[margin > 0]
    left = _decade_below(float(positive.min())) / 10 if positive.size else 1e-7
    cols = min(4, max(len(rule_columns), 1))
    rows = math.ceil(len(rule_columns) / cols)
    fig = Figure(figsize=(3.4 * cols, 3.0 * rows + 0.6))
    axes = fig.subplots(rows, cols, sharex=True, sharey=True, squeeze=False).ravel()
    for ax in axes[len(rule_columns) :]:
        ax.remove()
    grid = np.geomspace(max(positive.min(initial=1.0), 1e-6), 1.0, 200)
    bound = np.asarray(bounds.greedy_margin_bounds(grid, 2)[0])
    for ax, name in zip(axes[: len(rule_columns)], rule_columns, strict=True):
        v = _values(table, name)
        known = ~np.isnan(v)
        drawable = known & np.isfinite(v) & (v > 0)
        ties = known & (margin == 0)
        ax.scatter(margin[drawable & ~ties], v[drawable & ~ties], s=3, alpha=0.4)
        ax.scatter(
            np.full(int(np.sum(drawable & ties)), left),
            v[drawable & ties],
            s=12,
            marker="<",
            color="tab:red",
            clip_on=False,
            label="tie (margin 0)",
        )
        ax.plot(grid, bound, "k--", lw=1, label="greedy lower bound phi(gamma)")
        hidden = int(np.sum(known & ~drawable))
        title = f"{name.removeprefix('cert_')}: {int(ties.sum())} ties"
        if hidden:
            title += f"\n{hidden} not drawn (C = 0 or inf)"
        ax.set_title(title, fontsize=9)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.grid(alpha=0.3)
    for i, ax in enumerate(axes[: len(rule_columns)]):
        if i + cols >= len(rule_columns):  # nothing below it: its x tick labels show
            ax.tick_params(labelbottom=True)
    axes[0].set_xlim(left, 1.0)
    axes[0].legend(fontsize=7, markerscale=2)
    fig.supxlabel("target margin gamma = p(x0) - p(runner-up) (ties at the left edge)")
    fig.supylabel("certificate C_p (nats)")
    fig.suptitle("Certificate vs margin")
    fig.tight_layout()
    return fig


def drafter_summary(table: pa.Table, rules: Sequence) -> dict:
    """What a drafter's columns say over all positions (``jaxcert.pipeline.drafter``).

    Args:
      table: one row per position with ``kl``, ``tv`` and each rule's
        ``certified_<rule>`` and ``accepted_<rule>`` columns.
      rules: the rules.

    Returns:
      ``{"positions", "kl_undefined", "mean_kl", "median_kl", "kl_inf_share", "mean_tv",
      "rules"}``: the count of positions where KL is undefined (``nan``: a row that is no
      distribution; they count as neither certified nor accepted), KL in
      nats over the positions where it is defined (``mean_kl`` over the finite values, with
      ``kl_inf_share`` the share of ``+inf``, where ``q`` gives 0 to a token ``p`` does not;
      ``None`` without values), and per rule ``{"rule", "certified", "accepted",
      "certified_rejected"}``: the fractions of positions certified and accepted, and the
      count of positions certified yet rejected (0 but for float32 rounding at
      ``KL = C_p``).
    """
    kl = _values(table, "kl")
    undefined = int(np.isnan(kl).sum())
    kl = kl[~np.isnan(kl)]
    finite = kl[np.isfinite(kl)]
    tv = _values(table, "tv")
    tv = tv[~np.isnan(tv)]
    rows = []
    for rule in rules:
        certified = np.asarray(table.column(certified_column(rule)).to_numpy(), bool)
        accepted = np.asarray(table.column(accepted_column(rule)).to_numpy(), bool)
        n = max(certified.size, 1)
        rows.append(
            {
                "rule": rule.spec,
                "certified": float(certified.sum() / n),
                "accepted": float(accepted.sum() / n),
                "certified_rejected": int(np.sum(certified & ~accepted)),
            }
        )
    return {
        "positions": table.num_rows,
        "kl_undefined": undefined,
        "mean_kl": float(finite.mean()) if finite.size else None,
        "median_kl": _percentile(kl, 50),
        "kl_inf_share": float(np.mean(np.isinf(kl))) if kl.size else None,
        "mean_tv": float(tv.mean()) if tv.size else None,
        "rules": rows,
    }


def drafter_markdown(summary: dict, name: str | None = None) -> str:
    """The drafter's section of ``summary.md`` from :func:`drafter_summary`."""

    def number(v, digits=4):
        return "n/a" if v is None else ("inf" if math.isinf(v) else f"{v:.{digits}f}")

    title = "## Drafter" + (f" {name}" if name else "") + " against the target\n\n"
    text = (
        f"{title}Over {counted(summary['positions'], 'position')}: mean KL(p||q) "
        f"{number(summary['mean_kl'])} nats (median {number(summary['median_kl'])}"
        + (f", {summary['kl_inf_share']:.1%} infinite" if summary["kl_inf_share"] else "")
        + f"), mean TV {number(summary['mean_tv'])}. Certified: KL(p||q) < C_p, so the rule "
        "accepts the drafter's proposal whatever its ties; accepted: the rule's verifier "
        "accepts the drafter's greedy token (for tree:m, one of its top m).\n\n"
    )
    if summary.get("kl_undefined"):
        text += (
            f"At {counted(summary['kl_undefined'], 'position')} a row is no distribution "
            "(NaN or +inf logits, or none finite): KL undefined, neither certified nor "
            "accepted there.\n\n"
        )
    table = [
        {"rule": r["rule"], "certified": f"{r['certified']:.1%}",
         "accepted": f"{r['accepted']:.1%}"}
        for r in summary["rules"]
    ]  # fmt: skip
    text += markdown_table(table) + "\n"
    rejected = [f"{r['rule']} {r['certified_rejected']}" for r in summary["rules"]
                if r["certified_rejected"]]  # fmt: skip
    if rejected:
        text += f"\nCertified yet rejected (float32 rounding at KL = C_p): {', '.join(rejected)}\n"
    return text


def kl_figure(table: pa.Table, rules: Sequence) -> Figure:
    """A drafter's ``KL(p‖q)`` against each rule's ``C_p``, one panel per rule
    (``kl_vs_certificate.png``).

    Log-log scatter with the line ``KL = C_p``: points below it are certified. A point is
    green where the rule accepted the drafter's proposal, red where it rejected it (none is
    red below the line). Values outside the panel's range (``KL = 0``, ``C_p = 0`` or
    ``+inf``) are drawn on its edges; each panel's title gives the rule's certified and
    accepted fractions.

    Args:
      table: one row per position with ``kl`` and each rule's ``cert_<rule>``,
        ``certified_<rule>`` and ``accepted_<rule>`` columns.
      rules: the rules, one panel each.

    Returns:
      A `matplotlib.figure.Figure` (no pyplot state) with one axes per rule, in order.
    """
    from matplotlib.figure import Figure

    kl = _values(table, "kl")
    certs = {r: _values(table, rule_column(r)) for r in rules}
    pooled = np.concatenate([kl, *certs.values()])
    positive = pooled[np.isfinite(pooled) & (pooled > 0)]
    if positive.size:
        low = _decade_below(float(np.quantile(positive, 0.005)))
        high = float(10.0 ** math.ceil(math.log10(float(positive.max()))))
    else:
        low, high = 1e-6, 1.0
    high = max(high, low * 10)
    cols = min(4, max(len(rules), 1))
    rows = math.ceil(len(rules) / cols)
    fig = Figure(figsize=(3.4 * cols, 3.0 * rows + 0.6))
    axes = fig.subplots(rows, cols, sharex=True, sharey=True, squeeze=False).ravel()
    for ax in axes[len(rules) :]:
        ax.remove()
    y = np.clip(kl, low, high)  # nan (no distribution) stays nan: not drawn
    for ax, rule in zip(axes[: len(rules)], rules, strict=True):
        x = np.clip(certs[rule], low, high)
        accepted = np.asarray(table.column(accepted_column(rule)).to_numpy(), bool)
        certified = np.asarray(table.column(certified_column(rule)).to_numpy(), bool)
        for mask, color, label in ((accepted, "tab:green", "accepted"),
                                   (~accepted, "tab:red", "rejected")):  # fmt: skip
            ax.scatter(x[mask], y[mask], s=3, alpha=0.4, color=color, label=label,
                       clip_on=False)  # fmt: skip
        ax.plot([low, high], [low, high], "k--", lw=1, label="KL = C_p")
        ax.set_title(f"{rule.spec}: certified {certified.mean():.0%}, accepted "
                     f"{accepted.mean():.0%}", fontsize=9)  # fmt: skip
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.grid(alpha=0.3)
    for i, ax in enumerate(axes[: len(rules)]):
        if i + cols >= len(rules):  # nothing below it: its x tick labels show
            ax.tick_params(labelbottom=True)
    axes[0].set_xlim(low, high)
    axes[0].set_ylim(low, high)
    axes[0].legend(fontsize=7, markerscale=3)
    fig.supxlabel("certificate C_p (nats; 0 and +inf on the edges)")
    fig.supylabel("KL(p||q) (nats; 0 on the lower edge)")
    fig.suptitle("Drafter KL against the certificate (below the line: certified)")
    fig.tight_layout()
    return fig


def plot_report(table: pa.Table, rule_columns: Sequence[str], out_dir: pathlib.Path) -> list:
    """Writes ``certificate_cdf.png`` (:func:`cdf_figure`) and ``certificate_vs_margin.png``
    (:func:`margin_figure`) to ``out_dir``; returns their paths."""
    out_dir = pathlib.Path(out_dir)
    paths = []
    for figure, name in (
        (cdf_figure, "certificate_cdf.png"),
        (margin_figure, "certificate_vs_margin.png"),
    ):
        paths.append(out_dir / name)
        figure(table, rule_columns).savefig(paths[-1], dpi=120)
    return paths


def write_csv(path: pathlib.Path, rows: list[dict]) -> None:
    """Dict rows as a CSV file (the first row's keys are the header)."""
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def drafter_report(
    out: pathlib.Path, table: pa.Table, rules: Sequence, *, name: str | None, plots: bool
) -> tuple[str, dict]:
    """The drafter's part of a report in ``out``: ``drafter.csv`` (one row per rule of
    :func:`drafter_summary`) and, with ``plots``, ``kl_vs_certificate.png``
    (:func:`kl_figure`). Returns ``(markdown, summary)``
    (:func:`drafter_markdown`, :func:`drafter_summary`)."""
    out = pathlib.Path(out)
    summary = drafter_summary(table, rules)
    write_csv(out / "drafter.csv", summary["rules"])
    if plots:
        kl_figure(table, rules).savefig(out / "kl_vs_certificate.png", dpi=120)
    return drafter_markdown(summary, name), summary


def write_report(
    out: pathlib.Path,
    info: dict,
    meta: dict,
    rules,
    options,
    *,
    started: float,
    plots: bool,
    drafter: str | None = None,
) -> str:
    """The report of a finished certify run in ``out``, from its dataset.

    Writes ``summary.md`` (returned), ``summary.csv`` (:func:`summarize_positions`),
    ``run_lengths.csv`` (:func:`run_lengths`), with ``plots`` ``certificate_cdf.png`` and
    ``certificate_vs_margin.png`` (:func:`plot_report`), and ``run.json``: ``meta``
    updated with ``info``, ``status``, ``total_s`` (since ``started``, a
    ``time.perf_counter()``), ``positions_this_run`` and ``positions`` (the whole dataset,
    resumed prompts included). A run with a ``drafter`` also gets ``kl`` and ``tv`` in
    ``summary.csv``, a drafter section in ``summary.md``, ``drafter.csv`` and
    ``kl_vs_certificate.png`` (:func:`drafter_report`), and its :func:`drafter_summary`
    under ``"drafter_summary"`` in ``run.json``.

    Args:
      out: the run's folder (holding ``positions.parquet/``).
      info: the run's counts and timings (``Certifier.info``, merged over processes).
      meta: what run.json records besides (command line, target, options, ...).
      rules: the run's rules; options: its ``CertifyOptions``.
      drafter: the drafter's name, when the run has one (its columns are read).
    """
    from jaxcert.pipeline.store import read_positions

    out = pathlib.Path(out)
    rule_cols = [rule_column(r) for r in rules]
    stat_cols = ["top1", f"top{options.top}_coverage", "margin", "entropy"]
    drafter_cols = []
    if drafter is not None:
        drafter_cols = ["kl", "tv", *map(certified_column, rules), *map(accepted_column, rules)]
    # Only the numeric columns the summaries need (the rows stay on disk otherwise).
    table = read_positions(out, [*stat_cols, *rule_cols, *drafter_cols])
    summary = summarize_positions(table, stat_cols + rule_cols + drafter_cols[:2])
    runs = run_lengths(table, rule_cols)
    write_csv(out / "summary.csv", summary)
    write_csv(out / "run_lengths.csv", runs)
    text = (
        f"## Positions: {table.num_rows} ({counted(info['prompts_used'], 'prompt')} x up to "
        f"{counted(options.steps, 'greedy step')})\n\n"
        f"{markdown_table(summary, blank_none=True)}\n\n"
        f"## Mean certified run length (positions) at uniform KL budget eps\n\n"
        f"{markdown_table(runs, digits=2)}\n"
    )
    if drafter is not None:
        section, meta["drafter_summary"] = drafter_report(
            out, table, rules, name=drafter, plots=plots
        )
        text += "\n" + section
    (out / "summary.md").write_text(text)
    if plots:
        plot_report(table, rule_cols, out)
    meta.update(info, status="ok", total_s=round(time.perf_counter() - started, 1))
    meta["positions_this_run"] = info.get("positions", 0)
    meta["positions"] = table.num_rows  # the whole dataset, resumed prompts included
    (out / "run.json").write_text(json.dumps(meta, indent=2, default=str))
    return text
