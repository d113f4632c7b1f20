"""Drafter training recipe: head, features, objectives and offline acceptance length."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxcert import models, training
from jaxcert.base import prompts
from jaxcert.core import rules as R
from tests.helpers import tiny_lm

TEXTS = tiny_lm.TEXTS


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("pair")
    target = models.load(str(tiny_lm.save_tiny_checkpoint(root / "t", seed=1, layers=2)))
    drafter = models.load(str(tiny_lm.save_tiny_checkpoint(root / "d", seed=2, layers=1)))
    return target, drafter


@pytest.fixture(scope="module")
def features(pair):
    target, drafter = pair
    prompt_set = [prompts.Prompt(str(i), t) for i, t in enumerate(TEXTS)]
    return training.collect_features(target, drafter, prompt_set, steps=12, batch_size=2)


def test_chain_acceptance_length_by_hand():
    match = np.array([1, 1, 0, 1, 1, 1, 1, 1, 1, 0], bool)
    assert training.chain_acceptance_length(match, 3) == (10, 3)
    assert training.chain_acceptance_length(np.zeros(4, bool), 5) == (4, 4)
    assert training.chain_acceptance_length(np.ones(12, bool), 5) == (12, 2)


def test_headed_drafter_starts_as_the_base_and_runs_in_forward(pair):
    _, drafter = pair
    head = training.DraftHead(drafter.config.hidden_size, 16, rngs=nnx.Rngs(0))
    headed = training.HeadedDrafter(drafter.model, head)
    tokens = jnp.asarray([[3, 5, 7, 9]], jnp.int32)
    cache = models.KVCache.create(drafter.config, 1, 8)
    want, _ = models.forward(*nnx.split(drafter.model), tokens, cache)
    got, _ = models.forward(*nnx.split(headed), tokens, cache)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_projection_matches_the_model(pair):
    for lm in pair:
        hidden = jnp.asarray(np.random.default_rng(0).normal(size=(3, lm.config.hidden_size)))
        np.testing.assert_allclose(
            training.Projection(lm.model).project(hidden), lm.model.project(hidden), rtol=1e-6
        )


def test_features_are_consistent_with_the_target_continuation(pair, features):
    target, _ = pair
    assert len(features) > 0
    assert features.target_hidden.shape == (len(features), target.config.hidden_size)
    logits = np.asarray(target.model.project(jnp.asarray(features.target_hidden)))
    np.testing.assert_array_equal(np.argmax(logits, -1), features.token)
    for p in np.unique(features.prompt):
        pos = features.position[features.prompt == p]
        np.testing.assert_array_equal(pos, np.arange(len(pos)))


def test_objectives_train_and_evaluate(pair, features):
    target, drafter = pair
    base = training.evaluate(None, features, target.model, drafter.model)
    logits = training.target_logits(features, target.model, chunk=7)
    assert logits.shape == (len(features), target.config.vocab_size)
    assert 0 <= base["agreement"] <= 1 and base["mean_kl"] > 0
    assert 1 <= base["acceptance_length"] <= 6
    for objective in (
        training.Objective("kl"),
        training.Objective("kl+greedy", R.StrictGreedy(), weight=1.0),
        training.Objective("kl+tree:4", R.TreeCoverage(4), weight=1.0, margin=0.05),
    ):
        head, history = training.train_head(
            objective, features, logits, drafter.model, steps=40, batch_size=16,
            learning_rate=3e-3, width=32,
        )  # fmt: skip
        first = np.mean([h["loss"] for h in history[:5]])
        last = np.mean([h["loss"] for h in history[-5:]])
        assert last < first, (objective, first, last)
        if objective.rule is not None:
            assert history[0]["violation"] > 0
        result = training.evaluate(head, features, target.model, drafter.model)
        assert result["mean_kl"] < base["mean_kl"], (objective, result, base)
        assert set(result) == set(base)
    with pytest.raises(ValueError, match="target logits have shape"):
        training.train_head(training.Objective("kl"), features, logits[:3], drafter.model)


def test_decoder_acceptance_equals_the_offline_count(pair, features):
    """The speculative decoder reproduces the exact offline tokens-per-round count."""
    import dataclasses

    target, drafter = pair
    encoded = prompts.encode_prompts(
        target.tokenizer, [prompts.Prompt(str(i), t) for i, t in enumerate(TEXTS)]
    )
    head = training.DraftHead(drafter.config.hidden_size, 16, rngs=nnx.Rngs(0))
    head.w_out[...] = 0.3 * jnp.ones_like(head.w_out[...])
    # The target drafting for itself through a perturbing head: partial agreement.
    self_head = training.DraftHead(target.config.hidden_size, 16, rngs=nnx.Rngs(1))
    self_head.w_out[...] = 0.5 * np.random.default_rng(0).normal(size=self_head.w_out[...].shape)
    self_features = dataclasses.replace(features, drafter_hidden=features.target_hidden)
    lengths = []
    for data, base, h in (
        (features, drafter.model, None),
        (features, drafter.model, head),
        (self_features, target.model, self_head),
    ):
        offline = training.evaluate(h, data, target.model, base, draft_length=3)
        model = base if h is None else training.HeadedDrafter(base, h)
        got = training.decoder_acceptance(
            target, model, encoded, draft_length=3, max_new_tokens=12,
            eos_ids=target.config.eos_token_ids, batch_size=3,
        )  # fmt: skip
        assert got["decoder_tokens"] == len(features)
        assert got["decoder_acceptance_length"] == pytest.approx(offline["acceptance_length"])
        lengths.append(got["decoder_acceptance_length"])
    assert 1.5 < lengths[-1] < 4, lengths  # the comparison is not vacuous


def test_vocabulary_mismatch_is_rejected(pair, tmp_path):
    target, _ = pair
    import dataclasses

    other = dataclasses.replace(target, config=dataclasses.replace(target.config, vocab_size=7))
    with pytest.raises(ValueError, match="vocabulary mismatch"):
        training.collect_features(target, other, [prompts.Prompt("0", "a")], steps=2)


@pytest.mark.slow
def test_cli_train_drafter_end_to_end(tmp_path):
    import json

    from jaxcert import cli

    target = tiny_lm.save_tiny_checkpoint(tmp_path / "t", seed=1)
    drafter = tiny_lm.save_tiny_checkpoint(tmp_path / "d", seed=2, layers=1)
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in TEXTS))
    out = tmp_path / "out"
    rc = cli.main(["train-drafter", "--target", str(target), "--drafter", str(drafter),
                   "--prompts", str(path), "--continuation", "6", "--train-steps", "12",
                   "--batch-size", "8", "--width", "16", "--heldout", "0.5",
                   "--decode-tokens", "4", "--out", str(out)])  # fmt: skip
    assert rc == 0
    results = json.loads((out / "results.json").read_text())["results"]
    assert [r["drafter"].split()[0] for r in results] == ["untrained", "(a)", "(b)", "(c)"]
    assert all(1 <= r["decoder_acceptance_length"] <= 6 for r in results)
    assert (out / "training_curves.png").stat().st_size > 1000
    assert (out / "features.npz").is_file()
    early = cli.main(["train-drafter", "--target", str(target), "--exit-layer", "1",
                      "--prompts", str(path), "--continuation", "5", "--train-steps", "4",
                      "--width", "8", "--decode-tokens", "0",
                      "--out", str(tmp_path / "early")])  # fmt: skip
    assert early == 0
    assert (tmp_path / "early" / "results.md").read_text().count("\n") == 6
    again = ["--features", str(out / "features.npz"), "--out", str(tmp_path / "again")]
    rc = cli.main(["train-drafter", "--target", str(target), "--drafter", str(drafter),
                   "--prompts", str(path), "--train-steps", "3", "--width", "16",
                   "--decode-tokens", "0", *again])  # fmt: skip
    assert rc == 0
    # Features of other prompts are refused before any training.
    rc = cli.main(["train-drafter", "--target", str(target), "--drafter", str(drafter),
                   "--prompts", str(path), "--max-prompts", "2", *again])  # fmt: skip
    assert rc == 2


def test_cli_train_drafter_refuses_runs_past_the_context_length(tmp_path, capsys):
    import json

    from jaxcert import cli

    target = tiny_lm.save_tiny_checkpoint(tmp_path / "t", seed=1)
    drafter = tiny_lm.save_tiny_checkpoint(tmp_path / "d", seed=2, layers=1)
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in TEXTS))
    # A run past the model's 512 positions is refused before anything compiles: the
    # continuations (--continuation) and the decoder phase (--decode-tokens plus the draft).
    for flag, value in (("--continuation", "600"), ("--decode-tokens", "509")):
        rc = cli.main(["train-drafter", "--target", str(target), "--drafter", str(drafter),
                       "--prompts", str(path), flag, value,
                       "--out", str(tmp_path / "long")])  # fmt: skip
        assert rc == 2
        assert "supports 512" in capsys.readouterr().err


@pytest.mark.parametrize(
    "flag, value",
    [("--draft-length", "0"), ("--train-steps", "0"), ("--batch-size", "0"),
     ("--learning-rate", "nan"), ("--width", "0"), ("--heldout", "1.5")],
    ids=lambda v: v.lstrip("-"),
)  # fmt: skip
def test_cli_train_drafter_rejects_bad_options_when_parsing(flag, value, capsys):
    from jaxcert import cli

    with pytest.raises(SystemExit) as exit_info:
        cli.main(["train-drafter", flag, value])
    assert exit_info.value.code == 2
    assert flag in capsys.readouterr().err
