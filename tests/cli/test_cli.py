"""`jaxcert decode` end to end on tiny GGUF files written by the test."""

import json

import pytest

from jaxcert import cli
from tests.helpers.tiny_decoding import CONFIG, random_model, write_gguf


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


def test_export_head_then_decode_with_the_engines_layouts(files, monkeypatch, capsys):
    """A head trained here, exported as SpecForge and speculators write it, drafts here
    again from the exported folder, identical to the target (greedy and tree)."""
    import dataclasses

    from flax import nnx

    from jaxcert.models import EagleHead
    from jaxcert.models.eagle import save_head

    monkeypatch.setenv("JAXCERT_CACHE", str(files["root"] / "cache"))
    deep = dataclasses.replace(CONFIG, num_layers=3)
    target = random_model(deep, seed=8)
    target_file = write_gguf(target, files["root"] / "deep.gguf")
    head = EagleHead.from_target(
        target, rngs=nnx.Rngs(2), taps=(0, 1, 2), arch="eagle3", draft_vocab=list(range(0, 48, 2))
    )
    saved = save_head(head, files["root"] / "eagle3-head")
    for fmt in ("eagle3", "speculators"):
        exported = files["root"] / f"exported-{fmt}"
        argv = ["export-head", str(saved), "--format", fmt, "--out", str(exported)]
        assert cli.main(argv) == 0, capsys.readouterr().err
        assert "aux layers [1, 2, 3]" in capsys.readouterr().out
        assert cli.main(argv) == 2  # refuses to overwrite
        assert "exists; pass overwrite=True (--overwrite)" in capsys.readouterr().err
        out = files["root"] / f"decode-{fmt}"
        argv = ["decode", "--target", str(target_file), "--drafter", str(exported),
                "--prompts", str(files["prompts"]), "--policy", "constant:3",
                "--verify", "tree:2x2", "--max-new-tokens", "8", "--batch-size", "2",
                "--out", str(out)]  # fmt: skip
        assert cli.main(argv) == 0, capsys.readouterr().err
        summary = json.loads((out / "summary.json").read_text())
        assert summary["identical_outputs"] == "2/2"
        # the engines draft with -inf outside the draft vocabulary: KL(p||q) is infinite
        assert summary["speculative"]["mean_kl"] is None
    # with the shared logit, the same drafts at T = 0 and a finite KL to certify
    out = files["root"] / "decode-oov"
    argv[argv.index("--out") + 1] = str(out)
    assert cli.main(argv + ["--head-outside", "oov"]) == 0, capsys.readouterr().err
    summary = json.loads((out / "summary.json").read_text())
    assert summary["identical_outputs"] == "2/2"
    assert 0 < summary["speculative"]["mean_kl"] < float("inf")
    # an engine folder is read against its target: export-head needs --target then
    argv = ["export-head", str(files["root"] / "exported-eagle3"), "--format", "speculators",
            "--out", str(files["root"] / "again")]  # fmt: skip
    assert cli.main(argv) == 2
    assert "--target: an EAGLE-3 or speculators folder" in capsys.readouterr().err
    assert cli.main(argv + ["--target", str(target_file)]) == 0
    config = json.loads((files["root"] / "again" / "config.json").read_text())
    assert config["speculators_config"]["verifier"]["name_or_path"] == str(target_file)


def test_export_model_writes_a_folder_that_loads_back(files, monkeypatch, capsys):
    import numpy as np
    from flax import nnx

    from jaxcert import models

    monkeypatch.setenv("JAXCERT_CACHE", str(files["root"] / "cache"))
    out = files["root"] / "target-hf"
    assert cli.main(["export-model", str(files["target"]), "--out", str(out)]) == 0
    a, b = models.load(files["target"]).model, models.load(out).model
    for (path, x), (other, y) in zip(
        nnx.to_flat_state(nnx.state(a)), nnx.to_flat_state(nnx.state(b)), strict=True
    ):
        assert path == other
        np.testing.assert_array_equal(np.asarray(x.get_value()), np.asarray(y.get_value()))
    assert cli.main(["export-model", str(files["target"]), "--out", str(out)]) == 2
    assert "exists; pass overwrite=True (--overwrite)" in capsys.readouterr().err
