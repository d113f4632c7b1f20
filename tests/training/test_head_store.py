"""Draft-head training at scale: the record store (streamed, resumable) against a direct
recomputation, the window loss against the full-vocabulary KL and TV, and resumable
training (tiny target)."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxcert import losses
from jaxcert.base.prompts import Prompt
from jaxcert.core import rules, solver
from jaxcert.models import EagleHead
from jaxcert.training import head_data
from jaxcert.training.eagle import target_states, train_head_on_records, window_terms
from jaxcert.training.train import Objective
from tests.helpers.tiny_models import hf_tokenizer, random_model, tiny_config

V = 48
TAPS = (0, 1)


@pytest.fixture(scope="module")
def target():
    return random_model(tiny_config(vocab_size=V, num_layers=2, max_position_embeddings=64))


def _sequences(n, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        start = int(rng.integers(2, 6))
        length = int(rng.integers(start + 2, 20))
        out.append(head_data.TrainingSequence(str(i), tuple(rng.integers(0, V, length)), start))
    return out


def _spec(**kw):
    return head_data.StoreSpec(
        **{"target": "tiny", "taps": TAPS, "length": 24, "top_k": 8, "batch_size": 3} | kw
    )


def test_store_equals_a_direct_teacher_forced_pass(target, tmp_path):
    seqs = _sequences(7)
    store = head_data.write_store(target, seqs, tmp_path / "s", _spec())
    assert [s["rows"] for s in store.shards] == [3, 3, 1]
    assert store.positions == sum(len(s.tokens) - s.start for s in seqs)
    rec = head_data.read_store(tmp_path / "s").load()
    tokens = np.zeros((7, 24), np.int32)
    for i, s in enumerate(seqs):
        tokens[i, : len(s.tokens)] = s.tokens
    lengths = np.asarray([len(s.tokens) for s in seqs])
    direct = target_states(target, tokens, lengths, TAPS)
    logp = np.asarray(jax.nn.log_softmax(direct.logits, axis=-1))
    np.testing.assert_array_equal(rec.tokens, tokens)
    np.testing.assert_allclose(rec.states, np.asarray(direct.states), atol=2e-5)
    want_ids = np.argsort(-logp, axis=-1)[..., :8]
    np.testing.assert_allclose(rec.top_logp, np.take_along_axis(logp, want_ids, -1), atol=2e-5)
    assert np.mean(rec.top_ids == want_ids) > 0.999  # ties aside
    p = np.exp(logp)
    np.testing.assert_allclose(rec.entropy, -np.sum(p * logp, -1), atol=2e-5)
    certs = solver.certificates(jnp.asarray(logp), (rules.StrictGreedy(), rules.TreeCoverage(4)))
    np.testing.assert_allclose(
        rec.certificate[..., 0], np.asarray(certs[0].value), rtol=1e-4, atol=1e-8
    )
    np.testing.assert_allclose(
        rec.certificate[..., 1], np.asarray(certs[1].value), rtol=1e-4, atol=1e-8
    )
    mask = rec.mask
    for i, s in enumerate(seqs):  # the reply's positions: x_{t+1} is a reply token
        assert np.flatnonzero(mask[i]).tolist() == list(range(s.start - 1, len(s.tokens) - 1))


def test_store_resumes_and_refuses_what_does_not_match(target, tmp_path):
    seqs = _sequences(7)
    whole = head_data.write_store(target, seqs, tmp_path / "whole", _spec()).load()
    part = head_data.write_store(target, seqs, tmp_path / "p", _spec(), max_positions=1)
    assert len(part.shards) == 1  # stopped after the first shard passed the goal
    torn = tmp_path / "p" / ".shard-00001.safetensors.1234abcd.tmp"
    torn.write_bytes(b"torn write")  # a crash
    calls = []
    resumed = head_data.write_store(
        target, seqs, tmp_path / "p", _spec(), progress=lambda *a: calls.append(a)
    )
    assert len(resumed.shards) == 3 and not torn.exists()  # the leftover is gone
    # First what the earlier run wrote (the baseline of a rate), then after each new shard.
    assert [c[0] for c in calls] == [part.positions] + [
        sum(s["positions"] for s in resumed.shards[: i + 1]) for i in (1, 2)
    ]
    got = resumed.load()
    for name in ("tokens", "states", "top_logp", "certificate", "length", "start"):
        np.testing.assert_array_equal(getattr(got, name), getattr(whole, name))
    with pytest.raises(
        ValueError,
        match=r"written with other options: top_k \(then \d+, now 4\); use another folder",
    ):
        head_data.write_store(target, seqs, tmp_path / "p", _spec(top_k=4))
    with pytest.raises(ValueError, match="shard 0 was written from other sequences"):
        head_data.write_store(target, _sequences(7, seed=1), tmp_path / "p", _spec())
    with pytest.raises(ValueError, match="outside the target's vocabulary"):
        bad = [head_data.TrainingSequence("x", (1, V, 2), 1)]
        head_data.write_store(target, bad, tmp_path / "bad", _spec())
    with pytest.raises(FileNotFoundError, match="no head-record store"):
        head_data.read_store(tmp_path / "nothing")
    with pytest.raises(ValueError, match="rule"):
        _spec(rules=("greedy", "nonsense"))


@pytest.mark.parametrize("draft_vocab", [None, np.arange(0, V, 2)], ids=["full", "half"])
def test_window_terms_equal_full_kl_and_tv_with_the_whole_vocabulary(target, tmp_path, draft_vocab):
    seqs = _sequences(3)
    spec = _spec(top_k=V)  # the window is the whole vocabulary: nothing is coarsened
    rec = head_data.write_store(target, seqs, tmp_path / "s", spec).load()
    head = EagleHead.from_target(target, rngs=nnx.Rngs(1), taps=TAPS, draft_vocab=draft_vocab)
    batch = {k: jnp.asarray(getattr(rec, k)) for k in ("tokens", "states", "top_logp", "top_ids")}
    batch["certificate"] = jnp.asarray(rec.certificate)
    kl, tv, _, _ = window_terms(head, batch)
    from jaxcert.decoding.protocols import context_before

    q_logits, _ = head(
        batch["tokens"], head.init_cache(3, 24), context=context_before(head, batch["states"])
    )
    lengths = np.asarray([len(s.tokens) for s in seqs])
    direct = target_states(target, np.asarray(rec.tokens), lengths, TAPS)
    want_kl = losses.kl_divergence(drafter_logits=q_logits, target_logits=direct.logits)
    p, q = jax.nn.softmax(direct.logits, -1), jax.nn.softmax(q_logits, -1)
    want_tv = 0.5 * jnp.sum(jnp.abs(p - q), -1)
    m = rec.mask
    np.testing.assert_allclose(np.asarray(kl)[m], np.asarray(want_kl)[m], atol=2e-4, rtol=1e-4)
    np.testing.assert_allclose(np.asarray(tv)[m], np.asarray(want_tv)[m], atol=2e-5)
    # A narrower window coarsens: its KL is a lower bound.
    narrow = {**batch, "top_logp": batch["top_logp"][..., :4], "top_ids": batch["top_ids"][..., :4]}
    kl4, _, _, _ = window_terms(head, narrow)
    assert np.all(np.asarray(kl4)[m] <= np.asarray(want_kl)[m] + 1e-5)
    assert np.mean(np.asarray(kl4)[m] < np.asarray(want_kl)[m] - 1e-3) > 0.5


@pytest.mark.slow
def test_training_on_records_lowers_kl_and_resumes_exactly(target, tmp_path):
    seqs = _sequences(24)
    store = head_data.write_store(target, seqs, tmp_path / "s", _spec(top_k=16, batch_size=8))
    rec = store.load()
    objective = Objective("kl+greedy", rules.StrictGreedy(), tv_weight=0.5)
    new = lambda: EagleHead.from_target(target, rngs=nnx.Rngs(1), taps=TAPS)  # noqa: E731
    kw = dict(rule_names=store.spec.rules, steps=8, batch_size=4, learning_rate=3e-3, seed=0)
    head, history = train_head_on_records(new(), rec, objective, **kw)
    assert len(history) == 8
    assert history[-1]["kl"] < history[0]["kl"]

    class Stop(Exception):
        pass

    def crash(step, entry):
        if step == 5:
            raise Stop

    with pytest.raises(Stop):
        train_head_on_records(
            new(), rec, objective, checkpoint=tmp_path / "ck", every=3, log=crash, **kw
        )
    resumed, history2 = train_head_on_records(
        new(), rec, objective, checkpoint=tmp_path / "ck", every=3, **kw
    )
    assert len(history2) == 8
    np.testing.assert_allclose(
        [h["loss"] for h in history2], [h["loss"] for h in history], rtol=1e-5
    )
    a = jax.tree.leaves(nnx.state(head, nnx.Param))
    b = jax.tree.leaves(nnx.state(resumed, nnx.Param))
    for x, y in zip(a, b, strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=1e-6)
    with pytest.raises(ValueError, match="not among the store's rules"):
        train_head_on_records(new(), rec, Objective("x", rules.Additive(0.3)), **kw)


def test_heads_on_each_others_heldout_stores(target, tmp_path):
    """`evaluate_heads` (and scripts/compare_heads.py): each head on each store equals
    `evaluate_head` there, intervals bracket the means, differences are paired by sequence;
    a head of other taps is refused by name."""
    import json
    import pathlib

    from jaxcert.models.eagle import save_head
    from jaxcert.training import head_recipe
    from tests.helpers.scripts_loader import load_script

    stores = {
        "a": head_data.write_store(target, _sequences(5, seed=2), tmp_path / "a", _spec()),
        "b": head_data.write_store(target, _sequences(4, seed=3), tmp_path / "b", _spec()),
    }
    heads = {f"h{k}": EagleHead.from_target(target, rngs=nnx.Rngs(k), taps=TAPS) for k in (1, 2, 3)}
    pooled = {"h1": heads["h1"], "h2": heads["h2"], "h23": [heads["h2"], heads["h3"]]}
    result = head_recipe.evaluate_heads(pooled, stores, samples=500)
    for name, store in stores.items():
        got = result["stores"][name]
        records = store.load()
        assert got["sequences"] == records.tokens.shape[0]
        assert got["positions"] == store.positions
        per = {h: head_recipe.evaluate_head(heads[h], records, store.spec.rules) for h in heads}
        per["h23"] = {k: (per["h2"][k] + per["h3"][k]) / 2 for k in per["h2"]}  # seeds pooled
        for h in pooled:
            for metric, values in per[h].items():
                mean, low, high = got["heads"][h][metric]
                assert mean == pytest.approx(values.mean(), abs=1e-9)
                assert low <= mean <= high
        assert got["seeds"] == {"h1": 1, "h2": 1, "h23": 2}
        assert set(got["diff"]) == {"h2", "h23"}  # the first head is the baseline
        delta = per["h2"]["kl"] - per["h1"]["kl"]
        assert got["diff"]["h2"]["kl"][0] == pytest.approx(delta.mean(), abs=1e-9)
        assert not np.allclose(delta, 0.0)  # two different heads
    table = head_recipe.heads_table(result)
    assert len(table.splitlines()) == 2 + 6  # header, rule, 2 stores x 3 heads
    assert "| b (4 seq.) | h2 |" in table

    other = EagleHead.from_target(target, rngs=nnx.Rngs(0), taps=(1,))
    with pytest.raises(ValueError, match=r"head 'x' reads target blocks \(1,\), store 'a'"):
        head_recipe.evaluate_heads({"x": other}, {"a": stores["a"]})
    with pytest.raises(ValueError, match="at least one head"):
        head_recipe.evaluate_heads({}, stores)

    script = load_script("compare_heads")
    for k in (1, 2):
        save_head(heads[f"h{k}"], tmp_path / f"head{k}")
    out = tmp_path / "cmp.json"
    argv = ["--head", f"h1={tmp_path / 'head1'}", "--head", f"h2={tmp_path / 'head2'}",
            "--heldout", f"a={tmp_path / 'a'}", "--out", str(out)]  # fmt: skip
    assert script.main(argv) == 0
    saved = json.loads(out.read_text())
    want = result["stores"]["a"]["heads"]["h2"]["kl"][0]
    assert saved["stores"]["a"]["heads"]["h2"]["kl"][0] == pytest.approx(want, rel=1e-5)
    assert list(saved["stores"]) == ["a"] and set(saved["stores"]["a"]["diff"]) == {"h2"}
    with pytest.raises(SystemExit):
        script.parse_args(["--head", "nopath", "--heldout", "a=x"])
    with pytest.raises(SystemExit):
        script.parse_args(["--head", "h=x", "--head", "h=y", "--heldout", "a=x"])
    with pytest.raises(SystemExit):
        script.parse_args(["--head", "h=x", "--heldout", "a=x,y"])
    assert script.parse_args(["--head", "h=x,y", "--heldout", "a=z"]).head == [
        ("h", [pathlib.Path("x"), pathlib.Path("y")])
    ]


def test_reply_sequences_append_the_reply_and_the_end_token():
    tok = hf_tokenizer()
    end = tok.convert_tokens_to_ids("<|im_end|>")
    ps = [Prompt("a", "the cat", response="he is in"), Prompt("b", "no reply"),
          Prompt("c", "the cat sat on the mat " * 20, response="x")]  # fmt: skip
    seqs = head_data.reply_sequences(tok, ps, length=64, end_id=end)
    assert [s.id for s in seqs] == ["a"]  # no reply; a prompt over half the length
    text = tok.apply_chat_template(
        [{"role": "user", "content": "the cat"}], add_generation_prompt=True, tokenize=False
    )
    assert text.endswith("<|im_start|>assistant\n")
    prompt_ids = tok(text, add_special_tokens=False)["input_ids"]
    reply = tok("he is in", add_special_tokens=False)["input_ids"]
    assert list(seqs[0].tokens) == list(prompt_ids) + reply + [end]
    assert seqs[0].start == len(prompt_ids)


def _sharegpt(path, n, seed=0):
    import json

    rng = np.random.default_rng(seed)
    words = ["the", "cat", "sat", "on", "mat", "he", "is", "in", "an", "otter", "a", "b"]
    say = lambda k: " ".join(rng.choice(words, k))  # noqa: E731
    records = [
        {"id": f"c{i}", "conversations": [{"from": "human", "value": say(3)},
                                          {"from": "gpt", "value": say(int(rng.integers(4, 12)))}]}
        for i in range(n)
    ]  # fmt: skip
    path.write_text(json.dumps(records))
    return path


@pytest.mark.slow
def test_train_drafter_head_mode_end_to_end_and_resumes(tmp_path, capsys):
    """`jaxcert train-drafter --head eagle3` on a tiny checkpoint: stores, two objectives,
    held-out table with intervals, decoding at T = 0 and T = 1, saved heads that load; a
    second run retrains nothing and prints the same table."""
    import json

    from jaxcert.cli import main
    from jaxcert.models.eagle import load_head
    from tests.helpers.tiny_lm import save_tiny_checkpoint

    ckpt = save_tiny_checkpoint(tmp_path / "tiny")
    data = _sharegpt(tmp_path / "conv.json", 14)
    out = tmp_path / "out"
    argv = ["train-drafter", "--head", "eagle3", "--target", str(ckpt), "--prompts", str(data),
            "--positions", "30", "--heldout-sequences", "4", "--draft-vocab", "20",
            "--objectives", "kl,kl+tv", "--seeds", "0", "--train-steps", "4",
            "--decode-prompts", "2", "--decode-source", str(data), "--decode-tokens", "8",
            "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    first = capsys.readouterr().out
    summary = json.loads((out / "results.json").read_text())
    assert summary["training_positions"] >= 30 and summary["heldout_sequences"] == 4
    assert set(summary["objectives"]) == {"kl", "kl+tv"}
    kl = summary["objectives"]["kl"]
    assert kl["kl"][1] <= kl["kl"][0] <= kl["kl"][2]  # mean inside its interval
    assert 1.0 <= kl["T0_tokens_per_round"][0] <= 6.0 and 1.0 <= kl["T1_tokens_per_round"][0]
    assert "diff:kl" in summary["objectives"]["kl+tv"] and "diff:kl" not in kl
    head = load_head(out / "kl-seed0" / "head")
    assert head.taps == (0, 1) and head.draft_size == 20
    assert (out / "results.md").read_text().strip() == first.strip()
    assert main(argv) == 0  # everything is on disk: nothing is recomputed
    assert capsys.readouterr().out == first
    # Another run's settings (here a longer schedule; a grown store likewise changes the
    # records' digest): the finished heads are kept and not reused silently.
    longer = list(argv)
    longer[longer.index("--train-steps") + 1] = "6"
    assert main(longer) == 2
    assert re.search(r"kl-seed0 was written with other options: steps \(then \d+, now 6\); it "
                     "holds a head trained for another run", capsys.readouterr().err)  # fmt: skip
    assert main([*argv, "--ttt-depth", "2"]) == 2  # training-time test: another run too
    assert re.search(r"kl-seed0 was written with other options: ttt_depth \(then unset, now 2\)",
                     capsys.readouterr().err)  # fmt: skip
    assert (out / "kl-seed0" / "done.json").is_file()


def test_summary_pools_seeds_and_the_decoded_ones_only():
    """Per objective, seeds are averaged per held-out sequence; decoder figures pool the
    seeds that were decoded (``--decode-seeds``); paired differences are against ``kl``."""
    from types import SimpleNamespace

    from jaxcert.training import head_recipe

    def row(objective, seed, kl, tokens=None):
        decode = {}
        if tokens is not None:
            decode = {"T0": {"tokens_per_round": np.asarray(tokens, float)}}
        per = {"kl": np.asarray(kl, float), "agreement": np.asarray(kl, float) / 10}
        return {"objective": objective, "seed": seed, "head": f"{objective}-{seed}",
                "per_sequence": per, "decode": decode}  # fmt: skip

    rows = [
        row("kl", 0, [4.0, 6.0, 5.0], [1.2, 1.4]),
        row("kl", 1, [6.0, 8.0, 7.0]),
        row("kl+tv", 0, [3.0, 5.0, 4.0], [1.5, 1.5]),
        row("kl+tv", 1, [5.0, 7.0, 6.0]),
    ]
    store = SimpleNamespace(positions=100, sequences=3)
    summary = head_recipe.summarize(rows, store, head_recipe.HeadSettings())
    kl, tv = summary["objectives"]["kl"], summary["objectives"]["kl+tv"]
    assert kl["kl"][0] == pytest.approx(6.0) and tv["kl"][0] == pytest.approx(5.0)
    assert kl["seeds"] == [0, 1] and kl["decoded_seeds"] == [0]
    assert kl["T0_tokens_per_round"][0] == pytest.approx(1.3)
    assert tv["diff:kl"][0] == pytest.approx(-1.0) and tv["diff:kl"][2] == pytest.approx(-1.0)
    assert tv["diff:T0_tokens_per_round"][0] == pytest.approx(0.2)
    table = head_recipe.results_table(summary)
    assert "-1.0000 [-1.0000, -1.0000]*" in table and "decoded_seeds" not in table


# Greedy continuations as training text: generated in chunks, streamed to a cache, resumed.

GREEDY_LENGTH = 64


@pytest.fixture(scope="module")
def greedy_target(tmp_path_factory):
    from jaxcert import models
    from tests.helpers.tiny_lm import save_tiny_checkpoint

    return models.load(str(save_tiny_checkpoint(tmp_path_factory.mktemp("greedy") / "t")))


def _greedy_prompts():
    # Templated: 25, 23, 36 (over half of 64 tokens: left out), 24, 22, 21 tokens; "p1" twice.
    texts = [("p0", "an otter"), ("p1", "a, b?"), ("long", "the cat sat on the mat."),
             ("p1", "the cat"), ("p3", "he is"), ("p4", "a b")]  # fmt: skip
    return [Prompt(i, t) for i, t in texts]


GREEDY_KEYS = ["p0", "p1", "p1#1", "p3", "p4"]  # the fitting prompts, in order


class _Interrupted(Exception):
    pass


def _count_generations(monkeypatch, fail_at=None):
    """Records the prompt ids of every call of `features.greedy_continuations`; the call
    number ``fail_at`` (1-based) raises instead, like a run stopped there."""
    from jaxcert.training import features

    real = features.greedy_continuations
    calls = []
    made = iter(range(1, 1_000))  # call numbers, whatever the test clears from `calls`

    def counted(lm, prompt_set, **kw):
        calls.append([p.id for p in prompt_set])
        if next(made) == fail_at:
            raise _Interrupted
        return real(lm, prompt_set, **kw)

    monkeypatch.setattr(features, "greedy_continuations", counted)
    return calls


def _greedy(target, path=None, **kw):
    return head_data.greedy_sequences(
        target, _greedy_prompts(), length=GREEDY_LENGTH, batch_size=2, chunk=2, cache=path, **kw
    )


@pytest.fixture(scope="module")
def greedy_whole(greedy_target):
    """An uninterrupted run without a cache."""
    return _greedy(greedy_target)


def test_greedy_sequences_are_prompt_then_continuation(greedy_target, greedy_whole):
    from jaxcert.base import prompts as prompts_lib

    tok = greedy_target.tokenizer
    ps = _greedy_prompts()
    assert [p.id for p in head_data.unique_ids(ps)] == ["p0", "p1", "long", "p1#1", "p3", "p4"]
    fit = head_data.fitting_prompts(tok, head_data.unique_ids(ps), length=GREEDY_LENGTH)
    assert [p.id for p in fit] == GREEDY_KEYS
    assert [s.id for s in greedy_whole] == GREEDY_KEYS
    encoded = prompts_lib.encode_prompts(tok, [p for p in ps if p.id != "long"])
    eos = set(greedy_target.eos_ids)
    for s, ids in zip(greedy_whole, encoded, strict=True):
        assert s.start == len(ids) and list(s.tokens[: s.start]) == ids
        # Cut at the length, or ended by the target's end-of-turn token.
        assert len(s.tokens) == GREEDY_LENGTH or s.tokens[-1] in eos
        assert len(s.tokens) > s.start


def test_greedy_sequences_resume_from_the_cache(greedy_target, greedy_whole, tmp_path, monkeypatch):
    import json

    path = tmp_path / "out" / "greedy.jsonl"
    calls = _count_generations(monkeypatch, fail_at=2)
    with pytest.raises(_Interrupted):
        _greedy(greedy_target, path)
    assert calls == [["p0", "p1"], ["p1#1", "p3"]]
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert lines[0] == {"target": str(greedy_target.path), "length": GREEDY_LENGTH}
    assert [r["key"] for r in lines[1:]] == ["p0", "p1"]  # the first chunk, on disk
    for r, s in zip(lines[1:], greedy_whole, strict=False):
        assert r["prompt"] + r["generated"] == list(s.tokens) and len(r["prompt"]) == s.start

    calls.clear()
    reported = []
    resumed = _greedy(greedy_target, path, progress=lambda *a: reported.append(a))
    assert calls == [["p1#1", "p3"], ["p4"]]  # only the missing prompts
    assert resumed == greedy_whole
    trained = [len(s.tokens) - s.start for s in greedy_whole]
    # First the cached positions, then after each chunk; no goal without max_positions.
    assert reported == [(sum(trained[:2]), -1), (sum(trained[:4]), -1), (sum(trained), -1)]
    assert [json.loads(line)["key"] for line in path.read_text().splitlines()[1:]] == GREEDY_KEYS

    calls.clear()
    assert _greedy(greedy_target, path) == greedy_whole and calls == []  # nothing to generate

    # max_positions: generation stops after the chunk that reaches it.
    calls.clear()
    part = _greedy(greedy_target, tmp_path / "part.jsonl", max_positions=trained[0])
    assert calls == [["p0", "p1"]] and part == greedy_whole[:2]
    # The cached continuations are always used, past the goal too.
    assert _greedy(greedy_target, path, max_positions=1) == greedy_whole and calls == [["p0", "p1"]]


def test_greedy_cache_drops_a_torn_last_line(greedy_target, greedy_whole, tmp_path, monkeypatch):
    path = tmp_path / "greedy.jsonl"
    _greedy(greedy_target, path)
    good = path.read_bytes()
    last = good.rstrip(b"\n").rsplit(b"\n", 1)[1] + b"\n"  # p4's line, a chunk of its own
    path.write_bytes(good[: -len(last)] + last[:20])  # a crash in the middle of that write
    calls = _count_generations(monkeypatch)
    assert _greedy(greedy_target, path) == greedy_whole
    assert calls == [["p4"]]
    assert path.read_bytes() == good


def test_greedy_cache_refuses_what_it_cannot_reuse(greedy_target, tmp_path, monkeypatch):
    import json

    path = tmp_path / "greedy.jsonl"
    _greedy(greedy_target, path)
    lines = path.read_text().splitlines(keepends=True)
    calls = _count_generations(monkeypatch)

    def refused(text, match, **kw):
        path.write_text(text)
        with pytest.raises(ValueError, match=match):
            _greedy(greedy_target, path, **kw)
        assert path.read_text() == text  # left as it was
        assert calls == []

    header = json.dumps({"target": "/other/model", "length": GREEDY_LENGTH}) + "\n"
    refused(header + "".join(lines[1:]),
            r"holds greedy continuations of another run \(target /other/model, length 64\), "
            rf"not of target {re.escape(str(greedy_target.path))}, length 64")  # fmt: skip
    path.write_text("".join(lines))
    with pytest.raises(
        ValueError, match=r"another run \(target .*, length 64\), not of .*, length 80"
    ):
        head_data.greedy_sequences(greedy_target, _greedy_prompts(), length=80, cache=path)
    assert path.read_text() == "".join(lines) and calls == []
    record = json.loads(lines[2])
    assert record["key"] == "p1"
    changed = json.dumps(record | {"prompt": record["prompt"][:-1]}) + "\n"  # another template
    refused("".join(lines[:2]) + changed + "".join(lines[3:]),
            "prompt 'p1' was cached with other template tokens")  # fmt: skip
    garbage = "".join(lines[:2]) + "not a continuation\n" + "".join(lines[2:])
    refused(garbage, "line 3 is not a cached continuation")
    refused(garbage + '{"key": "p9", "prom', "line 3 is not a cached continuation")  # and torn
    refused('{"target": 1}\n' + "".join(lines[1:]), "line 1 is not a cached continuation header")


def test_head_recipe_holds_out_the_last_fitting_prompts_generated_first(
    greedy_target, tmp_path, monkeypatch
):
    from jaxcert.training import head_recipe

    settings = head_recipe.HeadSettings(data="greedy", length=GREEDY_LENGTH, heldout=2, positions=1)
    calls = _count_generations(monkeypatch)
    seqs = head_recipe.sequences(
        greedy_target, _greedy_prompts(), settings, cache=tmp_path / "greedy.jsonl"
    )
    # Held out first (whole), then training prompts in order until 1 position: one chunk.
    assert calls == [["p3", "p4"], ["p0", "p1", "p1#1"]]
    train, held = head_recipe.split_sequences(seqs, settings.heldout)
    assert [s.id for s in train] == ["p0", "p1", "p1#1"] and [s.id for s in held] == ["p3", "p4"]
    calls.clear()
    again = head_recipe.sequences(
        greedy_target, _greedy_prompts(), settings, cache=tmp_path / "greedy.jsonl"
    )
    assert again == seqs and calls == []
    too_many = dataclasses.replace(settings, heldout=5)
    with pytest.raises(ValueError, match=r"5 prompts fit 64 tokens: too few to hold out 5 "
                                         r"\(more prompts: --prompts, --max-prompts"):  # fmt: skip
        head_recipe.sequences(greedy_target, _greedy_prompts(), too_many)


def test_published_eagle3_head_trains_on_records_with_exact_window_terms(tmp_path):
    """An ``arch="eagle3"`` head: its window KL (lm_head after the final norm, the shared
    outside logit) equals the full-vocabulary KL of its ``outside="oov"`` logits, and
    training on records lowers it."""
    from jaxcert.decoding.protocols import context_before

    deep = random_model(tiny_config(vocab_size=V, num_layers=4, max_position_embeddings=64))
    taps = (0, 1, 2)
    seqs = _sequences(6, seed=3)
    store = head_data.write_store(
        deep, seqs, tmp_path / "s", _spec(taps=taps, top_k=V, batch_size=6)
    )
    rec = store.load()
    head = EagleHead.from_target(
        deep, rngs=nnx.Rngs(2), taps=taps, draft_vocab=np.arange(0, V, 2), arch="eagle3"
    )
    batch = {k: jnp.asarray(getattr(rec, k)) for k in ("tokens", "states", "top_logp", "top_ids")}
    batch["certificate"] = jnp.asarray(rec.certificate)
    kl, _, _, _ = window_terms(head, batch)
    b, t = batch["tokens"].shape
    q_logits, _ = head(
        batch["tokens"], head.init_cache(b, t), context=context_before(head, batch["states"]),
        outside="oov",
    )  # fmt: skip
    lengths = np.asarray([len(s.tokens) for s in seqs])
    direct = target_states(deep, np.asarray(rec.tokens), lengths, taps)
    want = losses.kl_divergence(drafter_logits=q_logits, target_logits=direct.logits)
    m = rec.mask
    np.testing.assert_allclose(np.asarray(kl)[m], np.asarray(want)[m], atol=2e-4, rtol=1e-4)
    objective = Objective("kl+tv", tv_weight=1.0)
    kw = dict(rule_names=store.spec.rules, steps=6, batch_size=3, learning_rate=3e-3, seed=0)
    trained, history = train_head_on_records(head, rec, objective, **kw)
    assert history[-1]["kl"] < history[0]["kl"]
    assert trained.arch == "eagle3" and trained.outside == "-inf"
