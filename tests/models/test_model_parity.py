"""Logits parity with the transformers PyTorch reference on tiny random checkpoints."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxcert.models import KVCache, forward
from tests.helpers import tiny_models

pytest.importorskip("torch")

CASES = sorted(tiny_models.HF_CONFIGS)
STEP = jax.jit(forward, static_argnums=0, static_argnames="return_hidden")
B, T, S = 2, 12, 16


def _tokens(vocab: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, vocab, size=(B, T), dtype=np.int32)


@pytest.mark.parametrize("name", CASES)
def test_prefill_matches_torch(hf_case, name):
    _, torch_model, lm = hf_case(name)
    tokens = _tokens(lm.config.vocab_size)
    graphdef, state = nnx.split(lm.model)
    logits, cache = STEP(graphdef, state, jnp.asarray(tokens), KVCache.create(lm.config, B, S))
    assert logits.dtype == jnp.float32 and logits.shape == (B, T, lm.config.vocab_size)
    np.testing.assert_allclose(logits, tiny_models.torch_logits(torch_model, tokens), atol=2e-5)
    np.testing.assert_array_equal(cache.length, [0, 0])  # the caller commits


@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("prefill", [1, 5])
def test_decode_matches_torch(hf_case, name, prefill):
    """Prefill `prefill` tokens, then decode the rest one at a time with the cache."""
    _, torch_model, lm = hf_case(name)
    tokens = _tokens(lm.config.vocab_size, seed=1)
    expected = tiny_models.torch_logits(torch_model, tokens)
    graphdef, state = nnx.split(lm.model)
    cache = KVCache.create(lm.config, B, S)
    logits, cache = STEP(graphdef, state, jnp.asarray(tokens[:, :prefill]), cache)
    cache = cache.commit(prefill)
    got = [logits]
    for t in range(prefill, T):
        logits, cache = STEP(graphdef, state, jnp.asarray(tokens[:, t : t + 1]), cache)
        cache = cache.commit(1)
        got.append(logits)
    np.testing.assert_allclose(jnp.concatenate(got, axis=1), expected, atol=2e-5)
    np.testing.assert_array_equal(cache.length, [T, T])


def test_chunked_matches_torch(hf_case):
    """Chunks of 4 tokens against the cache equal the full prefill."""
    _, torch_model, lm = hf_case("qwen3")
    tokens = _tokens(lm.config.vocab_size, seed=2)
    graphdef, state = nnx.split(lm.model)
    cache = KVCache.create(lm.config, B, S)
    got = []
    for t in range(0, T, 4):
        logits, cache = STEP(graphdef, state, jnp.asarray(tokens[:, t : t + 4]), cache)
        cache = cache.commit(4)
        got.append(logits)
    expected = tiny_models.torch_logits(torch_model, tokens)
    np.testing.assert_allclose(jnp.concatenate(got, axis=1), expected, atol=2e-5)


def test_return_hidden_is_what_the_head_sees(hf_case):
    _, torch_model, lm = hf_case("llama")
    tokens = _tokens(lm.config.vocab_size, seed=3)
    graphdef, state = nnx.split(lm.model)
    cache = KVCache.create(lm.config, B, S)
    logits, _, hidden = STEP(graphdef, state, jnp.asarray(tokens), cache, return_hidden=True)
    assert hidden.shape == (B, T, lm.config.hidden_size)
    np.testing.assert_allclose(hidden @ lm.model.lm_head[...], logits, atol=1e-5)
    import torch

    with torch.no_grad():
        out = torch_model(torch.as_tensor(tokens, dtype=torch.long), output_hidden_states=True)
    np.testing.assert_allclose(hidden, out.hidden_states[-1].numpy(), atol=2e-5)


def test_jit_compiles_once(hf_case):
    _, _, lm = hf_case("qwen2")
    graphdef, state = nnx.split(lm.model)
    step = jax.jit(forward, static_argnums=0, donate_argnames="cache")
    cache = KVCache.create(lm.config, B, S)
    for i in range(3):
        _, cache = step(graphdef, state, jnp.full((B, 1), i, jnp.int32), cache)
        cache = cache.commit(1)
    assert step._cache_size() == 1


def test_hf_tokenizer_and_config_loaded(hf_case):
    path, _, lm = hf_case("qwen2")
    assert lm.path == path
    assert lm.config.architecture == "qwen2" and lm.config.qkv_bias and lm.config.tie_embeddings
    assert lm.config.eos_token_ids == (tiny_models.TOKENS.index("<|im_end|>"),)
    ids = lm.tokenizer.encode(tiny_models.TEXTS[0])
    assert lm.tokenizer.decode(ids) == tiny_models.TEXTS[0]
