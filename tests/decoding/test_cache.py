"""After rounds with rejections, both caches hold exactly a fresh prefill of the kept tokens."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxcert import decoding
from jaxcert.base.programs import default_programs
from jaxcert.base.prompts import pad_prompts
from jaxcert.decoding import loop
from jaxcert.decoding.config import Sizes, bucket
from jaxcert.decoding.drafters import ModelDrafter
from jaxcert.decoding.policies import PolicyParams
from jaxcert.decoding.state import Settings
from jaxcert.models import KVCache, forward
from tests.helpers.tiny_decoding import MAX_NEW, PROMPTS, WIDTH


@functools.partial(jax.jit, static_argnames=("graph", "slots"))
def _fresh(params, tokens, *, graph, slots):
    """Cache of a fresh prefill of ``tokens`` ``[1, S]`` (right-padded: compare a prefix)."""
    model = nnx.merge(graph, params)
    return forward(graph, params, tokens, KVCache.create(model.config, 1, slots))[1]


def _check_prefix(cache, row, model, tokens, n, slots):
    graph, params = nnx.split(model)
    padded = jnp.zeros((1, slots), jnp.int32).at[0, :n].set(jnp.asarray(tokens[:n]))
    fresh = _fresh(params, padded, graph=graph, slots=slots)
    for got, want in zip(cache.keys + cache.values, fresh.keys + fresh.values, strict=True):
        np.testing.assert_allclose(got[row, :, :n], want[0, :, :n], atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "verify, kw",
    [
        ("greedy", dict(max_draft=6, buckets=(2, 4, 6))),
        ("tree:2x3", dict(buckets=(6,))),
        ("dyntree:3x3x6", dict(buckets=(6,))),
    ],
    ids=["chain-buckets2-4-6", "tree2x3", "dyntree3x3x6"],
)
def test_no_stale_cache_entries_after_rejections(target, drafters, verify, kw):
    drafter = drafters["unlike"]
    # The configs of the greedy tests: the compiled decoders are shared.
    config = decoding.DecodeConfig(
        verification=decoding.parse_verify(verify), max_new_tokens=MAX_NEW, **kw
    )
    m = config.branching
    (t_graph, t_params), (d_graph, d_params) = nnx.split(target), nnx.split(drafter)
    prompt, lengths = map(jnp.asarray, pad_prompts(PROMPTS, width=WIDTH, minimum=2))
    static = config.shape_only()
    sizes = Sizes.for_prompts(WIDTH, static, bucket(MAX_NEW))
    policy = PolicyParams.from_policy(decoding.Constant(k=3))
    graphdefs = dict(t_graphdef=t_graph, drafter=ModelDrafter(d_graph))
    settings = Settings.create(MAX_NEW, 0.0, 1.0, ())
    args = (t_params, d_params, prompt, lengths, policy, jax.random.key(0), settings)
    pre = default_programs().compile(
        loop.prefill, args, graphdefs | dict(config=static, sizes=sizes)
    )
    run = default_programs().compile(
        loop.run_rounds, (t_params, d_params, pre.out_info, policy), graphdefs | dict(config=static)
    )
    state = pre(*args)
    state, stats = run(t_params, d_params, state, policy)
    assert np.any(stats.active & (stats.accepted < stats.depth))  # rejections happened
    tokens, length, start, done = (
        np.asarray(x) for x in (state.tokens, state.length, state.drafter_start, state.done)
    )
    assert not done.all()
    for b in np.nonzero(~done)[0]:
        assert int(state.target_cache.length[b]) == length[b] - 1
        _check_prefix(state.target_cache, b, target, tokens[b], length[b] - 1, sizes.target)
        for r in range(m):
            _check_prefix(
                state.drafter_cache, b * m + r, drafter, tokens[b], start[b], sizes.drafter
            )
