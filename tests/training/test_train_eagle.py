"""Training an EAGLE head on the target's own states: the held-out KL falls and the decoder
accepts more of its drafts (tiny target, its own greedy continuations as the data)."""

import numpy as np
import pytest
from flax import nnx

from jaxcert import decoding
from jaxcert.core import rules
from jaxcert.models import EagleHead, Transformer
from jaxcert.training.eagle import target_states, train_eagle_head
from jaxcert.training.train import Objective
from tests.helpers.tiny_models import tiny_config


@pytest.fixture(scope="module")
def setup():
    config = tiny_config(vocab_size=48, num_layers=2, max_position_embeddings=256)
    target = Transformer(config, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(0)
    prompts = [list(rng.integers(0, 48, size=4)) for _ in range(40)]
    out = decoding.target_decode(target, prompts, max_new_tokens=24)
    seqs = [p + list(t) for p, t in zip(prompts, out.tokens, strict=True)]
    width = max(map(len, seqs))
    tokens = np.zeros((len(seqs), width), np.int32)
    for i, s in enumerate(seqs):
        tokens[i, : len(s)] = s
    lengths = np.asarray([len(s) for s in seqs])
    return target, prompts, tokens, lengths


def _acceptance(target, head, prompts):
    config = decoding.DecodeConfig(verification="greedy", max_new_tokens=24, max_draft=4)
    out = decoding.speculative_decode(
        target, head, prompts, config=config, policy=decoding.Constant(k=4)
    )
    want = decoding.target_decode(target, prompts, max_new_tokens=24).tokens
    assert all(np.array_equal(a, b) for a, b in zip(out.tokens, want, strict=True))
    active = out.stats.active
    return float(out.stats.emitted[active].mean())


@pytest.mark.parametrize(
    "objective",
    [
        Objective("kl"),
        pytest.param(
            Objective("kl+greedy", rules.StrictGreedy(), weight=1.0), marks=pytest.mark.slow
        ),
    ],
    ids=["kl", "kl+greedy"],
)
def test_training_lowers_heldout_kl_and_raises_acceptance(setup, objective):
    target, prompts, tokens, lengths = setup
    train, held = slice(0, 32), slice(32, 40)
    taps = (0, 1)
    data = target_states(target, tokens[train], lengths[train], taps)
    heldout = target_states(target, tokens[held], lengths[held], taps)
    head = EagleHead.from_target(target, rngs=nnx.Rngs(1), taps=taps)
    from jaxcert.training.eagle import head_loss

    before = float(head_loss(head, heldout, objective)[1][0])
    accept_before = _acceptance(target, head, prompts[32:])
    head, history = train_eagle_head(head, data, objective, steps=150, learning_rate=3e-3)
    after = float(head_loss(head, heldout, objective)[1][0])
    accept_after = _acceptance(target, head, prompts[32:])
    assert len(history) == 150
    assert after < 0.5 * before, (before, after)
    assert accept_after > accept_before + 0.5, (accept_before, accept_after)


def test_bad_lengths_are_named(setup):
    target, _, tokens, lengths = setup
    with pytest.raises(ValueError, match=r"lengths must be \[B=2\] in \[2, T="):
        target_states(target, tokens[:2], np.asarray([1, 5]), ())
