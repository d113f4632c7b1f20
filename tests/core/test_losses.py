"""Certificate-violation losses: values, exact gradients, masks, jit/vmap/optax."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.test_util import check_grads

from jaxcert import losses
from jaxcert.core import reference
from jaxcert.core import rules as R

RULES = [
    R.StrictGreedy(),
    R.Additive(0.1),
    R.Multiplicative(0.3),
    R.TargetTopK(2),
    R.Typical(0.5, 0.9),
    R.TreeCoverage(3),
    R.TreeCoverage(2, base=R.Additive(0.1)),
]
IDS = [r.spec for r in RULES]


@pytest.fixture
def x64():
    with jax.enable_x64(True):
        yield


def _pair(seed, shape=(6, 9), scale=2.0, spread=1.5):
    rng = np.random.default_rng(seed)
    target = rng.normal(0, scale, shape)
    drafter = target + rng.normal(0, spread, shape)
    return jnp.asarray(drafter), jnp.asarray(target)


@pytest.mark.parametrize("rule", RULES, ids=IDS)
def test_value_matches_definition(rule, x64):
    d, t = _pair(0)
    got = np.asarray(losses.certificate_violation(d, t, rule, margin=0.01))
    p = np.asarray(jax.nn.softmax(t))
    q = np.asarray(jax.nn.softmax(d))
    for row in range(p.shape[0]):
        kl = np.sum(p[row] * np.log(p[row] / q[row]))
        c = reference.certificate_np(p[row], rule).value
        np.testing.assert_allclose(got[row], max(kl - c + 0.01, 0.0), rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("rule", RULES, ids=IDS)
def test_gradients_drafter_side(rule, x64):
    d, t = _pair(1)

    def f(drafter):
        return jnp.sum(losses.certificate_violation(drafter, t, rule, margin=0.05))

    assert float(f(d)) > 0  # the hinge is active on some rows
    check_grads(f, (d,), order=1, modes=["rev"], eps=1e-6, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("rule", RULES, ids=IDS)
def test_gradients_target_side(rule, x64):
    d, t = _pair(2)

    def f(target):
        return jnp.sum(
            losses.certificate_violation(d, target, rule, margin=0.05, differentiate_target=True)
        )

    check_grads(f, (t,), order=1, modes=["rev"], eps=1e-6, atol=1e-6, rtol=1e-6)


def test_kl_derivatives_are_exact_in_both_modes_and_to_second_order(x64):
    """The KL's written-out derivatives (``q - p`` for the drafter, ``p (log p - log q -
    KL)`` for the target) against NumPy, and forward, reverse and second order against
    finite differences; a -inf logit on either side, where p or q is 0, included."""
    d, t = _pair(3)
    d = d.at[0, 2].set(-jnp.inf)  # q = 0 where p > 0: KL = +inf on row 0
    t = t.at[1, 4].set(-jnp.inf).at[2, :3].set(-jnp.inf)  # p = 0 tokens
    kl = losses.kl_divergence(d, t)
    p = np.asarray(jax.nn.softmax(t))
    q = np.asarray(jax.nn.softmax(d))
    with np.errstate(divide="ignore", invalid="ignore"):
        terms = np.where(p > 0, p * (np.log(p) - np.log(q)), 0.0)
    np.testing.assert_allclose(kl, terms.sum(-1), rtol=1e-12)
    assert kl[0] == np.inf
    grad_d, grad_t = jax.grad(lambda a, b: jnp.sum(losses.kl_divergence(a, b)[1:]), (0, 1))(d, t)
    np.testing.assert_allclose(grad_d[1:], q[1:] - p[1:], atol=1e-14)
    with np.errstate(divide="ignore", invalid="ignore"):
        gap = np.where(p > 0, np.log(p) - np.log(q) - terms.sum(-1, keepdims=True), 0.0)
    np.testing.assert_allclose(grad_t[1:], (p * gap)[1:], atol=1e-14)
    assert not grad_d[0].any() and not grad_t[0].any()  # row 0 was not in the sum
    d2, t2 = _pair(4)
    for f, x in [
        (lambda a: jnp.sum(losses.kl_divergence(a, t2) ** 2), d2),
        (lambda b: jnp.sum(losses.kl_divergence(d2, b) ** 2), t2),
    ]:
        check_grads(f, (x,), order=2, modes=["fwd", "rev"], eps=1e-6, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("rule", RULES, ids=IDS)
def test_certificate_sensitivity_is_exact(rule, x64):
    _, t = _pair(3)
    check_grads(
        lambda z: jnp.sum(jnp.where(jnp.isfinite(v := losses.certificate_value(z, rule)), v, 0)),
        (t,), order=1, modes=["rev"], eps=1e-6, atol=1e-7, rtol=1e-6,
    )  # fmt: skip


def test_smooth_variants_and_ratio(x64):
    d, t = _pair(4)
    rule = R.TreeCoverage(2)
    hinge = losses.certificate_violation(d, t, rule)
    for temperature in (1e-1, 1e-3):
        soft = losses.certificate_violation_softplus(d, t, rule, temperature=temperature)
        assert np.all(np.asarray(soft) >= np.asarray(hinge))
        np.testing.assert_allclose(soft, hinge, atol=temperature * np.log(2) + 1e-12)
    check_grads(lambda a: jnp.sum(losses.certificate_violation_softplus(a, t, rule)), (d,),
                order=1, modes=["rev"], eps=1e-6, atol=1e-6, rtol=1e-6)  # fmt: skip
    ratio = np.asarray(losses.certificate_ratio(d, t, rule, eps=1e-3))
    kl = np.asarray(losses.kl_divergence(drafter_logits=d, target_logits=t))
    c = np.asarray(losses.certificate_value(t, rule))
    np.testing.assert_allclose(ratio, kl / (c + 1e-3), rtol=1e-12)
    check_grads(lambda a: jnp.sum(losses.certificate_ratio(a, t, rule)), (d,),
                order=1, modes=["rev"], eps=1e-6, atol=1e-6, rtol=1e-6)  # fmt: skip


def test_zero_iff_certified_with_margin(x64):
    d, t = _pair(5, shape=(40, 7), spread=0.4)
    rule = R.StrictGreedy()
    kl = np.asarray(losses.kl_divergence(drafter_logits=d, target_logits=t))
    c = np.asarray(losses.certificate_value(t, rule))
    for margin in (0.0, 0.02):
        loss = np.asarray(losses.certificate_violation(d, t, rule, margin=margin))
        np.testing.assert_array_equal(loss == 0, kl <= c - margin)
        assert 0 < np.mean(loss == 0) < 1  # both cases occur


def test_mask_gives_exact_zero_value_and_gradient():
    d, t = _pair(6)
    d = d.astype(jnp.float32).at[2].set(jnp.nan)
    t = t.astype(jnp.float32).at[4].set(jnp.inf)
    mask = jnp.array([True, True, False, True, False, True])
    rule = R.TreeCoverage(2, base=R.Typical())
    for fn in (losses.certificate_violation, losses.certificate_violation_softplus,
               losses.certificate_ratio):  # fmt: skip
        value = fn(d, t, rule, where=mask)
        assert np.all(np.asarray(value)[[2, 4]] == 0) and np.all(np.isfinite(value))
        gd, gt = jax.grad(
            lambda a, b, fn=fn: jnp.sum(fn(a, b, rule, where=mask, differentiate_target=True)),
            argnums=(0, 1),
        )(d, t)
        assert np.all(np.isfinite(gd)) and np.all(np.isfinite(gt))
        assert np.all(np.asarray(gd)[[2, 4]] == 0) and np.all(np.asarray(gt)[[2, 4]] == 0)
    unmasked = losses.certificate_violation(
        d[jnp.array([0, 1, 3, 5])], t[jnp.array([0, 1, 3, 5])], rule
    )
    np.testing.assert_allclose(  # float32 rounding: GPU kernels differ with the batch size
        np.asarray(losses.certificate_violation(d, t, rule, where=mask))[[0, 1, 3, 5]],
        unmasked,
        rtol=1e-6,
    )


def test_infinite_certificate_gives_zero_loss_and_gradient():
    # Additive 0.6: with p(x0) < 0.6 every token is accepted, C = +inf.
    t = jnp.log(jnp.array([[0.4, 0.35, 0.25]]))
    d = jnp.log(jnp.array([[0.05, 0.05, 0.9]]))
    rule = R.Additive(0.6)
    assert np.isinf(float(losses.certificate_value(t, rule)[0]))
    for fn in (losses.certificate_violation, losses.certificate_violation_softplus,
               losses.certificate_ratio):  # fmt: skip
        assert float(fn(d, t, rule)[0]) == 0.0
        gd, gt = jax.grad(lambda a, b, fn=fn: jnp.sum(fn(a, b, rule, differentiate_target=True)),
                          argnums=(0, 1))(d, t)  # fmt: skip
        assert np.all(np.asarray(gd) == 0) and np.all(np.asarray(gt) == 0)


@pytest.mark.parametrize("kind", ["peaked", "near-tie", "zero-prob"])
def test_gradients_finite_on_extreme_inputs(kind):
    rng = np.random.default_rng(7)
    t = rng.normal(0, 1, (4, 12)).astype(np.float32)
    if kind == "peaked":
        t[:, 0] += 40.0
    elif kind == "near-tie":
        t[:, 1] = t[:, 0] = t.max(axis=1) + 1.0
        t[:, 1] += 1e-6
    else:
        t[:, 5:] = -np.inf
    d = rng.normal(0, 1, (4, 12)).astype(np.float32)
    for rule in RULES:
        gd, gt = jax.grad(
            lambda a, b, rule=rule: jnp.sum(
                losses.certificate_violation(a, b, rule, differentiate_target=True)
            ),
            argnums=(0, 1),
        )(jnp.asarray(d), jnp.asarray(t))
        assert np.all(np.isfinite(gd)) and np.all(np.isfinite(gt)), (rule, kind)


@pytest.mark.slow
def test_bfloat16_jit_and_vmap():
    d, t = _pair(8, shape=(3, 4, 20))
    rule = R.TreeCoverage(2)
    ref = losses.certificate_violation(d.astype(jnp.float32), t.astype(jnp.float32), rule)
    got = losses.certificate_violation(d.astype(jnp.bfloat16), t.astype(jnp.bfloat16), rule)
    assert got.dtype == jnp.float32 and got.shape == (3, 4)
    np.testing.assert_allclose(got, ref, atol=0.05)
    grad = jax.grad(
        lambda a: jnp.sum(losses.certificate_violation(a, t.astype(jnp.bfloat16), rule))
    )(d.astype(jnp.bfloat16))
    assert grad.dtype == jnp.bfloat16
    d32, t32 = d.astype(jnp.float32), t.astype(jnp.float32)
    jitted = jax.jit(lambda a, b: losses.certificate_violation(a, b, rule))(d32, t32)
    mapped = jax.vmap(lambda a, b: losses.certificate_violation(a, b, rule))(d32, t32)
    np.testing.assert_allclose(jitted, ref, rtol=1e-6)
    np.testing.assert_allclose(mapped, ref, rtol=1e-5, atol=1e-7)


def test_cvar():
    x = jnp.array([1.0, 5.0, 3.0, 2.0, 4.0])
    np.testing.assert_allclose(losses.cvar(x, 0.4), 4.5)
    np.testing.assert_allclose(losses.cvar(x, 1.0), 3.0)
    np.testing.assert_allclose(losses.cvar(x, 0.3), (5.0 + 0.5 * 4.0) / 1.5)
    mask = jnp.array([True, False, True, True, True])
    np.testing.assert_allclose(losses.cvar(x, 0.5, where=mask), 3.5)
    grad = jax.grad(lambda a: losses.cvar(a, 0.4))(x)
    np.testing.assert_allclose(grad, [0, 0.5, 0, 0, 0.5])
    with pytest.raises(ValueError):
        losses.cvar(x, 0.0)


def test_bad_inputs_raise():
    with pytest.raises(ValueError, match="same shape"):
        losses.certificate_violation(jnp.zeros((2, 5)), jnp.zeros((2, 6)), R.StrictGreedy())
    with pytest.raises(ValueError, match="floating"):
        losses.certificate_violation(jnp.zeros((2, 5), int), jnp.zeros((2, 5)), R.StrictGreedy())
    with pytest.raises(ValueError, match="temperature"):
        losses.certificate_violation_softplus(jnp.zeros(3), jnp.zeros(3), R.StrictGreedy(),
                                              temperature=0.0)  # fmt: skip


def test_optax_steps_reduce_violation():
    rng = np.random.default_rng(9)
    target = jnp.asarray(rng.normal(0, 2, (16, 30)), jnp.float32)
    params = {"logits": jnp.asarray(rng.normal(0, 2, (16, 30)), jnp.float32)}
    rule = R.TreeCoverage(2)
    optimizer = optax.adam(0.05)
    opt_state = optimizer.init(params)

    def loss_fn(p):
        return jnp.mean(losses.certificate_violation(p["logits"], target, rule, margin=0.05))

    @jax.jit
    def step(p, s):
        loss, grads = jax.value_and_grad(loss_fn)(p)
        updates, s = optimizer.update(grads, s, p)
        return optax.apply_updates(p, updates), s, loss

    history = []
    for _ in range(30):
        params, opt_state, loss = step(params, opt_state)
        history.append(float(loss))
    assert history[0] > 0.1
    assert all(b < a for a, b in zip(history[:10], history[1:11], strict=True)), history
    assert history[-1] < 0.5 * history[0], history


def test_kl_of_rows_that_are_no_distribution_is_nan():
    """An all -inf target row used to give KL = 0."""
    ninf = -jnp.inf
    target = jnp.array([[ninf, ninf, ninf], [0.0, 1.0, 2.0], [0.0, jnp.nan, 1.0], [0.0, 0.0, 0.0]])
    drafter = jnp.array([[0.0, 1.0, 2.0], [ninf, ninf, ninf], [0.0, 1.0, 1.0], [0.0, ninf, 0.0]])
    kl = np.asarray(losses.kl_divergence(drafter, target))
    assert np.isnan(kl[:3]).all()
    assert kl[3] == np.inf  # a real answer: the drafter gives 0 to a token the target does not
    # Zero-probability target tokens are fine, and masked rows are exactly 0.
    ok = losses.kl_divergence(jnp.array([0.0, 0.0, 0.0]), jnp.array([0.0, 0.0, ninf]))
    np.testing.assert_allclose(ok, np.log(1.5), rtol=1e-6)
    masked = losses.kl_divergence(drafter, target, where=jnp.array([False, False, False, True]))
    np.testing.assert_array_equal(np.asarray(masked)[:3], 0.0)


def test_a_mask_of_another_rank_is_refused():
    """Logits [B, T, V] with B == T: a [T] mask used to broadcast where [B] was meant."""
    d = jax.random.normal(jax.random.key(0), (3, 3, 5))
    t = jax.random.normal(jax.random.key(1), (3, 3, 5))
    per_row = jnp.array([True, False, True])
    for fn in (losses.kl_divergence, lambda a, b, where: losses.certificate_violation(
            a, b, R.StrictGreedy(), where=where)):  # fmt: skip
        with pytest.raises(ValueError, match="where has shape \\(3,\\)"):
            fn(d, t, where=per_row)
        got = np.asarray(fn(d, t, where=per_row[:, None]))
        assert np.all(got[1] == 0) and np.all(got[0] != 0)


@pytest.mark.parametrize("rule", [R.StrictGreedy(), R.TreeCoverage(4)], ids=["greedy", "tree:4"])
def test_certificate_miss_matches_definition_and_gradients(rule, x64):
    d, t = _pair(5, shape=(8, 11))
    got = np.asarray(losses.certificate_miss(d, t, rule, temperature=0.2, margin=0.03))
    p, q = np.asarray(jax.nn.softmax(t)), np.asarray(jax.nn.softmax(d))
    for row in range(p.shape[0]):
        kl = np.sum(p[row] * np.log(p[row] / q[row]))
        c = reference.certificate_np(p[row], rule).value
        want = 1.0 / (1.0 + np.exp(-(kl - c + 0.03) / 0.2))
        np.testing.assert_allclose(got[row], want, rtol=1e-9, atol=1e-12)
    assert 0.05 < got.min() and got.max() < 0.95 or got.std() > 0.01  # not saturated

    def f(drafter):
        return jnp.sum(losses.certificate_miss(drafter, t, rule, temperature=0.2))

    check_grads(f, (d,), order=1, modes=["rev"], eps=1e-6, atol=1e-6, rtol=1e-6)


def test_certificate_miss_gradient_is_concentrated_at_the_boundary(x64):
    """Two positions with the same KL gradient direction: the one near ``KL = C_p`` gets
    a larger push than one far above it, where the hinge gives both the same."""
    t = jnp.log(jnp.array([[0.5, 0.3, 0.2], [0.5, 0.3, 0.2]]))
    c = float(losses.certificate_value(t[:1], R.StrictGreedy())[0])
    near = jnp.log(jnp.array([0.36, 0.4, 0.24]))  # just past the boundary
    far = jnp.log(jnp.array([0.02, 0.96, 0.02]))
    d = jnp.stack([near, far])
    kl = np.asarray(losses.kl_divergence(d, t))
    assert 0 < kl[0] - c < 0.2 and kl[1] - c > 1.5
    g_miss = jax.grad(lambda z: losses.certificate_miss(z, t, R.StrictGreedy()).sum())(d)
    g_kl = jax.grad(lambda z: losses.kl_divergence(z, t).sum())(d)
    ratio = np.linalg.norm(g_miss, axis=-1) / np.linalg.norm(g_kl, axis=-1)
    assert ratio[0] > 100 * ratio[1]


def test_certificate_miss_edges():
    t = jnp.array([[0.0, 0.0, -jnp.inf], [2.0, 0.0, 0.0]])  # row 0: a tie, C_p = 0
    d = jnp.array([[0.0, 1.0, 0.0], [2.0, 0.0, -jnp.inf]])  # row 1: q = 0 where p > 0
    miss = np.asarray(losses.certificate_miss(d, t, R.StrictGreedy()))
    assert miss[1] == 1.0  # KL = +inf: a certain miss, not 0
    assert 0.5 <= miss[0] <= 1.0
    masked = losses.certificate_miss(d, t, R.StrictGreedy(), where=jnp.array([False, True]))
    assert float(masked[0]) == 0.0
    # additive:1 accepts every token: no drafter is rejected (C_p = +inf)
    assert float(losses.certificate_value(t[1:], R.Additive(1.0))[0]) == np.inf
    got = losses.certificate_miss(d[1:], t[1:], R.Additive(1.0))
    assert float(got[0]) == 0.0
    # the same for the hinge and its smooth form (KL = +inf there: no NaN from inf - inf)
    for loss in (losses.certificate_violation, losses.certificate_violation_softplus):
        assert float(loss(d[1:], t[1:], R.Additive(1.0))[0]) == 0.0
    with pytest.raises(ValueError, match="temperature"):
        losses.certificate_miss(d, t, R.StrictGreedy(), temperature=0.0)


def test_rejection_rate_matches_definition_and_gradients(x64):
    d, t = _pair(6, shape=(7, 10))
    got = np.asarray(losses.rejection_rate(d, t))
    p, q = np.asarray(jax.nn.softmax(t)), np.asarray(jax.nn.softmax(d))
    np.testing.assert_allclose(got, 1.0 - np.minimum(p, q).sum(-1), rtol=1e-9, atol=1e-12)
    assert np.all((got > 0) & (got < 1))
    assert float(losses.rejection_rate(t, t).max()) < 1e-12
    check_grads(
        lambda z: jnp.sum(losses.rejection_rate(z, t)),
        (d,),
        order=1,
        modes=["rev"],
        eps=1e-6,
        atol=1e-6,
        rtol=1e-6,
    )
    g_t = jax.grad(lambda z: jnp.sum(losses.rejection_rate(d, z)))(t)
    assert float(jnp.abs(g_t).max()) == 0.0  # the target is a constant
    masked = losses.rejection_rate(d, t, where=jnp.arange(7) % 2 == 0)
    assert np.all(np.asarray(masked)[1::2] == 0.0)
    nan_row = t.at[0, 0].set(jnp.nan)
    assert np.isnan(np.asarray(losses.rejection_rate(d, nan_row))[0])


def test_temperature_may_be_a_numpy_or_jax_scalar_or_traced():
    """An annealed temperature: NumPy and JAX scalars are checked like floats, a traced one
    (under jit) passes through."""
    d, t = _pair(7, shape=(3, 6))
    want = losses.certificate_miss(d, t, R.StrictGreedy(), temperature=0.1)
    for temperature in (np.float32(0.1), jnp.float32(0.1), np.array(0.1)):
        got = losses.certificate_miss(d, t, R.StrictGreedy(), temperature=temperature)
        np.testing.assert_allclose(got, want, rtol=1e-6)
    jitted = jax.jit(lambda tau: losses.certificate_miss(d, t, R.StrictGreedy(), temperature=tau))
    np.testing.assert_allclose(jitted(0.1), want, rtol=1e-6)
    smooth = jax.jit(
        lambda tau: losses.certificate_violation_softplus(d, t, R.StrictGreedy(), temperature=tau)
    )
    assert np.all(np.isfinite(np.asarray(smooth(jnp.float32(0.2)))))
    for bad in (np.float32(0.0), jnp.float32(-1.0), np.float64(np.inf)):
        with pytest.raises(ValueError, match="temperature must be a finite number > 0"):
            losses.certificate_miss(d, t, R.StrictGreedy(), temperature=bad)
