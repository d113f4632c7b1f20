"""KV cache semantics: padded batches, rollback, tree masks and path selection."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxcert.models import KVCache, forward
from tests.helpers import tiny_models

CONFIG = tiny_models.tiny_config()
S = 24
STEP = jax.jit(forward, static_argnums=0)


@pytest.fixture(scope="module")
def split():
    return nnx.split(tiny_models.random_model(CONFIG, seed=3))


def _run(split, tokens, cache, **kw):
    graphdef, state = split
    return STEP(graphdef, state, jnp.asarray(tokens, jnp.int32), cache, **kw)


def _prefill(split, tokens):
    """Logits `[T, V]` of one sequence from an empty cache."""
    tokens = np.asarray(tokens)[None]
    return _run(split, tokens, KVCache.create(CONFIG, 1, S))[0][0]


def test_right_padded_batch_matches_rows_alone(split):
    rng = np.random.default_rng(0)
    lengths = [3, 7, 5]
    prompts = [rng.integers(0, 64, n) for n in lengths]
    padded = np.zeros((3, 7), np.int32)  # pad id 0, to the right
    for b, p in enumerate(prompts):
        padded[b, : len(p)] = p
    logits, cache = _run(split, padded, KVCache.create(CONFIG, 3, S))
    cache = cache.commit(np.asarray(lengths, np.int32))
    nxt = rng.integers(0, 64, (3, 2))
    step1, cache = _run(split, nxt[:, :1], cache)
    step2, _ = _run(split, nxt[:, 1:], cache.commit(1))
    for b, p in enumerate(prompts):
        alone = _prefill(split, np.concatenate([p, nxt[b]]))
        np.testing.assert_allclose(logits[b, : len(p)], alone[: len(p)], atol=1e-5)
        np.testing.assert_allclose(step1[b, 0], alone[len(p)], atol=1e-5)
        np.testing.assert_allclose(step2[b, 0], alone[len(p) + 1], atol=1e-5)


def test_rollback_then_redecode_equals_fresh_prefill(split):
    rng = np.random.default_rng(1)
    prompt, wrong, right = rng.integers(0, 64, 6), rng.integers(0, 64, 4), rng.integers(0, 64, 3)
    _, cache = _run(split, prompt[None], KVCache.create(CONFIG, 1, S))
    cache = cache.commit(6)
    _, cache = _run(split, wrong[None], cache)  # stale entries at slots 6..9
    cache = cache.commit(4).rollback(6)
    np.testing.assert_array_equal(cache.length, [6])
    logits, _ = _run(split, right[None], cache)
    fresh = _prefill(split, np.concatenate([prompt, right]))
    np.testing.assert_allclose(logits[0], fresh[6:], atol=1e-5)


# A draft tree of 5 nodes: 0 is the root (child of the last prompt token), 1 and 2 its
# children, 3 a child of 1, 4 a child of 2.
PARENTS = [-1, 0, 0, 1, 2]
DEPTHS = np.array([0, 1, 1, 2, 2], np.int32)
PATHS = {3: [0, 1, 3], 4: [0, 2, 4]}


def _tree_mask() -> np.ndarray:
    n = len(PARENTS)
    mask = np.eye(n, dtype=bool)
    for t in range(n):
        p = PARENTS[t]
        while p >= 0:
            mask[t, p] = True
            p = PARENTS[p]
    return mask


def _tree_forward(split, prompts, nodes):
    b = len(prompts)
    _, cache = _run(split, np.stack(prompts), KVCache.create(CONFIG, b, S))
    cache = cache.commit(len(prompts[0]))
    mask = jnp.broadcast_to(jnp.asarray(_tree_mask()), (b, 5, 5))
    positions = cache.length[:, None] + jnp.asarray(DEPTHS)[None]
    logits, cache = _run(split, nodes, cache, positions=positions, attention_mask=mask)
    return logits, cache


def test_tree_mask_equals_chain_per_path(split):
    rng = np.random.default_rng(2)
    prompt, nodes = rng.integers(0, 64, 5), rng.integers(0, 64, 5)
    logits, _ = _tree_forward(split, [prompt], nodes[None])
    for path in PATHS.values():
        chain = _prefill(split, np.concatenate([prompt, nodes[path]]))
        np.testing.assert_allclose(logits[0, path], chain[5:], atol=1e-5)


def test_select_then_decode_equals_prefill_of_path(split):
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, 64, 5) for _ in range(2)]
    nodes = rng.integers(0, 64, (2, 5))
    _, cache = _tree_forward(split, prompts, nodes)
    # Row 0 keeps the whole path to node 4; row 1 keeps only root and node 1.
    offsets = np.array([PATHS[4], [0, 1, 9]], np.int32)  # offsets past count are ignored
    count = np.array([3, 2], np.int32)
    cache = jax.jit(KVCache.select)(cache, offsets, count)
    np.testing.assert_array_equal(cache.length, [8, 7])
    nxt = rng.integers(0, 64, (2, 1))
    logits, _ = _run(split, nxt, cache)
    for b in range(2):
        kept = nodes[b, offsets[b, : count[b]]]
        expected = _prefill(split, np.concatenate([prompts[b], kept, nxt[b]]))[-1]
        np.testing.assert_allclose(logits[b, 0], expected, atol=1e-5)


def test_cache_methods_on_known_buffers():
    cache = KVCache.create(CONFIG, 2, 8)
    assert cache.max_length == 8 and cache.batch_size == 2 and cache.num_layers == 2
    assert cache.keys[0].shape == (2, CONFIG.num_kv_heads, 8, CONFIG.head_dim)
    slot_ids = jnp.broadcast_to(jnp.arange(8.0)[None, None, :, None], cache.keys[0].shape)
    cache = cache.replace(keys=(slot_ids, slot_ids), values=(slot_ids, slot_ids))
    cache = cache.commit(2).commit(jnp.array([0, 1]))
    np.testing.assert_array_equal(cache.length, [2, 3])
    moved = cache.select(jnp.array([[1, 3], [2, 0]]), jnp.array([2, 1]))
    np.testing.assert_array_equal(moved.length, [4, 4])
    np.testing.assert_array_equal(moved.keys[1][0, 0, :, 0], [0, 1, 3, 5, 4, 5, 6, 7])
    np.testing.assert_array_equal(moved.values[0][1, 1, :, 0], [0, 1, 2, 5, 4, 5, 6, 7])
    np.testing.assert_array_equal(cache.rollback(1).length, [1, 1])


@pytest.mark.parametrize(
    "call",
    [
        lambda c: c.commit(jnp.ones(3, jnp.int32)),
        lambda c: c.rollback(jnp.ones(2)),
        lambda c: c.select(jnp.zeros((3, 2), jnp.int32), jnp.zeros(2, jnp.int32)),
    ],
    ids=["commit-shape", "rollback-dtype", "select-batch"],
)
def test_cache_method_errors(call):
    with pytest.raises(ValueError):
        call(KVCache.create(CONFIG, 2, 8))


def test_forward_shape_errors(split):
    cache = KVCache.create(CONFIG, 2, 8)
    with pytest.raises(ValueError, match="cache has B=2"):
        _run(split, np.zeros((3, 1)), cache)
    with pytest.raises(ValueError, match="attention_mask"):
        _run(split, np.zeros((2, 2)), cache, attention_mask=jnp.ones((2, 2, 2), jnp.int32))
    with pytest.raises(ValueError, match="positions"):
        _run(split, np.zeros((2, 2)), cache, positions=jnp.zeros((2, 3), jnp.int32))


@pytest.mark.parametrize("at", [[2], [0, 3]])
def test_put_rows_replaces_those_rows_only(at):
    """``Cache.put_rows``: the pipeline refills a finished slot through it."""
    from jaxcert.decoding.ngram import TokenCache

    rng = np.random.default_rng(0)
    for make in (lambda b: KVCache.create(CONFIG, b, S), lambda b: TokenCache.create(b, S)):
        cache = jax.tree.map(lambda x: jnp.asarray(rng.normal(size=x.shape), x.dtype), make(4))
        rows = jax.tree.map(lambda x: jnp.asarray(rng.normal(size=x.shape), x.dtype), make(len(at)))
        got = cache.put_rows(rows, jnp.asarray(at, jnp.int32))
        for old, new, put in zip(*(jax.tree.leaves(c) for c in (cache, got, rows)), strict=True):
            keep = [b for b in range(4) if b not in at]
            np.testing.assert_array_equal(new[np.asarray(keep)], old[np.asarray(keep)])
            np.testing.assert_array_equal(new[np.asarray(at)], put)
