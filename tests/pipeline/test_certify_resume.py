"""Streaming output of ``jaxcert certify``: shards, manifest, kill -9 and --resume, refusals."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pyarrow.parquet as pq
import pytest

from jaxcert import cli
from jaxcert.pipeline import engine as certify
from jaxcert.pipeline import store as certify_store

TEXTS = [f"{a} {b}" for a in ("the cat", "an otter", "he is", "a big one", "on the mat")
         for b in ("sat on", "is in the water", "a, b?", "on")]  # fmt: skip


@pytest.fixture(scope="module")
def many_prompts(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompts") / "many.jsonl"
    path.write_text("".join(json.dumps({"id": f"q{i}", "prompt": t}) + "\n"
                            for i, t in enumerate(TEXTS)))  # fmt: skip
    return path


def _args(checkpoint, prompts, out, *extra):
    return ["certify", "--target", str(checkpoint), "--prompts", str(prompts), "--rules",
            "greedy,tree:2,additive:0.3", "--steps", "6", "--batch-size", "3", "--no-plots",
            "--out", str(out), *extra]  # fmt: skip


@pytest.fixture(scope="module")
def uninterrupted(checkpoint, many_prompts, tmp_path_factory):
    out = tmp_path_factory.mktemp("whole") / "run"
    assert cli.main(_args(checkpoint, many_prompts, out)) == 0
    return out


def test_a_run_streams_shards_and_a_manifest(checkpoint, many_prompts, uninterrupted, tmp_path):
    out = tmp_path / "run"
    assert cli.main(_args(checkpoint, many_prompts, out, "--shard-rows", "10")) == 0
    shards = sorted(p.name for p in (out / "positions.parquet").iterdir())
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["status"] == "complete"
    assert [s["file"] for s in manifest["shards"]] == shards and len(shards) > 5
    assert manifest["prompts_done"] == list(range(len(TEXTS)))
    assert sum(s["rows"] for s in manifest["shards"]) == manifest["rows"]
    for s in manifest["shards"]:  # every row of a prompt is in one shard
        table = pq.read_table(out / "positions.parquet" / s["file"])
        assert sorted(set(table["prompt_index"].to_pylist())) == s["prompts"]
    whole = certify_store.read_positions(uninterrupted)
    assert certify_store.read_positions(out).equals(whole)  # shard size changes nothing
    assert manifest["rows"] == whole.num_rows
    info = json.loads((out / "run.json").read_text())
    assert info["prefill_padded_tokens"] >= info["prefill_tokens"] > 0


_KILLER = """
    import os, signal, sys
    from jaxcert.pipeline import store as certify_store
    from jaxcert import cli
    flush = certify_store.ShardWriter.flush
    def flush_then_die(self):
        if len(self.shards) == {after}:  # the next shard: die between write and rename
            real = os.replace
            def die(*a, **k):
                os.kill(os.getpid(), signal.SIGKILL)
            certify_store.os.replace = die
        flush(self)
    certify_store.ShardWriter.flush = flush_then_die
    sys.exit(cli.main({args!r}))
"""


def test_kill_9_mid_write_then_resume_gives_the_uninterrupted_rows(
    checkpoint, many_prompts, uninterrupted, tmp_path, capsys
):
    out = tmp_path / "run"
    args = _args(checkpoint, many_prompts, out, "--shard-rows", "12")
    code = textwrap.dedent(_KILLER.format(after=3, args=args))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=600, env=os.environ | {"PYTHONPATH": os.getcwd()})  # fmt: skip
    assert proc.returncode == -9, proc.stderr[-3000:]
    dataset = out / "positions.parquet"
    assert len(list(dataset.glob("part-*.parquet"))) == 3
    assert list(dataset.glob(".part-00003.parquet.*.tmp"))  # the shard cut short
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["status"] == "running" and len(manifest["shards"]) == 3
    done = set(manifest["prompts_done"])
    # Without --resume the run is refused, and nothing is touched.
    assert cli.main(args) == 2
    assert len(list(dataset.glob("part-*.parquet"))) == 3
    assert cli.main(args + ["--resume"]) == 0
    assert not list(dataset.glob(".*.tmp"))
    assert certify_store.read_positions(out).equals(certify_store.read_positions(uninterrupted))
    run = json.loads((out / "run.json").read_text())
    assert run["prompts_resumed"] == len(done)  # nothing finished was recomputed
    assert run["prompts_this_run"] == len(TEXTS) - len(done)
    assert json.loads((out / "manifest.json").read_text())["status"] == "complete"
    # Resuming a complete run says so, shows its summary, and computes and rewrites nothing.
    before = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    assert cli.main(args + ["--resume"]) == 0
    captured = capsys.readouterr()
    assert "is already complete: nothing to resume" in captured.err
    assert (out / "summary.md").read_text() in captured.out
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == before


def test_a_failure_keeps_the_finished_shards_and_resume_completes(
    checkpoint, many_prompts, uninterrupted, tmp_path, monkeypatch, capsys
):
    out = tmp_path / "run"
    args = _args(checkpoint, many_prompts, out, "--shard-rows", "1")
    # The fourth decoding chunk fails (Certifier._decode runs the compiled _decode_chunk).
    real, calls = certify.Certifier._decode, []

    def failing(self, *a):
        calls.append(1)
        if len(calls) == 4:
            raise RuntimeError("device lost")
        return real(self, *a)

    monkeypatch.setattr(certify.Certifier, "_decode", failing)
    with pytest.raises(RuntimeError, match="device lost"):
        cli.main(args)
    assert "--resume continues" in capsys.readouterr().err
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["status"] == "failed" and "device lost" in manifest["error"]
    assert 0 < len(manifest["prompts_done"]) < len(TEXTS)
    monkeypatch.setattr(certify.Certifier, "_decode", real)
    assert cli.main(args + ["--resume"]) == 0
    assert certify_store.read_positions(out).equals(certify_store.read_positions(uninterrupted))


def test_refusals_and_nothing_left_behind(
    checkpoint, many_prompts, uninterrupted, tmp_path, capsys
):
    # A second run into the same folder is refused; --overwrite replaces it.
    before = {p.name: p.stat().st_mtime_ns for p in uninterrupted.iterdir()}
    assert cli.main(_args(checkpoint, many_prompts, uninterrupted)) == 2
    assert "already holds a certify run; pass --resume" in capsys.readouterr().err
    assert {p.name: p.stat().st_mtime_ns for p in uninterrupted.iterdir()} == before
    out = tmp_path / "again"
    assert cli.main(_args(checkpoint, many_prompts, out)) == 0
    (out / "notes.txt").write_text("mine")
    assert cli.main(_args(checkpoint, many_prompts, out, "--overwrite", "--steps", "2")) == 0
    assert (out / "notes.txt").read_text() == "mine"  # only jaxcert's files are replaced
    assert certify_store.read_positions(out)["position"].to_pylist()[:3] == [0, 1, 0]
    # --resume with other options is refused, naming what differs.
    assert cli.main(_args(checkpoint, many_prompts, out, "--resume", "--steps", "3")) == 2
    assert (
        "was written with other options: options.steps (then 2, now 3)" in capsys.readouterr().err
    )
    # --resume of a run interrupted before its first shard (nothing saved): it just starts.
    none = tmp_path / "none"
    assert cli.main(_args(checkpoint, many_prompts, none, "--resume")) == 0
    assert f"nothing saved in {none} yet: starting the run" in capsys.readouterr().err
    assert certify_store.read_positions(none).equals(certify_store.read_positions(uninterrupted))
    # A run that fails before its first result leaves nothing behind.
    fresh = tmp_path / "fresh"
    assert cli.main(_args(checkpoint, many_prompts, fresh, "--steps", "600")) == 2
    assert "the target supports 512" in capsys.readouterr().err
    assert not fresh.exists()


def test_a_failed_overwrite_keeps_the_previous_run_and_bad_manifests_are_named(
    checkpoint, many_prompts, uninterrupted, tmp_path, capsys
):
    import shutil

    out = tmp_path / "copy"
    shutil.copytree(uninterrupted, out)
    want = certify_store.read_positions(out)
    # The new run fails before its first shard: the previous run stays whole.
    assert cli.main(_args(checkpoint, many_prompts, out, "--overwrite", "--max-prompt-tokens",
                          "1")) == 2  # fmt: skip
    assert "no prompt has between 1 and 1 tokens" in capsys.readouterr().err
    assert certify_store.read_positions(out).equals(want)
    assert (out / "summary.md").exists()
    # Without a manifest the shards' settings cannot be checked: no resume.
    manifest = (out / "manifest.json").read_text()
    (out / "manifest.json").unlink()
    assert cli.main(_args(checkpoint, many_prompts, out, "--resume")) == 2
    assert "its shards have no manifest.json" in capsys.readouterr().err
    for text in ("[]", '{"fingerprint": 5}', "{trunc"):
        (out / "manifest.json").write_text(text)
        assert cli.main(_args(checkpoint, many_prompts, out, "--resume")) == 2
        assert "manifest.json is corrupt" in capsys.readouterr().err
    (out / "manifest.json").write_text(manifest)
    assert cli.main(_args(checkpoint, many_prompts, out, "--resume", "--steps", "3")) == 2
    assert "options.steps" in capsys.readouterr().err
    # A stray file where the dataset goes is named before any work.
    stray = tmp_path / "stray"
    stray.mkdir()
    (stray / "positions.parquet").write_text("hi")
    assert cli.main(_args(checkpoint, many_prompts, stray, "--overwrite")) == 2
    assert "is a file, not a certify dataset" in capsys.readouterr().err


def test_resume_trusts_the_shards_not_the_manifests_word(
    checkpoint, many_prompts, uninterrupted, tmp_path, capsys, monkeypatch
):
    """Found by an adversarial pass: a complete run missing a shard was called complete, a
    shard copied twice was accepted (38 rows for 34), and a relative path to the same
    prompts file was another run."""
    import shutil

    out = tmp_path / "run"
    args = _args(checkpoint, many_prompts, out, "--shard-rows", "12")
    assert cli.main(args) == 0
    shards = sorted((out / "positions.parquet").glob("part-*.parquet"))
    assert len(shards) >= 3
    # A shard lost from a complete run: --resume certifies its prompts again.
    shards[1].unlink()
    assert cli.main(args + ["--resume"]) == 0
    assert "already complete" not in capsys.readouterr().err
    assert certify_store.read_positions(out).equals(certify_store.read_positions(uninterrupted))
    # A shard copied: refused, naming the prompt and both files.
    shards = sorted((out / "positions.parquet").glob("part-*.parquet"))
    shutil.copy(shards[0], out / "positions.parquet" / "part-00099.parquet")
    assert cli.main(args + ["--resume"]) == 2
    assert f"is in two shards ({shards[0].name} and part-00099.parquet)" in capsys.readouterr().err
    (out / "positions.parquet" / "part-00099.parquet").unlink()
    # The same prompts file spelt from another folder is the same run.
    monkeypatch.chdir(many_prompts.parent)
    relative = _args(checkpoint, many_prompts.name, out, "--shard-rows", "12", "--resume")
    assert cli.main(relative) == 0
    assert "already complete" in capsys.readouterr().err


def test_the_first_shard_is_on_disk_once_the_first_prompt_is_done(
    checkpoint, many_prompts, uninterrupted, tmp_path, monkeypatch
):
    """A short run with the default shard sizes wrote nothing before it ended (a kill -9
    lost it all): the first prompt's rows are now written at once."""
    out = tmp_path / "run"
    on_disk, real = [], certify_store.ShardWriter.write

    def write(self, table):
        real(self, table)
        on_disk.append(len(list((out / "positions.parquet").glob("part-*.parquet"))))

    monkeypatch.setattr(certify_store.ShardWriter, "write", write)
    assert cli.main(_args(checkpoint, many_prompts, out, "--shard-seconds", "3600")) == 0
    assert on_disk == [1] * len(TEXTS)  # from the first finished prompt on
    manifest = json.loads((out / "manifest.json").read_text())
    assert [len(s["prompts"]) for s in manifest["shards"]] == [1, len(TEXTS) - 1]
    assert certify_store.read_positions(out).equals(certify_store.read_positions(uninterrupted))


def test_resume_of_a_complete_run_or_with_other_options_loads_no_model(
    checkpoint, many_prompts, uninterrupted, tmp_path, monkeypatch, capsys
):
    import shutil

    from jaxcert import models

    out = tmp_path / "copy"
    shutil.copytree(uninterrupted, out)

    def no_load(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(models, "load", no_load)
    assert cli.main(_args(checkpoint, many_prompts, out, "--resume")) == 0
    err = capsys.readouterr().err
    assert "is already complete: nothing to resume" in err and "loading target" not in err
    assert cli.main(_args(checkpoint, many_prompts, out, "--resume", "--steps", "3")) == 2
    err = capsys.readouterr().err
    assert "written with other options: options.steps (then 6, now 3)" in err
    assert "loading target" not in err
