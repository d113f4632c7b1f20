"""Speculative sampling outputs the target's distribution (chi-square over many rows)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from scipy import stats

from jaxcert import decoding
from jaxcert.decoding.verify import sampling_log_probs
from jaxcert.models import EagleHead, KVCache, forward
from tests.helpers.tiny_decoding import CONFIG, random_model

SMALL = CONFIG.__class__(**{**CONFIG.__dict__, "vocab_size": 8})
PROMPT = [1, 2, 3]
ROWS = 2000


@pytest.fixture(scope="module")
def small_pair():
    target = random_model(SMALL, seed=11)
    drafter = random_model(SMALL, seed=12, noise_of=target, scale=0.3)
    return target, drafter


def _exact_joint(target, temperature, top_p, prompt=PROMPT):
    """P(x1, x2) of target-only sampling after ``prompt``: ``[V, V]``."""
    graph, params = nnx.split(target)
    v = SMALL.vocab_size
    seqs = jnp.asarray([prompt + [x] for x in range(v)], jnp.int32)
    logits, _ = forward(graph, params, seqs, KVCache.create(SMALL, v, len(prompt) + 2))
    lp = sampling_log_probs(logits, temperature, top_p)
    p1 = np.exp(np.asarray(lp[0, len(prompt) - 1], np.float64))
    p2 = np.exp(np.asarray(lp[:, len(prompt)], np.float64))
    return p1[:, None] * p2


def _chi_square(observed, expected):
    keep = expected >= 5
    obs = np.append(observed[keep], observed[~keep].sum())
    exp = np.append(expected[keep], expected[~keep].sum())
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    return stats.chisquare(obs, exp * obs.sum() / exp.sum()).pvalue


@pytest.mark.parametrize(
    "verify, temperature, top_p",
    [("sample", 1.0, 1.0), ("tree:2x2+sample", 0.7, 0.8)],
)
def test_sampling_matches_target_distribution(small_pair, verify, temperature, top_p):
    _check_sampling(*small_pair, verify, temperature, top_p)


@pytest.mark.parametrize(
    "verify, temperature, top_p",
    [("sample", 1.0, 1.0), pytest.param("tree:2x2+sample", 0.7, 0.8, marks=pytest.mark.slow)],
)
def test_sampling_with_an_eagle_head_matches_target_distribution(
    small_pair, verify, temperature, top_p
):
    """An EAGLE-3 head (two fused blocks) over 6 of the 8 tokens: the two outside have the
    shared logit, so q is positive everywhere and rejection sampling stays exact."""
    target, _ = small_pair
    head = EagleHead.from_target(target, rngs=nnx.Rngs(3), taps=(0, 1), draft_vocab=range(6))
    _check_sampling(target, head, verify, temperature, top_p)


@pytest.mark.parametrize("verify", ["sample", "tree:2x2+sample"])
def test_sampling_with_the_ngram_drafter_matches_target_distribution(small_pair, verify):
    """A one-hot q (prompt lookup): accepted with probability p(x), resampled from
    norm((p - q)+) on rejection. The prompt repeats itself, so most rounds propose."""
    target, _ = small_pair
    prompt = [1, 2, 3, 1, 2, 3, 1, 2]
    _check_sampling(target, decoding.NgramDrafter(2), verify, 1.0, 1.0, prompt=prompt)


@pytest.mark.parametrize("drafter", ["model", "eagle3-head"])
def test_sampling_with_goodput_matches_target_distribution(small_pair, drafter):
    """Rounds that skip the drafter (plain sampled target steps, in the target-only
    program; for a head it records the target's states the head reads next), rounds that
    draft nothing and rounds that draft, mixed in one batch: still the target's
    distribution."""
    target, model = small_pair
    if drafter == "eagle3-head":
        model = EagleHead.from_target(target, rngs=nnx.Rngs(3), taps=(0, 1))
    costs = decoding.PassCosts(rows=ROWS, target_s={1: 1.0, 2: 1.2, 8: 2.0}, drafter_s=0.5)
    out = _check_sampling(
        target, model, "sample", 1.0, 1.0, policy=decoding.Goodput(beta=0.01, patience=0),
        costs=costs,
        max_skip=1,
    )  # fmt: skip
    drafted = out.stats.drafted[out.stats.active]
    assert np.any(drafted == 0) and np.any(drafted > 0)


def _check_sampling(
    target, drafter, verify, temperature, top_p, prompt=PROMPT, policy=None, costs=None, **kw
):
    config = decoding.DecodeConfig(
        verification=decoding.parse_verify(verify),
        max_new_tokens=3,
        max_draft=2,
        temperature=temperature,
        top_p=top_p,
        **kw,
    )
    out = decoding.speculative_decode(
        target,
        drafter,
        [prompt] * ROWS,
        policy=policy or decoding.Constant(k=2),
        config=config,
        key=jax.random.key(42),
        costs=costs,
    )
    first_two = np.array([t[:2] for t in out.tokens])
    observed = np.zeros((8, 8))
    np.add.at(observed, (first_two[:, 0], first_two[:, 1]), 1)
    expected = _exact_joint(target, temperature, top_p, prompt) * ROWS
    assert observed[expected == 0].sum() == 0  # never outside the nucleus
    assert _chi_square(observed.ravel(), expected.ravel()) > 1e-3
    # Both paths of the rejection sampler were exercised.
    accepted = out.stats.accepted[out.stats.active]
    assert 0 < accepted.mean() < 2
    ns = out.stats.nodes  # no certificate for sampling; KL is measured unless q is one-hot
    assert np.all(np.isnan(ns.cert))
    one_hot = isinstance(drafter, decoding.NgramDrafter)
    assert np.all(np.isnan(ns.kl) if one_hot else np.isfinite(ns.kl[ns.valid]))
    return out


def test_target_only_sampling_matches_too(small_pair):
    target, _ = small_pair
    out = decoding.target_decode(
        target, [PROMPT] * ROWS, max_new_tokens=2, temperature=1.0, key=jax.random.key(7)
    )
    first_two = np.array([t[:2] for t in out.tokens])
    observed = np.zeros((8, 8))
    np.add.at(observed, (first_two[:, 0], first_two[:, 1]), 1)
    expected = _exact_joint(target, 1.0, 1.0) * ROWS
    assert _chi_square(observed.ravel(), expected.ravel()) > 1e-3


def test_vanishing_temperature_is_greedy(small_pair):
    """T -> 0 sampling is greedy decoding (no overflow to NaN in logits / T)."""
    target, drafter = small_pair
    greedy = decoding.target_decode(target, [PROMPT], max_new_tokens=4).tokens[0]
    cold = decoding.target_decode(target, [PROMPT], max_new_tokens=4, temperature=1e-20)
    np.testing.assert_array_equal(cold.tokens[0], greedy)
    config = decoding.DecodeConfig(
        verification=decoding.parse_verify("sample"), max_new_tokens=4, max_draft=2,
        temperature=1e-20,
    )  # fmt: skip
    spec = decoding.speculative_decode(
        target, drafter, [PROMPT], policy=decoding.Constant(k=2), config=config
    )
    np.testing.assert_array_equal(spec.tokens[0], greedy)
    lp = sampling_log_probs(jnp.asarray([[1.0, 3.0, -2.0]]), 1e-30)
    np.testing.assert_array_equal(np.exp(np.asarray(lp)), [[0.0, 1.0, 0.0]])
