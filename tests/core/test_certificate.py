"""The JAX solver against the golden cases, the NumPy reference and the brute force."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import jaxcert
from jaxcert.core import reference
from jaxcert.core import rules as R
from tests.helpers import golden
from tests.helpers.bruteforce import certificate_slsqp

CASES = golden.load_cases()

RULES = [
    R.StrictGreedy(),
    R.Additive(0.05),
    R.Additive(0.3),
    R.Multiplicative(0.1),
    R.Multiplicative(0.5),
    R.TargetTopK(1),
    R.TargetTopK(3),
    R.Typical(),
    R.Typical(0.5, 0.9),
    R.Typical(0.5, 2.0),
    R.TreeCoverage(2),
    R.TreeCoverage(4),
    R.TreeCoverage(3, base=R.Additive(0.1)),
    R.TreeCoverage(2, base=R.Multiplicative(0.3)),
    R.TreeCoverage(2, base=R.TargetTopK(2)),
    R.TreeCoverage(3, base=R.Typical()),
]


@pytest.fixture
def x64():
    with jax.enable_x64(True):
        yield


def _log(p):
    p = np.asarray(p, np.float64)
    with np.errstate(divide="ignore"):
        return np.log(p / p.sum())


def _close(got, want, rtol, atol):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    both_inf = np.isinf(got) & np.isinf(want) & (np.sign(got) == np.sign(want))
    with np.errstate(invalid="ignore"):
        ok = both_inf | (np.abs(got - want) <= rtol * np.abs(want) + atol)
    return bool(np.all(ok))


def _random_distributions(rng, vocab, rows):
    """A mix of flat, peaked, tied, near-tied and zero-containing distributions."""
    out = []
    for i in range(rows):
        kind = i % 6
        if kind == 0:
            p = rng.dirichlet(np.full(vocab, 0.3))
        elif kind == 1:
            p = rng.dirichlet(np.full(vocab, 5.0))
        elif kind == 2:  # ties (random levels, so no token sits exactly on a rule threshold)
            p = rng.choice(rng.random(3) + 0.05, vocab)
        elif kind == 3:  # near-ties at the top
            p = rng.dirichlet(np.ones(vocab))
            p[np.argsort(-p)[1]] = p.max() * (1 - 10 ** rng.uniform(-9, -3))
        elif kind == 4:  # zero-probability tokens
            p = rng.dirichlet(np.ones(vocab))
            p[rng.random(vocab) < 0.3] = 0.0
            p[rng.integers(vocab)] += 0.1
        else:  # peaked
            p = rng.dirichlet(np.full(vocab, 0.05))
        out.append(p / p.sum())
    return np.stack(out)


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_reference_matches_golden(case):
    rule = golden.rule_from_case(case)
    res = reference.certificate_np(np.array(case["p"]), rule)
    assert _close(res.value, case["expected"], 1e-12, 1e-300)
    assert res.greedy_token == case["x0"]
    assert res.pool.tolist() == case["pool"]
    if not math.isinf(case["expected"]):
        assert res.competitor.tolist() == case["competitor"]
        np.testing.assert_allclose(res.q_star, case["q_star"], rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("top_k", [64, 1, 2], ids=["window64", "window1", "window2"])
@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_golden_float64(case, top_k, x64):
    rule = golden.rule_from_case(case)
    p = np.array(case["p"])
    cert = jaxcert.certificate(jnp.asarray(_log(p)), rule, return_q=True, top_k=top_k)
    assert cert.value.dtype == jnp.float64
    assert _close(cert.value, case["expected"], 1e-9, 1e-300), (float(cert.value), case)
    assert int(cert.greedy_token) == case["x0"]
    assert bool(cert.valid)
    if math.isinf(case["expected"]):
        assert np.all(np.asarray(cert.competitor) == -1)
        assert int(cert.pool_size) == 0
        return
    assert np.asarray(cert.competitor).tolist() in case["competitor_alternatives"]
    assert np.asarray(cert.competitor).tolist() == case["competitor"]
    np.testing.assert_allclose(cert.q_star, case["q_star"], rtol=1e-12, atol=1e-15)
    # The golden pool also lists tokens already at the level (q* = p = c); ours counts
    # the tokens that moved.
    level = float(cert.level) if int(cert.pool_size) else math.nan
    moved = [i for i in case["pool"] if not math.isclose(p[i], level, rel_tol=1e-12)]
    assert len(moved) <= int(cert.pool_size) <= len(case["pool"])


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_golden_float32_matches_float64_on_same_input(case, x64):
    rule = golden.rule_from_case(case)
    x32 = jnp.asarray(_log(case["p"]), jnp.float32)
    c32 = jaxcert.certificate(x32, rule)
    c64 = jaxcert.certificate(x32.astype(jnp.float64), rule)
    assert c32.value.dtype == jnp.float32
    assert _close(c32.value, c64.value, 1e-5, 1e-9)
    assert _close(c32.value, case["expected"], 1e-5, 1e-9)


@pytest.mark.parametrize(
    "vocab, top_k",
    [(2, 64), (3, 1), (5, 2), (13, 64), (13, 3), pytest.param(40, 4, marks=pytest.mark.slow)],
    ids=lambda v: str(v),
)
def test_random_against_reference(vocab, top_k, x64):
    rng = np.random.default_rng(vocab + 1000 * top_k)
    p = _random_distributions(rng, vocab, 36)
    logits = jnp.asarray(_log(p) + rng.normal(0, 3))  # any shift: logits, not log-probs
    certs = jaxcert.certificates(logits, RULES, return_q=True, top_k=top_k)
    for rule, cert in zip(RULES, jax.device_get(certs), strict=True):
        for row in range(p.shape[0]):
            ref = reference.certificate_np(p[row], rule)
            got = float(cert.value[row])
            assert _close(got, ref.value, 1e-9, 1e-15), (rule, top_k, p[row], got, ref)
            assert int(cert.greedy_token[row]) == ref.greedy_token
            if math.isinf(ref.value):
                continue
            comp = np.asarray(cert.competitor[row])
            np.testing.assert_allclose(p[row][comp], p[row][ref.competitor], rtol=1e-12)
            assert comp.tolist() == ref.competitor.tolist()
            np.testing.assert_allclose(cert.q_star[row], ref.q_star, rtol=1e-9, atol=1e-15)


def test_lemma2_enumeration_agrees():
    rng = np.random.default_rng(7)
    p = _random_distributions(rng, 6, 30)
    for rule in RULES:
        for row in p:
            a = reference.certificate_np(row, rule).value
            b = reference.certificate_enumerate(row, rule)
            assert _close(a, b, 1e-12, 1e-300), (rule, row)


@pytest.mark.parametrize("vocab", [3, 4, 5])
def test_slsqp_bruteforce(vocab, x64):
    rng = np.random.default_rng(100 + vocab)
    rules = [
        R.StrictGreedy(),
        R.Additive(0.1),
        R.Multiplicative(0.5),
        R.TargetTopK(2),
        R.Typical(0.5, 0.9),
        R.TreeCoverage(2),
        R.TreeCoverage(2, base=R.Additive(0.1)),
    ]
    p = rng.dirichlet(np.ones(vocab), size=6) * 0.98 + 0.02 / vocab
    certs = jaxcert.certificates(jnp.asarray(np.log(p)), rules)
    for rule, cert in zip(rules, jax.device_get(certs), strict=True):
        for row in range(p.shape[0]):
            want = certificate_slsqp(p[row], rule)
            assert _close(cert.value[row], want, 1e-6, 1e-9), (rule, p[row])


@pytest.mark.parametrize(
    "vocab",
    [4, pytest.param(50, marks=pytest.mark.slow), pytest.param(3000, marks=pytest.mark.slow)],
)
def test_float32_close_to_float64_on_same_input(vocab, x64):
    rng = np.random.default_rng(vocab)
    p = _random_distributions(rng, vocab, 18)
    x32 = jnp.asarray(_log(p) * 1.7 + 3.0, jnp.float32)
    c32 = jaxcert.certificates(x32, RULES)
    c64 = jaxcert.certificates(x32.astype(jnp.float64), RULES)
    for rule, a, b in zip(RULES, c32, c64, strict=True):
        assert _close(a.value, b.value, 1e-5, 1e-9), (rule, a.value, b.value)
        assert _close(a.margin, b.margin, 1e-5, 1e-9)


def _rejected(q, upper, m):
    """Worst-case top-m list of q inside L: the m-th largest q over L >= max over U."""
    lower = np.setdiff1d(np.arange(q.size), upper)
    return np.sort(q[lower])[::-1][m - 1] >= np.max(q[upper]) * (1 - 1e-12)


def test_q_star_is_a_rejected_drafter_at_kl_equal_to_c(x64):
    rng = np.random.default_rng(3)
    p = _random_distributions(rng, 12, 30)
    certs = jaxcert.certificates(jnp.asarray(_log(p)), RULES, return_q=True)
    for rule, cert in zip(RULES, jax.device_get(certs), strict=True):
        q = np.asarray(cert.q_star)
        for row in range(p.shape[0]):
            value = float(cert.value[row])
            if math.isinf(value):
                continue
            np.testing.assert_allclose(q[row].sum(), 1.0, rtol=1e-12)
            pos = p[row] > 0
            kl = np.sum(p[row][pos] * np.log(p[row][pos] / q[row][pos]))
            assert _close(kl, value, 1e-9, 1e-14), (rule, kl, value)
            ref = reference.certificate_np(p[row], rule)
            if ref.upper_set.size:
                assert _rejected(q[row], ref.upper_set, rule.list_size)


def _flat_top(rng, vocab, n_flat, spread):
    """Many near-equal tokens on top: |U| and the pool exceed a small window."""
    p = rng.dirichlet(np.ones(vocab)) * 0.05
    top = rng.choice(vocab, n_flat, replace=False)
    p[top] = 1.0 + spread * rng.random(n_flat)
    return p / p.sum()


@pytest.mark.parametrize(
    "row_by_row",
    [True, pytest.param(False, marks=pytest.mark.slow)],  # the accelerators' path: slow on CPU
    ids=["cpu-rows", "batched"],
)
@pytest.mark.parametrize("top_k", [4, pytest.param(16, marks=pytest.mark.slow)])
def test_exact_fallback_on_large_vocab(top_k, row_by_row, x64):
    # batched: the accelerators' exact path (every row at once), forced on CPU.
    rng = np.random.default_rng(top_k)
    vocab = 3000
    p = np.stack(
        [_flat_top(rng, vocab, n, s) for n, s in [(40, 1e-3), (300, 0.5), (25, 0.02), (6, 0.1)]]
        + [rng.dirichlet(np.full(vocab, 0.5)), rng.dirichlet(np.full(vocab, 0.01))]
    )
    rules = [
        R.Additive(0.001),
        R.Multiplicative(0.5),
        R.Multiplicative(0.99),
        R.Typical(),
        R.TreeCoverage(3, base=R.Multiplicative(0.9)),
        R.StrictGreedy(),
        R.TreeCoverage(8),
    ]
    for dtype in (jnp.float64, jnp.float32):
        certs = jaxcert.certificates(jnp.asarray(_log(p), dtype), rules, return_q=True,
                                     top_k=top_k, exact_rows=row_by_row)  # fmt: skip
        for rule, cert in zip(rules, jax.device_get(certs), strict=True):
            for row in range(p.shape[0]):
                ref = reference.certificate_np(p[row], rule)
                rtol, atol = (1e-9, 1e-15) if dtype == jnp.float64 else (1e-5, 1e-9)
                assert _close(cert.value[row], ref.value, rtol, atol), (rule, row, dtype)
                if dtype == jnp.float64 and not math.isinf(ref.value):
                    assert int(cert.pool_size[row]) == ref.pool.size
                    np.testing.assert_allclose(cert.q_star[row], ref.q_star, rtol=1e-9, atol=1e-15)


@pytest.mark.slow
def test_leading_shape_jit_and_vmap_agree():
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(0, 2, (2, 3, 50)), jnp.float32)
    rule = R.TreeCoverage(3, base=R.Typical())
    whole = jaxcert.certificate(x, rule, return_q=True)
    assert whole.value.shape == (2, 3) and whole.competitor.shape == (2, 3, 3)
    assert whole.q_star.shape == (2, 3, 50)
    flat = jaxcert.certificate(x.reshape(6, 50), rule, return_q=True)
    np.testing.assert_array_equal(np.asarray(whole.value).ravel(), flat.value)
    jitted = jax.jit(lambda a: jaxcert.certificate(a, rule).value)(x)
    np.testing.assert_array_equal(jitted, whole.value)
    mapped = jax.vmap(lambda a: jaxcert.certificate(a, rule, top_k=2).value)(x)
    np.testing.assert_allclose(mapped, whole.value, rtol=1e-6)
    single = jaxcert.certificate(x[1, 2], rule)
    assert single.value.shape == ()
    np.testing.assert_allclose(single.value, whole.value[1, 2], rtol=1e-6)


def test_bfloat16_input_computes_in_float32():
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.normal(0, 2, (4, 30)), jnp.bfloat16)
    got = jaxcert.certificate(x, R.Additive(0.1))
    want = jaxcert.certificate(x.astype(jnp.float32), R.Additive(0.1))
    assert got.value.dtype == jnp.float32
    np.testing.assert_array_equal(got.value, want.value)


def test_invalid_rows_are_flagged_and_do_not_spoil_others():
    x = np.log(np.array([[0.6, 0.3, 0.1]] * 5, np.float32))
    x[1, 2] = np.nan
    x[2, 0] = np.inf
    x[3, :] = -np.inf
    cert = jaxcert.certificate(jnp.asarray(x), R.StrictGreedy(), return_q=True)
    np.testing.assert_array_equal(cert.valid, [True, False, False, False, True])
    assert np.all(np.isnan(np.asarray(cert.value)[1:4]))
    np.testing.assert_allclose(
        np.asarray(cert.value)[[0, 4]],
        reference.certificate_np(np.array([0.6, 0.3, 0.1]), R.StrictGreedy()).value,
        rtol=1e-6,
    )
    assert np.all(np.isfinite(np.asarray(cert.q_star)[[0, 4]]))


@pytest.mark.parametrize(
    "logits, rules, top_k, message",
    [
        (np.arange(4), [R.StrictGreedy()], 64, "floating"),
        (np.float32(1.0), [R.StrictGreedy()], 64, "shape"),
        (np.zeros((2, 0), np.float32), [R.StrictGreedy()], 64, "shape"),
        (np.zeros(4, np.float32), ["greedy"], 64, "rule"),
        (np.zeros(4, np.float32), [], 64, "rule"),
        (np.zeros(4, np.float32), [R.StrictGreedy()], 0, "top_k"),
    ],
    ids=["int", "scalar", "empty-vocab", "string-rule", "no-rule", "top_k"],
)
def test_bad_input_raises(logits, rules, top_k, message):
    with pytest.raises(ValueError, match=message):
        jaxcert.certificates(logits, rules, top_k=top_k)


def test_universal_bounds_and_limits(x64):
    rng = np.random.default_rng(5)
    p = _random_distributions(rng, 9, 60)
    for m in (1, 2, 4, 8):
        cert = jaxcert.certificate(jnp.asarray(_log(p)), R.TreeCoverage(m))
        assert np.all(np.asarray(cert.value) < math.log(m + 1))
    # log 2 - C_1 equals the binary entropy H_b(eps) as p(x0) -> 1 (docs/certificates.md §7).
    for eps in (1e-4, 1e-8, 1e-12):
        x = jnp.asarray([math.log1p(-eps), math.log(eps)])
        got = float(jaxcert.certificate(x, R.StrictGreedy()).value)
        h_b = -(eps * math.log(eps) + (1 - eps) * math.log1p(-eps))
        assert math.isclose(math.log(2) - got, h_b, rel_tol=1e-6, abs_tol=1e-14)


def test_small_margin_has_no_cancellation(x64):
    # C_1 ~ gamma^2 / 2 (docs/certificates.md §7); the naive formula loses the sign at 1e-8.
    for gamma in (1e-3, 1e-6, 1e-8):
        p = np.array([(1 + gamma) / 2, (1 - gamma) / 2])
        got = float(jaxcert.certificate(jnp.asarray(np.log(p)), R.StrictGreedy()).value)
        want = reference.certificate_np(p, R.StrictGreedy()).value
        assert got > 0 and math.isclose(got, want, rel_tol=1e-6)
        assert math.isclose(got / gamma**2, 0.5, rel_tol=1e-3)


_WEIGHTS = st.one_of(
    st.just(0.0),
    st.floats(1e-6, 1.0),
    st.sampled_from([0.25, 0.5, 0.125]),  # exact ties
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    data=st.data(),
    vocab=st.sampled_from([3, 7]),
    top_k=st.sampled_from([1, 64]),
)
def test_hypothesis_against_reference(data, vocab, top_k):
    weights = np.array(data.draw(st.lists(_WEIGHTS, min_size=vocab, max_size=vocab)))
    assume(weights.sum() > 0)
    p = weights / weights.sum()
    with jax.enable_x64(True):
        certs = jax.device_get(jaxcert.certificates(jnp.asarray(_log(p)), RULES, top_k=top_k))
    for rule, cert in zip(RULES, certs, strict=True):
        ref = reference.certificate_np(p, rule)
        # Tokens exactly on a relaxed rule's threshold may flip in floating point.
        threshold_tie = not isinstance(rule.upper_rule, (R.StrictGreedy, R.TargetTopK)) and (
            _on_threshold(p, rule)
        )
        if not threshold_tie:
            assert _close(cert.value, ref.value, 1e-9, 1e-15), (rule, p, cert.value, ref.value)


def _on_threshold(p, rule):
    base = rule.upper_rule
    top = p.max()
    if isinstance(base, R.Additive):
        level = top - base.t
    elif isinstance(base, R.Multiplicative):
        level = base.alpha * top
    else:
        pos = p[p > 0]
        level = min(base.eps, base.delta * np.exp(np.sum(pos * np.log(pos))))
    return bool(np.any(np.isclose(p, level, rtol=1e-9, atol=0)))


@pytest.mark.parametrize("vocab", [4, 10_000])  # lax.top_k directly, and the grouped top-k
def test_signed_zeros_are_one_value_for_solver_and_verifier(vocab):
    """``-0.0`` and ``+0.0`` tie: the solver's ``x0`` is ``argmax``'s (lower id) and its
    ``q*`` is rejected by the verifier's own accepted set (``lax.top_k`` alone orders
    ``+0.0`` first)."""
    from jaxcert.decoding import verify

    rows = np.full((3, vocab), -5.0, np.float32)
    rows[0, :3] = [-0.0, 0.0, -1.0]  # x0 = 0, not 1
    rows[1, :4] = [1.0, -0.0, 0.0, -1.0]  # topk:2 accepts {0, 1}; the competitor is 2
    rows[2, vocab - 2 :] = [-0.0, 0.0]  # the tie at the end of the row
    rules = (R.StrictGreedy(), R.TargetTopK(2), R.TreeCoverage(2))
    certs = jaxcert.certificates(jnp.asarray(rows), rules, return_q=True)
    assert certs[0].greedy_token.tolist() == np.argmax(rows, axis=-1).tolist() == [0, 0, vocab - 2]
    # U holds at most 2 tokens here, all among these (the rest are at -5).
    ids = np.array([0, 1, 2, 3, vocab - 2, vocab - 1])
    for rule, cert in zip(rules, certs, strict=True):
        q = np.asarray(cert.q_star)
        for row in range(rows.shape[0]):
            x = jnp.broadcast_to(jnp.asarray(rows[row]), (ids.size, vocab))
            member = np.asarray(verify.in_accepted_set(x, jnp.asarray(ids), rule))
            assert _rejected(q[row], ids[member], rule.list_size), (rule, row)


def test_window_certificate_of_the_whole_vocabulary_is_the_certificate():
    """With every token in the window the window path is the solver (``docs`` §9)."""
    rng = np.random.default_rng(7)
    p = _random_distributions(rng, 12, 16)  # [16, 12], some zeros
    with np.errstate(divide="ignore"):
        logp = np.log(p / p.sum(-1, keepdims=True))
    top = -np.sort(-logp, axis=-1)
    entropy = -np.sum(p * np.where(p > 0, logp, 0.0), axis=-1)
    full = jaxcert.certificates(jnp.asarray(logp, jnp.float32), RULES)
    for rule, cert in zip(RULES, full, strict=True):
        got = jaxcert.core.solver.window_certificate(
            jnp.asarray(top, jnp.float32), rule, vocab_size=12,
            entropy=jnp.asarray(entropy, jnp.float32),
        )  # fmt: skip
        np.testing.assert_allclose(got, cert.value, rtol=2e-5, atol=1e-7, err_msg=rule.spec)
