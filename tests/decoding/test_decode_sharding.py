"""Speculative decoding on a mesh of virtual CPU devices: a batch-sharded (data parallel) and a
tensor-parallel target give target-only greedy tokens and the single-device certificates (the
same accept/pass decisions; certificate values equal up to float rounding).

Multi-device cases run in a subprocess (`multidevice.run`), so an XLA abort fails the test
instead of killing pytest.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from jax.sharding import AxisType

from jaxcert import decoding, models
from tests.helpers.multidevice import run
from tests.helpers.tiny_decoding import MAX_NEW, PROMPTS, WIDTH

_PRELUDE = """
from jaxcert import decoding
from jaxcert.base.programs import default_programs
from jaxcert.decoding import loop
from tests.helpers.tiny_decoding import random_model
from tests.helpers.tiny_models import tiny_config

default_programs().compiler_options["xla_backend_optimization_level"] = 0
CONFIG = tiny_config(vocab_size=64, num_kv_heads=4)
target = random_model(CONFIG, seed=1)
drafter = random_model(CONFIG, seed=7, noise_of=target, scale=0.003)
FIELDS = ("valid", "passes", "accepted", "reached", "cert", "cert_list", "kl")


def decode(t, d, prompts, verify, buckets):
    config = decoding.DecodeConfig(
        verification=decoding.parse_verify(verify), max_new_tokens=12, max_draft=3,
        buckets=buckets,
    )
    return decoding.speculative_decode(
        t, d, prompts, policy=decoding.parse_policy("constant:3"), config=config,
        prompt_width=9,
    )


def compare(prompts, verify, buckets, t_mesh, d_mesh):
    '''Runs one device and the mesh; returns what the test asserts on.'''
    greedy = decoding.target_decode(target, prompts, max_new_tokens=12, prompt_width=9)
    want = decode(target, drafter, prompts, verify, buckets)
    default_programs().clear()
    got = decode(t_mesh, d_mesh, prompts, verify, buckets)
    (state, _), = [c.output_shardings
                   for c in default_programs().of(loop.run_rounds)]
    greedy_mesh = decoding.target_decode(t_mesh, prompts, max_new_tokens=12, prompt_width=9)
    a, b = want.stats.nodes, got.stats.nodes
    return {
        "tokens": [t.tolist() for t in got.tokens],
        "greedy": [t.tolist() for t in greedy.tokens],
        "greedy_mesh": [t.tolist() for t in greedy_mesh.tokens],
        "rounds": [want.rounds.tolist(), got.rounds.tolist()],
        "shapes": [list(a.cert.shape), list(b.cert.shape)],
        "equal": {f: bool(np.array_equal(getattr(a, f), getattr(b, f), equal_nan=True))
                  for f in FIELDS},
        "diff": {f: float(np.nanmax(np.abs(getattr(a, f) - getattr(b, f))))
                 for f in ("cert", "cert_list", "kl")},
        "certified": int(np.sum(np.isfinite(b.cert) & b.valid)),
        "cache": [list(state.target_cache.keys[0].spec), list(state.drafter_cache.keys[0].spec),
                  list(state.tokens.spec)],
    }
"""

_BATCH_SNIPPET = """
mesh = jax.make_mesh((4,), ("data",), axis_types=(AxisType.Auto,), devices=jax.devices()[:4])
placed = models.shard(target, mesh)  # no "model" axis: parameters replicate, rows split
prompts = [[5, 17, 3, 44, 9], [1, 2, 3, 4, 5, 6, 7, 8, 9], [30, 12, 7], [8, 8, 1, 60]]
report = compare(prompts, "greedy", (3,), placed, drafter)  # the drafter is placed for us
report["params"] = spec_of(placed.layers[0].attn.q_proj.get_value())
print(json.dumps(report))
"""

_HEAD_SNIPPET = """
from flax import nnx
mesh = jax.make_mesh((4,), ("data",), axis_types=(AxisType.Auto,), devices=jax.devices()[:4])
placed = models.shard(target, mesh)
head = models.EagleHead.from_target(target, rngs=nnx.Rngs(2), taps=(0, 1))
prompts = [[5, 17, 3, 44, 9], [1, 2, 3, 4, 5, 6, 7, 8, 9], [30, 12, 7], [8, 8, 1, 60]]
drafter = head  # compare() decodes one device with `drafter`, the mesh with the placed head
report = compare(prompts, "tree:2x3", (6,), placed, head)
print(json.dumps(report))
"""

_TENSOR_SNIPPET = """
mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=AUTO)
placed, placed_drafter = models.shard(target, mesh), models.shard(drafter, mesh)
prompts = [[5, 17, 3, 44, 9], [1, 2, 3, 4, 5, 6, 7, 8, 9], [30, 12, 7]]  # padded to 4 rows
report = compare(prompts, "tree:2x3", (6,), placed, placed_drafter)
report["params"] = [spec_of(placed.layers[0].attn.q_proj.get_value()),
                    local_shape(placed.embedding.get_value())]
print(json.dumps(report))
"""


_NGRAM_SNIPPET = """
mesh = jax.make_mesh((4,), ("data",), axis_types=(AxisType.Auto,), devices=jax.devices()[:4])
placed = models.shard(target, mesh)
prompts = [[5, 17, 3, 5, 17], [1, 2, 3, 1, 2, 3, 1, 2, 3], [30, 12, 7], [8, 8, 1, 60]]
costs = decoding.PassCosts(rows=4, target_s={1: 1.0, 2: 1.2, 8: 2.0}, drafter_s=0.0)
out = {}
for name, model in (("one", target), ("mesh", placed)):
    for policy in ("constant:3", "goodput"):
        config = decoding.DecodeConfig(verification="greedy", max_new_tokens=12, max_draft=3)
        got = decoding.speculative_decode(
            model, decoding.NgramDrafter(2), prompts, config=config, prompt_width=9,
            policy=decoding.parse_policy(policy), costs=costs,
        )
        out[name + "/" + policy] = [t.tolist() for t in got.tokens]
        out[name + "/" + policy + "/rounds"] = got.rounds.tolist()
greedy = decoding.target_decode(target, prompts, max_new_tokens=12, prompt_width=9)
out["greedy"] = [t.tolist() for t in greedy.tokens]
print(json.dumps(out))
"""

_HEAD_GOODPUT_SNIPPET = """
from flax import nnx
mesh = jax.make_mesh((4,), ("data",), axis_types=(AxisType.Auto,), devices=jax.devices()[:4])
placed = models.shard(target, mesh)
head = models.EagleHead.from_target(target, rngs=nnx.Rngs(2), taps=(0, 1))
prompts = [[5, 17, 3, 44, 9], [1, 2, 3, 4, 5, 6, 7, 8, 9], [30, 12, 7], [8, 8, 1, 60]]
costs = decoding.PassCosts(rows=4, target_s={1: 1.0, 2: 1.2, 8: 2.0}, drafter_s=0.5)
out = {}
for name, model in (("one", target), ("mesh", placed)):
    config = decoding.DecodeConfig(
        verification="greedy", max_new_tokens=12, max_draft=3, max_skip=2
    )
    got = decoding.speculative_decode(
        model, head, prompts, config=config, prompt_width=9, costs=costs,
        policy=decoding.Goodput(beta=0.01, patience=0),
    )
    out[name] = [t.tolist() for t in got.tokens]
    out[name + "/rounds"] = got.rounds.tolist()
    out[name + "/drafted"] = got.stats.drafted.tolist()
    out[name + "/active"] = got.stats.active.tolist()
    ns = got.stats.nodes
    out[name + "/kl"] = np.where(ns.valid, ns.kl, 0.0).tolist()
greedy = decoding.target_decode(target, prompts, max_new_tokens=12, prompt_width=9)
out["greedy"] = [t.tolist() for t in greedy.tokens]
print(json.dumps(out))
"""


def _check(report):
    assert report["tokens"] == report["greedy"] == report["greedy_mesh"]
    assert all(len(t) == 12 for t in report["tokens"])
    assert report["rounds"][0] == report["rounds"][1]
    assert report["shapes"][0] == report["shapes"][1]
    assert report["certified"] > 0
    for field in ("valid", "passes", "accepted", "reached"):
        assert report["equal"][field], field
    for field, diff in report["diff"].items():
        # Float rounding only: tensor parallel all-reduces sum in another order, and XLA:CPU
        # vectorises a 1-row shard differently from the 4-row batch (observed <= 6e-7).
        assert diff < 1e-5, (field, diff)


@pytest.mark.slow
def test_batch_sharded_target_decodes_like_one_device():
    report = run(_PRELUDE + _BATCH_SNIPPET)
    _check(report)
    assert report["params"] == [None, None]
    target_cache, drafter_cache, tokens = report["cache"]
    assert target_cache[0] == drafter_cache[0] == tokens[0] == "data"


@pytest.mark.slow
def test_batch_sharded_target_with_an_eagle_head_decodes_like_one_device():
    report = run(_PRELUDE + _HEAD_SNIPPET)
    _check(report)
    target_cache, drafter_cache, tokens = report["cache"]
    assert target_cache[0] == drafter_cache[0] == tokens[0] == "data"


@pytest.mark.slow
def test_tensor_parallel_target_decodes_like_one_device():
    report = run(_PRELUDE + _TENSOR_SNIPPET)
    _check(report)
    assert report["params"] == [[None, "model"], [16, 32]]
    target_cache, drafter_cache, _ = report["cache"]
    assert target_cache[:2] == drafter_cache[:2] == ["data", "model"]


def test_mesh_errors_are_clear(target, drafters):
    config = decoding.DecodeConfig(max_new_tokens=4, max_draft=2)
    policy = decoding.Constant(k=2)
    explicit = jax.make_mesh((1,), ("data",), axis_types=(AxisType.Explicit,))
    with pytest.raises(ValueError, match="Auto axes"):
        decoding.speculative_decode(
            target, drafters["similar"], PROMPTS, policy=policy, config=config, mesh=explicit
        )
    with pytest.raises(ValueError, match="Auto axes"):
        decoding.target_decode(target, PROMPTS, max_new_tokens=4, mesh=explicit)
    one = jax.make_mesh((1,), ("data",), axis_types=(AxisType.Auto,))
    other = jax.make_mesh((1,), ("model",), axis_types=(AxisType.Auto,))
    t, d = models.shard(target, one), models.shard(drafters["similar"], other)
    with pytest.raises(ValueError, match="different meshes"):
        decoding.speculative_decode(t, d, PROMPTS, policy=policy, config=config)


def test_one_device_mesh_matches_greedy(target, greedy_reference):
    """In-process: the mesh code path (placement, constraints) on a 1-device mesh."""
    mesh = jax.make_mesh((1, 1), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    out = decoding.target_decode(
        target, PROMPTS, max_new_tokens=MAX_NEW, prompt_width=WIDTH, mesh=mesh
    )
    for got, want in zip(out.tokens, greedy_reference, strict=True):
        np.testing.assert_array_equal(got, want)


@pytest.mark.slow
def test_batch_sharded_target_with_the_ngram_drafter_and_goodput_decodes_like_one_device():
    """The lookup drafter's token cache stays split over the batch (pinned each round) and
    goodput's batch-level choices are the same on the mesh as on one device."""
    report = run(_PRELUDE + _NGRAM_SNIPPET)
    for policy in ("constant:3", "goodput"):
        assert report[f"one/{policy}"] == report[f"mesh/{policy}"] == report["greedy"]
        assert report[f"one/{policy}/rounds"] == report[f"mesh/{policy}/rounds"]


@pytest.mark.slow
def test_batch_sharded_target_with_an_eagle_head_and_goodput_decodes_like_one_device():
    """goodput skips and drafts alike on the mesh and on one device; the skipped steps run
    in the target-only program, which hands the head the target's states sharded like
    its context (split over the batch)."""
    report = run(_PRELUDE + _HEAD_GOODPUT_SNIPPET)
    assert report["one"] == report["mesh"] == report["greedy"]
    assert report["one/rounds"] == report["mesh/rounds"]
    drafted = np.asarray(report["one/drafted"])
    assert drafted.tolist() == report["mesh/drafted"]
    drafted = drafted[np.asarray(report["one/active"])]
    assert np.any(drafted == 0) and np.any(drafted > 0)  # skipped steps and drafting rounds
    np.testing.assert_allclose(report["one/kl"], report["mesh/kl"], atol=1e-5)
