"""scripts/bench_certify.py on a small batch: every row against the logsumexp floor, its reads,
the separate-reduction baseline, the losses and the measured bandwidth, in its JSON."""

import json
import math
import subprocess
import sys

from tests.helpers.scripts_loader import ROOT, load_script


def test_bench_certify_reports_floor_ratios_and_reads(tmp_path):
    out = tmp_path / "bench.json"
    cmd = [sys.executable, str(ROOT / "scripts" / "bench_certify.py"), "--batch", "4",
           "--vocab", "9000", "--repeats", "1", "--numpy-rows", "1", "--rules", "greedy,typical",
           "--each", "greedy", "--baseline", "--losses", "--measure-bandwidth",
           "--json", str(out)]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(out.read_text())
    assert abs(result["floor"]["reads"] - 2.0) < 0.05  # max, then the sum of exp
    assert [r["rule"] for r in result["rows"]] == ["greedy", "all 2 together"]
    for row in result["rows"] + result["losses"]:
        assert row["ms"] > 0 and 0 < row["reads"] <= row["reads_xla"]
        assert 0 < row["of_bandwidth"] < math.inf
    for row in result["rows"]:
        assert math.isclose(row["x_logsumexp"], row["ms"] / result["floor"]["ms"])
        assert row["old_reads"] > 0 and row["old_ms"] > 0
    # The NumPy time of all rules together is every rule of --rules, not only --each's.
    greedy, together = result["rows"]
    assert together["numpy_ms"] > greedy["numpy_ms"]
    # The certificate adds to the KL loss's reads, never takes away.
    kl, violation = result["losses"]
    assert violation["reads"] > kl["reads"]
    assert "x the logsumexp floor" in done.stdout


def test_the_baseline_is_the_summary_of_separate_reductions():
    """``--baseline`` swaps the row summary for separate reductions: the same values."""
    import jax.numpy as jnp
    import numpy as np

    bench = load_script("bench_certify")
    x = jnp.asarray(bench.synthetic_logits(3, 9000, "flat"))
    new = bench.numerics.row_summary(x, 64, True)
    old = bench.numerics.separate_summary(x, 64, True)
    for a, b in zip(new, old, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5)
