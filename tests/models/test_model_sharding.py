"""Sharded models: parameters, cache and logits on a (2, 4) ("data", "model") mesh of 8 virtual
CPU devices, against the single-device model. Multi-device cases run in a subprocess
(`multidevice.run`), so an XLA abort fails the test instead of killing pytest."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AbstractMesh, AxisType
from jax.sharding import PartitionSpec as P

from jaxcert import models
from jaxcert.models import sharding
from tests.helpers.multidevice import run
from tests.helpers.tiny_models import random_model, tiny_config

MESH = AbstractMesh((2, 4), ("data", "model"))


def _expected(path: str, g_split: bool) -> list:
    """The mesh spec the default rules give a parameter of the tiny models (4 heads)."""
    kv = "model" if g_split else None
    name = path.rsplit(".", 1)[-1] if path.endswith(("_proj", "_bias")) else path
    table = {
        "embedding": ["model", None],
        "lm_head": [None, "model"],
        "q_proj": [None, "model"],
        "k_proj": [None, kv],
        "v_proj": [None, kv],
        "o_proj": ["model", None],
        "q_bias": ["model"],
        "k_bias": [kv],
        "v_bias": [kv],
        "gate_proj": [None, "model"],
        "up_proj": [None, "model"],
        "down_proj": ["model", None],
    }
    return table.get(name, [None])  # norms and o_bias replicate


def test_params_carry_logical_names_and_stay_on_one_device():
    model = random_model(tiny_config(qk_norm=True), seed=0)
    specs = nnx.get_partition_spec(nnx.state(model))
    assert specs["embedding"].get_value() == P("vocab", "embed")
    assert specs["layers"][0]["attn"]["k_proj"].get_value() == P("embed", "kv_heads")
    assert specs["layers"][0]["attn"]["q_norm"]["scale"].get_value() == P("head_dim")
    assert specs["layers"][1]["mlp"]["down_proj"].get_value() == P("mlp", "embed")
    assert specs["lm_head"].get_value() == P("embed", "vocab")
    assert model.layout is None
    assert all(len(x.devices()) == 1 for x in jax.tree.leaves(nnx.state(model)))


@pytest.mark.parametrize(
    "names, shape, units, expected",
    [
        (("batch", None, "vocab"), (4, 3, 64), {}, P("data", None, "model")),
        (("batch", "kv_heads", None, None), (4, 2, 8, 8), {}, P("data", None, None, None)),
        (("batch",), (3,), {}, P(None)),  # 3 rows on 2 data devices: replicated
        (("embed", "kv_heads"), (32, 16), {"kv_heads": 2}, P(None, None)),  # never cut a head
        (("embed", "heads"), (32, 32), {"heads": 4}, P(None, "model")),
        (("vocab", "vocab"), (8, 8), {}, P("model", None)),  # an axis is used once
        (("length", None), (8, 8), {}, P(None, None)),  # no rule: replicated
    ],
)
def test_logical_spec_falls_back_to_replication(names, shape, units, expected):
    assert sharding.logical_spec(names, shape, MESH, units=units) == expected


def test_rules_may_omit_mesh_axes_and_use_several():
    rules = (("batch", ("data", "model")), ("vocab", "expert"))
    assert sharding.logical_spec(("batch", "vocab"), (8, 8), MESH, rules) == P(
        ("data", "model"), None
    )
    assert sharding.axis_size("batch", MESH, rules) == 8
    assert sharding.axis_size("vocab", MESH, rules) == 1


def test_explicit_mesh_and_bad_rules_are_rejected():
    explicit = jax.make_mesh((1,), ("data",), axis_types=(AxisType.Explicit,))
    model = random_model(tiny_config(), seed=0)
    with pytest.raises(ValueError, match="Auto axes"):
        models.shard(model, explicit)
    with pytest.raises(ValueError, match="Auto axes"):
        models.KVCache.create(model.config, 1, 4, mesh=explicit)
    with pytest.raises(ValueError, match="Auto axes"):
        models.load("/nonexistent", mesh=explicit)
    auto = jax.make_mesh((1,), ("data",), axis_types=(AxisType.Auto,))
    with pytest.raises(ValueError, match="each logical axis once"):
        models.shard(model, auto, rules=(("batch", "data"), ("batch", None)))
    with pytest.raises(ValueError, match="mesh must be a jax.sharding.Mesh"):
        models.shard(model, "data")


def test_one_device_mesh_gives_the_same_logits():
    """In-process: a 1-device Auto mesh runs the constrained program; logits unchanged."""
    config = tiny_config()
    model = random_model(config, seed=0)
    mesh = jax.make_mesh((1, 1), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    placed = models.shard(model, mesh)
    assert placed.layout is not None and model.layout is None
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 64, (2, 5)), jnp.int32)
    step = jax.jit(models.forward, static_argnums=0)
    want, _ = step(*nnx.split(model), tokens, models.KVCache.create(config, 2, 8))
    cache = models.KVCache.create(config, 2, 8, mesh=mesh)
    got, cache = step(*nnx.split(placed), tokens, cache)
    np.testing.assert_allclose(got, want, atol=1e-6)
    assert models.truncate(placed, 1).layout == placed.layout


_SHARD_SNIPPET = """
from tests.helpers.tiny_models import random_model, tiny_config

mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=AUTO)
step = jax.jit(models.forward, static_argnums=0)
report = {}
for g, tied in ((4, False), (2, True)):
    config = tiny_config(num_kv_heads=g, tie_embeddings=tied, qk_norm=not tied)
    model = random_model(config, seed=3)
    placed = models.shard(model, mesh)
    flat = nnx.to_flat_state(nnx.state(placed))
    case = {
        "specs": {".".join(map(str, p)): spec_of(v.get_value()) for p, v in flat},
        "local": {".".join(map(str, p)): local_shape(v.get_value()) for p, v in flat},
    }
    tokens = jnp.asarray(np.random.default_rng(g).integers(0, 64, (4, 6)), jnp.int32)
    cache = models.KVCache.create(config, 4, 12)
    cache_on_mesh = models.KVCache.create(config, 4, 12, mesh=mesh)
    case["created_cache"] = [spec_of(cache_on_mesh.keys[0]), spec_of(cache_on_mesh.length)]
    stok = jax.device_put(tokens, NamedSharding(mesh, P("data", None)))
    diffs = []
    for start, width in ((0, 5), (5, 1)):  # prefill, then one step at offset 5
        want, cache = step(*nnx.split(model), tokens[:, start : start + width], cache)
        got, cache_on_mesh = step(*nnx.split(placed), stok[:, start : start + width],
                                  cache_on_mesh)
        diffs.append(float(jnp.max(jnp.abs(got - want))))
        cache = cache.commit(width)
        cache_on_mesh = cache_on_mesh.commit(width)
    case["max_diff"] = max(diffs)
    case["logits"] = [spec_of(got), local_shape(got)]
    case["cache"] = [spec_of(cache_on_mesh.keys[1]), local_shape(cache_on_mesh.keys[1])]
    # An unsharded cache given to a sharded model comes back sharded.
    _, fresh = step(*nnx.split(placed), stok, models.KVCache.create(config, 4, 12))
    case["fresh_cache"] = spec_of(fresh.values[0])
    short = models.truncate(placed, 1)
    case["truncated"] = [short.layout == placed.layout,
                         spec_of(short.layers[0].mlp.up_proj.get_value())]
    report[g] = case
print(json.dumps(report))
"""


@pytest.mark.slow
def test_shard_splits_params_cache_and_logits_like_one_device():
    report = run(_SHARD_SNIPPET)
    e, v, f, d = 32, 64, 64, 8
    for g, case in report.items():
        g_split = g == "4"
        for path, spec in case["specs"].items():
            assert spec == _expected(path, g_split), path
        local = case["local"]
        assert local["embedding"] == [v // 4, e]
        assert local["layers.0.attn.q_proj"] == [e, 4 * d // 4]
        assert local["layers.0.attn.k_proj"] == [e, int(g) * d // (4 if g_split else 1)]
        assert local["layers.1.mlp.down_proj"] == [f // 4, e]
        assert case["max_diff"] < 1e-5
        assert case["logits"] == [["data", None, "model"], [2, 1, v // 4]]
        kv = "model" if g_split else None
        assert case["cache"] == [
            ["data", kv, None, None],
            [2, int(g) // (4 if g_split else 1), 12, d],
        ]
        assert case["created_cache"] == [["data", kv, None, None], ["data"]]
        assert case["fresh_cache"] == ["data", kv, None, None]
        assert case["truncated"] == [True, [None, "model"]]
    assert "lm_head" in report["4"]["specs"] and "lm_head" not in report["2"]["specs"]


_LOAD_SNIPPET = """
import pathlib
import tempfile

from tests.helpers import tiny_models
from jaxcert.models import sharding

# Record every placement: each callback (one per distinct shard) returns only its own slice.
calls, slices = [], []
make = jax.make_array_from_callback


def recording(shape, where, callback, *args, **kw):
    def cb(index):
        out = callback(index)
        slices.append(tuple(out.shape) == where.shard_shape(shape))
        return out

    calls.append(shape)
    return make(shape, where, cb, *args, **kw)


jax.make_array_from_callback = recording
mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=AUTO)
tmp = pathlib.Path(tempfile.mkdtemp())
folder = tmp / "hf"
folder.mkdir()
tensors = tiny_models.numpy_checkpoint("qwen3", folder)
single = models.load_hf(folder)
assert not calls
file = tiny_models.write_gguf(tmp / "m.gguf", single.config, tensors, pre="default")
loaded = {
    "hf": models.load_hf(folder, mesh=mesh),
    "gguf": models.load_gguf(file, cache_dir=tmp / "cache", mesh=mesh),
    "load": models.load(str(folder), mesh=mesh),
}
report = {"placed": len(calls), "sliced": all(slices), "tensors": len(tensors)}
tokens = jnp.asarray(np.random.default_rng(0).integers(0, 128, (2, 7)), jnp.int32)
step = jax.jit(models.forward, static_argnums=0)
config = single.config
want, _ = step(*nnx.split(single.model), tokens, models.KVCache.create(config, 2, 8))
stok = jax.device_put(tokens, NamedSharding(mesh, P("data", None)))
for name, lm in loaded.items():
    m = lm.model
    cache = models.KVCache.create(config, 2, 8, mesh=mesh)
    got, _ = step(*nnx.split(m), stok, cache)
    report[name] = {
        "diff": float(jnp.max(jnp.abs(got - want))),
        "layout": m.layout is not None and m.layout.mesh == mesh,
        "lm_head": [spec_of(m.lm_head.get_value()), local_shape(m.lm_head.get_value())],
        "q": spec_of(m.layers[0].attn.q_proj.get_value()),
        "k": spec_of(m.layers[0].attn.k_proj.get_value()),
        "mlp": local_shape(m.layers[2].mlp.gate_proj.get_value()),
        "logits": spec_of(got),
    }
print(json.dumps(report))
"""


@pytest.mark.slow
def test_loaders_put_each_tensor_directly_on_its_shards():
    """HF folder and GGUF file (qwen3: untied, q/k norms, 2 KV heads) loaded onto the mesh."""
    report = run(_LOAD_SNIPPET)
    # Every tensor of the three loads was placed by callbacks that each returned one shard.
    assert report["placed"] == 3 * report["tensors"] and report["sliced"]
    for name in ("hf", "gguf", "load"):
        case = report[name]
        assert case["diff"] < 1e-5, name
        assert case["layout"]
        assert case["lm_head"] == [[None, "model"], [48, 128 // 4]]
        assert case["q"] == [None, "model"]
        assert case["k"] == [None, None]  # 2 KV heads on a 4-way model axis: replicated
        assert case["mlp"] == [48, 96 // 4]
        assert case["logits"] == ["data", None, "model"]
