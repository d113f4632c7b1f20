"""The cost-aware ``goodput`` policy: its objective against a brute-force NumPy search, its
skip / draft-nothing choices, exact greedy decoding with them on every shape (language-model
drafter, draft head, n-gram lookup), one program for every goodput parameter and cost, and
the cost model's calibration file."""

import dataclasses
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxcert import decoding
from jaxcert.decoding import costs as costs_lib
from jaxcert.decoding import goodput as goodput_lib
from jaxcert.decoding import policies as P
from jaxcert.decoding.costs import PassCosts
from jaxcert.decoding.goodput import GoodputController
from jaxcert.decoding.pairing import resolved_config
from tests.helpers.tiny_decoding import CONFIG, MAX_NEW, PROMPTS, WIDTH, random_model

# Verification as dear as drafting buys: a plain step (1 s) beats drafting at the prior
# rate, but once a probe round has paid the re-read, drafting pays (see _mixed_choices).
MIXED = PassCosts(rows=3, target_s={1: 1.0, 2: 1.2, 8: 2.0}, drafter_s=0.5)
CHEAP = PassCosts(rows=3, target_s={1: 1.0, 8: 1.05}, drafter_s=0.01)
DEAR = PassCosts(rows=3, target_s={1: 1.0, 2: 3.0, 8: 20.0}, drafter_s=0.5)


def _brute_force(round_s, expected, prob, a, drafted, k_max, need=None):
    """Best rate of a deeper draft and of stopping, by enumeration (float64): the batch's
    total tokens per second, or with ``need`` the least share of its remaining work a row
    still decoding gets through per second."""

    def batch(tokens):
        if need is None:
            return sum(tokens)
        shares = [t / n for t, n in zip(tokens, need, strict=True) if n > 0]
        return min(shares) if shares else 0.0

    best = -np.inf
    for d in range(drafted + 1, min(k_max, len(round_s) - 1) + 1):
        tokens = [
            e + p * sum(x**j for j in range(1, d - drafted + 1))
            for e, p, x in zip(expected, prob, a, strict=True)
        ]
        best = max(best, batch(tokens) / round_s[d])
    return best, batch(expected) / round_s[drafted]


@pytest.mark.parametrize("finish", [False, True])
@pytest.mark.parametrize("seed", range(6))
def test_lookahead_equals_a_brute_force_search(seed, finish):
    rng = np.random.default_rng(seed)
    k = int(rng.integers(2, 9))
    round_s = np.cumsum(rng.uniform(0.1, 2.0, size=k + 1))  # costs grow with depth
    expected = rng.uniform(1, 3, size=4)
    prob = rng.uniform(0, 1, size=4)
    a = rng.uniform(0, 0.99, size=4)
    drafted, k_max = int(rng.integers(0, k)), int(rng.integers(1, k + 2))
    need = rng.integers(0, 40, size=4).astype(np.float64) if finish else None  # 0: done
    costs = P.RoundCosts(round_s=jnp.asarray(round_s, jnp.float32), skip_s=jnp.asarray(1.0))
    got = P._best_deeper(
        costs, jnp.asarray(expected, jnp.float32), jnp.asarray(prob, jnp.float32),
        jnp.asarray(a, jnp.float32), jnp.asarray(drafted), jnp.asarray(k_max),
        None if need is None else jnp.asarray(need, jnp.float32),
    )  # fmt: skip
    want = _brute_force(round_s, expected, prob, a, drafted, k_max, need)
    np.testing.assert_allclose([float(x) for x in got], want, rtol=1e-5)


# The batch-4 costs measured on 2 cores (1.5B target, 0.5B drafter; docs/benchmarks.md).
BATCH4 = PassCosts(
    rows=4, target_s={1: 0.433, 2: 0.512, 3: 0.639, 5: 0.655, 9: 0.914}, drafter_s=0.148
)


def test_a_batch_drafts_for_the_row_that_finishes_last():
    """A batch ends with its last row. Three rows that accept almost everything and one
    that accepts little: the batch's total tokens per second says draft deep, but every
    such round costs the slow row about three plain steps for under two tokens, so the
    finishing-time objective drafts nothing deeper; rows that are done, or far ahead (less
    left to write), do not hold the batch back."""
    config = decoding.DecodeConfig(verification="greedy", max_draft=6, max_skip=2)
    params = _params(BATCH4, config)
    costs = params.costs
    one = jnp.ones((4,))
    a = jnp.asarray([0.95, 0.95, 0.1, 0.95])
    start = jnp.asarray(0, jnp.int32)
    total = P._best_deeper(costs, one, one, a, start, params.k_max)
    assert total[0] > total[1]  # by the total, drafting beats a root-only round
    equal = jnp.full((4,), 48.0)
    finish = P._best_deeper(costs, one, one, a, start, params.k_max, equal)
    assert finish[0] < finish[1]  # the slow row decides: no deeper draft pays
    # The slow row done, or with 10 tokens left against the others' 48: drafting pays again.
    for need in ([48.0, 48.0, 0.0, 48.0], [48.0, 48.0, 10.0, 48.0]):
        ahead = P._best_deeper(costs, one, one, a, start, params.k_max, jnp.asarray(need))
        assert ahead[0] > ahead[1]
    # The skip decision weighs each row's measured rate over its remaining work: three rows
    # at 4 tokens a depth-4 round and one at 1.2 lose to plain steps, though the total wins.
    rounds = np.zeros((4, costs.round_s.shape[0]), np.float32)
    rounds[:, 4] = 3.0
    state = P.init_policy_state(params, 4).replace(
        emitted=jnp.asarray([12.0, 12.0, 3.6, 12.0]), rounds=jnp.asarray(rounds),
        skipped=jnp.zeros((4,), jnp.int32),
    )  # fmt: skip
    active = jnp.ones((4,), bool)
    t4, step = float(costs.round_s[4]), float(costs.skip_s)
    assert 39.6 / (3 * t4) > 4 / step and 1.2 / t4 * (1 + 0.5 / np.sqrt(3)) < 1 / step
    assert not P.should_skip(params, state, active, 2)
    assert P.should_skip(params, state, active, 2, equal)
    np.testing.assert_allclose(
        P.measured_rate(params, state, active, equal),
        3.6 / (3 * t4) * (1 + 0.5 / np.sqrt(3)) / 48,
        rtol=1e-5,
    )
    # With the slow row done, the other three decide.
    done = jnp.asarray([True, True, False, True])
    need = jnp.asarray([48.0, 48.0, 0.0, 48.0])
    assert not P.should_skip(params, state, done, 2, need)


def _params(costs, config, **kw):
    return P.PolicyParams.from_policy(P.Goodput(**kw), costs.round_costs(config))


def test_skip_draft_nothing_and_continue_choices():
    config = decoding.DecodeConfig(verification="greedy", max_draft=6, max_skip=2)
    active = jnp.ones((3,), bool)
    for costs, skip in ((DEAR, True), (CHEAP, False), (MIXED, True)):
        params = _params(costs, config)
        fresh = P.init_policy_state(params, 3)
        state = fresh.replace(skipped=jnp.zeros((3,), jnp.int32))  # after a drafting round
        assert bool(P.should_skip(params, state, active, 2)) == skip
        # A row measures before it skips, unless no rate could make drafting pay (DEAR).
        assert bool(P.should_skip(params, fresh, active, 2)) == (costs is DEAR)
        # Never more than max_skip rounds in a row (but DEAR: nothing to measure), never
        # for other policies.
        after = state.replace(skipped=jnp.full((3,), 2))
        assert bool(P.should_skip(params, after, active, 2)) == (costs is DEAR)
        assert not P.should_skip(params, state, active, 0)
    other = P.PolicyParams.from_policy(P.Constant(k=3), DEAR.round_costs(config))
    assert not P.should_skip(other, P.init_policy_state(other, 3), active, 2)
    # After the re-read, MIXED makes drafting pay at the prior rate, DEAR does not; a round
    # that measures (a row's first, or one after skipped rounds) drafts in any case.
    point_mass = P.drafter_features(jnp.log(jnp.asarray([[0.999, 0.001]] * 3)))
    for costs, drafts in ((MIXED, True), (DEAR, False), (CHEAP, True)):
        params = _params(costs, config)
        fresh = P.init_policy_state(params, 3)
        state = fresh.replace(skipped=jnp.zeros((3,), jnp.int32))
        assert bool(P.draft_any(params, state, point_mass)) == drafts
        assert P.draft_any(params, fresh, point_mass)
        assert P.draft_any(params, state.replace(skipped=jnp.ones((3,), jnp.int32)), point_mass)
    assert P.draft_any(other, P.init_policy_state(other, 3), point_mass)


def test_the_batch_stops_measuring_after_patience_losing_measurements():
    """A measuring round followed by a skip is a loss, counted by the rows it measured;
    after ``patience`` row-rounds of them in a row the batch skips past ``max_skip``, and
    from then on always skips (its drafter cannot catch up in one re-read), even where the
    costs would make drafting pay."""
    config = decoding.DecodeConfig(verification="greedy", max_draft=6, max_skip=2)
    active = jnp.ones((3,), bool)
    params = _params(MIXED, config, patience=6)  # two measuring rounds of 3 rows
    state = P.init_policy_state(params, 3)
    assert not P.should_skip(params, state, active, 2)  # a row's first round drafts
    outcome = dict(drafted=jnp.ones((3,), jnp.int32), accepted=jnp.zeros((3,), jnp.int32))
    losses = []
    for _ in range(2):
        state = P.update_policy_state(params, state, active=active, **outcome)
        assert P.should_skip(params, state, active, 2)  # it lost: skip again
        state = P.skipped_round(state, 2)
        losses.append(state.losses.tolist())
        if len(losses) == 1:  # one loss: at max_skip it measures again
            assert not P.should_skip(params, state, active, 2)
    assert losses == [[3, 3, 3], [6, 6, 6]]
    assert P.should_skip(params, state, active, 2)  # gave up: no measuring round
    never = _params(MIXED, config, patience=0)
    assert not P.should_skip(never, state, active, 2)
    stale = P.skipped_round(state)  # now further behind than one re-read reaches
    assert stale.skipped.tolist() == [3, 3, 3] and stale.losses.tolist() == [6, 6, 6]
    for costs in (CHEAP, MIXED):
        assert P.should_skip(_params(costs, config, patience=0), stale, active, 2)
    # A measuring round followed by a drafting round is a win: the losses start again.
    measured = P.update_policy_state(params, state, active=active, **outcome)
    assert measured.losses.tolist() == [6, 6, 6]  # decided by the round after it
    won = P.update_policy_state(params, measured, active=active, **outcome)
    assert won.losses.tolist() == [0, 0, 0]
    assert P.skipped_round(won, 0).losses.tolist() == [0, 0, 0]  # no step ran: no loss
    # A measurement weighs the rows it measured: one row of three counts 1.
    assert P.skipped_round(won, 2, rows=1).losses.tolist() == [1, 1, 1]
    fresh = P.init_policy_state(params, 3)
    first = P.skipped_round(P.update_policy_state(params, fresh, active=active, **outcome), 2)
    assert P.should_skip(_params(MIXED, config, patience=3), first, active, 2)  # gave up
    assert not P.should_skip(params, first, active, 2)
    with pytest.raises(ValueError, match="Goodput.patience"):
        P.Goodput(patience=-1)


def test_the_skip_decision_weighs_the_measured_rate():
    """``goodput`` skips when a plain step is faster than what its drafting rounds measured
    (emitted tokens over their cost, summed over the rows), not than the geometric model at
    the rows' average acceptance rate, which underrates rounds that stop where the drafter
    is unsure; ``spread`` keeps one unlucky round from switching drafting off."""
    config = decoding.DecodeConfig(verification="greedy", max_draft=6, max_skip=2)
    active = jnp.ones((3,), bool)
    params = _params(MIXED, config, spread=0.0)
    round_s = np.asarray(params.costs.round_s)
    assert float(params.costs.skip_s) == 1.0  # a plain step: 3 tokens per second
    # Rows at an acceptance rate of 0.5 and nothing measured: the model decides, and at
    # that rate drafting one token (1.5 tokens per row in 1.7 s) loses to a plain step.
    low = P.init_policy_state(params, 3).replace(
        accepted=jnp.full((3,), 0.5), tested=jnp.ones((3,)), skipped=jnp.zeros((3,), jnp.int32)
    )
    assert P.should_skip(params, low, active, 2)
    # Two depth-1 rounds that emitted 2 tokens per row each: 12 tokens in 3.4 s beat 3/s.
    two = np.zeros((3, len(round_s)), np.float32)
    two[:, 1] = 2  # two rounds at depth 1 in every row
    won = low.replace(emitted=jnp.full((3,), 4.0), rounds=jnp.asarray(two))
    np.testing.assert_allclose(P.measured_rate(params, won, active), 12 / (2 * 1.7), rtol=1e-6)
    assert not P.should_skip(params, won, active, 2)
    lost = won.replace(emitted=jnp.full((3,), 3.0))  # 9 tokens in 3.4 s: 2.65/s
    assert P.should_skip(params, lost, active, 2)
    # The spread raises the measured rate by 1 + spread / sqrt(n), n = 6 row-rounds here.
    doubt = _params(MIXED, config, spread=0.5)
    bound = 9 / 3.4 * (1 + 0.5 / np.sqrt(6))  # 3.19/s
    np.testing.assert_allclose(P.measured_rate(doubt, lost, active), bound, rtol=1e-6)
    assert not P.should_skip(doubt, lost, active, 2)
    assert P.should_skip(doubt, lost.replace(emitted=jnp.full((3,), 2.0)), active, 2)
    # A finished row adds nothing to either side (2 tokens per second against 2.35).
    rows = jnp.array([True, True, False])
    np.testing.assert_allclose(P.measured_rate(params, won, rows), 8 / 3.4, rtol=1e-6)
    assert not P.should_skip(params, won, rows, 2)
    with pytest.raises(ValueError, match="Goodput.spread"):
        P.Goodput(spread=-0.1)


def test_the_measured_rate_counts_what_drafting_rounds_emitted():
    """Each round that ran the drafter adds, for every active row, its accepted drafts and
    the target's token, and the round's cost at the batch's depth (its deepest active row):
    a round whose rows read the drafter and drafted nothing adds one token at depth 0 (it
    cost more than a plain step); plain steps, which skip the drafter, add nothing."""
    config = decoding.DecodeConfig(verification="greedy", max_draft=6, max_skip=2)
    params = _params(MIXED, config)
    round_s = np.asarray(params.costs.round_s)
    active = jnp.array([True, True, False])
    state = P.update_policy_state(
        params, P.init_policy_state(params, 3), drafted=jnp.array([3, 1, 5]),
        accepted=jnp.array([2, 0, 5]), active=active,
    )  # fmt: skip
    np.testing.assert_allclose(state.emitted, [3, 1, 0])
    np.testing.assert_array_equal(state.rounds[:, 3], [1, 1, 0])  # counted at depth 3
    assert float(jnp.sum(state.rounds)) == 2
    state = P.update_policy_state(
        params, state, drafted=jnp.array([2, 2, 2]), accepted=jnp.array([2, 1, 0]),
        active=jnp.ones((3,), bool),
    )  # fmt: skip
    np.testing.assert_allclose(state.emitted, [6, 3, 1])
    spent = np.asarray(state.rounds) @ round_s  # the cost at today's costs
    np.testing.assert_allclose(spent, [round_s[3] + round_s[2]] * 2 + [round_s[2]], rtol=1e-6)
    # Costs corrected later apply to the rounds already counted.
    dearer = params.replace(costs=params.costs.replace(round_s=params.costs.round_s * 2))
    rate = P.measured_rate(dearer.replace(spread=jnp.asarray(0.0)), state, jnp.ones((3,), bool))
    np.testing.assert_allclose(rate, np.sum([6, 3, 1] / (2 * spent)), rtol=1e-6)
    zeros = jnp.zeros((3,), jnp.int32)
    none = P.update_policy_state(params, state, drafted=zeros, accepted=zeros, active=active)
    np.testing.assert_allclose(none.emitted, [7, 4, 1])  # the inactive row keeps its count
    np.testing.assert_array_equal(none.rounds[:, 0], [1, 1, 0])
    np.testing.assert_array_equal(none.rounds[:, 1:], state.rounds[:, 1:])
    rate = P.measured_rate(params.replace(spread=jnp.asarray(0.0)), none, active)
    np.testing.assert_allclose(rate, 7 / (spent[0] + round_s[0]) + 4 / (spent[1] + round_s[0]))
    skipped = P.skipped_round(state, 2)
    for name in ("emitted", "rounds"):
        np.testing.assert_array_equal(getattr(skipped, name), getattr(state, name))


def test_goodput_counts_add_each_round_in_full():
    """The counts add each round's tokens in full (weight ``memory`` for the past): a row
    whose first drafting round accepts 3 of 3 has rate (0.8 * 0.6 + 3) / (0.8 + 3), not the
    moving average's 0.8 * 0.6 + 0.2 * 1."""
    params = P.PolicyParams.from_policy(P.Goodput(prior=0.6, memory=0.8))
    state = P.update_policy_state(
        params, P.init_policy_state(params, 1), drafted=jnp.array([3]),
        accepted=jnp.array([3]), active=jnp.array([True]),
    )  # fmt: skip
    np.testing.assert_allclose(P._rate(state), [(0.48 + 3) / 3.8], rtol=1e-6)
    assert state.skipped.tolist() == [0]


def test_the_running_rate_follows_acceptance():
    params = P.PolicyParams.from_policy(P.Goodput(prior=0.5, memory=0.5))
    state = P.init_policy_state(params, 2)
    np.testing.assert_allclose(P._rate(state), [0.5, 0.5])
    # Row 0: 3 drafted, all accepted (3 tested); row 1: 4 drafted, 1 accepted (2 tested).
    state = P.update_policy_state(
        params, state, drafted=jnp.array([3, 4]), accepted=jnp.array([3, 1]),
        active=jnp.array([True, True]),
    )  # fmt: skip
    np.testing.assert_allclose(state.accepted, [0.5 * 0.5 + 3, 0.25 + 1])
    np.testing.assert_allclose(state.tested, [0.5 + 3, 0.5 + 2])
    np.testing.assert_allclose(P._rate(state), [3.25 / 3.5, 1.25 / 2.5], rtol=1e-6)
    # An inactive row, or a round that drafted nothing, keeps its counts.
    kept = P.update_policy_state(
        params, state, drafted=jnp.array([0, 2]), accepted=jnp.array([0, 2]),
        active=jnp.array([True, False]),
    )  # fmt: skip
    np.testing.assert_allclose(kept.accepted, state.accepted)
    np.testing.assert_allclose(kept.tested, state.tested)
    assert P.skipped_round(state).skipped.tolist() == [1, 1]


def test_the_estimate_is_the_certificate_calibrated_by_the_row():
    """A token's estimate is ``(accepted / predicted) * (C_q / log 2) ** beta``: a row whose
    tokens were accepted half as often as their certificates said gets half the estimate;
    a confident token gets more than a doubtful one at the same row rate."""
    params = P.PolicyParams.from_policy(P.Goodput(prior=0.6, beta=0.5, memory=0.0))
    state = P.init_policy_state(params, 2)
    q = jnp.log(jnp.asarray([[0.999, 0.0005, 0.0005], [0.5, 0.45, 0.05]]))
    feats = P.drafter_features(q)
    ratio = np.clip(np.asarray(feats.cert) / np.log(2.0), 0, 1) ** 0.5
    np.testing.assert_allclose(P._token_estimate(params, state, feats), 0.6 * ratio, rtol=1e-5)
    assert ratio[0] > 0.95 and ratio[1] < 0.5  # confident vs doubtful
    # Tested nodes' certificate estimates: node 2 was not tested; nan is a point mass (1).
    q_cert = jnp.asarray([[np.log(2.0), 0.25 * np.log(2.0), 0.1], [np.nan, 0.0, 0.0]])
    tested = jnp.asarray([[True, True, False], [True, True, False]])
    predicted = P.tested_estimate(params, q_cert, tested)
    np.testing.assert_allclose(predicted, [1.0 + 0.5, 1.0 + 0.0], rtol=1e-6)
    # Row 0 accepted 1 of 2 tested (predicted 1.5), row 1 both of 2 (predicted 1).
    state = P.update_policy_state(
        params, state, drafted=jnp.array([3, 2]), accepted=jnp.array([1, 2]),
        active=jnp.array([True, True]), predicted=predicted,
    )  # fmt: skip
    np.testing.assert_allclose(state.predicted, [1.5, 1.0])
    got = P._token_estimate(params, state, feats)
    np.testing.assert_allclose(got, np.minimum([ratio[0] / 1.5, 2.0 * ratio[1]], 0.999), rtol=1e-5)


@pytest.fixture(scope="module")
def pair():
    target = random_model(CONFIG, seed=3)
    return target, random_model(CONFIG, seed=3, noise_of=target, scale=0.3)


@pytest.fixture(scope="module")
def want(pair):
    return decoding.target_decode(pair[0], PROMPTS, max_new_tokens=MAX_NEW, prompt_width=WIDTH)


def _decode(target, drafter, verify, costs, policy=None, programs=None, **kw):
    config = decoding.DecodeConfig(verification=verify, max_new_tokens=MAX_NEW, max_draft=5, **kw)
    return decoding.speculative_decode(
        target, drafter, PROMPTS, config=config, policy=policy or decoding.Goodput(beta=0.01),
        costs=costs, prompt_width=WIDTH, programs=programs,
    )  # fmt: skip


def _mixed_choices(out):
    """Rounds that drafted, and rounds that drafted nothing (skipped or declined)."""
    st = out.stats
    drafted = st.drafted[st.active]
    return int(np.sum(drafted > 0)), int(np.sum(drafted == 0))


@pytest.mark.parametrize(
    "verify", ["greedy", pytest.param("tree:2x3", marks=pytest.mark.slow), "dyntree:3x3x6"]
)
def test_goodput_greedy_equals_target_greedy(pair, want, verify):
    for costs in (MIXED, CHEAP, DEAR):
        out = _decode(*pair, verify, costs, max_skip=2)
        for got, ref in zip(out.tokens, want.tokens, strict=True):
            np.testing.assert_array_equal(got, ref)
        drafted, nothing = _mixed_choices(out)
        # Every emitted token is in the statistics, the skipped steps' included (they run
        # in the target-only program: one round each, nothing drafted, one token emitted).
        emitted = np.sum(np.where(out.stats.active, out.stats.emitted, 0), axis=0)
        assert emitted.tolist() == [len(t) for t in out.tokens]
        if costs is CHEAP:
            # Near-free verification: the first round drafts to the cap in every row; later
            # rounds draft nothing only once a row's measured rate is near 0 (this random
            # pair accepts about 1 token in 10).
            # (dyntree:3x3x6 fills its 6 nodes at depth 2: 3 + 3)
            cap = {"greedy": 5, "tree:2x3": 3, "dyntree:3x3x6": 2}[verify]
            assert out.stats.depth[0].tolist() == [cap] * 3
            assert drafted > 5 * nothing
        elif costs is DEAR:
            assert drafted == 0  # a plain step every round: target-only decoding
        else:
            assert drafted > 0 and nothing > 0


def test_goodput_stops_measuring_in_a_decode(pair, want):
    """With verification dear enough that every measurement loses (MIXED, this random pair
    accepting about 1 token in 10), ``patience=1`` drafts only in the first round; with
    ``patience=0`` the batch measures again after every ``max_skip`` skipped rounds. Both
    stay exact."""
    rounds = {}
    for patience in (0, 1):
        policy = decoding.Goodput(beta=0.01, patience=patience)
        out = _decode(*pair, "greedy", MIXED, policy=policy, max_skip=2)
        for got, ref in zip(out.tokens, want.tokens, strict=True):
            np.testing.assert_array_equal(got, ref)
        st = out.stats
        rounds[patience] = np.any(st.active & (st.drafted > 0), axis=1)  # [R] drafted
    assert rounds[1][0] and not np.any(rounds[1][1:])
    assert np.sum(rounds[0]) >= 2 and len(rounds[0]) == len(rounds[1])


def test_calls_say_which_program_ran_each_stretch(pair, want):
    """``DecodeOutput.calls``: every host call, its program, seconds and tokens; they add up
    to the decode's tokens and ``decode_s``. Target-only decoding runs only steps (16 a
    call), a fixed policy only rounds, ``goodput`` with dear verification only steps, and
    with ``patience=1`` it measures in the round loop first and then steps."""

    def check(out, programs):
        assert {c.program for c in out.calls} == programs
        assert sum(c.tokens for c in out.calls) == out.num_tokens
        assert all(c.tokens >= 0 and c.seconds > 0 for c in out.calls)
        np.testing.assert_allclose(sum(c.seconds for c in out.calls), out.decode_s, rtol=1e-9)

    check(want, {"steps"})
    assert [c.tokens for c in want.calls][:-1] == [16 * len(PROMPTS)] * (len(want.calls) - 1)
    check(_decode(*pair, "greedy", MIXED, policy=decoding.Constant(k=2)), {"rounds"})
    check(_decode(*pair, "greedy", DEAR, max_skip=2), {"steps"})
    measured = _decode(*pair, "greedy", MIXED, decoding.Goodput(beta=0.01, patience=1), max_skip=2)
    check(measured, {"rounds", "steps"})
    assert measured.calls[0].program == "rounds" and measured.calls[-1].program == "steps"


def test_one_program_serves_every_goodput_parameter_and_cost(pair):
    programs = decoding.Programs()
    runs = [
        (MIXED, decoding.Goodput()),
        (CHEAP, decoding.Goodput(prior=0.3, beta=0.5, memory=0.5, spread=0.0)),
        (DEAR, decoding.Goodput(prior=0.9, patience=0)),
    ]
    counts = []
    for costs, policy in runs:
        _decode(*pair, "greedy", costs, policy=policy, programs=programs)
        counts.append(programs.compiled)
    assert counts[0] >= 1 and counts == [counts[0]] * 3


def test_goodput_with_an_eagle_head_after_skipped_rounds(pair, want):
    """A head catches up after plain steps: its context gains the target's state before
    each new token, so the output stays exact and its drafts keep their KL finite."""
    target, _ = pair
    head = decoding_head(target)
    out = _decode(target, head, "greedy", MIXED, max_skip=2)
    for got, ref in zip(out.tokens, want.tokens, strict=True):
        np.testing.assert_array_equal(got, ref)
    drafted, nothing = _mixed_choices(out)
    assert drafted > 0 and nothing > 0
    ns = out.stats.nodes
    assert np.all(np.isfinite(ns.kl[ns.valid]))


def decoding_head(target):
    from flax import nnx

    from jaxcert.models import EagleHead

    return EagleHead.from_target(target, rngs=nnx.Rngs(1), taps=(0, 1))


def test_goodput_with_the_ngram_drafter(pair, want):
    out = _decode(pair[0], decoding.NgramDrafter(2), "greedy", CHEAP)
    for got, ref in zip(out.tokens, want.tokens, strict=True):
        np.testing.assert_array_equal(got, ref)


@pytest.mark.parametrize(
    "spec, policy",
    [
        ("goodput", P.Goodput()),
        ("goodput:0.5", P.Goodput(prior=0.5)),
        ("goodput:0.5:0.4/16", P.Goodput(prior=0.5, beta=0.4, k_max=16)),
        ("goodput:patience=0", P.Goodput(patience=0)),
        ("goodput:0.5:spread=0:memory=0.5", P.Goodput(prior=0.5, spread=0.0, memory=0.5)),
        ("goodput:0.7:0.2:patience=8/12", P.Goodput(prior=0.7, beta=0.2, patience=8, k_max=12)),
    ],
)
def test_parse_goodput(spec, policy):
    assert P.parse_policy(spec) == policy
    # The spec reads back to the same policy (its cap aside), named options included.
    assert P.parse_policy(policy.spec) == dataclasses.replace(policy, k_max=P.DEFAULT_K_MAX)


@pytest.mark.parametrize(
    "spec",
    ["goodput:1", "goodput:0", "goodput:0.5:0", "goodput:1:2:3", "goodput:patience=-1"],
)  # the misspellings' own messages: test_bad_policy_spellings_say_what_is_wrong
def test_bad_goodput_spellings_are_named(spec):
    with pytest.raises(ValueError, match="goodput"):
        P.parse_policy(spec)


@pytest.mark.parametrize(
    "spec, message",
    [
        ("goodput:patience=1.5", "goodput's patience must be an integer, got '1.5'"),
        ("goodput:spread=x", "goodput's spread must be a number, got 'x'"),
        ("goodput:depth=3", "goodput has no option 'depth' \\(its options: memory, patience"),
        ("goodput:patience=1:patience=2", "goodput's option 'patience' is given twice"),
        ("goodput:0.5:patience=2:0.4", "parameter '0.4' comes after a named option"),
        ("goodput::", "goodput's parameters are numbers, got ''"),
        ("cert:patience=2", "cert takes no named options, got 'patience=2'"),
        ("svip:x", "svip's parameters are numbers, got 'x'"),
    ],
)
def test_bad_policy_spellings_say_what_is_wrong(spec, message):
    with pytest.raises(ValueError, match=message):
        P.parse_policy(spec)


def test_round_costs_by_depth():
    config = decoding.DecodeConfig(verification="greedy", max_draft=5, max_skip=8)
    assert config.verify_buckets() == (0, 1, 2, 4, 5)
    costs = PassCosts(rows=1, target_s={1: 1.0, 2: 1.5, 3: 2.0, 5: 3.0, 6: 3.5}, drafter_s=0.25)
    rc = costs.round_costs(config)
    # depth d: max(d, 1) drafter steps + the pass at bucket(d) + 1 positions.
    want = [0.25 + 1.0, 0.25 + 1.5, 0.5 + 2.0, 0.75 + 3.0, 1.0 + 3.0, 1.25 + 3.5]
    np.testing.assert_allclose(rc.round_s, want, rtol=1e-6)
    assert float(rc.skip_s) == 1.0
    tree = decoding.DecodeConfig(verification="dyntree:3x3x8")
    assert costs_lib.nodes_at_depth(tree) == [0, 3, 8, 8]
    assert costs_lib.nodes_at_depth(decoding.DecodeConfig(verification="tree:2x3")) == [0, 2, 4, 6]


def test_a_narrower_pass_is_never_priced_above_a_wider_one():
    # The batch-1 calibration of the 1.5B on this machine: widths 2 and 3 were slowed by
    # something else (0.60, 0.63 s) and measured dearer than width 5 (0.42 s).
    measured = {1: 0.296, 2: 0.605, 3: 0.626, 5: 0.420, 9: 0.529, 17: 0.658}
    costs = PassCosts(rows=1, target_s=measured, drafter_s=0.1)
    priced = [costs.target(w) for w in (1, 2, 3, 4, 5, 9, 13, 17)]
    np.testing.assert_allclose(
        priced, [0.296, 0.420, 0.420, 0.420, 0.420, 0.529, (0.529 + 0.658) / 2, 0.658]
    )
    assert costs.target_s == measured  # the raw timings are kept
    config = decoding.DecodeConfig(verification="greedy", max_draft=4, buckets=(0, 1, 2, 4))
    rounds = np.asarray(costs.round_costs(config, overhead=False).round_s)
    assert np.all(np.diff(rounds) >= 0), rounds
    # A monotone table is priced as measured.
    plain = PassCosts(rows=1, target_s={1: 1.0, 2: 1.5, 5: 3.0}, drafter_s=0.0)
    np.testing.assert_allclose([plain.target(w) for w in (1, 2, 3, 5)], [1.0, 1.5, 2.0, 3.0])


def test_calibrate_measures_once_and_keeps_the_result(pair, tmp_path, monkeypatch):
    config = decoding.DecodeConfig(verification="greedy", max_draft=2, max_skip=1)
    calls = []
    real = costs_lib.measure

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(costs_lib, "measure", counted)
    calibrate = functools.partial(
        GoodputController.calibrate, *pair, config=config, folder=tmp_path, repeats=1
    )
    first = calibrate(rows=2).costs(2)
    assert sorted(first.target_s) == [1, 2, 3] and first.drafter_s > 0
    assert all(v > 0 for v in first.target_s.values())
    again = calibrate(rows=2).costs(2)
    assert again == first and len(calls) == 1
    (path,) = tmp_path.glob("*.json")
    assert json.loads(path.read_text())["format"] == costs_lib.FORMAT
    path.write_text("{broken")  # a damaged file is measured again, not trusted
    with pytest.warns(UserWarning, match=f"pass costs {path}: .*; measuring again"):
        calibrate(rows=2)
    assert len(calls) == 2 and PassCosts.from_json(json.loads(path.read_text()))
    both = calibrate(rows=[3, 2])
    assert sorted(both.table) == [2, 3] and len(calls) == 3
    assert len(list(tmp_path.glob("*.json"))) == 2
    # A draft head's step is timed with a context; the lookup drafter's is free.
    head = decoding_head(pair[0])
    assert real(pair[0], head, rows=1, config=config, repeats=1).drafter_s > 0
    ngram = decoding.NgramDrafter(2, vocab_size=CONFIG.vocab_size)
    assert real(pair[0], ngram, rows=1, config=config, repeats=1).drafter_s == 0


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("drafter_s", float("nan"), "drafter_s must be finite and >= 0, .*got nan"),
        ("target_s", {}, "target_s must map widths to seconds, got {}"),
        ("round_scale", -3.0, "round_scale must be finite and > 0, .*got -3.0"),
        ("round_overhead_s", float("inf"), "round_overhead_s must be finite, .*got inf"),
        ("target_s", {"1": 0.0, "2": 1.0, "3": 1.0}, r"target_s\[1\] must be finite and > 0"),
        ("rows", "two", "rows must be a positive integer, got 'two'"),
        ("rows", 5, "for 5 rows, expected 3"),
        ("drafter_s", 10**400, "drafter_s must be finite and >= 0, at most 1e\\+06 in size"),
        ("target_s", {"01": 1.0}, "a width of target_s must be a positive integer, got '01'"),
        ("format", True, "pass costs of format True, expected 1"),
        ("drafting", {"greedy": {"emitted": "1", "rounds": [1.0]}}, "emitted must be a number"),
        ("drafting", None, "drafting must map modes to counts, got None"),
        ("target_s", {"0": 1.0}, "a width of target_s must be a positive integer, got '0'"),
        ("drafter_s", True, "drafter_s must be a number, got True"),
    ],
)
def test_a_damaged_calibration_is_named_and_measured_again(pair, tmp_path, field, value, message):
    """A calibration file with a NaN, an empty table or a negative scale was used as it
    stood: the decode weighed NaN costs and wrote NaN back, or failed naming no file. Each
    is refused when read, named in a warning, measured again and replaced, and the decode
    runs on the new costs."""
    config = decoding.DecodeConfig(verification="greedy", max_new_tokens=4, max_draft=2)
    calibrate = functools.partial(
        GoodputController.calibrate, *pair, config=config, rows=3, folder=tmp_path, repeats=1
    )
    (path,) = calibrate().table and tmp_path.glob("*.json")
    data = json.loads(path.read_text())
    data[field] = value
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=message):
        goodput_lib.read_costs(path, rows=3)
    with pytest.warns(UserWarning, match=f"pass costs {path}: "):
        controller = calibrate()
    fresh = controller.costs(3)
    assert np.isfinite(fresh.drafter_s) and fresh.round_scale == 1.0 and fresh.target_s
    assert PassCosts.from_json(json.loads(path.read_text())) == fresh
    out = decoding.speculative_decode(
        *pair, PROMPTS, config=config, policy=decoding.Goodput(), costs=controller,
        prompt_width=WIDTH,
    )  # fmt: skip
    assert np.all(np.isfinite(out.round_costs.round_s)) and out.num_tokens == 12
    controller.save()
    kept = goodput_lib.read_costs(path)
    assert np.isfinite(kept.round_overhead_s) and kept.round_scale > 0


def test_calibrate_refuses_a_folder_where_its_file_goes_and_bad_rows(pair, tmp_path):
    config = decoding.DecodeConfig(verification="greedy", max_new_tokens=4, max_draft=2)
    path = costs_lib.cache_path(
        *pair, rows=3, config=resolved_config(config, *pair, decoding.Goodput()).shape_only(),
        folder=tmp_path,
    )  # fmt: skip
    path.mkdir(parents=True)
    with pytest.raises(ValueError, match=f"pass costs {path}: not a file"):
        GoodputController.calibrate(*pair, config=config, rows=3, folder=tmp_path)
    for rows in (True, 0, 2.5, "3"):
        with pytest.raises(ValueError, match="calibrate rows must be an integer >= 1"):
            GoodputController.calibrate(*pair, config=config, rows=[rows], folder=tmp_path)
    for bad in (None, 3):
        with pytest.raises(ValueError, match="GoodputController needs PassCosts"):
            GoodputController(bad)
    with pytest.raises(ValueError, match="is a folder, not a file"):
        GoodputController(MIXED).save(tmp_path)
    with pytest.raises(ValueError, match="prompt_width must be an integer >= 1, got 65.0"):
        decoding.target_decode(pair[0], PROMPTS, max_new_tokens=2, prompt_width=65.0)


def test_evidence_that_halves_for_many_decodes_reads_back():
    """A depth no longer drafted halves with every decode: after 40 its row-rounds are about
    1e-19, which a saved file must read back (it was refused as below 1e-9, and everything
    learnt was measured anew)."""
    past = costs_lib.PastDrafting(3.0, (0.0, 2.0, 1.0))
    for _ in range(40):
        past = past.then(1.0, [0.0, 1.0, 0.0], rows=3)
    assert 0 < past.rounds[2] < 1e-9
    costs = dataclasses.replace(MIXED, drafting={"greedy": past})
    assert PassCosts.from_json(json.loads(json.dumps(costs.to_json()))) == costs


def test_a_cost_table_file_names_what_is_wrong(tmp_path):
    path = tmp_path / "costs.json"
    for body, message in [
        ("[]", "expected an object mapping batch rows to pass costs"),
        (json.dumps({"3": MIXED.to_json() | {"rows": 2}}), "the costs under '3' are for 2 rows"),
        (json.dumps({"3": MIXED.to_json() | {"drafter_s": None}}), "drafter_s must be a number"),
    ]:
        path.write_text(body)
        with pytest.raises(ValueError, match=f"pass costs {path}: {message}"):
            GoodputController.load(path)
    GoodputController([MIXED, CHEAP.__class__(**{**vars(CHEAP), "rows": 2})]).save(path)
    loaded = GoodputController.load(path)
    assert loaded.table == {3: MIXED, 2: dataclasses.replace(CHEAP, rows=2)}
    with pytest.raises(
        ValueError, match=r"no pass costs for batches of 5 rows \(it has \[2, 3\]\)"
    ):
        loaded.costs(5)
    with pytest.raises(ValueError, match="no calibration file for batches of"):
        loaded.save()


def _fit_reference(calls, *, memory, ridge, scale=1.0):
    """``(o, k)`` by plain least squares of ``y = o R + k P`` over ``calls`` (``(R, P, y)``,
    oldest first; call ``c`` of ``n`` weighted ``memory^(n-1-c) / R_c``) and a ridge row
    holding ``k`` at ``scale``, ``o`` not held."""
    n = len(calls)
    rows = [np.sqrt(memory ** (n - 1 - c) / r) * np.asarray([r, p, y]) for c, (r, p, y) in
            enumerate(calls)]  # fmt: skip
    rows.append(np.sqrt(ridge) * np.asarray([0.0, 1.0, scale]))
    a = np.asarray(rows)
    (o, k), *_ = np.linalg.lstsq(a[:, :2], a[:, 2], rcond=None)
    return o, k


def test_the_cost_tracker_fits_an_overhead_and_a_factor():
    base = P.RoundCosts(round_s=jnp.asarray([1.0, 1.5, 2.0, 2.5]), skip_s=jnp.asarray(1.0))
    passes = np.asarray(base.round_s)
    ridge = passes[1] ** 2  # one round at depth 1
    tracker = costs_lib.CostTracker(base, memory=0.5, floor=0.5)
    np.testing.assert_allclose(tracker.round_costs().round_s, passes)  # nothing seen yet
    assert tracker.scale() == 1.0
    # Calls of one depth mix cannot tell a factor from an overhead: the factor stays at 1
    # and the overhead is the ratio estimate.
    tracker.observe_rounds(6.5 + 1.2, [1, 3, 3])
    np.testing.assert_allclose(tracker.overhead_s("round"), 0.4)
    tracker.observe_rounds(6.5 + 0.3, [3, 1, 3])
    np.testing.assert_allclose(tracker.scale(), 1.0, atol=1e-12)
    want = (0.5 * 1.2 + 0.3) / (0.5 * 3 + 3)
    np.testing.assert_allclose(tracker.overhead_s("round"), want, rtol=1e-12)
    np.testing.assert_allclose(tracker.round_costs().round_s, passes + want, rtol=1e-6)
    # Rounds that cost 0.2 s + 0.8 of their passes, at varied depths: both are found, and
    # match a plain least squares fit of the same weighted calls.
    fit = costs_lib.CostTracker(base, memory=0.9, floor=0.5)
    calls = []
    for depths in ([1] * 8, [3] * 8, [2, 1, 1, 2], [3, 3, 1], [1] * 6, [3] * 5) * 2:
        p = float(passes[depths].sum())
        y = 0.2 * len(depths) + 0.8 * p
        fit.observe_rounds(y, depths)
        calls.append((len(depths), p, y))
    o, k = _fit_reference(calls, memory=0.9, ridge=ridge)
    np.testing.assert_allclose([fit.overhead_s("round"), fit.scale()], [o, k], rtol=1e-9)
    assert 0.8 < k < 0.9 and o > 0.1  # the ridge pulls k towards 1 a little
    np.testing.assert_allclose(fit.round_costs().round_s, k * passes + o, rtol=1e-5)
    got = fit.round_costs()
    assert float(got.skip_s) == 1.0  # steps have their own correction
    fit.observe_steps(8 * 1.3, 8)
    np.testing.assert_allclose(float(fit.round_costs().skip_s), 1.3, rtol=1e-6)
    # A calibration that overestimates is corrected down, never below the floor.
    fast = costs_lib.CostTracker(base, floor=0.5)
    fast.observe_rounds(0.01, [3, 3])
    np.testing.assert_allclose(fast.round_costs().round_s, 0.5 * passes)
    fast.observe_rounds(float("nan"), [1])  # an unusable timing is ignored
    fast.observe_rounds(1.0, [])
    assert fast.observed["round"] == 1
    # A factor outside [floor, 1 / floor] is held at the bound, the overhead refitted.
    steep = costs_lib.CostTracker(base, floor=0.5, ridge=1e-6)
    for depths in ([1] * 4, [3] * 4):
        steep.observe_rounds(5.0 * float(passes[depths].sum()) - 4.0, depths)
    assert steep.scale() == 2.0
    np.testing.assert_allclose(
        np.asarray(steep.round_costs().round_s)[1:],
        (2.0 * passes + steep.overhead_s("round"))[1:],
        rtol=1e-5,
    )


@pytest.mark.parametrize(
    "kw",
    [
        {"memory": 1.0}, {"memory": -0.1}, {"floor": 0.0}, {"floor": 2}, {"scale": 0.0},
        {"scale": float("nan")}, {"ridge": 0.0}, {"prior_weight": -1.0},
    ],
)  # fmt: skip
def test_the_cost_tracker_refuses_bad_settings(kw):
    base = P.RoundCosts.unknown(2)
    with pytest.raises(ValueError, match="CostTracker (memory|floor|scale|ridge|prior_weight)"):
        costs_lib.CostTracker(base, **kw)


def test_a_programs_first_execution_is_reported_once():
    programs = decoding.Programs()
    square = jax.jit(lambda x: x * x)
    prog = programs.compile(square, (jnp.zeros(3),), {})
    other = programs.compile(square, (jnp.zeros(4),), {})
    assert programs.compile(square, (jnp.zeros(3),), {}) is prog  # cached, still unrun
    assert programs.first_execution(prog) and not programs.first_execution(prog)
    assert programs.first_execution(prog, other)  # one of them is new
    assert not programs.first_execution(prog, other) and not programs.first_execution(object())
    programs.clear()
    again = programs.compile(square, (jnp.zeros(3),), {})
    assert again is not prog and programs.first_execution(again)


def test_a_measured_overhead_turns_drafting_into_skipping():
    """Calibrated passes say drafting pays at a rate of 0.5; once the tracker has seen
    rounds cost 0.8 s more than their passes (and steps what they should), it skips."""
    config = decoding.DecodeConfig(verification="greedy", max_draft=4, max_skip=8)
    costs = PassCosts(rows=8, target_s={1: 1.0, 2: 1.1, 3: 1.2, 5: 1.3}, drafter_s=0.05)
    base = costs.round_costs(config)
    params = P.PolicyParams.from_policy(P.Goodput(), base)
    state = P.init_policy_state(params, 8)
    state = state.replace(
        accepted=jnp.full((8,), 0.5), tested=jnp.ones((8,)), skipped=jnp.zeros((8,), jnp.int32)
    )
    active = jnp.ones((8,), bool)
    assert not bool(P.should_skip(params, state, active, 8))
    tracker = costs_lib.CostTracker(base)
    depths = np.asarray([2, 2, 3, 2])
    tracker.observe_rounds(float(np.asarray(base.round_s)[depths].sum()) + 4 * 0.8, depths)
    tracker.observe_steps(8 * 1.0, 8)
    corrected = params.replace(costs=tracker.round_costs())
    assert bool(P.should_skip(corrected, state, active, 8))


def _calibrated_as(monkeypatch, costs):
    """``GoodputController.calibrate`` returning ``costs`` (corrected as calibrated costs are)."""
    monkeypatch.setattr(
        GoodputController, "calibrate", classmethod(lambda cls, *a, **k: cls(costs))
    )


def test_calibrated_costs_are_corrected_and_given_ones_kept(pair, want, monkeypatch):
    """With costs calibrated here, or a controller that corrects, the decoder corrects them
    from its timed calls (the tiny pair's rounds take milliseconds, not the seconds
    claimed, so the costs fall to the floor), in one compiled program; ``PassCosts`` the
    caller gives stay as they are."""
    _calibrated_as(monkeypatch, CHEAP)
    config = decoding.DecodeConfig(verification="greedy", max_new_tokens=MAX_NEW, max_draft=5)
    base = np.asarray(CHEAP.round_costs(resolved_config(
        config, *pair, decoding.Goodput())).round_s)  # fmt: skip
    programs = decoding.Programs()
    run = lambda **kw: decoding.speculative_decode(  # noqa: E731
        *pair, PROMPTS, config=config, policy=decoding.Goodput(), prompt_width=WIDTH,
        programs=programs, **kw,
    )  # fmt: skip
    given = run(costs=CHEAP)
    np.testing.assert_allclose(given.round_costs.round_s, base, rtol=1e-6)
    compiled = programs.compiled
    corrected = run()
    assert programs.compiled == compiled  # the corrections are traced values
    np.testing.assert_allclose(corrected.round_costs.round_s, 0.5 * base, rtol=1e-5)
    held = GoodputController(CHEAP)
    asked = run(costs=held)
    np.testing.assert_allclose(asked.round_costs.round_s, 0.5 * base, rtol=1e-5)
    assert held.table[3].round_overhead_s < 0 and held.table[3].drafting  # learnt, kept
    fixed = run(costs=GoodputController(CHEAP, correct=False))
    np.testing.assert_allclose(fixed.round_costs.round_s, base, rtol=1e-6)
    for out in (given, corrected, asked, fixed):
        for got, ref in zip(out.tokens, want.tokens, strict=True):
            np.testing.assert_array_equal(got, ref)


def test_learnt_overheads_are_kept_with_the_calibration(pair, tmp_path):
    config = decoding.DecodeConfig(verification="greedy", max_draft=2, max_skip=1)
    calibrate = functools.partial(
        GoodputController.calibrate, *pair, config=config, rows=2, folder=tmp_path, repeats=1
    )
    controller = calibrate()
    first = controller.costs(2)
    assert (first.round_overhead_s, first.step_overhead_s) == (0.0, 0.0)
    path = costs_lib.cache_path(*pair, rows=2, config=config, folder=tmp_path)
    assert path.is_file()
    base = first.round_costs(config, overhead=False)
    passes = np.asarray(base.round_s)
    run = controller.begin(2, config, temperature=0.0)
    run.observe("rounds", float(passes[[1, 2]].sum()) + 2 * 0.3, [1, 2], first=False)
    run.observe("rounds", 100.0, [1], first=True)  # a first execution is not timed
    run.observe("steps", 3 * float(base.skip_s) + 3 * 0.05, 3, first=False)
    run.finish(0.0, np.zeros(3))
    assert json.loads(path.read_text())["round_overhead_s"] == 0.0  # not saved yet
    controller.save()
    kept = controller.costs(2)
    again = calibrate().costs(2)
    assert again == kept and again.target_s == first.target_s  # read, not measured again
    np.testing.assert_allclose([again.round_overhead_s, again.step_overhead_s], [0.3, 0.05])
    np.testing.assert_allclose(
        again.round_costs(config).round_s, np.maximum(passes + 0.3, 0.5 * passes), rtol=1e-5
    )
    # The next run's tracker starts from them, as prior_weight rounds of evidence.
    nxt = costs_lib.CostTracker(base, memory=0.5, prior=(0.3, 0.05), prior_weight=4)
    np.testing.assert_allclose(nxt.overhead_s("round"), 0.3)
    seconds = float(passes[[1, 1, 1, 1]].sum()) + 4 * 1.0
    nxt.observe_rounds(seconds, [1, 1, 1, 1])
    # One depth mix: the factor stays at 1 and the overhead is the ratio estimate with the
    # prior's rounds.
    np.testing.assert_allclose(nxt.overhead_s("round"), (0.5 * 4 * 0.3 + 4.0) / (0.5 * 4 + 4))
    assert nxt.scale() == 1.0
    # A plain step's prior counts only until this tracker times steps of its own.
    np.testing.assert_allclose(nxt.overhead_s("step"), 0.05)
    nxt.observe_steps(2 * float(base.skip_s) - 2 * 0.1, 2)
    np.testing.assert_allclose(nxt.overhead_s("step"), -0.1, rtol=1e-6)
    nxt.observe_steps(2 * float(base.skip_s) + 2 * 0.2, 2)
    np.testing.assert_allclose(nxt.overhead_s("step"), (0.5 * 2 * -0.1 + 0.4) / (0.5 * 2 + 2))
    # A file of the same format without learnt overheads reads as none learnt.
    data = json.loads(path.read_text())
    assert PassCosts.from_json(data).round_scale == pytest.approx(1.0)  # one depth mix
    del data["round_overhead_s"], data["step_overhead_s"], data["round_scale"]
    read = PassCosts.from_json(data)
    assert (read.round_overhead_s, read.round_scale) == (0.0, 1.0)


def test_the_plain_step_is_measured_once_when_the_decode_never_skips(pair, want, monkeypatch):
    """Costs calibrated here (CHEAP: drafting looks far better than a plain step) are
    corrected from timed calls, and a plain step's cost is one of them: after the first
    call of the round loop, one call of plain steps runs to time them (a probe, which does
    not count as a losing measurement, so drafting goes on after it). A program's first
    execution is not timed, so with programs never run before the probe runs twice. Costs
    the caller gives are not corrected, so nothing is probed. All stay exact."""
    from jaxcert.decoding import host

    calls = []

    def spy(*args, losing=True, **kw):
        state, ran = plain_steps(*args, losing=losing, **kw)
        calls.append((losing, ran))
        return state, ran

    plain_steps = host.plain_steps
    monkeypatch.setattr(host, "plain_steps", spy)
    _calibrated_as(monkeypatch, CHEAP)
    config = decoding.DecodeConfig(
        verification="greedy", max_new_tokens=MAX_NEW, max_draft=5, max_skip=2
    )
    policy = decoding.Goodput(beta=0.01, patience=1)
    programs = decoding.Programs()
    for given, probes in ((None, 2), (None, 1), (CHEAP, 0)):
        calls.clear()
        out = decoding.speculative_decode(
            *pair, PROMPTS, config=config, policy=policy, prompt_width=WIDTH, costs=given,
            programs=programs,
        )  # fmt: skip
        for got, ref in zip(out.tokens, want.tokens, strict=True):
            np.testing.assert_array_equal(got, ref)
        assert [c for c in calls if not c[0]] == [(False, 2)] * probes
        st = out.stats
        drafted = np.any(st.active & (st.drafted > 0), axis=1)  # [R]
        if probes == 2:
            # The first call's rounds (8, all drafting at these costs, untimed), then the
            # probes' plain steps; only the second probe's are timed, and they correct the
            # plain step's cost while the rounds' is still the calibrated one.
            assert drafted[:8].all() and not drafted[8:12].any()
        elif probes:
            # The first call's rounds, then the probe's 2 plain steps, then drafting again:
            # patience=1 would have stopped it otherwise.
            assert drafted[:8].all() and not drafted[8:10].any() and drafted[10:].any()
        else:
            assert not calls


def _prior(params, emitted_per_row, weight=1.0, depth=1):
    """``params`` with a prior of ``weight`` row-rounds per row at ``depth`` that emitted
    ``emitted_per_row`` tokens per row-round."""
    rounds = np.zeros(params.costs.round_s.shape, np.float64)
    rounds[depth] = weight
    return params.with_past(emitted_per_row * weight, rounds)


def test_a_prior_from_earlier_decodes_decides_the_first_round():
    """With what earlier decodes' drafting produced, a row's first round weighs it like its
    own measurement (an upper confidence bound over the prior's row-rounds): a losing prior
    makes the first round a plain step, counted as a losing measurement, so a batch whose
    rows reach ``patience`` stops measuring at once; a winning prior drafts, and need not
    draft a token to measure. No prior (zeros) is the old start: the first round drafts."""
    config = decoding.DecodeConfig(verification="greedy", max_draft=6, max_skip=2)
    active = jnp.ones((3,), bool)
    params = _params(MIXED, config)  # patience 2 row-rounds; a plain step: 3 tokens/s
    t1 = float(params.costs.round_s[1])
    # One depth-1 round per row that emitted only the target's token: 3 / t1 tokens/s,
    # raised by 1 + 0.5 / sqrt(3), is below the plain step's 3.
    assert 3 / t1 * (1 + 0.5 / np.sqrt(3)) < 3
    losing = _prior(params, 1.0)
    state = P.init_policy_state(losing, 3)
    assert state.skipped.tolist() == [0, 0, 0] and state.emitted.tolist() == [1, 1, 1]
    np.testing.assert_array_equal(state.rounds[:, 1], [1, 1, 1])
    np.testing.assert_allclose(
        P.measured_rate(losing, state, active), 3 / t1 * (1 + 0.5 / np.sqrt(3)), rtol=1e-6
    )
    assert P.should_skip(losing, state, active, 2)
    state = P.skipped_round(state, 2)  # the host's plain steps: a loss of 3 row-rounds
    assert state.losses.tolist() == [3, 3, 3]
    assert P.should_skip(losing, state, active, 2)  # gave up: no measuring round follows
    one_row = P.skipped_round(P.init_policy_state(losing, 3), 2, rows=1)
    assert not P.should_skip(losing, one_row, active, 2)  # 1 < patience: it measures
    # The same rate with less weight (it halves with each decode that did not draft): the
    # bound rises without a floor at one row-round, until the first round drafts again.
    skips = []
    for halvings in range(8):
        faded = _prior(params, 1.0, weight=0.5**halvings)
        skips.append(bool(P.should_skip(faded, P.init_policy_state(faded, 3), active, 2)))
    n = 3 * 0.5 ** np.arange(8)
    np.testing.assert_array_equal(skips, 3 / t1 * (1 + 0.5 / np.sqrt(n)) < 3)
    assert skips[0] and not skips[-1]
    # A winning prior (4 tokens per row-round) drafts, and its first round is not forced
    # to draft a token (the prior has measured).
    winning = _prior(params, 4.0)
    fresh = P.init_policy_state(winning, 3)
    assert not P.should_skip(winning, fresh, active, 2)
    bad = P.DrafterFeatures(
        top=jnp.full((3,), 0.3),
        entropy=jnp.full((3,), 3.0),
        cert=jnp.full((3,), 1e-6),
        match=jnp.zeros((3,), jnp.int32),
    )
    assert not P.draft_any(winning, fresh, bad)
    assert P.draft_any(params, P.init_policy_state(params, 3), bad)  # no prior: measures
    # No prior: the first round drafts (UNMEASURED), as before.
    none = params.with_past(0.0, np.zeros(params.costs.round_s.shape))
    assert P.init_policy_state(none, 3).skipped.tolist() == [P.UNMEASURED] * 3
    assert not P.should_skip(none, P.init_policy_state(none, 3), active, 2)
    with pytest.raises(ValueError, match="past rounds of shape"):
        params.with_past(1.0, np.ones(2))
    with pytest.raises(ValueError, match="finite and >= 0"):
        params.with_past(-1.0, np.ones(params.costs.round_s.shape))


def test_past_drafting_decays_caps_and_round_trips():
    """The kept evidence halves with each decode and adds the decode's own, capped at one
    row-round per row; a decode that never drafted only halves it. Per row, a batch starts
    with at most one row-round. It is kept by sampling mode in the calibration file."""
    past = costs_lib.PastDrafting(0.0, (0.0, 0.0, 0.0))
    first = past.then(10.0, [0.0, 4.0, 2.0], rows=8)  # 6 row-rounds, under the cap
    assert first == costs_lib.PastDrafting(10.0, (0.0, 4.0, 2.0))
    second = first.then(12.0, [0.0, 8.0, 0.0], rows=8)  # 5 + 12 = 17 tokens, 11 row-rounds
    np.testing.assert_allclose(second.weight, 8.0)
    np.testing.assert_allclose(second.emitted, 17.0 * 8 / 11)
    np.testing.assert_allclose(second.rounds, np.array([0.0, 10.0, 1.0]) * 8 / 11)
    idle = second.then(0.0, [0.0, 0.0, 0.0], rows=8)
    np.testing.assert_allclose([idle.weight, idle.emitted], [4.0, second.emitted / 2])
    emitted, rounds = idle.per_row(8)
    np.testing.assert_allclose([emitted, rounds.sum()], [idle.emitted / 8, 0.5])
    emitted, rounds = second.then(80.0, [0.0, 40.0, 0.0], rows=8).per_row(8)
    np.testing.assert_allclose(rounds.sum(), 1.0)  # capped: one row-round per row
    with pytest.raises(ValueError, match="rounds of shape"):
        first.then(1.0, [1.0], rows=8)
    costs = dataclasses.replace(MIXED, drafting={"sampling": second})
    assert PassCosts.from_json(json.loads(json.dumps(costs.to_json()))) == costs
    assert PassCosts.from_json(MIXED.to_json()).drafting == {}
    for bad in (
        {"emitted": 1.0},
        {"emitted": float("nan"), "rounds": [0.0, 1.0]},
        {"emitted": 1.0, "rounds": [0.0, -1.0]},
        {"emitted": 1.0, "rounds": "12"},
    ):
        broken = json.loads(json.dumps(costs.to_json() | {"drafting": {"greedy": bad}}))
        with pytest.raises(ValueError, match=r"drafting\['greedy'\]"):
            PassCosts.from_json(broken)
    assert costs_lib.sampling_mode(0.0) == "greedy" and costs_lib.sampling_mode(0.7) == "sampling"


# A losing prior (one token per depth-1 row-round) stays losing, but drafting is not ruled
# out by the costs alone once the tiny models' plain steps correct ``skip_s`` to its floor.
SPLIT = PassCosts(rows=3, target_s={1: 1.0, 2: 1.5, 8: 2.0}, drafter_s=0.05)


def test_a_decode_starts_from_what_earlier_decodes_drafting_measured(
    pair, want, tmp_path, monkeypatch
):
    """End to end, with a controller that corrects: a kept prior that says drafting loses makes
    the next greedy decode run as target-only decoding (its first round would skip, and
    that loss of 3 row-rounds reaches ``patience``): the drafter never reads the prompts,
    the output is target-only greedy's, every round is recorded as a plain one, and the
    decode, having drafted nothing, halves the kept weight. With ``patience`` above the
    batch the first round skips inside the speculative decoder and it measures later.
    Without the prior the same decode drafts, and what it measured is kept under its
    sampling mode."""
    from jaxcert.decoding import loop

    config = decoding.DecodeConfig(
        verification="greedy", max_new_tokens=MAX_NEW, max_draft=5, max_skip=2
    )
    resolved = resolved_config(config, *pair, decoding.Goodput())
    depths = SPLIT.round_costs(resolved).round_s.shape[0]
    rounds = np.zeros(depths)
    rounds[1] = 3.0
    losing = costs_lib.PastDrafting(3.0, tuple(rounds))  # one token per row-round
    default = decoding.Goodput()
    run = lambda policy=default, **kw: decoding.speculative_decode(  # noqa: E731
        *pair, PROMPTS, config=config, policy=policy, prompt_width=WIDTH, **kw
    )  # fmt: skip
    controller = GoodputController(dataclasses.replace(SPLIT, drafting={"greedy": losing}))
    programs = decoding.Programs()
    out = run(programs=programs, costs=controller)
    for got, ref in zip(out.tokens, want.tokens, strict=True):
        np.testing.assert_array_equal(got, ref)
    assert not programs.of(loop.prefill) and programs.of(loop.prefill_target)
    assert not np.any(out.stats.drafted) and np.all(out.stats.emitted == out.stats.active)
    np.testing.assert_array_equal(out.stats.active.sum(axis=0), [len(t) for t in out.tokens])
    kept = controller.costs(3).drafting
    assert set(kept) == {"greedy"}
    np.testing.assert_allclose(kept["greedy"].rounds, rounds / 2)
    np.testing.assert_allclose(kept["greedy"].emitted, 1.5)
    # patience 4 > 3 rows: the skip does not stop measuring, so the speculative decoder
    # runs; its first round is a plain step, and later rounds measure. (A decode before it
    # runs the programs once: a program's first execution is not timed, and the plain
    # steps' timing is what rules drafting back in.)
    for _ in range(2):
        controller = GoodputController(dataclasses.replace(SPLIT, drafting={"greedy": losing}))
        out = run(decoding.Goodput(patience=4), programs=programs, costs=controller)
    for got, ref in zip(out.tokens, want.tokens, strict=True):
        np.testing.assert_array_equal(got, ref)
    assert programs.of(loop.prefill)
    drafted = np.any(out.stats.active & (out.stats.drafted > 0), axis=1)
    assert not drafted[0] and drafted.any()
    # What is kept: the prior halved plus this decode's own drafting (its rows' counts
    # less the prior they started with).
    kept = controller.costs(3).drafting["greedy"]
    want_kept = losing.then(*_drafting_of(out.stats, depths), rows=3)
    np.testing.assert_allclose(kept.rounds, want_kept.rounds, rtol=1e-5)
    np.testing.assert_allclose(kept.emitted, want_kept.emitted, rtol=1e-5)
    # No prior: the first round drafts, and the decode's drafting is kept.
    controller = GoodputController(SPLIT)
    out = run(costs=controller)
    for got, ref in zip(out.tokens, want.tokens, strict=True):
        np.testing.assert_array_equal(got, ref)
    drafted = out.stats.active & (out.stats.drafted > 0)
    assert drafted[0].all()
    kept = controller.costs(3).drafting["greedy"]
    assert 0 < kept.weight <= 3
    emitted, real = _drafting_of(out.stats, depths)
    scale = min(1.0, 3 / real.sum())
    np.testing.assert_allclose(kept.rounds, real * scale, rtol=1e-5)
    np.testing.assert_allclose(kept.emitted, emitted * scale, rtol=1e-5)


def _drafting_of(stats, depths):
    """``(emitted, [depths] row-rounds by depth)`` of a decode's drafting rounds, from its
    statistics: every active row of a round that drafted, at the batch's depth, with its
    emitted tokens."""
    depth = np.where(stats.active, stats.drafted, 0).max(axis=1)  # [R] the batch's
    took = stats.active & (depth[:, None] > 0)  # [R, B] row-rounds that paid a round
    rounds = np.bincount(np.broadcast_to(depth[:, None], took.shape)[took], minlength=depths)
    emitted = np.where(took, stats.emitted, 0).sum()  # what an end token or budget let through
    return float(emitted), rounds.astype(np.float64)


# A drafter without a forward pass of its own (prompt lookup): a round that drafts nothing
# costs a plain step.
LOOKUP = PassCosts(rows=3, target_s={1: 1.0, 2: 1.2, 8: 2.0}, drafter_s=0.0)


def _lookup_params(costs, **kw):
    config = decoding.DecodeConfig(
        verification="greedy", max_draft=6, max_skip=2, proposes_tokens=True
    )
    return _params(costs, config, **kw)


def _proposal(length, v=5):
    """One-hot drafter logits as prompt lookup writes them: the match length at token 1."""
    length = np.asarray(length, np.float32)
    logits = np.full(length.shape + (v,), -np.inf, np.float32)
    logits[..., 1] = length
    logits[length == 0] = -np.inf  # no match: no proposal
    return jnp.asarray(logits)


def _lookup_features(match):
    return P.proposal_features(jnp.stack([jnp.where(jnp.asarray(match) > 0, 1, -1),
                                          jnp.asarray(match)], axis=-1))  # fmt: skip


def test_prompt_lookup_is_read_before_every_round():
    """A proposing drafter is read before the round: the batch skips exactly when no
    active row's proposal is worth a round, whatever its drafting measured, its losses or
    how long it skipped (it catches up from the text); a drafter with distributions is
    skipped on its measured drafting at the same costs; with rounds far dearer than plain
    steps no proposal is worth one."""
    active = jnp.ones((3,), bool)
    params = _lookup_params(LOOKUP, spread=0.0)
    depths = params.costs.round_s.shape[0]
    rounds = np.zeros((3, depths), np.float32)
    rounds[:, 1] = 2.0
    hits = np.full((3, P.MATCH_CLASSES), 0.6, np.float32)
    tries = np.ones_like(hits)
    tries[:, 0], hits[:, 0] = 10.0, 0.5  # matches of 1 token: rarely accepted
    tries[:, -1], hits[:, -1] = 10.0, 10.0  # matches of 8 or more: always
    lost = P.init_policy_state(params, 3).replace(
        skipped=jnp.full((3,), 5, jnp.int32),  # stale for a drafter with distributions
        losses=jnp.full((3,), 100),
        emitted=jnp.full((3,), 2.0),
        rounds=jnp.asarray(rounds),
        match_accepted=jnp.asarray(hits),
        match_tested=jnp.asarray(tries),
    )  # fmt: skip  two depth-1 rounds that emitted one token each: drafting lost
    assert P.should_skip(params, lost, active, 2)  # a drafter with distributions
    none, short, long = (_lookup_features([k, k, k]) for k in (0, 1, 8))
    assert P.should_skip(params, lost, active, 2, proposal=none)  # nothing proposed
    assert P.should_skip(params, lost, active, 2, proposal=short)  # not worth a round
    assert not P.should_skip(params, lost, active, 2, proposal=long)
    one_long = _lookup_features([0, 8, 1])
    assert not P.should_skip(params, lost, active, 2, proposal=one_long)
    # ... unless the row with the long match is done.
    assert P.should_skip(params, lost, jnp.array([True, False, True]), 2, proposal=one_long)
    dear = _lookup_params(dataclasses.replace(LOOKUP, round_overhead_s=50.0), spread=0.0)
    assert P.should_skip(dear, lost, active, 2, proposal=long)
    # With max_skip 0 nothing is skipped.
    assert not P.should_skip(params, lost, active, 0, proposal=none)


def test_a_proposal_is_estimated_by_its_match_length():
    """``goodput``'s estimate of a proposal is the row's acceptance rate of proposals from
    matches of that length (all start at ``prior``): with short matches rejected and long
    ones accepted, a round drafts on a long match and not on a short one; a drafter with
    distributions still reads its certificate (``match`` 0)."""
    params = _lookup_params(LOOKUP)
    state = P.init_policy_state(params, 3)
    np.testing.assert_allclose(state.match_accepted, np.full((3, P.MATCH_CLASSES), 0.6))
    hits = np.zeros((3, P.MATCH_CLASSES), np.float32)
    tries = np.zeros_like(hits)
    tries[:, 0], hits[:, 0] = 10.0, 0.5  # matches of 1 token: 0.5 of 10 (+ the prior) accepted
    tries[:, -1], hits[:, -1] = 10.0, 10.0  # matches of 8 or more: all accepted
    state = P.update_policy_state(
        params, state.replace(skipped=jnp.zeros((3,), jnp.int32)),
        drafted=jnp.zeros((3,), jnp.int32), accepted=jnp.zeros((3,), jnp.int32),
        active=jnp.ones((3,), bool), match=(jnp.asarray(hits), jnp.asarray(tries)),
    )  # fmt: skip
    short, mid, long = 0.8 * 0.6 + 0.5, 0.6, 0.8 * 0.6 + 10.0
    rates = [short / (0.8 + 10), mid / 1.0, long / (0.8 + 10)]
    # Lengths 1, 3 and 12 (above the last class: counted in it).
    feats = P.drafter_features(_proposal([1, 3, 12]), proposes=True)
    assert feats.match.tolist() == [1, 3, 12]
    np.testing.assert_allclose(
        P._token_estimate(params, state, feats), np.minimum(rates, 0.999), rtol=1e-6
    )
    for length, drafts in ((1, False), (3, True), (12, True)):
        feats = P.drafter_features(_proposal([length] * 3), proposes=True)
        assert bool(P.draft_any(params, state, feats)) == drafts, length
    # The same logits from a drafter with distributions: no match, the certificate decides.
    plain = P.drafter_features(_proposal([1, 3, 12]))
    assert plain.match.tolist() == [0, 0, 0]
    np.testing.assert_allclose(P._token_estimate(params, state, plain), 0.6, rtol=1e-6)


def test_a_round_counts_each_proposal_by_the_match_that_proposed_it():
    """``tree_match_counts`` reads each node's match length from the logits of its parent
    (``q_logits`` at ``q_index``): a chain of three proposals from matches of 2, 3 and 4
    tokens, the first two accepted and the third rejected; a row with no proposal."""
    from jaxcert.decoding.state import DraftTree

    q = _proposal(np.asarray([[2, 3, 4, 0], [0, 0, 0, 0]]))  # [B, X, V] rows 0..3
    tree = DraftTree(
        tokens=jnp.ones((2, 3), jnp.int32),
        parent=jnp.asarray([[-1, 0, 1]] * 2),
        depth=jnp.asarray([[1, 2, 3]] * 2),
        rank=jnp.zeros((2, 3), jnp.int32),
        valid=jnp.asarray([[True, True, True], [False, False, False]]),
        q_index=jnp.asarray([[0, 1, 2]] * 2),
        q_logits=q,
    )
    tested = jnp.asarray([[True, True, True], [False, False, False]])
    accepted = jnp.asarray([[True, True, False], [False, False, False]])
    hits, tries = P.tree_match_counts(tree, tested, accepted)
    want_tries = np.zeros((2, P.MATCH_CLASSES))
    want_tries[0, [1, 2, 3]] = 1  # lengths 2, 3, 4
    want_hits = want_tries.copy()
    want_hits[0, 3] = 0  # the length-4 proposal was rejected
    np.testing.assert_array_equal(tries, want_tries)
    np.testing.assert_array_equal(hits, want_hits)


def test_match_counts_and_their_update():
    """A round's tested and accepted proposals counted by match length (against a plain
    loop), added to the row's counts after the lengths it tested fade by ``memory``; the
    other lengths and inactive rows keep theirs."""
    rng = np.random.default_rng(0)
    b, n = 4, 9
    length = rng.integers(0, 12, size=(b, n)).astype(np.int32)
    tested = rng.random((b, n)) < 0.7
    accepted = rng.random((b, n)) < 0.5
    hits, tries = P.match_counts(jnp.asarray(length), jnp.asarray(tested), jnp.asarray(accepted))
    want_hits = np.zeros((b, P.MATCH_CLASSES))
    want_tries = np.zeros((b, P.MATCH_CLASSES))
    for i in range(b):
        for j in range(n):
            if tested[i, j] and length[i, j] > 0:
                c = min(length[i, j], P.MATCH_CLASSES) - 1
                want_tries[i, c] += 1
                want_hits[i, c] += accepted[i, j]
    np.testing.assert_allclose(hits, want_hits)
    np.testing.assert_allclose(tries, want_tries)
    params = _lookup_params(LOOKUP, memory=0.5)
    state = P.init_policy_state(params, b)
    active = jnp.asarray([True, True, True, False])
    new = P.update_policy_state(
        params, state, drafted=jnp.full((b,), 3), accepted=jnp.ones((b,), jnp.int32),
        active=active, match=(hits, tries),
    )  # fmt: skip
    fade = np.where(want_tries > 0, 0.5, 1.0)
    keep = np.asarray(active)[:, None]
    np.testing.assert_allclose(
        new.match_accepted, np.where(keep, fade * 0.6 + want_hits, 0.6), rtol=1e-6
    )
    np.testing.assert_allclose(
        new.match_tested, np.where(keep, fade * 1.0 + want_tries, 1.0), rtol=1e-6
    )


def test_the_kept_drafting_counts_only_emitted_tokens(pair):
    """With the drafter = the target (every draft accepted), ``K = 5``, 32 new tokens and an
    end token at row 2's 8th token, rows' last rounds verify more than an end token or the
    budget let through: the evidence kept for the next decode counted ``accepted + 1`` (48
    tokens in 14 row-rounds kept where 45 were emitted). It counts what was emitted."""
    target = pair[0]
    eos = int(decoding.target_decode(target, PROMPTS, max_new_tokens=32).tokens[2][7])
    config = decoding.DecodeConfig(
        verification="greedy", max_new_tokens=32, max_draft=5, eos_ids=(eos,), max_skip=2
    )
    controller = GoodputController(CHEAP)
    out = decoding.speculative_decode(
        target, target, PROMPTS, config=config, policy=decoding.Goodput(), costs=controller
    )
    lengths = [len(t) for t in out.tokens]
    assert lengths[2] == 8  # cut by the end token
    st = out.stats
    depth = np.where(st.active, st.drafted, 0).max(axis=1)
    took = st.active & (depth[:, None] > 0)  # the drafting rounds' row-rounds
    kept = controller.costs(3).drafting["greedy"]
    emitted, rounds = int(np.where(took, st.emitted, 0).sum()), int(took.sum())
    assert emitted < int(np.where(took, st.accepted + 1, 0).sum())  # tokens were cut
    scale = min(1.0, 3 / rounds)  # the kept evidence never exceeds one round of the batch
    np.testing.assert_allclose(kept.emitted, emitted * scale, rtol=1e-6)
    np.testing.assert_allclose(kept.weight, rounds * scale, rtol=1e-6)
