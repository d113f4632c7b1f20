"""Draft-length policies: parsing and stopping decisions on hand-made drafter distributions."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxcert import StrictGreedy, certificate
from jaxcert.decoding import policies as P


def _logits(*probs):
    """Logits of rows of probabilities over V = 6 (missing mass spread over the rest)."""
    rows = []
    for p in probs:
        p = list(p)
        rest = (1.0 - sum(p)) / (6 - len(p))
        rows.append(np.log(np.array(p + [rest] * (6 - len(p)))))
    return jnp.asarray(np.array(rows), jnp.float32)


def _decide(policy, q_logits, drafted, state=None, survival=None):
    b = q_logits.shape[0]
    params = P.PolicyParams.from_policy(policy)
    state = state or P.init_policy_state(params, b)
    feats = P.drafter_features(q_logits)
    drafted = jnp.full((b,), drafted, jnp.int32)
    prob = jnp.ones((b,)) if survival is None else jnp.asarray(survival, jnp.float32)
    survival = P.Survival(prob=prob, expected=jnp.ones((b,)))
    cont, _ = jax.jit(P.should_continue)(params, state, feats, drafted, survival)
    return np.asarray(cont)


@pytest.mark.parametrize(
    "spec, expected",
    [
        ("constant:5", P.Constant(k=5)),
        ("heuristic", P.Heuristic()),
        ("heuristic:3/16", P.Heuristic(k0=3, k_max=16)),
        ("confidence", P.Confidence(tau=0.4)),
        ("confidence:0.6", P.Confidence(tau=0.6)),
        ("svip", P.SVIP(h=0.3)),
        ("svip:0.5/12", P.SVIP(h=0.5, k_max=12)),
        ("cert", P.Certified()),
        ("cert:0.5:0.3/16", P.Certified(lam=0.5, beta=0.3, k_max=16)),
    ],
    ids=[
        "constant:5",
        "heuristic",
        "heuristic:3/16",
        "confidence",
        "confidence:0.6",
        "svip",
        "svip:0.5/12",
        "cert",
        "cert:0.5:0.3/16",
    ],
)
def test_parse_policy(spec, expected):
    assert P.parse_policy(spec) == expected
    if expected.k_max in (P.DEFAULT_K_MAX, getattr(expected, "k", None)):  # spec round trip
        assert P.parse_policy(expected.spec.upper()) == expected


@pytest.mark.parametrize(
    "bad",
    ["constant", "constant:0", "svip:-1", "nope", "confidence:2", "x:1", "constant:3/9", "cert:2"],
)
def test_parse_policy_errors(bad):
    with pytest.raises(ValueError):
        P.parse_policy(bad)


def test_features_match_definitions():
    q = _logits([0.5, 0.3], [0.9, 0.02], [0.4, 0.4], [0.999999], [0.2, 0.2, 0.2])
    feats = P.drafter_features(q)
    p = np.exp(np.asarray(q))
    np.testing.assert_allclose(feats.top, p.max(-1), rtol=1e-6)
    np.testing.assert_allclose(feats.entropy, -(p * np.log(p)).sum(-1), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(feats.cert, certificate(q, StrictGreedy()).value, rtol=1e-6)


def test_constant_and_cap():
    q = _logits([0.9], [0.9])
    assert _decide(P.Constant(k=3), q, 2).all()
    assert not _decide(P.Constant(k=3), q, 3).any()
    assert not _decide(P.SVIP(k_max=4), q, 4).any()


def test_confidence_stops_below_tau():
    q = _logits([0.5, 0.3], [0.35, 0.3])
    np.testing.assert_array_equal(_decide(P.Confidence(tau=0.4), q, 1), [True, False])


def test_svip_stops_on_high_entropy():
    # Stop iff sqrt(0.15 * H) > 0.3, i.e. H > 0.6 nats.
    q = _logits([0.9, 0.05], [0.5, 0.3])
    p = np.exp(np.asarray(q))
    entropy = -(p * np.log(p)).sum(-1)
    assert entropy[0] < 0.6 < entropy[1]
    np.testing.assert_array_equal(_decide(P.SVIP(h=0.3), q, 1), [True, False])
    np.testing.assert_array_equal(_decide(P.SVIP(h=1.0), q, 1), [True, True])


def test_certified_multiplies_certificate_ratios():
    q = _logits([0.9, 0.05], [0.4, 0.35], [0.6, 0.2])
    ratio = np.asarray(certificate(q, StrictGreedy()).value) / math.log(2)
    a = ratio**0.3
    assert a[0] > a[2] > 0.5 > a[1]
    np.testing.assert_array_equal(_decide(P.Certified(lam=0.5), q, 1), [True, False, True])
    # The product over the round: an earlier doubtful token makes the next one stop.
    assert not _decide(P.Certified(lam=0.5), q, 2, survival=[1.0, 1.0, 0.7])[2]
    params = P.PolicyParams.from_policy(P.Certified(lam=0.5))
    feats = P.drafter_features(q)
    ones = jnp.ones(3, jnp.int32)
    state = P.init_policy_state(params, 3)
    _, survival = P.should_continue(params, state, feats, ones, P.Survival.start(3))
    np.testing.assert_allclose(survival.prob, a, rtol=1e-5)
    np.testing.assert_allclose(survival.expected, 1 + a, rtol=1e-5)


def test_heuristic_schedule():
    params = P.PolicyParams.from_policy(P.Heuristic(k0=5, k_max=8))
    state = P.init_policy_state(params, 3)
    update = jax.jit(P.update_policy_state)
    kw = {}
    state = update(
        params,
        state,
        drafted=jnp.array([5, 5, 5]),
        accepted=jnp.array([5, 2, 0]),
        active=jnp.array([True, True, False]),
        **kw,
    )
    np.testing.assert_array_equal(state.k, [7, 4, 5])  # +2, -1, inactive row unchanged
    state = state.replace(k=jnp.array([7, 1, 5]))
    state = update(
        params,
        state,
        drafted=jnp.array([7, 1, 5]),
        accepted=jnp.array([7, 0, 5]),
        active=jnp.array([True, True, True]),
        **kw,
    )
    np.testing.assert_array_equal(state.k, [8, 1, 7])  # capped at k_max, floor 1
    q = _logits([0.9], [0.9], [0.9])
    decision = _decide(P.Heuristic(k0=5, k_max=8), q, 7, state)
    np.testing.assert_array_equal(decision, [True, False, False])


def test_bootstrap_speedup_interval():
    from jaxcert.decoding import run_report

    base_tokens, base_s = [100, 100, 100, 100], [10.0, 10.0, 10.0, 10.0]
    s, low, high = run_report.bootstrap_speedup(base_tokens, base_s, base_tokens, [5.0] * 4)
    assert (s, low, high) == (2.0, 2.0, 2.0)  # no spread, no width
    rng = np.random.default_rng(0)
    new_s = rng.uniform(4, 8, 12)
    s, low, high = run_report.bootstrap_speedup([100] * 12, [10.0] * 12, [100] * 12, new_s)
    assert s == pytest.approx(10 / new_s.mean())
    assert low < s < high and high - low > 0.1
    s, low, high = run_report.bootstrap_speedup([100], [10.0], [100], [5.0])
    assert s == 2.0 and np.isnan(low) and np.isnan(high)  # one unit: no interval
