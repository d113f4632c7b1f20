"""scripts/peer_vllm.py without vLLM: the configurations it runs and the report it draws from
both engines' per-prompt records (the vLLM step itself runs only where vLLM is installed)."""

import json

import pytest

from tests.helpers.scripts_loader import load_script

peer = load_script("peer_vllm")


def _row(tokens, seconds, drafts=None, accepted=None):
    row = {"tokens": tokens, "seconds": seconds}
    if drafts is not None:
        row |= {"drafts": drafts, "accepted_per_pos": accepted}
    return row


def test_configs_and_their_subsets():
    args = peer._args(["jaxcert", "--run", "x", "--head", "h", "--head-lengths", "1,3"])
    assert [c[0] for c in peer.configs(args)] == [
        "target", "ngram/k4", "draft/k3", "eagle3/k1", "eagle3/k3",
    ]  # fmt: skip
    args = peer._args(["jaxcert", "--run", "x", "--head", "h", "--configs", "target,eagle3/k2"])
    assert [c[0] for c in peer.configs(args)] == ["target", "eagle3/k2"]
    args = peer._args(["jaxcert", "--run", "x", "--head", "h", "--configs", "eagle3/k9"])
    with pytest.raises(SystemExit, match="unknown --configs"):
        peer.configs(args)


def test_report_fractions_identity_and_speedups(tmp_path, capsys):
    a, b = [1, 2, 3, 4], [5, 6, 7, 8]
    jaxcert = {
        "target": {"k": 0, "prompts": [_row(a, 2.0), _row(b, 2.0)]},
        "eagle3/k2": {"k": 2, "prompts": [_row(a, 1.0, 3, [2, 1]), _row(b, 1.0, 1, [1, 0])]},
    }
    vllm = {
        "target": {"k": 0, "prompts": [_row(a, 1.0), _row([5, 6, 7, 9], 1.0)]},
        "eagle3/k2": {"k": 2, "prompts": [_row(a, 0.5, 2, [1, 1]), _row(b, 0.5, 2, [2, 0])]},
    }
    (tmp_path / "jaxcert.json").write_text(json.dumps(jaxcert))
    (tmp_path / "vllm-float32.json").write_text(json.dumps(vllm))
    peer.main(["report", "--run", str(tmp_path)])
    report = json.loads((tmp_path / "report.json").read_text())
    j, v = report["eagle3/k2"]["jaxcert float32"], report["eagle3/k2"]["vllm float32"]
    assert j["tokens_per_s"] == pytest.approx(4.0) and j["speedup"] == pytest.approx(2.0)
    assert [p["fraction"] for p in j["accepted_per_pos"]] == [0.75, 0.25]
    assert [p["fraction"] for p in v["accepted_per_pos"]] == [0.75, 0.25]
    lo, hi = j["accepted_per_pos"][0]["ci"]
    assert 0.5 <= lo <= 0.75 <= hi <= 1.0
    assert (j["identical_own"], j["identical_jaxcert"]) == (2, 2)
    # vLLM's target-only differs from jaxcert's on the second prompt; its head run does not
    assert report["target"]["vllm float32"]["identical_jaxcert"] == 1
    assert (v["identical_own"], v["identical_jaxcert"]) == (1, 2)
    assert "| eagle3/k2 | vllm float32 | 8.00 | 2.00x | 1/2 | 2/2 |" in capsys.readouterr().out
