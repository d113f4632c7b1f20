"""The n-gram (prompt-lookup) drafter: its lookup against plain Python, exact greedy
decoding on every draft shape, plain target steps when nothing matches, ``nan`` statistics."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxcert import decoding
from jaxcert.decoding.ngram import (
    NgramDrafter,
    lookup_reference,
    match_length,
    match_reference,
    parse_ngram,
)
from jaxcert.decoding.pairing import resolved_config
from tests.helpers.tiny_decoding import CONFIG, MAX_NEW, WIDTH, random_model

V = CONFIG.vocab_size


def _proposals(drafter, sequences, split):
    """Proposals after every position of each sequence, read in two calls (``split`` tokens,
    then the rest) so that the cache's committed history is used too: ``[B, T]``."""
    tokens = jnp.asarray(sequences, jnp.int32)
    cache = drafter.init_cache(tokens.shape[0], tokens.shape[1] + 4)
    first, cache = drafter.features(tokens[:, :split], cache)
    second, _ = drafter.features(tokens[:, split:], cache.commit(split))
    return np.concatenate([np.asarray(first), np.asarray(second)], axis=1)[..., 0]


def _matches(drafter, tokens, split):
    """Proposals and match lengths ``[B, T, 2]`` read in two calls, as :func:`_proposals`."""
    tokens = jnp.asarray(tokens, jnp.int32)
    cache = drafter.init_cache(tokens.shape[0], tokens.shape[1] + 4)
    first, cache = drafter.features(tokens[:, :split], cache)
    second, _ = drafter.features(tokens[:, split:], cache.commit(split))
    return np.concatenate([np.asarray(first), np.asarray(second)], axis=1)


@pytest.mark.parametrize("n, min_n", [(1, 1), (3, 1), (3, 2), (5, 1)])
def test_lookup_equals_the_python_reference(n, min_n):
    rng = np.random.default_rng(n * 10 + min_n)
    rows = [rng.integers(0, 4, size=24) for _ in range(6)]  # 4 symbols: many repeats
    rows += [np.arange(24) % 24, np.full(24, 7), np.tile([1, 2, 3], 8)]  # none, runs, cycles
    drafter = NgramDrafter(n, min_n=min_n, vocab_size=V)
    got = _matches(drafter, np.stack(rows), split=9)
    for row, found in zip(rows, got, strict=True):
        seq = [int(x) for x in row]
        want = [match_reference(seq[: t + 1], n, min_n) for t in range(len(seq))]
        assert [tuple(x) for x in found.tolist()] == want
        proposals = [lookup_reference(seq[: t + 1], n, min_n) for t in range(len(seq))]
        assert found[:, 0].tolist() == proposals


def test_lookup_prefers_the_longest_then_the_latest_match():
    drafter = NgramDrafter(3, vocab_size=V)
    # "5 6" occurs at 0-1 (then 7) and at 4-5 (then 8); "4 5 6" only at 3-5: the longest wins.
    seq = [5, 6, 7, 4, 5, 6, 8, 9, 4, 5, 6]
    assert _proposals(drafter, [seq], split=4)[0, -1] == 8
    # Without the longer context, the latest of the equal matches wins.
    seq = [5, 6, 7, 1, 5, 6, 8, 9, 2, 5, 6]
    assert _proposals(drafter, [seq], split=4)[0, -1] == 8
    assert lookup_reference([1, 2, 3], 3) == -1  # no earlier occurrence: no proposal


def test_the_match_length_is_read_beyond_n():
    """The proposal comes from the longest match up to ``n``; its length is read further,
    up to ``MATCH_REACH``: a copy under way reads long even with ``n`` = 2."""
    from jaxcert.decoding.ngram import MATCH_REACH

    drafter = NgramDrafter(2, vocab_size=V)
    seq = list(range(1, 13)) + [40] + list(range(1, 11))  # 1..12, then 1..10 again
    found = _matches(drafter, [seq], split=5)[0]
    assert found[-1].tolist() == [11, MATCH_REACH]  # 10 tokens match, read up to 8
    assert found[13].tolist() == [2, 1]  # "1" after 40: a one-token match so far
    assert match_reference(seq, 2) == (11, MATCH_REACH)
    assert match_reference(seq[:16], 2) == (4, 3)


def test_project_is_one_hot_and_empty_without_a_match():
    drafter = NgramDrafter(2, vocab_size=V)
    logits = drafter.project(jnp.asarray([[3, 2], [-1, 0]], jnp.int32))
    assert logits.shape == (2, V)
    # The proposal's logit is its match length (q is one-hot whatever the finite value).
    assert logits[0, 3] == 2.0 and np.all(np.isneginf(np.delete(np.asarray(logits[0]), 3)))
    assert np.all(np.isneginf(logits[1]))
    np.testing.assert_array_equal(jax.nn.softmax(logits[0]), np.eye(V)[3])
    assert match_length(logits).tolist() == [2, 0]


# Prompts that repeat themselves, and one that never does (its rounds draft nothing at first).
PROMPTS = [
    [5, 17, 3, 44, 9, 5, 17, 3],
    [1, 2, 3, 4, 1, 2, 3, 4, 1],
    [30, 12, 7],
]


@pytest.fixture(scope="module")
def target():
    return random_model(CONFIG, seed=3)


@pytest.mark.parametrize(
    "verify, extra",
    [
        ("greedy", dict(max_draft=6)),
        ("tree:2x3", {}),
        ("dyntree:3x3x6", {}),
        ("topk:3", dict(max_draft=6)),
    ],
)
def test_ngram_greedy_equals_target_greedy(target, verify, extra):
    want = decoding.target_decode(target, PROMPTS, max_new_tokens=MAX_NEW, prompt_width=WIDTH)
    config = decoding.DecodeConfig(
        verification=decoding.parse_verify(verify), max_new_tokens=MAX_NEW, **extra
    )
    out = decoding.speculative_decode(
        target, NgramDrafter(3), PROMPTS, config=config, policy=decoding.Constant(k=4),
        prompt_width=WIDTH,
    )  # fmt: skip
    if verify.startswith("topk"):  # a relaxed rule: the tokens may differ, not the lengths
        assert [len(t) for t in out.tokens] == [len(t) for t in want.tokens]
    else:
        for got, ref in zip(out.tokens, want.tokens, strict=True):
            np.testing.assert_array_equal(got, ref)
    st = out.stats
    active = st.active
    assert st.accepted[active].sum() > 0  # the lookup's proposals were accepted ...
    assert np.any(st.drafted[active] == 0)  # ... and some rounds had nothing to draft
    ns = st.nodes
    assert ns.valid.any()
    for name in ("kl", "cert", "cert_list", "entropy", "q_top", "q_cert"):
        assert np.all(np.isnan(getattr(ns, name))), name


def test_zero_draft_rounds_are_plain_target_steps(target):
    """A prompt without repeats and a budget of 3: the first round has no proposal, so it
    emits exactly the target's token and drafts nothing."""
    config = decoding.DecodeConfig(verification="greedy", max_new_tokens=3, max_draft=4)
    out = decoding.speculative_decode(
        target, NgramDrafter(2), [[30, 12, 7]], config=config, policy=decoding.Constant(k=4)
    )
    want = decoding.target_decode(target, [[30, 12, 7]], max_new_tokens=3)
    np.testing.assert_array_equal(out.tokens[0], want.tokens[0])
    assert out.stats.drafted[0, 0] == 0 and out.stats.emitted[0, 0] == 1
    assert config.verify_buckets()[0] == 1  # an LM drafter's config has no zero width
    assert decoding.DecodeConfig(proposes_tokens=True, max_draft=4).verify_buckets()[0] == 0


@pytest.mark.parametrize(
    "spec, n, min_n", [("ngram:3", 3, 1), ("NGRAM:4:2", 4, 2), (" ngram:1 ", 1, 1)]
)
def test_parse_ngram(spec, n, min_n):
    drafter = parse_ngram(spec)
    assert (drafter.n, drafter.min_n) == (n, min_n)
    assert parse_ngram(drafter.spec).spec == drafter.spec


@pytest.mark.parametrize(
    "spec", ["ngram", "ngram:", "ngram:0", "ngram:2:3", "ngram:a", "ngram:1:1:1"]
)
def test_bad_ngram_spellings_are_named(spec):
    with pytest.raises(ValueError, match="ngram"):
        parse_ngram(spec)


def test_other_spellings_are_not_ngram():
    assert parse_ngram("qwen2.5-coder-0.5b-instruct") is None
    assert parse_ngram("./ngrams/model") is None


def test_an_unbound_drafter_needs_a_vocabulary():
    with pytest.raises(ValueError, match="vocabulary size"):
        NgramDrafter(3).project(jnp.zeros((1, 2), jnp.int32))


def test_goodput_reads_the_lookup_before_every_round_whatever_the_past_says(target):
    """Earlier decodes' drafting says drafting loses, which makes a drafter with a cost of
    its own run as target-only decoding; prompt lookup is still read before every round
    (and after every plain step) and drafts where its matches are worth a round (exactly,
    at T = 0). With rounds far dearer than plain steps no proposal is worth one: every
    token comes from a plain step, and the output is still exact."""
    from jaxcert.decoding import loop
    from jaxcert.decoding.costs import PassCosts, PastDrafting

    want = decoding.target_decode(target, PROMPTS, max_new_tokens=MAX_NEW, prompt_width=WIDTH)
    config = decoding.DecodeConfig(
        verification="greedy", max_new_tokens=MAX_NEW, max_draft=6, max_skip=2
    )
    drafter = NgramDrafter(3)
    resolved = resolved_config(config, target, drafter, decoding.Goodput())
    free = PassCosts(rows=3, target_s={1: 1.0, 2: 1.2, 8: 2.0}, drafter_s=0.0)
    rounds = np.zeros(free.round_costs(resolved).round_s.shape[0])
    rounds[1] = 3.0
    losing = {"greedy": PastDrafting(3.0, tuple(rounds))}  # one token per row-round
    for overhead, drafts in ((0.0, True), (50.0, False)):
        costs = dataclasses.replace(free, drafting=losing, round_overhead_s=overhead)
        programs = decoding.Programs()
        out = decoding.speculative_decode(
            target, drafter, PROMPTS, config=config, policy=decoding.Goodput(), costs=costs,
            prompt_width=WIDTH, programs=programs,
        )  # fmt: skip
        for got, ref in zip(out.tokens, want.tokens, strict=True):
            np.testing.assert_array_equal(got, ref)
        st = out.stats
        assert programs.of(loop.prefill)  # never run as target-only decoding
        assert (st.accepted[st.active].sum() > 0) == drafts
        assert (st.drafted[st.active].sum() > 0) == drafts
        # Every token of a decode that never drafts comes from a plain step.
        emitted = np.where(st.active, st.emitted, 0).sum()
        assert emitted == sum(len(t) for t in out.tokens)


def test_propose_reads_the_text_as_the_drafter_would():
    """``propose`` (read before a round, from the text alone) equals what ``features``
    returns at the last position once the drafter has read the text; ``catch_up`` gives
    every tree branch's row that text, after which the drafter proposes the same."""
    rng = np.random.default_rng(7)
    tokens = rng.integers(0, 4, size=(3, 20)).astype(np.int32)
    length = np.array([20, 11, 5], np.int32)
    drafter = NgramDrafter(3, vocab_size=V)
    assert isinstance(drafter, decoding.protocols.ProposingDrafter)
    got = np.asarray(drafter.propose(jnp.asarray(tokens), jnp.asarray(length)))
    for row, n, found in zip(tokens, length, got, strict=True):
        assert tuple(found.tolist()) == match_reference([int(x) for x in row[:n]], 3)
    m = 2  # two branches per row
    cache = drafter.init_cache(3 * m, 32).commit(4)  # read something else before
    cache = drafter.catch_up(cache, jnp.asarray(tokens), jnp.asarray(length))
    np.testing.assert_array_equal(np.asarray(cache.length), np.repeat(length, m))
    for r in range(3 * m):
        np.testing.assert_array_equal(np.asarray(cache.tokens)[r, :20], tokens[r // m])
    # Re-reading the last token after the catch-up proposes what `propose` did.
    last = jnp.asarray(tokens[np.arange(3), length - 1])[:, None]
    rows = jnp.arange(3) * m
    feats, _ = drafter.features(last, cache.take_rows(rows).rollback(jnp.asarray(length - 1)))
    np.testing.assert_array_equal(np.asarray(feats)[:, 0], got)
