"""`jaxcert decode` end to end on tiny GGUF files written by the test."""

import json
import pathlib
import sys

import pytest
from tiny_decoding import CONFIG, random_model, write_gguf

from jaxcert import cli

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "models"))


@pytest.fixture(scope="module")
def files(tmp_path_factory, target, drafters):
    root = tmp_path_factory.mktemp("cli")
    prompts = root / "prompts.jsonl"
    prompts.write_text('{"id": "a", "prompt": "the cat sat"}\n{"id": "b", "prompt": "an otter"}\n')
    small = CONFIG.__class__(**{**CONFIG.__dict__, "vocab_size": 44})
    short = CONFIG.__class__(**{**CONFIG.__dict__, "max_position_embeddings": 16})
    return {
        "short": write_gguf(random_model(short, seed=6), root / "short.gguf"),
        "target": write_gguf(target, root / "target.gguf"),
        "drafter": write_gguf(drafters["similar"], root / "drafter.gguf"),
        "small": write_gguf(random_model(small, seed=5), root / "small.gguf"),
        "prompts": prompts,
        "root": root,
    }


def test_decode_writes_statistics_and_matches_target(files, monkeypatch, capsys):
    monkeypatch.setenv("JAXCERT_CACHE", str(files["root"] / "cache"))
    out = files["root"] / "out"
    argv = ["decode", "--target", str(files["target"]), "--drafter", str(files["drafter"]),
            "--prompts", str(files["prompts"]), "--policy", "svip:0.3/4", "--verify", "greedy",
            "--max-new-tokens", "8", "--batch-size", "2", "--out", str(out)]  # fmt: skip
    assert cli.main(argv) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["identical_outputs"] == "2/2"
    assert summary["speculative"]["rounds"] >= 1 and summary["speedup"] > 0
    # One batch cannot measure noise: no interval, and the run says so.
    assert summary["speedup_ci95"] is None and "too few" in summary["speedup_note"]
    assert summary["programs_compiled"] >= 0 and summary["compile_s"] >= 0
    for name in ("rounds.parquet", "nodes.parquet", "outputs.jsonl"):
        assert (out / name).is_file()
    import pyarrow.parquet as pq

    nodes = pq.read_table(out / "nodes.parquet")
    assert {"kl", "cert", "certified", "entropy", "passes"} <= set(nodes.column_names)
    printed = capsys.readouterr().out
    assert "tokens/s" in printed and "too few to measure" in printed


def test_decode_rejects_mismatched_vocabularies(files, monkeypatch, capsys):
    monkeypatch.setenv("JAXCERT_CACHE", str(files["root"] / "cache"))
    argv = ["decode", "--target", str(files["target"]), "--drafter", str(files["small"]),
            "--prompts", str(files["prompts"]), "--out", str(files["root"] / "bad")]  # fmt: skip
    assert cli.main(argv) == 2
    assert "target has 48 logit rows, the drafter 44" in capsys.readouterr().err


def test_decode_rejects_temperature_with_greedy(capsys):
    assert cli.main(["decode", "--temperature", "1", "--verify", "greedy"]) == 2
    assert "needs temperature > 0" in capsys.readouterr().err


def test_decode_refuses_to_run_past_the_context_length(files, monkeypatch, capsys):
    monkeypatch.setenv("JAXCERT_CACHE", str(files["root"] / "cache"))
    argv = ["decode", "--target", str(files["short"]), "--drafter", str(files["short"]),
            "--prompts", str(files["prompts"]), "--max-new-tokens", "12",
            "--out", str(files["root"] / "short-out")]  # fmt: skip
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "context too long for the target" in err and "supports 16" in err


@pytest.mark.parametrize(
    "flag, value, message",
    [
        ("--policy", "svip:-1", "argument --policy: policy 'svip:-1': H must be a finite number"),
        ("--verify", "tree:2x3+additive:2", "argument --verify: rule 'additive:2': T must be in"),
    ],
)
def test_decode_errors_use_the_command_lines_words(flag, value, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["decode", flag, value])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "SVIP." not in err and "Additive." not in err


def test_decode_refuses_a_prompt_set_as_a_model(files, monkeypatch, capsys):
    monkeypatch.setenv("JAXCERT_CACHE", str(files["root"] / "cache"))
    argv = ["decode", "--target", "mtbench", "--drafter", str(files["drafter"]),
            "--prompts", str(files["prompts"]), "--out", str(files["root"] / "x")]  # fmt: skip
    assert cli.main(argv) == 2
    assert "--target: 'mtbench' is a prompt set, not a model" in capsys.readouterr().err


def test_decode_drafts_with_a_saved_eagle_head(files, target, monkeypatch, capsys):
    from flax import nnx

    from jaxcert.models import EagleHead
    from jaxcert.models.eagle import save_head

    monkeypatch.setenv("JAXCERT_CACHE", str(files["root"] / "cache"))
    head = EagleHead.from_target(target, rngs=nnx.Rngs(4), taps=(0, 1))
    folder = save_head(head, files["root"] / "head")
    out = files["root"] / "head-out"
    argv = ["decode", "--target", str(files["target"]), "--drafter", str(folder),
            "--prompts", str(files["prompts"]), "--policy", "constant:3",
            "--verify", "tree:2x2", "--max-new-tokens", "8", "--batch-size", "2",
            "--out", str(out)]  # fmt: skip
    assert cli.main(argv) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["identical_outputs"] == "2/2"
    assert summary["drafter"] == str(folder)


def test_decode_refuses_a_head_of_another_target(files, monkeypatch, capsys):
    from flax import nnx

    from jaxcert.models import EagleHead
    from jaxcert.models.eagle import save_head

    monkeypatch.setenv("JAXCERT_CACHE", str(files["root"] / "cache"))
    other = CONFIG.__class__(**{**CONFIG.__dict__, "num_layers": 3})
    folder = save_head(EagleHead(other, rngs=nnx.Rngs(0)), files["root"] / "other-head")
    argv = ["decode", "--target", str(files["target"]), "--drafter", str(folder),
            "--prompts", str(files["prompts"]), "--out", str(files["root"] / "x")]  # fmt: skip
    assert cli.main(argv) == 2
    assert "--drafter: the draft head was built for another target: num_layers 3 (head)" in (
        capsys.readouterr().err
    )
