"""The decoder drives any model with the `DecoderModel` surface, whatever its cache holds.

`BigramLM` is not a `models.Transformer`: its next-token distribution depends on the current
token and the one before it, and its cache (`TokenCache`) stores token ids per slot instead
of keys and values. If the decoder touched cache internals, or any cache operation it uses
(commit, rollback, select, repeat, take_rows, copy_segments) were applied wrongly, the token
before some position would be wrong and speculative greedy would leave target-only greedy.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx, struct
from jax import lax

from jaxcert import decoding
from jaxcert.decoding.protocols import Cache, DecoderModel
from jaxcert.models.cache import put_rows
from tests.helpers.tiny_decoding import CONFIG, MAX_NEW, PROMPTS, random_model

V, E = CONFIG.vocab_size, 16
NO_TOKEN = -1  # the token "before" position 0


@struct.dataclass
class TokenCache:
    """Token ids per slot, ``[B, S]`` int32, and committed entries per row."""

    tokens: jax.Array
    length: jax.Array

    def commit(self, num_tokens):
        return self.replace(length=self.length + jnp.asarray(num_tokens, jnp.int32))

    def rollback(self, length):
        return self.replace(length=jnp.broadcast_to(jnp.asarray(length, jnp.int32), (self.b,)))

    def select(self, offsets, count):
        s = self.tokens.shape[1]
        i = jnp.arange(offsets.shape[1])
        src = jnp.clip(self.length[:, None] + offsets, 0, s - 1)
        dst = jnp.where(i < count[:, None], self.length[:, None] + i, s)
        rows = jnp.arange(self.b)[:, None]
        moved = self.tokens.at[rows, dst].set(self.tokens[rows, src], mode="drop")
        return TokenCache(tokens=moved, length=self.length + count)

    def repeat(self, times):
        return jax.tree.map(lambda x: jnp.repeat(x, times, axis=0), self)

    def take_rows(self, rows):
        return jax.tree.map(lambda x: x[rows], self)

    def put_rows(self, rows, at):
        return put_rows(self, rows, at)

    def copy_segments(self, src, start, width):
        take = jax.vmap(lambda row, s: lax.dynamic_slice_in_dim(row, s, width))
        put = jax.vmap(lambda row, seg, s: lax.dynamic_update_slice_in_dim(row, seg, s, 0))
        start = jnp.broadcast_to(start, (self.b,))
        return self.replace(tokens=put(self.tokens, take(self.tokens, start)[src], start))

    @property
    def b(self) -> int:
        return self.tokens.shape[0]


@dataclasses.dataclass(frozen=True)
class Config:
    vocab_size: int = V
    max_position_embeddings: int = 4096


class BigramLM(nnx.Module):
    """``logits(x_t | x_{t-1}, x_t) = W_out tanh(A[x_t] + B[x_{t-1}])`` with its own cache."""

    def __init__(self, seed: int):
        k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
        self.a = nnx.Param(jax.random.normal(k1, (V, E)))
        self.b = nnx.Param(jax.random.normal(k2, (V + 1, E)))  # row V: no token before
        self.w_out = nnx.Param(jax.random.normal(k3, (E, V)) * 2.0)
        self.config = Config()

    def init_cache(self, batch_size: int, max_length: int) -> TokenCache:
        tokens = jnp.full((batch_size, max_length), NO_TOKEN, jnp.int32)
        return TokenCache(tokens=tokens, length=jnp.zeros((batch_size,), jnp.int32))

    def features(self, tokens, cache, *, positions=None, attention_mask=None):
        b, t = tokens.shape
        rows = jnp.arange(b)[:, None]
        length = cache.length[:, None]
        if positions is None:
            positions = length + jnp.arange(t)
        if attention_mask is None:
            attention_mask = jnp.tril(jnp.ones((t, t), bool))[None]
        # The token before a new one: a visible new token one position earlier, else the
        # committed entry at that position (committed slot i holds position i).
        earlier = attention_mask & (positions[:, None, :] == positions[:, :, None] - 1)
        from_new = jnp.where(earlier, tokens[:, None, :], -1).max(axis=-1)
        committed = cache.tokens[rows, jnp.clip(positions - 1, 0, None)]
        before = jnp.where(jnp.any(earlier, axis=-1), from_new, committed)
        before = jnp.where(positions == 0, NO_TOKEN, before)
        cache = cache.replace(tokens=cache.tokens.at[rows, length + jnp.arange(t)].set(tokens))
        hidden = jnp.tanh(self.a[...][tokens] + self.b[...][jnp.where(before < 0, V, before)])
        return hidden, cache

    def project(self, hidden):
        return (hidden @ self.w_out[...]).astype(jnp.float32)

    def __call__(self, tokens, cache, **kwargs):
        hidden, cache = self.features(tokens, cache, **kwargs)
        return self.project(hidden), cache


def _reference_greedy(model: BigramLM, prompt, steps):
    """Plain NumPy greedy decoding of the bigram model."""
    a, b, w = (np.asarray(x[...], np.float64) for x in (model.a, model.b, model.w_out))
    seq = list(prompt)
    for _ in range(steps):
        before = seq[-2] if len(seq) > 1 else V
        seq.append(int(np.argmax(np.tanh(a[seq[-1]] + b[before]) @ w)))
    return seq[len(prompt) :]


@pytest.fixture(scope="module")
def bigram_pair():
    target = BigramLM(seed=0)
    # A drafter close to the target: some drafts pass, some are rejected.
    drafter = BigramLM(seed=0)
    noise = jax.random.normal(jax.random.key(9), (E, V))
    drafter.w_out = nnx.Param(target.w_out[...] + 1.5 * noise)
    return target, drafter


def test_bigram_model_meets_the_protocol(bigram_pair):
    target, _ = bigram_pair
    assert isinstance(target, DecoderModel)
    assert isinstance(target.init_cache(2, 8), Cache)
    out = decoding.target_decode(target, PROMPTS, max_new_tokens=MAX_NEW)
    for prompt, tokens in zip(PROMPTS, out.tokens, strict=True):
        assert list(tokens) == _reference_greedy(target, prompt, MAX_NEW)


@pytest.mark.parametrize("verify", ["greedy", "tree:2x3", "dyntree:3x3x6"])
def test_speculative_greedy_with_a_model_of_its_own_cache(bigram_pair, verify):
    target, drafter = bigram_pair
    config = decoding.DecodeConfig(
        verification=decoding.parse_verify(verify), max_new_tokens=MAX_NEW, max_draft=6
    )
    out = decoding.speculative_decode(
        target, drafter, PROMPTS, config=config, policy=decoding.Constant(k=4)
    )
    for prompt, tokens in zip(PROMPTS, out.tokens, strict=True):
        assert list(tokens) == _reference_greedy(target, prompt, MAX_NEW)
    accepted, depth = out.stats.accepted[out.stats.active], out.stats.depth[out.stats.active]
    assert accepted.sum() > 0  # drafts were accepted ...
    assert np.any(accepted < depth)  # ... and rejected, so rollback and select were used


def test_a_transformer_target_with_a_bigram_drafter(bigram_pair):
    target = random_model(CONFIG, seed=3)
    _, drafter = bigram_pair
    config = decoding.DecodeConfig(
        verification=decoding.parse_verify("tree:2x3"), max_new_tokens=MAX_NEW
    )
    want = decoding.target_decode(target, PROMPTS, max_new_tokens=MAX_NEW).tokens
    policy = decoding.Constant(k=3)
    got = decoding.speculative_decode(target, drafter, PROMPTS, config=config, policy=policy)
    got = got.tokens
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(g, w)


def test_a_model_without_init_cache_is_named():
    class NoCache(nnx.Module):
        def __init__(self):
            self.config = Config()

        def features(self, tokens, cache):
            return tokens, cache

        def project(self, hidden):
            return hidden

    with pytest.raises(ValueError, match="NoCache lacks init_cache"):
        decoding.target_decode(NoCache(), PROMPTS, max_new_tokens=2)
