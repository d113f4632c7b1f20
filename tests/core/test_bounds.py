"""Margin-only bounds (docs/certificates.md §7) and certified run lengths."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxcert
from jaxcert.core import bounds
from jaxcert.core import rules as R


@pytest.fixture(autouse=True)
def x64():
    with jax.enable_x64(True):
        yield


def _margin_family(rng, vocab, gamma, rows):
    """p = (a_1 + gamma, a_1, a_2, ..., a_{V-1}) with a decreasing: margin exactly gamma."""
    a = np.sort(rng.dirichlet(np.full(vocab - 1, 0.7), size=rows), axis=1)[:, ::-1]
    tilde = np.concatenate([a[:, :1], a], axis=1)[:, :vocab]
    tilde = tilde / tilde.sum(axis=1, keepdims=True) * (1 - gamma)
    tilde[:, 0] += gamma
    return tilde


@pytest.mark.parametrize("vocab", [2, 3, 8, 50])
def test_greedy_bounds_bracket_the_exact_certificate(vocab):
    rng = np.random.default_rng(vocab)
    for gamma in (1e-4, 0.01, 0.2, 0.7):
        p = _margin_family(rng, vocab, gamma, 40)
        cert = jaxcert.certificate(jnp.asarray(np.log(p)), R.StrictGreedy())
        np.testing.assert_allclose(cert.margin, gamma, rtol=1e-9)
        lower, upper = bounds.greedy_margin_bounds(gamma, vocab)
        assert np.all(np.asarray(cert.value) >= float(lower) * (1 - 1e-9))
        assert np.all(np.asarray(cert.value) <= float(upper) * (1 + 1e-9))
        assert float(upper) < gamma * math.log(2)


def test_greedy_bounds_are_attained():
    gamma, vocab = 0.3, 7
    lower, upper = bounds.greedy_margin_bounds(gamma, vocab)
    two = np.array([(1 + gamma) / 2, (1 - gamma) / 2])
    flat = np.full(vocab, (1 - gamma) / vocab)
    flat[0] += gamma
    c2 = jaxcert.certificate(jnp.asarray(np.log(two)), R.StrictGreedy()).value
    cf = jaxcert.certificate(jnp.asarray(np.log(flat)), R.StrictGreedy()).value
    np.testing.assert_allclose(c2, lower, rtol=1e-12)
    np.testing.assert_allclose(cf, upper, rtol=1e-12)


def test_leading_terms():
    lower, _ = bounds.greedy_margin_bounds(1e-3, 10)
    assert math.isclose(float(lower) / 1e-6, 0.5, rel_tol=1e-6)
    _, upper = bounds.greedy_margin_bounds(1e-4, 8)
    assert math.isclose(float(upper) / 1e-8, 1.9994, abs_tol=1e-4)
    for m, want in [(2, 0.99997), (3, 1.49990), (5, 2.49967)]:
        got = float(bounds.tree_margin_lower_bound(1e-4, m)) / 1e-8
        assert math.isclose(got, want, abs_tol=1e-5)
    np.testing.assert_allclose(
        bounds.tree_margin_lower_bound(0.2, 1), bounds.greedy_margin_bounds(0.2, 5)[0], rtol=1e-14
    )


@pytest.mark.parametrize("m", [2, 3, 5])
def test_tree_bounds_bracket_and_are_attained(m):
    rng = np.random.default_rng(m)
    vocab = m + 4
    for gamma in (1e-3, 0.05, 0.4):
        p = _margin_family(rng, vocab, gamma, 60)
        cert = jaxcert.certificate(jnp.asarray(np.log(p)), R.TreeCoverage(m))
        low = float(bounds.tree_margin_lower_bound(gamma, m))
        high = float(bounds.tree_margin_upper_bound(gamma, m, vocab))
        values = np.asarray(cert.value)
        assert np.all(values >= low * (1 - 1e-9)) and np.all(values <= high * (1 + 1e-9))
        # Infimum: (b + gamma, b, ..., b) on m + 1 tokens.
        b = (1 - gamma) / (m + 1)
        tight = np.array([b + gamma] + [b] * m)
        at = jaxcert.certificate(jnp.asarray(np.log(tight)), R.TreeCoverage(m)).value
        np.testing.assert_allclose(at, low, rtol=1e-12)
        # Supremum: the largest certificate over the vertices of the margin polytope,
        # v_k = (gamma + t_k, t_k x k, 0 x (V-1-k)); zeros are handled exactly.
        vertices = []
        for k in range(1, vocab):
            t = (1 - gamma) / (k + 1)
            vertices.append([gamma + t] + [t] * k + [0.0] * (vocab - 1 - k))
        with np.errstate(divide="ignore"):
            vx = jnp.asarray(np.log(np.array(vertices)))
        best = np.max(np.asarray(jaxcert.certificate(vx, R.TreeCoverage(m)).value))
        np.testing.assert_allclose(best, high, rtol=1e-10)


def test_tree_supremum_is_order_one():
    # Spec section 5: 0.3500 at gamma = 0.01, m = 2, for any V >= 3.
    for vocab in (3, 10, 1000):
        got = float(bounds.tree_margin_upper_bound(0.01, 2, vocab))
        assert math.isclose(got, 0.3500, abs_tol=5e-5)


@pytest.mark.parametrize(
    "call",
    [
        lambda: bounds.greedy_margin_bounds(0.1, 1),
        lambda: bounds.tree_margin_lower_bound(0.1, 0),
        lambda: bounds.tree_margin_upper_bound(0.1, 3, 3),
        lambda: bounds.certified_run_length(jnp.float32(1.0), 0.1),
        lambda: bounds.certified_run_length(jnp.ones((2, 5)), jnp.ones(3)),
    ],
    ids=["greedy-V1", "tree-m0", "tree-V-too-small", "no-time-axis", "budget-shape"],
)
def test_bad_arguments_raise(call):
    with pytest.raises(ValueError):
        call()


def test_certified_run_length_by_hand():
    c = jnp.array([[0.5, 0.2, 0.9, jnp.inf, 0.05, 0.6]])
    np.testing.assert_array_equal(bounds.certified_run_length(c, 0.1), [[4, 3, 2, 1, 0, 1]])
    np.testing.assert_array_equal(bounds.certified_run_length(c, 0.3), [[1, 0, 2, 1, 0, 1]])
    eps = jnp.array([[0.1, 0.3, 0.1, 5.0, 0.01, 0.1]])
    np.testing.assert_array_equal(bounds.certified_run_length(c, eps), [[1, 0, 4, 3, 2, 1]])
    mask = jnp.array([[True, True, False, True, True, True]])
    np.testing.assert_array_equal(
        bounds.certified_run_length(c, 0.1, where=mask), [[2, 1, 0, 1, 0, 1]]
    )


def test_certified_run_length_matches_loop():
    rng = np.random.default_rng(0)
    c = rng.exponential(0.3, (3, 4, 17))
    eps = rng.exponential(0.2, (3, 4, 17))
    got = np.asarray(jax.jit(bounds.certified_run_length)(c, eps))
    want = np.zeros_like(got)
    for idx in np.ndindex(c.shape[:-1]):
        run = 0
        for t in range(c.shape[-1] - 1, -1, -1):
            run = run + 1 if eps[idx][t] < c[idx][t] else 0
            want[idx + (t,)] = run
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("m", [1, 2, 4])
def test_tree_upper_bound_at_margin_one_is_the_point_mass_certificate(m):
    """gamma = 1 (p a point mass): the supremum is C = log(m + 1), finite (no 0 log 0)."""
    upper = float(jaxcert.tree_margin_upper_bound(1.0, m, 50))
    point = jnp.full((50,), -jnp.inf).at[3].set(0.0)
    cert = float(jaxcert.certificate(point, jaxcert.TreeCoverage(m)).value)
    np.testing.assert_allclose([upper, cert], [np.log(m + 1)] * 2, rtol=1e-6)


def test_run_length_compares_in_float32_for_bfloat16_certificates():
    values = jnp.asarray([0.2, 0.3, 0.1, 0.5], jnp.bfloat16)
    budget = float(values[0]) - 1e-7  # just below the first certificate
    np.testing.assert_array_equal(jaxcert.certified_run_length(values, budget), [2, 1, 0, 1])


@pytest.mark.parametrize("margin", [1.5, -0.5, [0.2, 1.0001]])
def test_margins_outside_the_unit_interval_are_refused_not_clipped(margin):
    """They used to be clipped to [0, 1] silently (1.5 gave the bounds of margin 1)."""
    calls = [
        lambda g: bounds.greedy_margin_bounds(g, 10),
        lambda g: bounds.tree_margin_lower_bound(g, 2),
        lambda g: bounds.tree_margin_upper_bound(g, 2, 10),
    ]
    for call in calls:
        with pytest.raises(ValueError, match="margin must be in \\[0, 1\\]"):
            call(margin)
        # Under jit the margin is traced: nan, not a plausible bound.
        traced = jax.tree.leaves(jax.jit(call)(jnp.asarray(margin)))
        assert all(np.all(np.isnan(np.asarray(x)[np.asarray(margin) != 0.2])) for x in traced)
    for edge in (0.0, 1.0):  # the ends are margins
        assert np.isfinite(bounds.greedy_margin_bounds(edge, 10)[1])


def test_a_negative_or_nan_budget_is_refused():
    """A negative budget used to certify every position, C = 0 ones included."""
    c = jnp.array([[0.0, 0.2, 0.0]])
    for budget in (-1.0, float("nan"), jnp.array([[0.1, -0.1, 0.1]])):
        with pytest.raises(ValueError, match="budget must be a KL in nats >= 0"):
            bounds.certified_run_length(c, budget)
    got = jax.jit(bounds.certified_run_length)(c, jnp.array([[0.1, -0.1, 0.1]]))
    np.testing.assert_array_equal(got, [[0, -1, 0]])  # -1: no run length there
    np.testing.assert_array_equal(bounds.certified_run_length(c, 0.0), [[0, 1, 0]])


def test_masks_and_budgets_of_another_rank_are_refused():
    """A [T] mask meant as [B] (B == T == 3) used to broadcast onto the time axis."""
    c = jnp.full((3, 3), 0.5)
    per_row = jnp.array([True, False, True])
    with pytest.raises(ValueError, match="where has shape \\(3,\\)"):
        bounds.certified_run_length(c, 0.1, where=per_row)
    with pytest.raises(ValueError, match="budget has shape \\(3,\\)"):
        bounds.certified_run_length(c, jnp.array([0.1, 0.9, 0.1]))
    np.testing.assert_array_equal(
        bounds.certified_run_length(c, 0.1, where=per_row[:, None]), [[3, 2, 1], [0] * 3, [3, 2, 1]]
    )
