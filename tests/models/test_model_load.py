"""load() dispatch and load_hf error handling (sharded, bfloat16, bad tensors)."""

import copy
import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy
import tiny_models
from flax import nnx

from jaxcert import assets, models
from jaxcert.models import KVCache, forward, load, load_hf

STEP = jax.jit(forward, static_argnums=0)
TOKENS = np.random.default_rng(0).integers(0, 64, (1, 7)).astype(np.int32)


def _logits(model):
    graphdef, state = nnx.split(model)
    return STEP(graphdef, state, jnp.asarray(TOKENS), KVCache.create(model.config, 1, 8))[0]


def test_public_surface():
    assert sorted(models.__all__) == sorted(
        [
            "KVCache",
            "LOGICAL_RULES",
            "Layout",
            "LoadedModel",
            "ModelConfig",
            "Transformer",
            "check_context_length",
            "check_same_vocabulary",
            "config_of",
            "decode_step",
            "forward",
            "load",
            "load_gguf",
            "load_hf",
            "shard",
            "truncate",
        ]
    )


def test_sharded_bfloat16_checkpoint(hf_case, tmp_path):
    import torch

    _, torch_model, lm = hf_case("qwen3")
    copy.deepcopy(torch_model).to(torch.bfloat16).save_pretrained(tmp_path, max_shard_size="20KB")
    tiny_models.hf_tokenizer().save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors.index.json").is_file()
    loaded = load_hf(tmp_path)
    assert loaded.model.embedding[...].dtype == jnp.float32
    np.testing.assert_allclose(_logits(loaded.model), _logits(lm.model), atol=0.1)
    low = load_hf(tmp_path, dtype=jnp.bfloat16)
    assert low.model.embedding[...].dtype == jnp.bfloat16
    assert _logits(low.model).dtype == jnp.float32


def _broken_copy(src, dst, edit):
    shutil.copytree(src, dst)
    tensors = safetensors.numpy.load_file(dst / "model.safetensors")
    edit(tensors)
    safetensors.numpy.save_file(tensors, dst / "model.safetensors")
    return dst


@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda t: t.pop("model.layers.1.mlp.up_proj.weight"), "missing.*layers.1.mlp.up_proj"),
        (lambda t: t.update(extra=np.zeros(3, np.float32)), "unexpected.*extra"),
        (
            lambda t: t.update({"model.norm.weight": np.ones(5, np.float32)}),
            "'model.norm.weight' has shape \\(5,\\)",
        ),
    ],
    ids=["missing", "unexpected", "shape"],
)
def test_bad_tensors_are_named(np_case, tmp_path, edit, match):
    path, _, _ = np_case("llama")
    with pytest.raises(ValueError, match=match):
        load_hf(_broken_copy(path, tmp_path / "ckpt", edit))


def test_unsupported_config_is_named(np_case, tmp_path):
    path, _, _ = np_case("llama")
    shutil.copytree(path, tmp_path / "ckpt")
    config = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    config["hidden_act"] = "gelu"
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="hidden_act"):
        load_hf(tmp_path / "ckpt")


@pytest.mark.parametrize(
    "damage, match",
    [
        (lambda d: (d / "config.json").unlink(), "no config.json"),
        (lambda d: (d / "config.json").write_text("{bad json"), "config.json: cannot be read"),
        (
            lambda d: [
                (d / f).unlink()
                for f in ("tokenizer.json", "tokenizer_config.json")
                if (d / f).exists()
            ],
            "no tokenizer files",
        ),  # fmt: skip
        (
            lambda d: (d / "model.safetensors").write_bytes(
                (d / "model.safetensors").read_bytes()[:2000]
            ),
            "model.safetensors: not a readable safetensors file",
        ),
    ],
    ids=["no-config", "corrupt-config", "no-tokenizer", "truncated-weights"],
)
def test_damaged_folder_is_named(np_case, tmp_path, damage, match):
    path, _, _ = np_case("llama")
    shutil.copytree(path, tmp_path / "ckpt")
    damage(tmp_path / "ckpt")
    with pytest.raises(ValueError, match=match):
        load_hf(tmp_path / "ckpt")


def test_load_dispatch(np_case, tmp_path, monkeypatch):
    path, lm, _ = np_case("qwen2")
    assert load(path).config == lm.config
    gguf_file = tiny_models.write_gguf(
        tmp_path / "tiny.gguf", lm.config, safetensors.numpy.load_file(path / "model.safetensors")
    )
    monkeypatch.setenv("JAXCERT_CACHE", str(tmp_path / "cache"))
    assert load(gguf_file).config.architecture == "qwen2"

    fetched = []

    def fetch(name):
        fetched.append(name)
        if name != "tiny-asset":
            raise assets.AssetError(f"unknown asset {name!r}")
        return gguf_file

    monkeypatch.setattr(assets, "fetch", fetch)
    tiny = assets.Asset("tiny-asset", "a tiny model", (), "tiny.gguf", "0" * 64, 1)
    monkeypatch.setitem(assets.ASSETS, "tiny-asset", tiny)
    np.testing.assert_allclose(_logits(load("tiny-asset").model), _logits(lm.model), atol=1e-5)
    with pytest.raises(ValueError, match="cannot load 'no-such-model': no folder or .gguf file"):
        load("no-such-model")
    with pytest.raises(ValueError, match="'mtbench' is a prompt set, not a model"):
        load("mtbench")
    assert fetched == ["tiny-asset"]  # names that are no model asset are not fetched
