"""Training-time test: the head's later drafted tokens, unrolled over a teacher-forced
sequence, against the decoder's own way of drafting them (the head's cache, one token at a
time, each reading the previous draft's hidden state), and the depth-aware loss and
evaluation (tiny target)."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxcert.decoding.protocols import context_before
from jaxcert.models import EagleHead
from jaxcert.training import head_data, head_recipe
from jaxcert.training.eagle import (
    train_head_on_records,
    unroll_mask,
    unrolled_features,
    unrolled_window_terms,
    window_loss,
    window_terms,
)
from jaxcert.training.train import Objective
from tests.helpers.tiny_models import random_model, tiny_config

V = 48
TAPS = (0, 1)


@pytest.fixture(scope="module")
def target():
    return random_model(tiny_config(vocab_size=V, num_layers=2, max_position_embeddings=64))


@pytest.fixture(scope="module")
def records(target, tmp_path_factory):
    rng = np.random.default_rng(0)
    seqs = []
    for i in range(5):
        start = int(rng.integers(2, 5))
        length = int(rng.integers(start + 6, 20))
        seqs.append(head_data.TrainingSequence(str(i), tuple(rng.integers(0, V, length)), start))
    spec = head_data.StoreSpec(target="tiny", taps=TAPS, length=20, top_k=8, batch_size=5)
    return head_data.write_store(target, seqs, tmp_path_factory.mktemp("s") / "s", spec).load()


def _head(target, seed=1, **kw):
    return EagleHead.from_target(target, rngs=nnx.Rngs(seed), taps=TAPS, **kw)


def _mask_reference(t, d):
    """The mask from its definition, entry by entry."""
    n = d * t
    out = np.zeros((n, n), bool)
    for k in range(d):
        for i in range(t):
            for j in range(d):
                for u in range(t):
                    if j == 0:
                        out[k * t + i, u] = u <= i - k
                    elif j <= k:
                        out[k * t + i, j * t + u] = u == i - k + j
    return out


@pytest.mark.parametrize("t,d", [(1, 1), (5, 1), (5, 2), (6, 3), (3, 4)])
def test_unroll_mask_is_its_definition(t, d):
    got = unroll_mask(t, d)
    np.testing.assert_array_equal(got, _mask_reference(t, d))
    assert got.diagonal().all()  # every token sees itself: no empty softmax row
    np.testing.assert_array_equal(unroll_mask(t, 1), np.tril(np.ones((t, t), bool)))


def test_unroll_mask_refuses_bad_sizes():
    with pytest.raises(ValueError, match="length must be an integer >= 1, got 0"):
        unroll_mask(0, 2)
    with pytest.raises(ValueError, match="depth must be an integer >= 1, got 0"):
        unroll_mask(4, 0)


@pytest.mark.parametrize("draft_vocab", [None, np.arange(0, V, 3)], ids=["full", "third"])
def test_unrolled_passes_equal_the_decoders_drafts(target, records, draft_vocab):
    """Pass k at t is the (k+1)-th token drafted after x_0..x_{t-k}, as the decoder drafts
    it: the head's cache filled with the target-fed slots, then one token at a time, each
    reading the previous draft's hidden state (`jaxcert.decoding.draft`)."""
    head = _head(target, draft_vocab=draft_vocab)
    depth = 3
    tokens = jnp.asarray(records.tokens[:2])
    states = jnp.asarray(records.states[:2])
    got = np.asarray(unrolled_features(head, tokens, states, depth))  # [D, b, T, E]
    b, t = tokens.shape
    context = context_before(head, states)
    for row in range(b):
        n = int(records.length[row])
        for s in range(0, n - depth + 1, 2):  # the round's last accepted token x_s
            cache = head.init_cache(1, t)
            hidden, cache = head.features(
                tokens[row : row + 1, : s + 1], cache, context=context[row : row + 1, : s + 1]
            )
            cache = cache.commit(jnp.asarray([s + 1]))
            h = hidden[:, -1]  # [1, E]
            np.testing.assert_allclose(got[0, row, s], np.asarray(h[0]), atol=2e-5, rtol=2e-5)
            for k in range(1, depth):
                hidden, cache = head.features(
                    tokens[row : row + 1, s + k : s + k + 1], cache, context=h[:, None]
                )
                cache = cache.commit(jnp.asarray([1]))
                h = hidden[:, 0]
                np.testing.assert_allclose(
                    got[k, row, s + k], np.asarray(h[0]), atol=2e-5, rtol=2e-5
                )
    # Depth 1 is plain teacher forcing, and deeper unrolls keep pass 0 unchanged.
    one = np.asarray(unrolled_features(head, tokens, states, 1))
    plain, _ = head.features(tokens, head.init_cache(b, t), context=context)
    np.testing.assert_array_equal(one[0], np.asarray(plain))
    np.testing.assert_allclose(got[0], one[0], atol=2e-5, rtol=2e-5)
    # Later passes differ from pass 0: they read the head's own states.
    assert np.abs(got[1] - got[0]).max() > 1e-2


def test_window_terms_are_the_first_unrolled_pass(target, records):
    head = _head(target)
    batch = records.batch(slice(0, 3))
    kl, tv, cert, top = unrolled_window_terms(head, batch, 2)
    assert kl.shape == tv.shape == top.shape == (2,) + batch["tokens"].shape
    kl1, tv1, cert1, top1 = window_terms(head, batch)
    m = np.asarray(batch["mask"])
    np.testing.assert_allclose(np.asarray(kl[0])[m], np.asarray(kl1)[m], atol=2e-5, rtol=1e-4)
    np.testing.assert_allclose(np.asarray(tv[0])[m], np.asarray(tv1)[m], atol=2e-6)
    np.testing.assert_array_equal(np.asarray(cert), np.asarray(cert1))
    assert np.mean(np.asarray(top[0])[m] == np.asarray(top1)[m]) > 0.99  # float ties aside


def test_depth_loss_is_the_decayed_mean_of_the_passes(target, records):
    head = _head(target)
    batch = records.batch(slice(0, 4))
    objective = Objective("kl+tv", tv_weight=1.0)
    kl, tv, _, _ = unrolled_window_terms(head, batch, 3)
    mask = np.asarray(batch["mask"])
    t = np.arange(mask.shape[1])
    per_pass = []
    for k in range(3):
        mk = mask & (t >= k)[None, :]
        per_pass.append(np.asarray(kl[k])[mk].mean() + np.asarray(tv[k])[mk].mean())
    want = sum(0.5**k * v for k, v in enumerate(per_pass)) / sum(0.5**k for k in range(3))
    loss, (kl0, _, tv0) = window_loss(head, batch, objective, None, depth=3, decay=0.5)
    np.testing.assert_allclose(float(loss), want, rtol=1e-5)
    one, (kl1, _, tv1) = window_loss(head, batch, objective, None)
    np.testing.assert_allclose([float(kl0), float(tv0)], [float(kl1), float(tv1)], rtol=1e-5)
    np.testing.assert_allclose(float(one), per_pass[0], rtol=1e-5)
    # The loss's gradient reaches the later passes: depth 3 moves the head otherwise.
    diff = nnx.DiffState(0, nnx.Param)
    g1 = nnx.grad(lambda h: window_loss(h, batch, objective, None)[0], argnums=diff)(head)
    g3 = nnx.grad(lambda h: window_loss(h, batch, objective, None, 3, 0.5)[0], argnums=diff)(head)
    fc1, fc3 = np.asarray(g1["fc"].get_value()), np.asarray(g3["fc"].get_value())
    assert np.abs(fc1 - fc3).max() > 1e-3 * np.abs(fc1).max()


def test_training_with_depth_lowers_the_second_tokens_kl(target, records):
    """Training on two passes lowers the second drafted token's KL more than teacher forcing
    over the same steps (the first pass gets both)."""
    rules_ = ("greedy", "tree:4")
    plain = train_head_on_records(
        _head(target), records, Objective("kl"), rule_names=rules_, steps=40,
        batch_size=5, learning_rate=3e-3,
    )[0]  # fmt: skip
    ttt = train_head_on_records(
        _head(target), records, Objective("kl"), rule_names=rules_, steps=40,
        batch_size=5, learning_rate=3e-3, depth=2, decay=1.0,
    )[0]  # fmt: skip
    before = head_recipe.evaluate_head(_head(target), records, rules_, depth=2)
    a = head_recipe.evaluate_head(plain, records, rules_, depth=2)
    b = head_recipe.evaluate_head(ttt, records, rules_, depth=2)
    assert b["kl@2"].mean() < a["kl@2"].mean() < before["kl@2"].mean()
    assert a["kl"].mean() < before["kl"].mean() and b["kl"].mean() < before["kl"].mean()
    with pytest.raises(ValueError, match="depth must be an integer >= 1, got 0"):
        train_head_on_records(_head(target), records, Objective("kl"), rule_names=rules_,
                              steps=1, depth=0)  # fmt: skip
    with pytest.raises(ValueError, match="decay must be in"):
        train_head_on_records(_head(target), records, Objective("kl"), rule_names=rules_,
                              steps=1, depth=2, decay=0.0)  # fmt: skip


def test_evaluate_head_by_depth_against_a_direct_count(target, records):
    head = _head(target)
    rules_ = ("greedy", "tree:4")
    got = head_recipe.evaluate_head(head, records, rules_, depth=3)
    first = head_recipe.evaluate_head(head, records, rules_)
    for k in first:  # depth adds metrics, and leaves the first token's as they were
        np.testing.assert_allclose(got[k], first[k], rtol=1e-5, atol=1e-6)
    assert set(got) - set(first) == {"kl@2", "agreement@2", "kl@3", "agreement@3", "accepted@3"}
    for i in range(records.tokens.shape[0]):
        batch = records.batch(slice(i, i + 1))
        kl, _, _, top = (np.asarray(x) for x in unrolled_window_terms(head, batch, 3))
        greedy = records.top_ids[i, :, 0]
        m = records.mask[i]
        trained = np.flatnonzero(m)
        hits, counts, kls = [], [], []
        for s in trained:  # rounds of 3 drafts starting at s, by hand
            if s + 2 > trained[-1]:
                continue
            n = 0
            for k in range(3):
                if top[k, 0, s + k] != greedy[s + k]:
                    break
                n += 1
            counts.append(n)
        for k in (1, 2):
            pos = [t for t in trained if t >= k]
            hits.append(np.mean([top[k, 0, t] == greedy[t] for t in pos]))
            kls.append(np.mean([kl[k, 0, t] for t in pos]))
        np.testing.assert_allclose(got["accepted@3"][i], np.mean(counts), rtol=1e-12)
        np.testing.assert_allclose([got["agreement@2"][i], got["agreement@3"][i]], hits)
        np.testing.assert_allclose([got["kl@2"][i], got["kl@3"][i]], kls, rtol=1e-5)
    with pytest.raises(ValueError, match="depth must be an integer >= 1, got 0"):
        head_recipe.evaluate_head(head, records, rules_, depth=0)


def test_ttt_depth_setting_is_checked_and_keyed(records):
    with pytest.raises(ValueError, match="ttt_depth must be an integer >= 1, got 0"):
        head_recipe.HeadSettings(ttt_depth=0)
    objective = Objective("kl")
    key1 = head_recipe.run_key(records, objective, 0, head_recipe.HeadSettings(), None)
    key2 = head_recipe.run_key(records, objective, 0, head_recipe.HeadSettings(ttt_depth=2), None)
    assert "ttt_depth" not in key1  # folders trained before the option keep their keys
    assert key2 == key1 | {"ttt_depth": 2}


def test_jitted_unroll_matches_eager(target, records):
    head = _head(target)
    batch = records.batch(slice(0, 2))
    eager = unrolled_window_terms(head, batch, 2)
    jitted = nnx.jit(unrolled_window_terms, static_argnums=2)(head, batch, 2)
    for a, b in zip(eager, jitted, strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=1e-5)


def test_finetune_script_trains_resumes_and_compares_by_depth(target, records, tmp_path):
    """scripts/finetune_head.py continues a saved head (depth 2), resumes without redoing
    steps, refuses other options in its folder; compare_heads --depth reports the later
    tokens' metrics of both heads."""
    import json

    from jaxcert.models.eagle import load_head, save_head
    from tests.helpers.scripts_loader import load_script

    spec = head_data.StoreSpec(target="tiny", taps=TAPS, length=20, top_k=8, batch_size=5)
    rng = np.random.default_rng(5)
    seqs = [head_data.TrainingSequence(str(i), tuple(rng.integers(0, V, 14)), 3) for i in range(4)]
    head_data.write_store(target, seqs, tmp_path / "store", spec)
    save_head(_head(target), tmp_path / "h0")
    script = load_script("finetune_head")
    argv = ["--head", str(tmp_path / "h0"), "--store", str(tmp_path / "store"), "--depth", "2",
            "--steps", "3", "--every", "2", "--learning-rate", "1e-2",
            "--out", str(tmp_path / "ft")]  # fmt: skip
    assert script.main(argv) == 0
    progress = json.loads((tmp_path / "ft" / "progress.json").read_text())
    assert progress["step"] == 3 and len(progress["history"]) == 3
    tuned = load_head(tmp_path / "ft" / "head")
    before = np.asarray(load_head(tmp_path / "h0").fc.get_value())
    assert np.abs(np.asarray(tuned.fc.get_value()) - before).max() > 1e-4
    assert script.main(argv) == 0  # finished: resumes at step 3, trains nothing more
    assert json.loads((tmp_path / "ft" / "progress.json").read_text()) == progress
    with pytest.raises(SystemExit, match="other options"):
        script.main([*argv[:5], "1", *argv[6:]])  # --depth 1 in the same folder
    with pytest.raises(SystemExit):
        script.parse_args([*argv[:5], "0", *argv[6:]])
    with pytest.raises(SystemExit):
        script.parse_args([*argv, "--decay", "1.5"])

    compare = load_script("compare_heads")
    out = tmp_path / "cmp.json"
    cmp_argv = ["--head", f"h0={tmp_path / 'h0'}", "--head", f"ft={tmp_path / 'ft' / 'head'}",
                "--heldout", f"s={tmp_path / 'store'}", "--depth", "2",
                "--out", str(out)]  # fmt: skip
    assert compare.main(cmp_argv) == 0
    saved = json.loads(out.read_text())["stores"]["s"]
    direct = head_recipe.evaluate_head(tuned, head_data.read_store(tmp_path / "store").load(),
                                       spec.rules, depth=2)  # fmt: skip
    assert saved["heads"]["ft"]["agreement@2"][0] == pytest.approx(direct["agreement@2"].mean())
    assert saved["heads"]["ft"]["accepted@2"][0] == pytest.approx(direct["accepted@2"].mean())
    assert "kl@2" in saved["diff"]["ft"]
    with pytest.raises(SystemExit):
        compare.parse_args([*cmp_argv[:7], "0", *cmp_argv[8:]])
