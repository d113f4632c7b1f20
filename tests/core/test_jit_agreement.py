"""Every public array function gives the same result with and without `jax.jit` (chex variants)."""

from __future__ import annotations

import chex
import jax.numpy as jnp
import numpy as np
from absl.testing import parameterized

import jaxcert
from jaxcert import losses
from jaxcert.core import bounds
from jaxcert.core import rules as R

RULES = (
    R.StrictGreedy(),
    R.Additive(0.2),
    R.Multiplicative(0.3),
    R.TargetTopK(2),
    R.Typical(),
    R.TreeCoverage(3),
    R.TreeCoverage(2, base=R.Additive(0.1)),
)


def _logits(seed: int, shape=(3, 5, 40)):
    rng = np.random.default_rng(seed)
    return jnp.asarray(rng.normal(0.0, 2.5, shape), jnp.float32)


class JitAgreementTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.named_parameters((rule.spec, rule) for rule in RULES)
    def test_certificate(self, rule):
        x = _logits(0)
        got = self.variant(lambda a: jaxcert.certificate(a, rule, return_q=True, top_k=4))(x)
        want = jaxcert.certificate(np.asarray(x), rule, return_q=True, top_k=4)
        chex.assert_shape(got.value, (3, 5))
        chex.assert_shape(got.competitor, (3, 5, rule.list_size))
        chex.assert_shape(got.q_star, (3, 5, 40))
        chex.assert_trees_all_close(got, want, rtol=1e-6, atol=1e-7)

    @chex.variants(with_jit=True, without_jit=True)
    def test_distribution_stats(self):
        x = _logits(1)
        got = self.variant(lambda a: jaxcert.distribution_stats(a, top=4))(x)
        chex.assert_shape(got.entropy, (3, 5))
        chex.assert_trees_all_close(got, jaxcert.distribution_stats(np.asarray(x), top=4))

    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.named_parameters(
        ("kl", lambda d, t: losses.kl_divergence(drafter_logits=d, target_logits=t)),
        ("hinge", lambda d, t: losses.certificate_violation(d, t, R.TreeCoverage(2), margin=0.1)),
        (
            "softplus",
            lambda d, t: losses.certificate_violation_softplus(d, t, R.Additive(0.2)),
        ),
        ("ratio", lambda d, t: losses.certificate_ratio(d, t, R.StrictGreedy())),
    )
    def test_losses(self, loss):
        d, t = _logits(2), _logits(3)
        got = self.variant(loss)(d, t)
        chex.assert_shape(got, (3, 5))
        chex.assert_trees_all_close(got, loss(np.asarray(d), np.asarray(t)), rtol=1e-6)

    @chex.variants(with_jit=True, without_jit=True)
    def test_bounds(self):
        margin = jnp.linspace(0.0, 1.0, 11)
        got = self.variant(lambda g: bounds.greedy_margin_bounds(g, 1000))(margin)
        chex.assert_trees_all_close(got, bounds.greedy_margin_bounds(np.asarray(margin), 1000))
        c = jnp.asarray(np.random.default_rng(4).exponential(0.3, (2, 9)))
        runs = self.variant(lambda a: bounds.certified_run_length(a, 0.2))(c)
        chex.assert_trees_all_equal(runs, bounds.certified_run_length(np.asarray(c), 0.2))
