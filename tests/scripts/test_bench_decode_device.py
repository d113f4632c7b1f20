"""scripts/bench_decode_device.py: decode speed from configs alone (random weights), with the
tokens per round of a CPU benchmark's JSON as the projection's acceptance."""

import json

import pytest

from tests.helpers.scripts_loader import load_script


@pytest.fixture(scope="module")
def script():
    return load_script("bench_decode_device")


def _acceptance(path, drop=None):
    rows = [
        dict(batch=1, temperature=0.0, shape="target", policy="-", tokens_per_s=3.5),
        dict(batch=1, temperature=0.0, shape="chain", policy="cert:0.55",
             tokens_per_round=3.34, mean_drafted=3.08),
        dict(batch=1, temperature=0.0, shape="head/chain", policy="constant:2",
             tokens_per_round=1.32, mean_drafted=1.98),
        dict(batch=1, temperature=0.0, shape="head/tree:2x2", policy="constant:2",
             tokens_per_round=1.43, mean_drafted=3.97),
        dict(batch=1, temperature=1.0, shape="chain", policy="cert:0.55",
             tokens_per_round=9.0, mean_drafted=9.0),  # T = 1: never read
    ]  # fmt: skip
    path.write_text(json.dumps({"rows": [r for r in rows if r["shape"] != drop]}))
    return path


def test_draft_length_is_the_rows_constant_or_its_rounded_mean(script):
    chain, head_chain, tree = script.SETUPS
    assert script.draft_length(chain, {"mean_drafted": 3.08}) == 3
    assert script.draft_length(chain, {"mean_drafted": 0.2}) == 1  # never below 1
    assert script.draft_length(head_chain, {"mean_drafted": 1.2}) == 2  # constant:2 wins
    assert script.draft_length(tree, {"mean_drafted": 3.97}) == 2


def test_the_shipped_acceptance_file_has_every_row(script):
    rows = script.cpu_rows(script.ACCEPTANCE)
    assert rows[("head/chain", "constant:2")]["tokens_per_round"] == pytest.approx(1.321)
    assert rows[("chain", "cert:0.55")]["tokens_per_round"] == pytest.approx(3.343)


def test_tiny_run_measures_and_projects(script, tmp_path):
    out = tmp_path / "device.json"
    argv = [
        "--tiny", "--dtype", "float32", "--batch-sizes", "1,2", "--prompt-length", "6",
        "--max-new-tokens", "8", "--repeats", "1", "--acceptance",
        str(_acceptance(tmp_path / "cpu.json")), "--json", str(out),
    ]  # fmt: skip
    assert script.main(argv) == 0
    data = json.loads(out.read_text())
    assert data["tiny"] and data["taps"] == [1, 4, 6] and data["draft_vocab"] == 128
    rows = data["rows"]
    assert [(r["batch"], r["setup"]) for r in rows] == [
        (b, s) for b in (1, 2) for s in ("target only", "0.5B chain", "head chain", "head tree:2x2")
    ]
    expected = {"0.5B chain": (3.34, "constant:3"), "head chain": (1.32, "constant:2"),
                "head tree:2x2": (1.43, "constant:2")}  # fmt: skip
    for base, *spec in (rows[:4], rows[4:]):
        assert base["tokens_per_s"] > 0 and base["step_ms"] > 0
        for r in spec:
            tpr, policy = expected[r["setup"]]
            assert (r["cpu_tokens_per_round"], r["policy"]) == (tpr, policy)
            round_s = r["round_ms"] / 1e3
            # the projection is the CPU's tokens a round (per row) over the round measured here
            assert r["projected_tokens_per_s"] == pytest.approx(r["batch"] * tpr / round_s)
            assert r["projected_speedup"] == pytest.approx(
                r["projected_tokens_per_s"] / base["tokens_per_s"]
            )
            assert r["round_in_steps"] == pytest.approx(r["round_ms"] / base["step_ms"])
            # every round gives each row at least one token (8 tokens, no end token)
            assert r["tokens_per_s"] * round_s / r["batch"] >= 1 - 1e-9


def test_acceptance_without_a_needed_row_is_refused(script, tmp_path, capsys):
    cpu = _acceptance(tmp_path / "cpu.json", drop="head/tree:2x2")
    with pytest.raises(SystemExit) as e:
        script.main(["--tiny", "--acceptance", str(cpu)])
    assert e.value.code == 2
    assert "no batch-1 T=0 row for head/tree:2x2 constant:2" in capsys.readouterr().err


def test_acceptance_that_is_not_json_is_refused(script, tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text("not json")
    with pytest.raises(SystemExit):
        script.main(["--tiny", "--acceptance", str(bad)])
    assert "not a bench_decode.py JSON" in capsys.readouterr().err


@pytest.mark.parametrize("taps", ["2,x", "2,2", "2,28", "-1"])
def test_bad_taps_are_named_before_a_model_is_built(script, taps):
    with pytest.raises(ValueError, match="--taps must be"):
        script.parse_taps(taps, 28)
    assert script.parse_taps("2,14,25", 28) == (2, 14, 25)


def test_default_configs_are_the_kept_shapes(script, capsys):
    # the 1.5B's kept config (28 blocks) is read before the taps are checked against it
    with pytest.raises(SystemExit):
        script.main(["--taps", "2,28"])
    assert "--taps must be distinct target blocks in [0, 28), got '2,28'" in capsys.readouterr().err
