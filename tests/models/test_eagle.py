"""EagleHead: shapes, cache equivalences (causal, tree), reduced vocabulary, init, save/load."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxcert.models import EagleHead, KVCache, forward
from jaxcert.models.eagle import (
    OOV_INIT_MASS,
    TRAINABLE,
    draft_vocab_from_counts,
    load_head,
    save_head,
    target_features,
)
from tests.helpers import tiny_models

CONFIG = tiny_models.tiny_config(num_layers=3)
V, E = CONFIG.vocab_size, CONFIG.hidden_size
S = 16
STEP = jax.jit(forward, static_argnums=0)
IDS = np.array([1, 3, 4, 9, 10, 17, 30, 31, 40, 63], np.int32)


def _randomise(head: EagleHead, seed: int) -> EagleHead:
    """O(1) random parameters (so masks, positions and context matter)."""
    graphdef, state = nnx.split(head)
    params = nnx.state(head, nnx.Param)
    leaves, treedef = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    new = [0.2 * jax.random.normal(k, x.shape, x.dtype) for k, x in zip(keys, leaves, strict=True)]
    nnx.update(state, jax.tree.unflatten(treedef, new))
    return nnx.merge(graphdef, state)


def _head(seed=0, **kw) -> EagleHead:
    return _randomise(EagleHead(CONFIG, rngs=nnx.Rngs(seed), **kw), seed + 1)


@pytest.fixture(scope="module", params=["eagle1", "eagle3-draft-vocab"])
def split(request):
    kw = {} if request.param == "eagle1" else dict(taps=(0, 2), draft_vocab=IDS, num_layers=2)
    return nnx.split(_head(3, **kw))


def _run(split, tokens, context, cache, **kw):
    graphdef, state = split
    return STEP(graphdef, state, jnp.asarray(tokens, jnp.int32), cache, context=context, **kw)


def _cache(split, b):
    return nnx.merge(*split).init_cache(b, S)


def _contexts(rng, *shape):
    return jnp.asarray(rng.standard_normal((*shape, E)), jnp.float32)


def test_shapes_and_attributes():
    head = EagleHead(CONFIG, rngs=nnx.Rngs(0), num_layers=2, taps=(0, 2), draft_vocab=IDS)
    assert head.config.num_layers == 2 and head.config.vocab_size == V
    assert head.taps == (0, 2) and head.draft_size == IDS.size
    cache = head.init_cache(3, S)
    assert cache.num_layers == 2 and cache.batch_size == 3
    tapped = jnp.ones((3, 5, 2 * E))
    context = head.fuse(tapped)
    assert context.shape == (3, 5, E)
    logits, new_cache, hidden = head(
        jnp.zeros((3, 5), jnp.int32), cache, context=context, return_hidden=True
    )
    assert logits.shape == (3, 5, V) and logits.dtype == jnp.float32
    assert hidden.shape == (3, 5, E)
    np.testing.assert_array_equal(new_cache.length, [0, 0, 0])
    assert EagleHead(CONFIG, rngs=nnx.Rngs(0)).taps == ()


def test_fuse_without_taps_is_the_identity_and_checks_width():
    head = EagleHead(CONFIG, rngs=nnx.Rngs(0))
    x = jnp.arange(2 * 3 * E, dtype=jnp.float32).reshape(2, 3, E)
    np.testing.assert_array_equal(head.fuse(x), x)
    with pytest.raises(ValueError, match=r"target_states must be \[B, T, 64\]"):
        EagleHead(CONFIG, rngs=nnx.Rngs(0), taps=(0, 1)).fuse(x)


def test_fuse_reads_tapped_features_of_the_target():
    target = tiny_models.random_model(CONFIG, seed=1)
    head = EagleHead.from_target(target, taps=(0, 1, 2))
    tokens = jnp.asarray([[5, 6, 7]], jnp.int32)
    _, _, tapped = target.tapped_features(tokens, target.init_cache(1, S), head.taps)
    assert head.fuse(tapped).shape == (1, 3, E)


@pytest.mark.parametrize("taps", [(), (0, 2)])
def test_target_features_are_what_the_head_reads(taps):
    """EAGLE-1 reads the final-norm hidden states, EAGLE-3 the tapped blocks' outputs, and
    the pass's hidden states and cache are the target's own."""
    target = tiny_models.random_model(CONFIG, seed=1)
    tokens = jnp.asarray([[5, 6, 7, 8]], jnp.int32)
    hidden, cache, states = target_features(target, tokens, target.init_cache(1, S), taps)
    want_hidden, want_cache = target.features(tokens, target.init_cache(1, S))
    np.testing.assert_array_equal(hidden, want_hidden)
    np.testing.assert_array_equal(cache.keys[1], want_cache.keys[1])
    if taps:
        _, _, tapped = target.tapped_features(tokens, target.init_cache(1, S), taps)
        np.testing.assert_array_equal(states, tapped)
        assert states.shape == (1, 4, 2 * E)
    else:
        np.testing.assert_array_equal(states, hidden)
    head = EagleHead.from_target(target, taps=taps)
    assert head.fuse(states).shape == (1, 4, E)


def test_all_at_once_equals_one_token_steps(split):
    rng = np.random.default_rng(0)
    tokens, context = rng.integers(0, V, (2, 6)), _contexts(rng, 2, 6)
    full, _ = _run(split, tokens, context, _cache(split, 2))
    cache = _cache(split, 2)
    for t in range(6):
        step, cache = _run(split, tokens[:, t : t + 1], context[:, t : t + 1], cache)
        cache = cache.commit(1)
        np.testing.assert_allclose(step[:, 0], full[:, t], atol=1e-5, rtol=1e-5)


def test_context_changes_the_logits(split):
    rng = np.random.default_rng(1)
    tokens, context = rng.integers(0, V, (1, 3)), _contexts(rng, 1, 3)
    a, _ = _run(split, tokens, context, _cache(split, 1))
    b, _ = _run(split, tokens, context.at[:, 1].add(1.0), _cache(split, 1))
    np.testing.assert_allclose(a[:, 0], b[:, 0], atol=1e-6)  # position 0 cannot see it
    assert np.abs(np.asarray(a[:, 1:] - b[:, 1:])).max() > 1e-3


# The draft tree of test_model_cache: 0 the root, 1 and 2 its children, 3 under 1, 4 under 2.
PARENTS = [-1, 0, 0, 1, 2]
DEPTHS = np.array([0, 1, 1, 2, 2], np.int32)
PATHS = {3: [0, 1, 3], 4: [0, 2, 4]}


def _tree_mask() -> np.ndarray:
    mask = np.eye(len(PARENTS), dtype=bool)
    for t, p in enumerate(PARENTS):
        while p >= 0:
            mask[t, p] = True
            p = PARENTS[p]
    return mask


def test_tree_mask_equals_chain_per_path(split):
    rng = np.random.default_rng(2)
    prompt, nodes = rng.integers(0, V, (1, 4)), rng.integers(0, V, (1, 5))
    ctx_prompt, ctx_nodes = _contexts(rng, 1, 4), _contexts(rng, 1, 5)
    _, cache = _run(split, prompt, ctx_prompt, _cache(split, 1))
    cache = cache.commit(4)
    mask = jnp.asarray(_tree_mask())[None]
    positions = cache.length[:, None] + jnp.asarray(DEPTHS)[None]
    tree, _ = _run(split, nodes, ctx_nodes, cache, positions=positions, attention_mask=mask)
    for path in PATHS.values():
        tokens = np.concatenate([prompt, nodes[:, path]], axis=1)
        context = jnp.concatenate([ctx_prompt, ctx_nodes[:, path]], axis=1)
        chain, _ = _run(split, tokens, context, _cache(split, 1))
        np.testing.assert_allclose(tree[0, path], chain[0, 4:], atol=1e-5, rtol=1e-5)


def test_reduced_vocabulary_gives_a_proper_full_distribution():
    head = _head(4, draft_vocab=IDS[::-1])  # stored sorted
    np.testing.assert_array_equal(head.draft_vocab[...], IDS)
    b0 = float(EagleHead(CONFIG, rngs=nnx.Rngs(0), draft_vocab=IDS).oov_logit[...])
    np.testing.assert_allclose(b0, np.log(OOV_INIT_MASS / (V - IDS.size)), rtol=1e-6)
    hidden = jax.random.normal(jax.random.key(0), (2, 3, E))
    logits = head.project(hidden)
    assert logits.shape == (2, 3, V) and logits.dtype == jnp.float32
    outside = np.setdiff1d(np.arange(V), IDS)
    np.testing.assert_array_equal(logits[..., outside], float(head.oov_logit[...]))
    small = jnp.einsum("...E,EV->...V", hidden, head.lm_head[...])
    np.testing.assert_allclose(logits[..., IDS], small, atol=1e-5, rtol=1e-5)
    log_q = jax.nn.log_softmax(logits, axis=-1)
    np.testing.assert_allclose(jnp.exp(log_q).sum(-1), 1.0, atol=1e-5)
    p = jax.nn.softmax(jax.random.normal(jax.random.key(1), (2, 3, V)) * 3, axis=-1)
    kl = (p * (jnp.log(p) - log_q)).sum(-1)
    assert np.isfinite(kl).all() and (kl >= 0).all()


def test_gradient_of_kl_in_the_oov_logit_is_q_out_minus_p_out():
    head = _head(5, draft_vocab=IDS)
    hidden = jax.random.normal(jax.random.key(0), (4, E))
    p = jax.nn.softmax(jax.random.normal(jax.random.key(1), (4, V)), axis=-1)
    outside = np.setdiff1d(np.arange(V), IDS)

    def kl(h):
        log_q = jax.nn.log_softmax(h.project(hidden), axis=-1)
        return (p * (jnp.log(p) - log_q)).sum(-1).sum()

    wrt = nnx.DiffState(0, nnx.PathContains("oov_logit"))
    grad = nnx.grad(kl, argnums=wrt)(head)["oov_logit"][...]
    q = jax.nn.softmax(head.project(hidden), axis=-1)
    want = (q[:, outside].sum(-1) - p[:, outside].sum(-1)).sum()
    np.testing.assert_allclose(grad, want, atol=1e-5, rtol=1e-4)


def test_full_vocabulary_has_no_oov_logit():
    head = EagleHead(CONFIG, rngs=nnx.Rngs(0))
    assert head.draft_vocab is None and head.oov_logit is None and head.draft_size == V
    assert head.project(jnp.ones((2, E))).shape == (2, V)


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_from_target_copies_embedding_norm_and_lm_head_rows(tie):
    target = tiny_models.random_model(tiny_models.tiny_config(tie_embeddings=tie), seed=2)
    head = EagleHead.from_target(target, draft_vocab=IDS)
    assert head.embedding[...] is target.embedding[...]  # shared, not copied
    np.testing.assert_array_equal(head.norm.scale[...], target.norm.scale[...])
    hidden = jax.random.normal(jax.random.key(0), (3, E))
    np.testing.assert_allclose(
        head.project(hidden)[:, IDS], target.project(hidden)[:, IDS], atol=1e-5, rtol=1e-5
    )
    full = EagleHead.from_target(target)
    np.testing.assert_allclose(full.project(hidden), target.project(hidden), atol=1e-5, rtol=1e-5)


def test_trainable_filter_leaves_out_embedding_and_lm_head():
    head = EagleHead(CONFIG, rngs=nnx.Rngs(0), taps=(0, 1), draft_vocab=IDS)
    names = {".".join(map(str, p)) for p, _ in nnx.to_flat_state(nnx.state(head, TRAINABLE))}
    assert "embedding" not in names and "lm_head" not in names and "draft_vocab" not in names
    assert {"fc", "fuse_fc", "oov_logit", "embed_norm.scale", "norm.scale"} <= names
    assert any(n.startswith("layers.0.attn.") for n in names)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_save_load_round_trip(tmp_path, dtype):
    kw = dict(taps=(0, 2), draft_vocab=IDS, num_layers=2)
    head = _head(6, param_dtype=jnp.dtype(dtype), dtype=jnp.dtype(dtype), **kw)
    save_head(head, tmp_path / "h")
    back = load_head(tmp_path / "h")
    assert (back.config, back.taps, back.draft_size) == (head.config, head.taps, head.draft_size)
    assert back.dtype == head.dtype
    for a, b in zip(*(jax.tree.leaves(nnx.state(h)) for h in (head, back)), strict=True):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    tokens, context = jnp.asarray([[1, 2, 3]]), jnp.ones((1, 3, E), head.dtype)
    want, _ = head(tokens, head.init_cache(1, S), context=context)
    got, _ = back(tokens, back.init_cache(1, S), context=context)
    np.testing.assert_array_equal(got, want)


def test_load_rejects_another_format(tmp_path):
    save_head(EagleHead(CONFIG, rngs=nnx.Rngs(0)), tmp_path)
    meta = (tmp_path / "head.json").read_text().replace('"version": 1', '"version": 99')
    (tmp_path / "head.json").write_text(meta)
    with pytest.raises(ValueError, match="version 99"):
        load_head(tmp_path)
    with pytest.raises(ValueError, match="lacks head.json"):
        load_head(tmp_path / "missing")


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (lambda m: m.pop("target_config"), "lacks target_config"),
        (lambda m: (m.pop("taps"), m.pop("dtype")), "lacks taps, dtype"),
        (lambda m: m["target_config"].pop("eos_token_ids"), "not a model configuration"),
        (lambda m: m["target_config"].update(colour=1), "not a model configuration"),
        (lambda m: m.update(target_config=[1]), "not a model configuration"),
    ],
)
def test_an_incomplete_head_json_is_a_value_error_naming_it(tmp_path, edit, match):
    from jaxcert.models.eagle import read_head_config

    save_head(EagleHead(CONFIG, rngs=nnx.Rngs(0)), tmp_path)
    meta = json.loads((tmp_path / "head.json").read_text())
    assert read_head_config(tmp_path) == CONFIG
    load_head(tmp_path)  # the file as written loads
    edit(meta)
    (tmp_path / "head.json").write_text(json.dumps(meta))
    for read in (read_head_config, load_head):
        with pytest.raises(ValueError, match=f"head.json: .*{match}"):
            read(tmp_path)


BAD = {
    "tap-high": (dict(taps=(0, 3)), r"taps must be target block indices in \[0, 3\), got \(0, 3\)"),
    "tap-negative": (dict(taps=(-1,)), r"taps must be target block indices"),
    "tap-dup": (dict(taps=(1, 1)), r"taps must be distinct"),
    "layers": (dict(num_layers=0), r"num_layers must be a positive int"),
    "id-high": (dict(draft_vocab=np.array([0, 5, 64])), r"out of range \[0, 64\): \[64\]"),
    "id-low": (dict(draft_vocab=np.array([-2, 5])), r"out of range \[0, 64\): \[-2\]"),
    "id-dup": (dict(draft_vocab=np.array([7, 2, 7, 2, 3])), r"duplicated ids: \[2, 7\]"),
    "id-float": (dict(draft_vocab=np.array([1.0, 2.0])), r"integer array"),
    "id-empty": (dict(draft_vocab=np.zeros((0,), np.int32)), r"non-empty"),
}


@pytest.mark.parametrize(("kw", "match"), BAD.values(), ids=BAD.keys())
def test_bad_arguments_are_named(kw, match):
    with pytest.raises(ValueError, match=match):
        EagleHead(CONFIG, rngs=nnx.Rngs(0), **kw)


def test_call_checks_its_inputs():
    head = EagleHead(CONFIG, rngs=nnx.Rngs(0))
    cache, tokens = head.init_cache(2, 8), jnp.zeros((2, 3), jnp.int32)
    with pytest.raises(ValueError, match=r"context must be float \[B, T, E\]"):
        head(tokens, cache, context=jnp.zeros((2, 2, E)))
    with pytest.raises(ValueError, match="cache has B=2, L=3; expected B=2, L=1"):
        head(tokens, KVCache.create(CONFIG, 2, 8), context=jnp.zeros((2, 3, E)))  # the target's
    with pytest.raises(ValueError, match="attention_mask"):
        head(tokens, cache, context=jnp.zeros((2, 3, E)), attention_mask=jnp.ones((2, 3, 3)))


def test_draft_vocab_from_counts():
    counts = np.array([5, 0, 9, 9, 1, 7])
    np.testing.assert_array_equal(draft_vocab_from_counts(counts, 3), [2, 3, 5])
    np.testing.assert_array_equal(draft_vocab_from_counts(counts, 4), [0, 2, 3, 5])
    assert draft_vocab_from_counts(counts, 4).dtype == np.int32
    with pytest.raises(ValueError, match=r"size must be in \[1, 6\]"):
        draft_vocab_from_counts(counts, 7)
    with pytest.raises(ValueError, match="counts must be"):
        draft_vocab_from_counts(counts[None], 2)
