"""load() dispatch and load_hf error handling (sharded, bfloat16, bad tensors)."""

import copy
import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy
from flax import nnx

from jaxcert import models
from jaxcert.base import assets
from jaxcert.models import KVCache, forward, load, load_hf
from tests.helpers import tiny_models

STEP = jax.jit(forward, static_argnums=0)
TOKENS = np.random.default_rng(0).integers(0, 64, (1, 7)).astype(np.int32)


def _logits(model):
    graphdef, state = nnx.split(model)
    return STEP(graphdef, state, jnp.asarray(TOKENS), KVCache.create(model.config, 1, 8))[0]


def test_public_surface():
    assert sorted(models.__all__) == sorted(
        [
            "EagleHead",
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
            "model_path",
            "read_config",
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


def _no_weights(monkeypatch):
    """Makes reading, dequantising or building any weights (or a full GGUF parse) an error."""
    from jaxcert.models import gguf as gguf_loader
    from jaxcert.models import hf as hf_loader

    def boom(*args, **kwargs):
        raise AssertionError("weights were read")

    for module, name in (
        (gguf_loader, "write_dequantized"),
        (gguf_loader, "_dequantize"),
        (gguf_loader, "model_from_tensors"),
        (gguf_loader, "read_gguf"),
        (hf_loader, "model_from_tensors"),
        (hf_loader, "SafetensorsFolder"),
    ):
        monkeypatch.setattr(module, name, boom)


def test_read_config_reads_no_weights(np_case, tmp_path, monkeypatch):
    path, lm, tensors = np_case("qwen2")
    gguf_file = tiny_models.write_gguf(tmp_path / "tiny.gguf", lm.config, tensors)
    monkeypatch.setenv("JAXCERT_CACHE", str(tmp_path / "cache"))
    loaded = load(gguf_file).config  # writes the dequantised cache
    monkeypatch.setenv("JAXCERT_CACHE", str(tmp_path / "empty-cache"))
    with monkeypatch.context() as m:
        _no_weights(m)
        assert models.read_config(path) == lm.config
        assert models.read_config(gguf_file) == loaded  # from the GGUF header alone
        assert models.read_config(gguf_file).vocab_size == lm.config.vocab_size == 96
    assert not (tmp_path / "empty-cache").exists()
    monkeypatch.setenv("JAXCERT_CACHE", str(tmp_path / "cache"))
    with monkeypatch.context() as m:
        _no_weights(m)
        assert models.read_config(gguf_file) == loaded  # with a dequantised cache too
    with pytest.raises(ValueError, match="'mtbench' is a prompt set, not a model"):
        models.read_config("mtbench")
    with pytest.raises(ValueError, match="cannot load 'no-such-model': no folder or .gguf file"):
        models.read_config("no-such-model")


def test_read_gguf_header_skips_array_elements(np_case, tmp_path):
    from jaxcert.models import gguf as gguf_loader

    _, lm, tensors = np_case("qwen2")
    gguf_file = tiny_models.write_gguf(tmp_path / "tiny.gguf", lm.config, tensors)
    metadata, names = gguf_loader.read_gguf_header(gguf_file)
    full, reference = gguf_loader.read_gguf(gguf_file)
    assert names == [t.name for t in full.tensors]
    tokens = metadata["tokenizer.ggml.tokens"]
    assert len(tokens) == len(reference["tokenizer.ggml.tokens"]) == lm.config.vocab_size == 96
    scalars = {k: v for k, v in reference.items() if not isinstance(v, list)}
    assert {k: metadata[k] for k in scalars} == scalars
    with pytest.raises(ValueError, match="not a readable GGUF file"):
        (tmp_path / "bad.gguf").write_bytes(b"GGUF\x03\x00\x00\x00" + b"\xff" * 9)
        gguf_loader.read_gguf_header(tmp_path / "bad.gguf")
