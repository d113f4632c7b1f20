"""Fine-tuning a language-model drafter's top blocks on a target's records (tiny models):
the window terms and objectives against `jaxcert.losses` and NumPy, the split forward, the
drafter-states store, training, resuming and data parallelism."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.test_util import check_grads

from jaxcert import losses
from jaxcert.core import rules as R
from jaxcert.training import drafter_states, finetune, head_data
from tests.helpers import multidevice
from tests.helpers.tiny_models import random_model, tiny_config

V = 48
L = 4
RULES = ("greedy", "tree:4")


@pytest.fixture(scope="module")
def pair():
    config = tiny_config(vocab_size=V, num_layers=L, max_position_embeddings=64)
    return random_model(config, seed=0), random_model(config, seed=7)


def _sequences(n=6, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        start = int(rng.integers(2, 6))
        length = int(rng.integers(start + 5, 21))
        out.append(head_data.TrainingSequence(str(i), tuple(rng.integers(0, V, length)), start))
    return out


@pytest.fixture(scope="module")
def stores(pair, tmp_path_factory):
    target, drafter = pair
    root = tmp_path_factory.mktemp("ft")
    spec = head_data.StoreSpec(
        target="tiny", taps=(), length=20, top_k=V, batch_size=2, states=False
    )
    store = head_data.write_store(target, _sequences(), root / "store", spec)
    states = drafter_states.write_drafter_states(
        drafter, store, root / "states", blocks=2, name="d"
    )
    return store, states


# ----------------------------------------------------------------- terms and objectives


def _np_terms(logits, target_logits):
    logits, target_logits = np.asarray(logits, np.float64), np.asarray(target_logits, np.float64)
    lq = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True))
    lq -= logits.max(-1, keepdims=True)
    lp = target_logits - target_logits.max(-1, keepdims=True)
    lp -= np.log(np.exp(lp).sum(-1, keepdims=True))
    p, q = np.exp(lp), np.exp(lq)
    return (p * (lp - lq)).sum(-1), 0.5 * np.abs(p - q).sum(-1)


def test_window_terms_over_the_whole_vocabulary_are_kl_and_tv():
    rng = np.random.default_rng(1)
    target = jnp.asarray(rng.normal(0, 2, (5, V)), jnp.float32)
    logits = target + jnp.asarray(rng.normal(0, 1, (5, V)), jnp.float32)
    log_p = jax.nn.log_softmax(target)
    top_logp, top_ids = jax.lax.top_k(log_p, V)
    kl, tv, top = finetune.window_terms(logits, top_ids, top_logp)
    want_kl, want_tv = _np_terms(logits, target)
    np.testing.assert_allclose(kl, want_kl, rtol=1e-5, atol=3e-5)  # float32 rest bucket
    np.testing.assert_allclose(tv, want_tv, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(top, np.argmax(np.asarray(logits), -1))
    # a narrower window is a lower bound on both
    kl8, tv8, _ = finetune.window_terms(logits, top_ids[:, :8], top_logp[:, :8])
    assert np.all(np.asarray(kl8) <= want_kl + 1e-5) and np.all(np.asarray(tv8) <= want_tv + 1e-6)
    assert np.any(np.asarray(kl8) < want_kl - 1e-3)


@pytest.mark.parametrize("name", list(finetune.OBJECTIVES))
def test_objectives_are_the_losses_of_jaxcert_losses_over_the_whole_vocabulary(name):
    """With the whole vocabulary as the window, each objective per position is KL plus the
    `jaxcert.losses` term of the same name, and its gradient is exact (float64)."""
    objective = finetune.OBJECTIVES[name]
    with jax.enable_x64(True):
        rng = np.random.default_rng(2)
        target = jnp.asarray(rng.normal(0, 2.5, (12, V)))
        logits = target + jnp.asarray(rng.normal(0, 0.6, (12, V)))
        top_logp, top_ids = jax.lax.top_k(jax.nn.log_softmax(target), V)
        rule = None if objective.rule is None else R.parse_rule(objective.rule)
        c = None if rule is None else losses.certificate_value(target, rule)

        def ours(z):
            kl, tv, _ = finetune.window_terms(z, top_ids, top_logp)
            return objective.loss(kl, tv, c)

        kl = losses.kl_divergence(logits, target)
        extra = {
            "kl": jnp.zeros_like(kl),
            "kl+tv": losses.rejection_rate(logits, target),
            "kl+greedy": losses.certificate_violation(logits, target, R.StrictGreedy()),
            "kl+tree4": losses.certificate_violation(logits, target, R.TreeCoverage(4)),
            "kl+miss": losses.certificate_miss(logits, target, R.StrictGreedy(), temperature=0.1),
        }[name]
        np.testing.assert_allclose(ours(logits), kl + extra, rtol=1e-9, atol=1e-10)
        if rule is not None:  # the term must be neither always on nor always off here
            certified = np.asarray(kl < c)
            assert 0 < certified.sum() < len(certified)
        check_grads(
            lambda z: jnp.sum(ours(z)),
            (logits,),
            order=1,
            modes=["rev"],
            eps=1e-6,
            atol=1e-6,
            rtol=1e-5,
        )


def test_objective_active_fractions_and_refusals():
    kl = jnp.array([0.1, 0.5, 0.95, 3.0])
    c = jnp.array([0.3, 0.4, 1.0, jnp.inf])
    hinge = finetune.OBJECTIVES["kl+greedy"]
    miss = finetune.OBJECTIVES["kl+miss"]
    np.testing.assert_array_equal(hinge.active(kl, c), [False, True, False, False])
    np.testing.assert_array_equal(miss.active(kl, c), [True, True, True, False])
    assert float(miss.term(kl, kl, c)[3]) == 0.0 and float(hinge.term(kl, kl, c)[3]) == 0.0
    assert not finetune.OBJECTIVES["kl"].active(kl, c).any()
    with pytest.raises(ValueError, match="kind must be"):
        finetune.FinetuneObjective("x", "cvar")
    with pytest.raises(ValueError, match="needs a rule"):
        finetune.FinetuneObjective("x", "hinge")
    with pytest.raises(ValueError, match="temperature"):
        finetune.FinetuneObjective("x", "miss", "greedy", temperature=0.0)


# ----------------------------------------------------------------- states and the split forward


def test_stored_states_and_the_top_blocks_are_the_drafters_forward(pair, stores):
    """Bottom states + the top blocks (+ final norm) = the drafter's own final states."""
    _, drafter = pair
    store, states = stores
    records = store.load()
    x = states.load()
    assert x.shape == (*records.tokens.shape, drafter.config.hidden_size)
    tokens = jnp.asarray(records.tokens)
    full, _ = drafter.features(tokens, drafter.init_cache(*tokens.shape))
    top = finetune._top_hidden(drafter, jnp.asarray(x), 2)
    np.testing.assert_allclose(top, full, rtol=2e-5, atol=2e-5)


def test_drafter_states_resume_and_refuse(pair, stores, tmp_path):
    target, drafter = pair
    store, states = stores
    again = drafter_states.write_drafter_states(drafter, store, states.folder, blocks=2, name="d")
    assert again.shards == states.shards  # nothing rewritten
    with pytest.raises(ValueError, match="other options: blocks"):
        drafter_states.write_drafter_states(drafter, store, states.folder, blocks=1, name="d")
    with pytest.raises(ValueError, match=r"blocks must be in \[1, 4\)"):
        drafter_states.write_drafter_states(drafter, store, tmp_path / "x", blocks=4, name="d")
    # a store that grew: only the new shard is computed
    bigger = head_data.write_store(target, _sequences(8), tmp_path / "s", store.spec)
    first = drafter_states.write_drafter_states(
        drafter,
        head_data.Store(bigger.folder, bigger.spec, bigger.shards[:2]),
        tmp_path / "st",
        blocks=2,
        name="d",
    )
    grown = drafter_states.write_drafter_states(
        drafter, bigger, tmp_path / "st", blocks=2, name="d"
    )
    assert len(first.shards) == 2 and len(grown.shards) == 4
    np.testing.assert_array_equal(grown.load()[:4], first.load())


# ----------------------------------------------------------------- training


SETTINGS = finetune.FinetuneSettings(
    trained_blocks=1, steps=6, batch_size=2, learning_rate=3e-3, every=3
)


def _train(pair, stores, name="kl+greedy", **kw):
    _, drafter = pair
    store, states = stores
    kw.setdefault("settings", SETTINGS)
    return finetune.finetune_drafter(
        drafter,
        store.load(),
        states.load(),
        finetune.OBJECTIVES[name],
        rule_names=RULES,
        first=2,
        seed=0,
        **kw,
    )


def test_training_lowers_the_loss_and_moves_only_the_top(pair, stores):
    _, drafter = pair
    settings = finetune.FinetuneSettings(
        trained_blocks=1, steps=30, batch_size=6, learning_rate=3e-3, every=10
    )
    trainable, progress = _train(pair, stores, "kl", settings=settings)
    history = progress["history"]
    assert len(history) == 30 and history[-1]["step"] == 30
    assert history[-1]["kl"] < 0.8 * history[0]["kl"]  # the same 6 sequences every step
    assert {"certified:greedy", "certified:tree:4", "agreement", "active"} <= history[0].keys()
    tuned = finetune.merged_drafter(drafter, trainable, trained_blocks=1)
    before, after = nnx.state(drafter, nnx.Param), nnx.state(tuned, nnx.Param)
    moved = {
        jax.tree_util.keystr(p)
        for (p, a), b in zip(
            jax.tree_util.tree_flatten_with_path(before)[0], jax.tree.leaves(after), strict=True
        )
        if not np.array_equal(a, b)
    }
    assert moved and all("[3]" in m or m.startswith("['norm']") for m in moved), moved
    assert any(m.startswith("['norm']") for m in moved)


def test_an_interrupted_run_resumes_where_it_stopped(pair, stores, tmp_path):
    straight, _ = _train(pair, stores, folder=tmp_path / "a")

    class Stop(Exception):
        pass

    def stop_at_5(step, entry):
        if step == 5:
            raise Stop

    with pytest.raises(Stop):
        _train(pair, stores, folder=tmp_path / "b", log=stop_at_5)
    saved = json.loads((tmp_path / "b" / "checkpoint" / "progress.json").read_text())
    assert saved["step"] == 3
    resumed, progress = _train(pair, stores, folder=tmp_path / "b")
    assert [h["step"] for h in progress["history"]] == list(range(1, 7))
    for a, b in zip(jax.tree.leaves(straight), jax.tree.leaves(resumed), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    assert (tmp_path / "b" / "done.json").is_file()


def test_a_folder_of_another_run_is_refused(pair, stores, tmp_path):
    store, states = stores
    key = finetune.run_key(store, states, finetune.OBJECTIVES["kl"], 0, SETTINGS)
    _train(
        pair,
        stores,
        "kl",
        folder=tmp_path,
        key=key,
        settings=finetune.FinetuneSettings(1, steps=1, batch_size=2),
    )
    other = dict(key, seed=1)
    with pytest.raises(ValueError, match="other options: seed"):
        _train(pair, stores, "kl", folder=tmp_path, key=other)


def test_bad_settings_are_refused(pair, stores):
    with pytest.raises(ValueError, match="3 trained blocks need them after at most 1 of"):
        _train(pair, stores, settings=finetune.FinetuneSettings(trained_blocks=3, steps=1))
    with pytest.raises(ValueError, match="not among the store's rules"):
        _, drafter = pair
        store, states = stores
        finetune.finetune_drafter(
            drafter,
            store.load(),
            states.load(),
            finetune.OBJECTIVES["kl+tree4"],
            rule_names=("greedy",),
            first=2,
            seed=0,
            settings=SETTINGS,
        )


def test_evaluation_is_the_full_forward_at_the_trained_positions(pair, stores):
    """Per-sequence figures against the drafter's full forward and the target's stored
    window (the whole vocabulary here), in NumPy."""
    _, drafter = pair
    store, states = stores
    records = store.load()
    got = finetune.evaluate_drafter(
        drafter,
        None,
        records,
        states.load(),
        rule_names=RULES,
        first=2,
        trained_blocks=1,
        batch_size=4,
    )
    tokens = jnp.asarray(records.tokens)
    logits, _ = drafter(tokens, drafter.init_cache(*tokens.shape))
    logits = np.asarray(logits, np.float64)
    mask = records.mask
    for i in range(len(tokens)):
        at = mask[i]
        z = logits[i][at]
        lq = z - z.max(-1, keepdims=True)
        lq -= np.log(np.exp(lq).sum(-1, keepdims=True))
        ids = records.top_ids[i][at]
        lp = records.top_logp[i][at].astype(np.float64)
        kl = (np.exp(lp) * (lp - np.take_along_axis(lq, ids, -1))).sum(-1)
        x0 = ids[:, 0]
        top4 = np.argsort(-z, -1)[:, :4]
        np.testing.assert_allclose(got["kl"][i], kl.mean(), rtol=1e-4)
        assert got["positions"][i] == at.sum()
        np.testing.assert_allclose(got["agreement"][i], (z.argmax(-1) == x0).mean())
        np.testing.assert_allclose(got["accepted:tree:4"][i], (top4 == x0[:, None]).any(-1).mean())
        for j, r in enumerate(RULES):
            c = records.certificate[i][at][:, j]
            np.testing.assert_allclose(got[f"certified:{r}"][i], (kl < c).mean())
            np.testing.assert_allclose(got[f"near:{r}"][i], ((kl >= c) & (kl < c + 0.05)).mean())


def test_data_parallel_training_equals_one_device(pair, stores, tmp_path):
    store, states = stores
    one, _ = _train(
        pair,
        stores,
        settings=finetune.FinetuneSettings(
            trained_blocks=1, steps=3, batch_size=4, learning_rate=3e-3
        ),
    )
    np.savez(tmp_path / "one.npz", *[np.asarray(x) for x in jax.tree.leaves(one)])
    out = multidevice.run(
        f"""
        import numpy as np
        from jax.sharding import Mesh
        from jaxcert.training import drafter_states, finetune, head_data
        from tests.helpers.tiny_models import random_model, tiny_config
        config = tiny_config(vocab_size={V}, num_layers={L}, max_position_embeddings=64)
        drafter = random_model(config, seed=7)
        store = head_data.read_store("{store.folder}")
        states = drafter_states.read_drafter_states("{states.folder}")
        mesh = Mesh(np.array(jax.devices()[:2]), ("data",))
        settings = finetune.FinetuneSettings(trained_blocks=1, steps=3, batch_size=4,
                                             learning_rate=3e-3)
        got, _ = finetune.finetune_drafter(
            drafter, store.load(), states.load(), finetune.OBJECTIVES["kl+greedy"],
            rule_names=("greedy", "tree:4"), first=2, seed=0, settings=settings, mesh=mesh)
        want = np.load("{tmp_path / "one.npz"}")
        leaves = jax.tree.leaves(got)
        diff = max(float(np.max(np.abs(np.asarray(a) - want[f"arr_{{i}}"])))
                   for i, a in enumerate(leaves))
        specs = sorted({{str(x.sharding.spec) for x in leaves}})
        print(json.dumps({{"diff": diff, "specs": specs}}))
        """,
        devices=2,
    )
    assert out["diff"] < 1e-5, out


def test_compare_initial_logs_the_untrained_kl_of_each_batch(pair, stores):
    _, progress = _train(pair, stores, "kl", compare_initial=True)
    history = progress["history"]
    assert history[0]["kl"] == pytest.approx(history[0]["kl_initial"], rel=1e-6)  # no update yet
    assert any(abs(h["kl"] - h["kl_initial"]) > 1e-5 for h in history[1:])
    _, plain = _train(pair, stores, "kl")
    assert "kl_initial" not in plain["history"][0]
    assert [h["kl"] for h in plain["history"]] == pytest.approx([h["kl"] for h in history])


def test_training_the_lm_head_unties_it_from_the_frozen_embedding(pair, tmp_path):
    """``train_lm_head`` on a tied drafter: the lm_head moves, the embedding (which made the
    stored states) does not; the merged drafter is untied, evaluates as trained, and its
    export reads back with the same logits."""
    from jaxcert import models
    from jaxcert.models import LoadedModel
    from jaxcert.models.export import save_hf
    from tests.helpers.tiny_models import hf_tokenizer

    target, _ = pair
    tied = random_model(
        tiny_config(vocab_size=V, num_layers=L, max_position_embeddings=64, tie_embeddings=True),
        seed=7,
    )
    spec = head_data.StoreSpec(
        target="tiny", taps=(), length=20, top_k=V, batch_size=2, states=False
    )
    store = head_data.write_store(target, _sequences(), tmp_path / "store", spec)
    states = drafter_states.write_drafter_states(
        tied, store, tmp_path / "states", blocks=2, name="t"
    )
    settings = finetune.FinetuneSettings(
        trained_blocks=1, steps=10, batch_size=6, learning_rate=3e-3, train_lm_head=True
    )
    records = store.load()
    trainable, progress = finetune.finetune_drafter(
        tied, records, states.load(), finetune.OBJECTIVES["kl"], rule_names=RULES, first=2,
        seed=0, settings=settings,
    )  # fmt: skip
    assert progress["history"][-1]["kl"] < progress["history"][0]["kl"]
    tuned = finetune.merged_drafter(tied, trainable, trained_blocks=1)
    assert tied.lm_head is None and not tuned.config.tie_embeddings
    np.testing.assert_array_equal(tuned.embedding[...], tied.embedding[...])
    assert not np.allclose(tuned.lm_head[...], np.asarray(tied.embedding[...]).T)
    got = finetune.evaluate_drafter(
        tied, trainable, records, states.load(), rule_names=RULES, first=2, trained_blocks=1
    )
    tokens = jnp.asarray(records.tokens)
    logits, _ = tuned(tokens, tuned.init_cache(*tokens.shape))
    lq = jax.nn.log_softmax(np.asarray(logits, np.float64), -1)
    i, at = 0, records.mask[0]
    lp = records.top_logp[i][at].astype(np.float64)
    kl = np.exp(lp) * (lp - np.take_along_axis(np.asarray(lq[i][at]), records.top_ids[i][at], -1))
    np.testing.assert_allclose(got["kl"][i], kl.sum(-1).mean(), rtol=1e-4)
    # the run's key keeps the option; a run without it keeps the key it always had
    key = finetune.run_key(store, states, finetune.OBJECTIVES["kl"], 0, settings)
    assert key["settings"]["train_lm_head"] is True
    plain = finetune.run_key(store, states, finetune.OBJECTIVES["kl"], 0, SETTINGS)
    assert "train_lm_head" not in plain["settings"]
    # the export follows the model's own config (untied), not the tied one it was loaded with
    loaded = LoadedModel(tuned, hf_tokenizer(), tied.config, tmp_path)
    folder = save_hf(loaded, tmp_path / "hf")
    back = models.load(folder, dtype=jnp.float32).model
    again, _ = back(tokens, back.init_cache(*tokens.shape))
    assert not back.config.tie_embeddings
    np.testing.assert_allclose(again, logits, rtol=1e-5, atol=1e-5)


def test_relative_speed_is_the_ratio_of_total_throughputs():
    from jaxcert.training.finetune_recipe import relative_speed

    base = {"per_prompt_tokens": [64, 64, 32], "per_prompt_seconds": [4.0, 8.0, 4.0]}
    fast = {"per_prompt_tokens": [64, 64, 32], "per_prompt_seconds": [2.0, 4.0, 2.0]}
    ratio, low, high = relative_speed(fast, base)
    assert ratio == pytest.approx(2.0) and low == pytest.approx(2.0) and high == pytest.approx(2.0)
    mixed = {"per_prompt_tokens": [64, 64, 32], "per_prompt_seconds": [2.0, 8.0, 4.0]}
    ratio, low, high = relative_speed(mixed, base)
    # totals: 160 tokens in 14 s against 160 in 16 s
    assert ratio == pytest.approx(16 / 14) and 1.0 <= low < ratio < high <= 2.0


def test_speed_runs_interleave_the_methods_and_resume_after_each_prompt(tmp_path, monkeypatch):
    import json
    import types

    from jaxcert import decoding
    from jaxcert.training import finetune_recipe

    calls = []  # (method, first prompt id)
    seconds = {"target-only": 4.0, "a": 2.0, "b": 1.0}
    crash_at = [None]

    def result(name, prompts):
        if (name, prompts[0][0]) == crash_at[0]:
            raise KeyboardInterrupt
        calls.append((name, prompts[0][0]))
        return types.SimpleNamespace(
            num_tokens=8, prefill_s=0.0, decode_s=seconds[name], tokens=[[1, 2, 3]]
        )

    monkeypatch.setattr(decoding, "target_decode", lambda model, p, **kw: result("target-only", p))
    monkeypatch.setattr(decoding, "speculative_decode", lambda model, d, p, **kw: result(d, p))
    target = types.SimpleNamespace(model=None, eos_ids=(0,))
    prompts = [[10], [11], [12]]
    path = tmp_path / "speed.json"
    crash_at[0] = ("b", 12)  # interrupted during the third prompt
    with pytest.raises(KeyboardInterrupt):
        finetune_recipe.speed_runs(target, {"a": "a", "b": "b"}, prompts, path)
    # Every method compiles on the first prompt, then each prompt is decoded by every
    # method in turn, the order rotated by one from prompt to prompt.
    assert calls == [("target-only", 10), ("a", 10), ("b", 10),
                     ("target-only", 10), ("a", 10), ("b", 10),
                     ("a", 11), ("b", 11), ("target-only", 11)]  # fmt: skip
    saved = json.loads(path.read_text())["methods"]
    assert {m: len(r["per_prompt_seconds"]) for m, r in saved.items()} == {
        "target-only": 2, "a": 2, "b": 2
    }  # fmt: skip
    calls.clear()
    crash_at[0] = None
    seconds["c"] = 2.0
    speed = finetune_recipe.speed_runs(target, {"a": "a", "b": "b", "c": "c"}, prompts, path)
    # Resumed at the third prompt (each method compiles first), the new method c timed
    # alone on the prompts the others have done, then all four in turn.
    assert calls == [("target-only", 10), ("a", 10), ("b", 10), ("c", 10),
                     ("c", 10), ("c", 11),
                     ("b", 12), ("c", 12), ("target-only", 12), ("a", 12)]  # fmt: skip
    assert speed["target-only"]["tokens_per_s"] == pytest.approx(24 / 12.0)
    assert speed["b"]["tokens_per_s"] == pytest.approx(24 / 3.0)
    assert speed["b"]["speedup"] == pytest.approx(4.0)
    assert speed["a"]["same_as_target"] == 3
    # Stopped after the last prompt was saved, before the totals: nothing is decoded again.
    saved = json.loads(path.read_text())
    for entry in saved["methods"].values():
        for total in ("tokens", "seconds", "tokens_per_s"):
            del entry[total]
    path.write_text(json.dumps(saved))
    calls.clear()
    again = finetune_recipe.speed_runs(target, {"a": "a", "b": "b", "c": "c"}, prompts, path)
    assert calls == [] and again == speed


def test_record_options_fingerprints_and_the_records_written_before_them(tmp_path):
    from jaxcert.training.finetune_recipe import record_options

    data = {"target": "t", "drafter": "d", "positions": 60}
    printed = data | {"target_sha256": "a" * 64, "drafter_sha256": "b" * 64}
    path = tmp_path / "options.json"
    record_options(tmp_path, data, record=False)  # nothing recorded: nothing to check
    assert not path.exists()
    record_options(tmp_path, printed)
    assert json.loads(path.read_text()) == printed
    record_options(tmp_path, data, record=False)  # before the models load: the rest agrees
    with pytest.raises(ValueError, match="positions \\(then 60, now 61\\)"):
        record_options(tmp_path, data | {"positions": 61}, record=False)
    with pytest.raises(ValueError, match="drafter_sha256 \\(then 'bbbb"):
        record_options(tmp_path, printed | {"drafter_sha256": "c" * 64})
    path.write_text(json.dumps(data))  # a record written before the fingerprints
    with pytest.raises(ValueError, match="positions"):
        record_options(tmp_path, printed | {"positions": 61})
    assert json.loads(path.read_text()) == data
    said = []
    record_options(tmp_path, printed, log=said.append)
    assert json.loads(path.read_text()) == printed and "fingerprints" in said[0]
