"""The two-pass row summary of wide rows (maximum, normaliser, entropy sum, top-``k``) and the
certificates built on it, against NumPy in float64 on random and adversarial rows."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxcert
from jaxcert.cli import DEFAULT_RULES
from jaxcert.core import numerics, reference
from jaxcert.core import rules as R
from tests.helpers import multidevice


def _adversarial_rows(rng, vocab: int) -> np.ndarray:
    """Rows that test each way the groups can go wrong (float32)."""
    rows = [rng.normal(0, 3, vocab)]  # plain
    shifted = rng.normal(0, 2, vocab) + 1e4  # a large common offset
    rows.append(shifted)
    holes = rng.normal(0, 2, vocab)
    holes[: 64 * 7] = -np.inf  # whole groups of -inf at the start
    holes[rng.random(vocab) < 0.2] = -np.inf  # and scattered ones
    rows.append(holes)
    one = np.full(vocab, -np.inf)
    one[vocab - 1] = 0.0  # one finite token, in the last (possibly padded) group
    rows.append(one)
    ties = np.full(vocab, -3.0)
    ties[[5, 64 * 3 + 1, vocab - 2]] = 2.0  # the maximum tied across groups
    ties[[7, 64 * 9]] = [-0.0, 0.0]  # signed zeros tie too
    rows.append(ties)
    peaked = rng.normal(0, 1, vocab)
    peaked[rng.integers(vocab)] = 40.0  # p(x0) ~ 1
    rows.append(peaked)
    flat = rng.normal(0, 0.01, vocab)  # entropy near log V: typical's U outgrows the window
    rows.append(flat)
    return np.stack(rows).astype(np.float32)


def _numpy_summary(x: np.ndarray, k: int):
    x = x.astype(np.float64)
    m = x.max(-1)
    s = x - m[:, None]
    e = np.exp(s)
    total = e.sum(-1)
    with np.errstate(invalid="ignore"):  # 0 * -inf: 0 log 0 = 0
        weighted = np.where(e > 0, e * s, 0.0).sum(-1)
    canonical = np.where(x == 0, 0.0, x)
    order = np.lexsort((np.arange(x.shape[1])[None].repeat(len(x), 0), -canonical), axis=-1)
    ids = order[:, :k]
    return m, total, weighted, np.take_along_axis(canonical, ids, -1), ids


@pytest.mark.parametrize("vocab", [8192, 8200, 10_000, 151_936])  # 8200: padded groups
def test_row_summary_matches_numpy(vocab):
    rng = np.random.default_rng(vocab)
    x = _adversarial_rows(rng, vocab)
    got = jax.jit(lambda a: numerics.row_summary(a, 64, True))(jnp.asarray(x))
    m, total, weighted, values, ids = _numpy_summary(x, 64)
    np.testing.assert_array_equal(got[0], m.astype(np.float32))
    np.testing.assert_allclose(got[1], total, rtol=2e-6)
    np.testing.assert_allclose(got[2], weighted, rtol=2e-5, atol=1e-6 * vocab)
    np.testing.assert_array_equal(got[3], values.astype(np.float32))
    # Ties: the lower id first, as lax.top_k and argmax (the -inf tail of row 3 included).
    np.testing.assert_array_equal(got[4], ids)


def test_row_summary_flags_rows_that_are_no_distribution():
    vocab = 10_000
    x = np.random.default_rng(0).normal(0, 2, (4, vocab)).astype(np.float32)
    x[0, 777] = np.nan  # a NaN inside one group must poison the whole normaliser
    x[1, 9_999] = np.inf
    x[2] = -np.inf
    x_max, total, weighted, _, _ = jax.jit(lambda a: numerics.row_summary(a, 64, True))(
        jnp.asarray(x)
    )
    assert np.isnan(total[0]) and np.isnan(weighted[0])
    assert not (np.isfinite(x_max[1]) and np.isfinite(total[1]))
    assert x_max[2] == -np.inf and total[2] == 0.0 and weighted[2] == 0.0
    assert np.isfinite(total[3]) and total[3] >= 1.0


@pytest.mark.parametrize(
    "vocab, where",
    [(8192, 63), (8192, 8191), (8193, 8192), (8288, 31), (8208, 15), (16_384, 127)],
)
def test_a_nan_at_the_end_of_a_group_makes_the_row_invalid(vocab, where):
    """XLA:CPU gives -inf as the maximum of a group whose last entry is NaN (groups of 16,
    32, 64; the padded group's one real token): the NaN must still reach the normaliser."""
    x = np.zeros((2, vocab), np.float32)
    x[0, where] = np.nan
    cert = jaxcert.certificate(jnp.asarray(x), R.StrictGreedy())
    assert cert.valid.tolist() == [False, True]
    assert np.isnan(cert.value[0])
    stats = jaxcert.distribution_stats(jnp.asarray(x), top=2)
    assert np.isnan(stats.entropy[0]) and np.isfinite(stats.entropy[1])


@pytest.mark.slow
def test_a_nan_at_the_end_of_a_vocabulary_shard_makes_the_row_invalid():
    out = multidevice.run(
        """
        import jaxcert
        mesh = jax.make_mesh((2,), ("model",), axis_types=(AxisType.Explicit,))
        x = np.zeros((3, 16384), np.float32)
        x[0, 8191] = np.nan   # the last entry of the first shard (and of its last group)
        x[1, 16383] = np.nan  # the last entry of the row
        sharded = jax.device_put(jnp.asarray(x), NamedSharding(mesh, P(None, "model")))
        cert = jaxcert.certificate(sharded, jaxcert.StrictGreedy())
        print(json.dumps({"valid": np.asarray(cert.valid).tolist()}))
        """,
        devices=2,
    )
    assert out["valid"] == [False, False, True]


def test_extreme_finite_logits_have_a_finite_entropy():
    x = np.full((1, 8192), -2e38, np.float32)
    x[0, -1] = 2e38  # the gap to the row's maximum overflows to -inf
    _, total, weighted, _, _ = jax.jit(lambda a: numerics.row_summary(a, 64, True))(jnp.asarray(x))
    assert total[0] == 1.0 and weighted[0] == 0.0
    assert jaxcert.distribution_stats(jnp.asarray(x), top=1).entropy[0] == 0.0


@pytest.mark.parametrize("vocab", [10_000, 151_936])
def test_certificates_of_wide_rows_match_the_reference(vocab):
    """Every default rule, plus the threshold rules' exact path (flat rows) and their
    shortcut (additive with t >= p(x0): every token accepted, C_p = +inf)."""
    rng = np.random.default_rng(vocab + 1)
    x = _adversarial_rows(rng, vocab)
    x = np.concatenate([x, rng.normal(0, 0.5, (1, vocab)).astype(np.float32)])  # p(x0) < 0.3
    rules = R.parse_rules(DEFAULT_RULES) + (R.TreeCoverage(3, base=R.Typical()),)
    certs = jaxcert.certificates(jnp.asarray(x), rules)
    p = np.exp(x.astype(np.float64) - x.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    for rule, cert in zip(rules, jax.device_get(certs), strict=True):
        assert cert.valid.all()
        for row in range(len(x)):
            ref = reference.certificate_np(p[row], rule)
            got = float(cert.value[row])
            if np.isinf(ref.value):
                assert got == np.inf, (rule.spec, row, got)
            else:
                assert abs(got - ref.value) <= 1e-4 * ref.value + 1e-7, (rule.spec, row)
            assert int(cert.greedy_token[row]) == ref.greedy_token


def test_wide_bfloat16_rows_are_certified_as_their_float32_values():
    x = jnp.asarray(_adversarial_rows(np.random.default_rng(3), 10_000), jnp.bfloat16)
    rules = R.parse_rules(DEFAULT_RULES)
    got = jaxcert.certificates(x, rules)
    want = jaxcert.certificates(x.astype(jnp.float32), rules)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_array_equal(a.value, b.value)
        np.testing.assert_array_equal(a.competitor, b.competitor)
