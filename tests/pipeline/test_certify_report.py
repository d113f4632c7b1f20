"""The plots of ``jaxcert.pipeline.report``: the CDF's x-range and the per-rule scatter."""

import math

import numpy as np
import pyarrow as pa
import pytest
from matplotlib.figure import Figure

from jaxcert.pipeline import report as certify_report


def _rules_with_an_outlier():
    """Eight rules of 1000 positions; the first has an outlier, a zero, an inf and a nan."""
    values = [np.geomspace(2e-3, 5.0, 1000) for _ in range(8)]
    values[0] = np.r_[1e-11, 0.0, math.inf, math.nan, np.geomspace(2e-3, 5.0, 996)]
    return values


def test_cdf_range_ignores_an_outlier():
    low, high, left = certify_report.cdf_range(_rules_with_an_outlier())
    assert low == pytest.approx(1e-3) and high == pytest.approx(10.0)
    assert left == 2  # the outlier and the zero
    assert certify_report.cdf_range([np.array([math.inf, 0.0])]) is None  # nothing on log axis


def test_cdf_figure_uses_the_robust_range_and_says_what_it_leaves_out():
    table = pa.table({f"cert_r{i}": v for i, v in enumerate(_rules_with_an_outlier())})
    fig = certify_report.cdf_figure(table, [f"cert_r{i}" for i in range(8)])
    assert isinstance(fig, Figure)
    (ax,) = fig.axes
    assert ax.get_xlim() == pytest.approx((1e-3, 10.0))
    assert "2 of 7998 finite certificates (all rules) lie left of 0.001" in ax.get_xlabel()


def test_margin_figure_has_one_panel_per_rule_and_counts_ties():
    margin = np.array([0.0, 0.0, 0.0, 0.1, 0.5, 0.9])
    table = pa.table(
        {
            "margin": margin,
            "cert_greedy": [0.0, 0.0, 0.0, 0.01, 0.2, 1.5],
            "cert_tree:4": [0.3, 0.4, math.inf, 0.5, 0.9, 2.0],
            "cert_typical": [0.1, 0.2, 0.3, 0.4, 0.5, 0.6],
        }
    )
    fig = certify_report.margin_figure(table, ["cert_greedy", "cert_tree:4", "cert_typical"])
    assert isinstance(fig, Figure)
    assert [ax.get_title() for ax in fig.axes] == [
        "greedy: 3 ties\n3 not drawn (C = 0 or inf)",
        "tree:4: 3 ties\n1 not drawn (C = 0 or inf)",
        "typical: 3 ties",
    ]
    first = fig.axes[0]
    assert all(ax.get_shared_x_axes().joined(first, ax) for ax in fig.axes)
    assert all(ax.get_shared_y_axes().joined(first, ax) for ax in fig.axes)
    # The ties of tree:4 sit at the left edge, the 3 positive margins at their own x.
    tree = fig.axes[1]
    ties = [c for c in tree.collections if c.get_label() == "tie (margin 0)"]
    (tie_points,) = ties
    xs = tie_points.get_offsets()[:, 0]
    assert len(xs) == 2 and np.all(xs == tree.get_xlim()[0])


def test_plot_report_writes_both_pngs(tmp_path):
    table = pa.table({"margin": [0.0, 0.2, 0.6], "cert_greedy": [0.0, 0.05, 0.9]})
    paths = certify_report.plot_report(table, ["cert_greedy"], tmp_path)
    assert [p.name for p in paths] == ["certificate_cdf.png", "certificate_vs_margin.png"]
    assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in paths)
