"""``jaxcert finetune-drafter`` end to end on tiny checkpoints: records, drafter states,
runs, held-out and decoder figures, the learning curves, the export, and a rerun that
resumes every phase without redoing it."""

import json

import jax.numpy as jnp
import numpy as np
import pytest

from jaxcert import cli, models
from tests.helpers import tiny_lm

WORDS = ["the cat", "an otter", "he is in", "a big one", "on the mat", "water"]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("ftcli")
    target = tiny_lm.save_tiny_checkpoint(root / "target", seed=0, layers=2)
    drafter = tiny_lm.save_tiny_checkpoint(root / "drafter", seed=3, layers=3)
    rng = np.random.default_rng(0)
    conversations = []
    for i in range(14):
        ask = " ".join(rng.choice(WORDS, 2))
        reply = " ".join(rng.choice(WORDS, int(rng.integers(3, 7))))
        conversations.append({"id": f"c{i}", "conversations": [
            {"from": "human", "value": ask}, {"from": "gpt", "value": reply}]})  # fmt: skip
    sharegpt = root / "sharegpt.json"
    sharegpt.write_text(json.dumps(conversations))
    decode = root / "decode.jsonl"
    decode.write_text('{"prompt": "the cat sat"}\n{"prompt": "an otter is in"}\n')
    return root, target, drafter, sharegpt, decode


def _argv(folders, out, *extra):
    root, target, drafter, sharegpt, decode = folders
    return ["finetune-drafter", "--target", str(target), "--drafter", str(drafter),
            "--prompts", str(sharegpt), "--positions", "60", "--heldout-sequences", "3",
            "--trained-blocks", "1", "--train-steps", "4", "--batch-size", "2",
            "--learning-rate", "1e-2", "--objectives", "kl,kl+miss", "--seeds", "0,1",
            "--decode-source", str(decode), "--decode-prompts", "2", "--decode-tokens", "6",
            "--out", str(out), *extra]  # fmt: skip


def test_finetune_drafter_end_to_end_and_resumed(folders, tmp_path, capsys):
    out = tmp_path / "out"
    argv = _argv(folders, out, "--export", str(tmp_path / "hf"), "--export-run", "kl+miss-seed1",
                 "--speed-prompts", "1")  # fmt: skip
    assert cli.main(argv) == 0
    text = capsys.readouterr().out
    assert "Held-out (per conversation), Δ against kl:" in text and "T0 cert:0.55" in text
    results = json.loads((out / "results.json").read_text())
    objectives = results["objectives"]
    assert list(objectives) == ["untrained", "kl", "kl+miss"]
    assert objectives["kl+miss"]["seeds"] == [0, 1]
    for name in ("kl", "kl+miss"):
        entry = objectives[name]
        mean, low, high = entry["certified:greedy"]
        assert 0.0 <= low <= mean <= high <= 1.0
        assert "vs_kl:kl" in entry or name == "kl"
        assert "vs_untrained:T0 cert:0.55" in entry
        assert entry["T0 constant:5"][0] >= 1.0  # tokens per round: at least the target's
    assert results["training_positions"] >= 60
    # per seed: the seed's runs alone, against the kl run of the same seed
    for seed in ("0", "1"):
        alone = results["per_seed"][seed]
        assert alone["kl+miss"]["seeds"] == [int(seed)] and alone["untrained"]["seeds"] == []
        runs = {n: json.loads((out / f"{n}-seed{seed}" / "decode.json").read_text())["runs"]
                for n in ("kl", "kl+miss")}  # fmt: skip
        got = alone["kl+miss"]["vs_kl:T0 cert:0.55"][0]
        want = np.mean(np.subtract(runs["kl+miss"]["T0 cert:0.55"], runs["kl"]["T0 cert:0.55"]))
        assert got == pytest.approx(want, abs=1e-6)
    pooled = objectives["kl+miss"]["vs_kl:T0 cert:0.55"][0]
    assert pooled == pytest.approx(
        np.mean([results["per_seed"][s]["kl+miss"]["vs_kl:T0 cert:0.55"][0] for s in "01"]),
        abs=1e-6,
    )
    assert "Seed 1 alone, Δ against its kl:" in (out / "results.md").read_text()
    keys = {n: json.loads((out / n / "run.json").read_text())["objective"]
            for n in ("kl-seed0", "kl+miss-seed0")}  # fmt: skip
    assert keys["kl+miss-seed0"]["margin"] == 0.05 and keys["kl-seed0"]["margin"] == 0.0
    curves = results["curves"]["kl-seed0"]
    assert [p["step"] for p in curves] == [0, 4]
    assert set(results["speed_batch1"]) == {"target-only", "untrained", "kl-seed0", "kl+miss-seed0"}
    # T = 0: every drafter's output is the target's, on the first decoded prompt only
    assert all(r["same_as_target"] == 1 for r in results["speed_batch1"].values())
    assert len(json.loads((out / "speed.json").read_text())["key"]["prompts"]) == 1
    speed = results["speed_batch1"]
    assert speed["target-only"]["speedup"] == 1.0
    for r in speed.values():  # the totals are the per-prompt sums; one prompt: no interval
        assert r["tokens"] == sum(r["per_prompt_tokens"]) and len(r["per_prompt_tokens"]) == 1
        assert r["speedup_ci95"] is None
        assert r["seconds"] == pytest.approx(sum(r["per_prompt_seconds"]), abs=2e-3)
        assert r["speedup"] == pytest.approx(
            r["tokens_per_s"] / speed["target-only"]["tokens_per_s"], rel=1e-3, abs=1e-4
        )  # both rounded to 4 decimals
    speed_table = (out / "results.md").read_text().split("tokens/s:")[-1]
    assert "| kl+miss-seed0 |" in speed_table and "nan" not in speed_table
    assert (out / "learning_curves.png").stat().st_size > 1000
    # the export is the run's drafter: its logits equal the merged model's
    exported = models.load(tmp_path / "hf", dtype=jnp.float32)
    tokens = jnp.array([[3, 5, 7, 9]])
    logits, _ = exported.model(tokens, exported.model.init_cache(1, 4))
    from jaxcert.training import finetune

    trainable, _ = _checkpoint(out / "kl+miss-seed1", exported.model)
    merged = finetune.merged_drafter(
        models.load(folders[2], dtype=jnp.float32).model, trainable, trained_blocks=1
    )
    want, _ = merged(tokens, merged.init_cache(1, 4))
    np.testing.assert_allclose(logits, want, rtol=1e-5, atol=1e-5)
    base, _ = models.load(folders[2], dtype=jnp.float32).model(tokens, merged.init_cache(1, 4))
    assert float(jnp.abs(base - want).max()) > 1e-4  # the export is not the untrained drafter
    # jaxcert decode drafts with the exported folder; greedy outputs are the target's
    decoded = tmp_path / "decode"
    assert cli.main(["decode", "--target", str(folders[1]), "--drafter", str(tmp_path / "hf"),
                     "--prompts", str(folders[4]), "--verify", "greedy", "--max-new-tokens", "6",
                     "--out", str(decoded)]) == 0  # fmt: skip
    lines = [json.loads(x) for x in (decoded / "outputs.jsonl").read_text().splitlines()]
    assert len(lines) == 2 and all(r["identical"] for r in lines)

    # a rerun reads every phase back: nothing is trained, decoded or timed again
    stamps = {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()}
    assert cli.main(_argv(folders, out, "--speed-prompts", "1")) == 0
    for p, t in stamps.items():
        if p.name not in ("results.json", "results.md", "learning_curves.png"):
            assert p.stat().st_mtime_ns == t, p


def _checkpoint(folder, model):
    """The trained parameters a run's checkpoint holds (in the drafter's tree)."""
    import jax
    from flax import nnx
    from safetensors.numpy import load_file

    from jaxcert.training import finetune

    keep = finetune.trainable_filter(model.config.num_layers, 1)
    _, trainable, _ = nnx.split(model, keep, ...)
    saved = load_file(folder / "checkpoint" / "params.safetensors")
    leaves, treedef = jax.tree.flatten(trainable)
    restored = [jnp.asarray(saved[f"{i:05d}"]) for i in range(len(leaves))]
    return jax.tree.unflatten(treedef, restored), None


@pytest.mark.parametrize(
    "extra,message",
    [
        (["--objectives", "kl,cvar"], "--objectives: unknown ['cvar']"),
        (["--objectives", "kl,kl"], "names an objective twice"),
        (["--seeds", "0,x"], "--seeds: comma-separated integers"),
        (["--seeds", "0,0"], "--seeds: distinct integers >= 0"),
        (["--export-run", "kl-seed0"], "--export-run needs --export FOLDER"),
        (
            ["--export", "EXPORT", "--export-run", "kl+tv-seed0"],
            "--export-run: no run 'kl+tv-seed0'",
        ),
        (["--export", "OUT/hf"], "is inside --out"),
        (["--export", "FILE/hf/x"], "FILE is not a writable folder"),
        (["--export", "EXPORT", "--sweep", "1"], "the sweep trains no run to export"),
        (
            ["--trained-blocks", "3"],
            "--trained-blocks 3: the states come after 1 of the drafter's 3",
        ),
        (["--sweep", "1,3"], "--sweep 3: the states come after 1"),
        (["--states-after", "3"], "--states-after must be in [1, 3)"),
        (
            ["--speed-prompts", "3"],
            "--speed-prompts 3: times the first N of the --decode-prompts 2 decoded prompts",
        ),
        (["--decode-prompts", "0", "--speed-prompts", "1"], "give at most 0"),
    ],
)
def test_finetune_drafter_refuses_bad_options_before_loading(
    folders, tmp_path, capsys, monkeypatch, extra, message
):
    def boom(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(models, "load", boom)
    out = tmp_path / "o"
    (tmp_path / "FILE").write_text("a file")
    extra = [
        str(out) + "/hf"
        if e == "OUT/hf"
        else str(tmp_path / "x")
        if e == "EXPORT"
        else str(tmp_path / e)
        if e.startswith("FILE")
        else e
        for e in extra
    ]
    assert cli.main(_argv(folders, out, *extra)) == 2
    assert message in capsys.readouterr().err
    assert not out.exists()


def test_finetune_drafter_refuses_prompts_without_replies(folders, tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "the cat"}\n{"prompt": "an otter"}\n')
    argv = _argv(folders, tmp_path / "o")
    argv[argv.index("--prompts") + 1] = str(prompts)
    assert cli.main(argv) == 2
    assert "has no replies to train on" in capsys.readouterr().err


def test_changed_data_options_are_refused_before_anything_is_written(folders, tmp_path, capsys):
    """A larger --positions on a finished folder would grow its records under runs trained
    on the old ones: refused, and the folder left as it was."""
    import shutil

    out = tmp_path / "o"
    drafter = shutil.copytree(folders[2], tmp_path / "drafter")  # its weights change below
    argv = _argv(folders, out, "--objectives", "kl", "--seeds", "0", "--decode-prompts", "0")
    argv[argv.index("--drafter") + 1] = str(drafter)
    # a run refused once the data is known (too few sequences) records nothing
    few = list(argv)
    few[few.index("--heldout-sequences") + 1] = "100"
    assert cli.main(few) == 2
    assert "cannot hold out 100" in capsys.readouterr().err
    assert not (out / "options.json").exists()
    assert cli.main(argv) == 0
    options = json.loads((out / "options.json").read_text())
    assert len(options["target_sha256"]) == len(options["drafter_sha256"]) == 64
    stamps = {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()}
    more = list(argv)
    more[more.index("--positions") + 1] = "200"
    assert cli.main(more) == 2
    assert "positions (then 60, now 200)" in capsys.readouterr().err
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()} == stamps
    # another run's settings: refused before any run trains, kl+miss's included
    other = list(argv)
    other[other.index("--objectives") + 1] = "kl+miss,kl"
    other[other.index("--learning-rate") + 1] = "2e-2"
    assert cli.main(other) == 2
    assert "kl-seed0 was written with other options: settings.learning_rate (then 0.01, " \
        "now 0.02)" in capsys.readouterr().err  # fmt: skip
    assert not (out / "kl+miss-seed0").exists()
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()} == stamps
    # a record written before the fingerprints gets them; then other weights at the same
    # path are another folder's data
    (out / "options.json").write_text(json.dumps(
        {k: v for k, v in options.items() if not k.endswith("_sha256")}))  # fmt: skip
    assert cli.main(argv) == 0
    assert "recorded the models' fingerprints" in capsys.readouterr().err
    assert json.loads((out / "options.json").read_text()) == options
    # a damaged checkpoint is named in one line, not a traceback
    (out / "kl-seed0" / "checkpoint" / "params.safetensors").write_bytes(b"junk")
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "kl-seed0/checkpoint: a damaged checkpoint" in err and "Traceback" not in err
    from safetensors.numpy import load_file, save_file

    weights = load_file(drafter / "model.safetensors")
    weights["lm_head.weight"] = weights["lm_head.weight"] * 1.5
    save_file(weights, drafter / "model.safetensors")
    stamps = {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()}
    assert cli.main(argv) == 2
    assert "drafter_sha256 (then" in capsys.readouterr().err
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()} == stamps


def test_the_sweep_writes_its_table_and_stops(folders, tmp_path, capsys):
    out = tmp_path / "o"
    assert cli.main(_argv(folders, out, "--sweep", "1,2", "--sweep-steps", "3")) == 0
    rows = json.loads((out / "sweep.json").read_text())["rows"]
    assert [r["trained_blocks"] for r in rows] == [1, 2]
    for r in rows:
        assert np.isfinite(r["fresh_kl_change"]) and 0 <= r["certified:greedy"] <= 1
        assert r["seconds_per_step"] > 0
    assert "fresh_kl_change" in (out / "sweep.md").read_text()
    assert not (out / "kl-seed0").exists()  # the sweep trains no comparison run
