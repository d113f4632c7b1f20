"""Transformer pieces without a reference implementation: RoPE layouts, dtypes, positions."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxcert.models import KVCache, Transformer, forward, truncate
from jaxcert.models.transformer import apply_rope, rope_angles
from tests.helpers import tiny_models

CONFIG = tiny_models.tiny_config(architecture="llama", o_bias=True)
STEP = jax.jit(forward, static_argnums=0)


def _logits(model, tokens, **kw):
    graphdef, state = nnx.split(model)
    cache = KVCache.create(model.config, tokens.shape[0], 16, **kw)
    return STEP(graphdef, state, jnp.asarray(tokens), cache)[0]


def _permute_columns(kernel: jax.Array, n_head: int) -> jax.Array:
    """llama.cpp's row permutation of an `[out, in]` matrix, applied to an `[in, out]` kernel."""
    w = np.asarray(kernel)
    return jnp.asarray(tiny_models.llama_cpp_permute(w.T if w.ndim == 2 else w, n_head).T)


def test_interleaved_with_permuted_weights_equals_half():
    half = tiny_models.random_model(CONFIG, seed=0)
    inter = Transformer(dataclasses.replace(CONFIG, rope_layout="interleaved"), rngs=nnx.Rngs(1))
    _, state = nnx.split(half)
    nnx.update(inter, state)
    for layer in inter.layers:
        attn = layer.attn
        for name, heads in (("q", CONFIG.num_heads), ("k", CONFIG.num_kv_heads)):
            for param in (getattr(attn, f"{name}_proj"), getattr(attn, f"{name}_bias")):
                param[...] = _permute_columns(param[...], heads)
    tokens = np.random.default_rng(0).integers(0, 64, (2, 10)).astype(np.int32)
    np.testing.assert_allclose(_logits(inter, tokens), _logits(half, tokens), atol=1e-5)
    # Without the permutation the interleaved layout is a different model.
    nnx.update(inter, state)
    assert np.abs(_logits(inter, tokens) - _logits(half, tokens)).max() > 1e-2


@pytest.mark.parametrize("layout", ["half", "interleaved"])
def test_rope_is_a_rotation(layout):
    x = jax.random.normal(jax.random.key(0), (2, 5, 3, 8))
    positions = jnp.arange(10).reshape(2, 5)
    cos, sin = rope_angles(positions, 8, 10_000.0)
    y = apply_rope(x, cos, sin, layout)
    np.testing.assert_allclose(jnp.linalg.norm(y, axis=-1), jnp.linalg.norm(x, axis=-1), rtol=1e-5)
    np.testing.assert_allclose(y[0, 0], x[0, 0], atol=1e-7)  # position 0 is the identity
    # Relative: <rot(q, m), rot(k, n)> depends on m - n only.
    q, k = x[:1, :1, :1], x[1:, :1, :1]
    dots = []
    for m, n in ((3, 1), (7, 5)):
        cm, sm = rope_angles(jnp.full((1, 1), m), 8, 10_000.0)
        cn, sn = rope_angles(jnp.full((1, 1), n), 8, 10_000.0)
        dots.append(jnp.sum(apply_rope(q, cm, sm, layout) * apply_rope(k, cn, sn, layout)))
    np.testing.assert_allclose(dots[0], dots[1], rtol=1e-5)


def test_explicit_default_positions_and_mask_change_nothing():
    model = tiny_models.random_model(CONFIG, seed=2)
    graphdef, state = nnx.split(model)
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, 64, (2, 6)), jnp.int32)
    cache = KVCache.create(CONFIG, 2, 16).commit(jnp.array([0, 3]))
    base, _ = STEP(graphdef, state, tokens, cache)
    positions = cache.length[:, None] + jnp.arange(6)[None]
    causal = jnp.broadcast_to(jnp.tril(jnp.ones((6, 6), bool)), (2, 6, 6))
    same, _ = STEP(graphdef, state, tokens, cache, positions=positions, attention_mask=causal)
    np.testing.assert_allclose(same, base, atol=1e-6)
    # RoPE is relative: a common shift changes nothing, moving one token does.
    shifted, _ = STEP(graphdef, state, tokens, cache, positions=positions + 5)
    np.testing.assert_allclose(shifted, base, atol=1e-5)
    moved, _ = STEP(graphdef, state, tokens, cache, positions=positions.at[:, 0].add(-1))
    assert np.abs(moved - base).max() > 1e-3


def test_bfloat16_model_gives_float32_logits():
    f32 = tiny_models.random_model(CONFIG, seed=4)
    bf16 = Transformer(CONFIG, rngs=nnx.Rngs(0), dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
    _, state = nnx.split(f32)
    nnx.update(bf16, jax.tree.map(lambda x: x.astype(jnp.bfloat16), state))
    tokens = np.random.default_rng(2).integers(0, 64, (2, 8)).astype(np.int32)
    low = _logits(bf16, tokens, dtype=jnp.bfloat16)
    assert low.dtype == jnp.float32
    np.testing.assert_allclose(low, _logits(f32, tokens), atol=0.25)


def test_config_validation():
    with pytest.raises(ValueError, match="must divide"):
        dataclasses.replace(CONFIG, num_kv_heads=3)
    with pytest.raises(ValueError, match="rope_layout"):
        dataclasses.replace(CONFIG, rope_layout="neox")
    with pytest.raises(ValueError, match="architecture"):
        dataclasses.replace(CONFIG, architecture="gemma")
    with pytest.raises(ValueError, match="head_dim"):
        dataclasses.replace(CONFIG, head_dim=0)


def test_truncate_is_an_early_exit_sharing_weights():
    model = tiny_models.random_model(CONFIG, seed=3)
    tokens = np.array([[1, 5, 9, 2]])
    np.testing.assert_array_equal(_logits(truncate(model, 2), tokens), _logits(model, tokens))
    short = truncate(model, 1)
    assert short.config.num_layers == 1 and len(short.layers) == 1
    assert short.layers[0].mlp.up_proj[...] is model.layers[0].mlp.up_proj[...]
    # One block, then the final norm and the lm_head: compute it by hand.
    cache = KVCache.create(model.config, 1, 16)
    x = jnp.take(model.embedding[...], jnp.asarray(tokens), axis=0)
    positions = jnp.arange(4)[None]
    cos, sin = rope_angles(positions, CONFIG.head_dim, CONFIG.rope_theta)
    mask = jnp.tril(jnp.ones((4, 16), bool), 0)[None]
    x, _, _ = model.layers[0](x, cos, sin, cache.keys[0], cache.values[0], cache.length, mask)
    want = model.project(model.norm(x))
    np.testing.assert_allclose(_logits(short, tokens), want, rtol=1e-5, atol=1e-5)
    for bad in (0, 3):
        with pytest.raises(ValueError, match="num_layers"):
            truncate(model, bad)


def test_untied_gives_a_tied_model_its_own_lm_head_with_the_same_logits():
    from jaxcert.models.transformer import untied

    tied = tiny_models.random_model(tiny_models.tiny_config(tie_embeddings=True), seed=3)
    own = untied(tied)
    assert tied.lm_head is None and tied.config.tie_embeddings  # the input is left as it was
    assert not own.config.tie_embeddings and own.lm_head[...].shape == (32, 64)
    tokens = jnp.array([[1, 5, 7, 9, 11]])
    a, _ = tied(tokens, tied.init_cache(1, 5))
    b, _ = own(tokens, own.init_cache(1, 5))
    np.testing.assert_allclose(b, a, rtol=1e-6, atol=1e-6)
    own.lm_head[...] = own.lm_head[...] * 2.0  # its own: the embedding does not move
    np.testing.assert_array_equal(own.embedding[...], tied.embedding[...])
    assert untied(own) is own
