"""scripts/bench_decode.py on tiny checkpoints: an interrupted run resumes where it stopped
and decodes what an uninterrupted one does; a checkpoint is never overwritten silently;
``--ignore-eos`` decodes every row to its budget."""

import dataclasses
import json

import numpy as np
import pytest

from tests.helpers import tiny_lm
from tests.helpers.scripts_loader import load_script


def _script():
    return load_script("bench_decode")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("bench")
    target = tiny_lm.save_tiny_checkpoint(root / "target", seed=0)
    drafter = tiny_lm.save_tiny_checkpoint(root / "drafter", seed=1, layers=1)
    lines = [
        {"prompt": text, "category": "c"}
        for text in ("a b c a b c a b", "hello world hello", "x y z", "one two one two")
    ]
    prompts = root / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps(r) for r in lines) + "\n")
    return root, target, drafter, prompts


def _argv(setup, out, *extra):
    _, target, drafter, prompts = setup
    return [
        "--target", str(target), "--drafter", str(drafter), "--prompts", str(prompts),
        "--per-category", "4", "--max-new-tokens", "6", "--temperatures", "1",
        "--shapes", "chain", "--policies", "constant:2", "--ngram", "2",
        "--ngram-policies", "constant:3", "--batch-sizes", "1,2", "--out", str(out), *extra,
    ]  # fmt: skip


class _Interrupt(Exception):
    pass


def _accepted(results) -> dict:
    """Per configuration, the accepted counts of every round of every unit."""
    return {
        k: [np.asarray(s.accepted).tolist() for s in runs["stats"]]
        for k, runs in results.items()
        if runs["stats"]
    }


def test_resume_continues_an_interrupted_run(setup, monkeypatch):
    bench = _script()
    root = setup[0]
    assert bench.main(_argv(setup, root / "whole.json")) == 0
    with (root / "whole.units.pkl").open("rb") as f:
        whole = bench.pickle.load(f)["results"]

    real_save, saves = bench._Checkpoint.save, []

    def save_then_stop(self, results):
        real_save(self, results)
        saves.append(1)
        if len(saves) == 3:  # after 3 of the 6 units (4 at batch 1, 2 at batch 2)
            raise _Interrupt

    monkeypatch.setattr(bench._Checkpoint, "save", save_then_stop)
    out = root / "cut.json"
    with pytest.raises(_Interrupt):
        bench.main(_argv(setup, out))
    with (root / "cut.units.pkl").open("rb") as f:
        cut = bench.pickle.load(f)["results"]
    assert len(cut[(1, 1.0, "target", "-")]["tokens"]) == 3
    monkeypatch.setattr(bench._Checkpoint, "save", real_save)

    with pytest.raises(SystemExit, match="--resume continues it"):
        bench.main(_argv(setup, out))
    with pytest.raises(SystemExit, match=r"max_new_tokens \(then 6, now 5\)"):
        bench.main(_argv(setup, out, "--resume", "--max-new-tokens", "5"))
    assert bench.main(_argv(setup, out, "--resume")) == 0
    with (root / "cut.units.pkl").open("rb") as f:
        resumed = bench.pickle.load(f)["results"]
    assert resumed.keys() == whole.keys()
    assert len(resumed[(2, 1.0, "target", "-")]["tokens"]) == 2
    # T = 1 sampling: equal accepted counts in every round need the same keys per unit
    assert _accepted(resumed) == _accepted(whole)
    rows = json.loads(out.read_text())["rows"]
    assert {(r["batch"], r["shape"]) for r in rows} == {
        (b, s) for b in (1, 2) for s in ("target", "chain", "ngram/chain")
    }
    assert all(r["prompts"] == 4 // r["batch"] for r in rows)


def test_resume_needs_a_checkpoint(setup, tmp_path):
    bench = _script()
    with pytest.raises(SystemExit, match="no checkpoint"):
        bench.main(_argv(setup, tmp_path / "none.json", "--resume"))
    with pytest.raises(SystemExit, match="choose one"):
        bench.main(_argv(setup, tmp_path / "none.json", "--resume", "--overwrite"))


def test_ignore_eos_decodes_every_row_to_the_budget(setup, monkeypatch):
    # An eighth of the tiny vocabulary ends a sequence: at T = 1 rows end early, unless
    # --ignore-eos, which decodes every row to its 6 tokens.
    bench = _script()
    real_load = bench.models.load
    ends = tuple(range(0, 42, 6))  # 7 ids; the tokenizer adds its <|im_end|>

    def load(name):
        m = real_load(name)
        return dataclasses.replace(m, config=dataclasses.replace(m.config, eos_token_ids=ends))

    monkeypatch.setattr(bench.models, "load", load)
    root = setup[0]
    counts = {}
    for extra in ((), ("--ignore-eos",)):
        out = root / f"eos{len(extra)}.json"
        assert bench.main(_argv(setup, out, "--batch-sizes", "2", *extra)) == 0
        with out.with_suffix(".units.pkl").open("rb") as f:
            results = bench.pickle.load(f)["results"]
        assert set(results) == {(2, 1.0, s, p) for s, p in (
            ("target", "-"), ("chain", "constant:2"), ("ngram/chain", "constant:3")
        )}  # fmt: skip
        counts[extra] = [n for runs in results.values() for n in runs["tokens"]]
    assert counts[("--ignore-eos",)] == [12] * 6  # 3 configurations x 2 units of 2 rows
    assert min(counts[()]) < 12
