"""Acceptance sets agree with the certificate solver; sampling distributions; verify specs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxcert.core import rules as R
from jaxcert.core.solver import certificate
from jaxcert.decoding import tree as T
from jaxcert.decoding import verify as Vf

RULES = [
    R.StrictGreedy(),
    R.Additive(0.05),
    R.Additive(0.3),
    R.Multiplicative(0.5),
    R.TargetTopK(3),
    R.Typical(),
    R.Typical(0.3, 0.9),
]


@pytest.mark.parametrize("rule", RULES, ids=lambda r: r.spec)
def test_accepted_set_is_the_certificates_upper_set(rule):
    """U is a prefix of tokens by decreasing p: x0 is in it, the competitor is not, and
    |U| equals the number of tokens ranked above the competitor."""
    logits = jax.random.normal(jax.random.key(0), (64, 12)) * 1.5
    logits = logits.at[:4, :2].set(1.0)  # exact ties at the top of a few rows
    v = logits.shape[-1]
    tokens = jnp.broadcast_to(jnp.arange(v), logits.shape)
    member = Vf.in_accepted_set(logits[:, None, :].repeat(v, 1), tokens, rule)  # [64, V]
    cert = certificate(logits, R.TreeCoverage(1, base=None) if rule == R.StrictGreedy() else rule)
    rows = np.arange(64)
    assert np.all(np.asarray(member)[rows, np.asarray(cert.greedy_token)])
    comp = np.asarray(cert.competitor[:, 0])
    has = comp >= 0
    assert not np.any(np.asarray(member)[rows[has], comp[has]])
    # Prefix property: every member has p >= every non-member.
    p = np.asarray(jax.nn.softmax(logits))
    m = np.asarray(member)
    for i in range(64):
        if m[i].any() and (~m[i]).any():
            assert p[i][m[i]].min() >= p[i][~m[i]].max()
    # Rejection is impossible exactly when everything is accepted (m = 1).
    np.testing.assert_array_equal(np.isinf(np.asarray(cert.value)), m.all(-1))


def test_sampling_log_probs_top_p():
    logits = jnp.log(jnp.array([[0.5, 0.3, 0.15, 0.05]]))
    lp = np.exp(np.asarray(Vf.sampling_log_probs(logits, 1.0, 0.75)))
    np.testing.assert_allclose(lp[0], [0.625, 0.375, 0, 0], rtol=1e-6)
    lp = np.exp(np.asarray(Vf.sampling_log_probs(logits, 1.0, 0.85)))
    np.testing.assert_allclose(lp[0], [0.5, 0.3, 0.15, 0] / np.float32(0.95), rtol=1e-6)
    lp = np.exp(np.asarray(Vf.sampling_log_probs(logits, 0.5, 1.0)))
    want = np.array([0.5, 0.3, 0.15, 0.05]) ** 2
    np.testing.assert_allclose(lp[0], want / want.sum(), rtol=1e-5)


def test_sample_tree_single_node_is_exact_speculative_sampling():
    """One drafted token, many rows: P(output) = p exactly (accept + residual)."""
    p = jnp.log(jnp.array([0.5, 0.2, 0.2, 0.1]))
    q = jnp.log(jnp.array([0.1, 0.6, 0.2, 0.1]))
    n = 40_000
    key_q, key_v = jax.random.split(jax.random.key(1))
    drafted = jax.random.categorical(key_q, q, shape=(n,)).astype(jnp.int32)
    target = jnp.broadcast_to(p, (n, 2, 4))
    children = jnp.broadcast_to(jnp.array([[0], [-1]], jnp.int32), (n, 2, 1))
    expanded = jnp.zeros((n, 2), jnp.int32)
    passes, last, token = jax.jit(
        lambda k: Vf.sample_tree(
            k,
            target,
            drafted[:, None],
            children,
            expanded,
            jnp.broadcast_to(q, (n, 1, 4)),
            max_depth=1,
            temperature=1.0,
        )
    )(key_v)
    out = np.where(np.asarray(last) == 1, np.asarray(drafted), np.asarray(token))
    freq = np.bincount(out, minlength=4) / n
    np.testing.assert_allclose(freq, [0.5, 0.2, 0.2, 0.1], atol=0.01)
    accept = np.asarray(passes[:, 0]).mean()
    np.testing.assert_allclose(accept, 0.6, atol=0.01)  # sum_x min(p_x, q_x)


@pytest.mark.parametrize(
    "spec, tree, rule",
    [
        ("greedy", T.Chain(), R.StrictGreedy()),
        ("additive:0.3", T.Chain(), R.Additive(0.3)),
        ("sample", T.Chain(), None),
        ("tree:4x6", T.StaticTree(m=4, depth=6), R.StrictGreedy()),
        ("tree:2x4+sample", T.StaticTree(m=2, depth=4), None),
        ("dyntree:4x6x24+typical", T.DynamicTree(m=4, depth=6, nodes=24), R.Typical()),
    ],
    ids=[
        "greedy",
        "additive:0.3",
        "sample",
        "tree:4x6",
        "tree:2x4+sample",
        "dyntree:4x6x24+typical",
    ],
)
def test_parse_verify(spec, tree, rule):
    v = Vf.parse_verify(spec)
    assert v.tree == tree and v.rule == rule
    assert Vf.parse_verify(v.spec) == v


@pytest.mark.parametrize("bad", ["tree:4", "dyntree:2x2x4+sample", "bogus", "tree:2x2+tree:3"])
def test_parse_verify_errors(bad):
    with pytest.raises(ValueError):
        Vf.parse_verify(bad)


@pytest.mark.slow
def test_verification_of_bfloat16_logits_is_float32_arithmetic():
    """bf16 logits (a bf16 model's, or a bf16 dump) are verified in float32: the accepted
    sets, sampling distributions and certificates equal those of the same values in float32,
    and come back as float32. (A bf16 model's logits themselves depend on the batch size;
    nothing here may add bf16 rounding of its own.)"""
    logits = (jax.random.normal(jax.random.key(1), (16, 40)) * 3).astype(jnp.bfloat16)
    up = logits.astype(jnp.float32)
    tokens = jax.random.randint(jax.random.key(2), (16,), 0, 40)
    for rule in RULES:
        np.testing.assert_array_equal(
            Vf.in_accepted_set(logits, tokens, rule), Vf.in_accepted_set(up, tokens, rule)
        )
        a, b = (
            certificate(logits, R.TreeCoverage(2, base=rule)),
            certificate(up, R.TreeCoverage(2, base=rule)),
        )
        assert a.value.dtype == jnp.float32
        np.testing.assert_array_equal(a.value, b.value)
    for t, top_p in ((1.0, 1.0), (0.7, 0.9)):
        lp = Vf.sampling_log_probs(logits, t, top_p)
        assert lp.dtype == jnp.float32
        np.testing.assert_array_equal(lp, Vf.sampling_log_probs(up, t, top_p))


def test_a_bfloat16_model_gives_float32_logits():
    from jaxcert.models.cache import KVCache
    from jaxcert.models.config import ModelConfig
    from jaxcert.models.transformer import Transformer

    config = ModelConfig(
        architecture="qwen2", vocab_size=40, hidden_size=32, intermediate_size=64,
        num_layers=1, num_heads=4, num_kv_heads=2, head_dim=8, qkv_bias=True,
    )  # fmt: skip
    model = Transformer(config, rngs=nnx.Rngs(0), dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
    cache = KVCache.create(config, 2, 8, dtype=jnp.bfloat16)
    logits, _ = model(jnp.ones((2, 3), jnp.int32), cache)
    assert logits.dtype == jnp.float32 and logits.shape == (2, 3, 40)


def test_traced_temperature_and_top_p_match_python_numbers():
    """Sampling settings are traced in the decoders (one program for every value)."""
    logits = jax.random.normal(jax.random.key(4), (6, 30)) * 2
    fn = jax.jit(Vf.sampling_log_probs)
    for t, top_p in ((1.0, 1.0), (0.7, 0.85), (1.6, 0.3)):
        np.testing.assert_allclose(
            fn(logits, jnp.float32(t), jnp.float32(top_p)),
            Vf.sampling_log_probs(logits, t, top_p),
            rtol=1e-6,
        )
