"""GGUF loading: tiny files written with gguf.GGUFWriter from the same weights as a checkpoint."""

import os
import subprocess
import sys

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxcert.models.gguf as gguf_module
from jaxcert.models import KVCache, forward, load_gguf
from jaxcert.models._weights import model_from_tensors
from tests.helpers import tiny_models

Q = gguf.GGMLQuantizationType
STEP = jax.jit(forward, static_argnums=0)
TOKENS = np.random.default_rng(0).integers(0, 64, (2, 10)).astype(np.int32)


def _logits(model):
    graphdef, state = nnx.split(model)
    cache = KVCache.create(model.config, *TOKENS.shape)
    return STEP(graphdef, state, jnp.asarray(TOKENS), cache)[0]


@pytest.fixture
def written(np_case, tmp_path):
    """`written(name, qtype) -> (gguf path, LoadedModel from load_hf, HF tensors)`."""

    def write(name, qtype=None):
        _, lm, tensors = np_case(name)
        pre = "qwen2" if name == "qwen2" else "default"
        file = tmp_path / f"{name}-{qtype.name if qtype else 'F32'}.gguf"
        tiny_models.write_gguf(file, lm.config, tensors, qtype=qtype, pre=pre)
        return file, lm, tensors

    return write


@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_f32_gguf_matches_hf(written, tmp_path, name):
    file, lm, _ = written(name)
    loaded = load_gguf(file, cache_dir=tmp_path / "cache")
    expected_layout = "interleaved" if name == "llama" else "half"
    assert loaded.config.rope_layout == expected_layout
    assert loaded.config.tie_embeddings == lm.config.tie_embeddings
    assert loaded.config.qkv_bias == lm.config.qkv_bias
    np.testing.assert_allclose(_logits(loaded.model), _logits(lm.model), atol=1e-5)


@pytest.mark.parametrize(
    "name, qtype",
    [("llama", Q.Q8_0), ("qwen2", Q.Q4_1), ("qwen2", Q.F16), ("qwen2", Q.BF16)],
    ids=["llama-Q8_0", "qwen2-Q4_1", "qwen2-F16", "qwen2-BF16"],
)
def test_quantised_gguf_matches_dequantised_weights(written, tmp_path, name, qtype):
    file, lm, tensors = written(name, qtype)
    loaded = load_gguf(file, cache_dir=tmp_path / "cache")
    # The same weights after a quantise/dequantise round trip, back in the HF layout.
    expected = {}
    for hf, w in tensors.items():
        w = tiny_models.roundtrip(tiny_models.gguf_tensors({hf: w}, lm.config).popitem()[1], qtype)
        if name == "llama" and ".q_proj." in hf:
            w = tiny_models.llama_cpp_unpermute(w, lm.config.num_heads)
        elif name == "llama" and ".k_proj." in hf:
            w = tiny_models.llama_cpp_unpermute(w, lm.config.num_kv_heads)
        expected[hf] = w
    reference = model_from_tensors(lm.config, expected)
    np.testing.assert_allclose(_logits(loaded.model), _logits(reference), atol=1e-5)
    # ... and close to the unquantised model (4-bit weights of O(1) random models: loosely).
    got, exact = np.ravel(_logits(loaded.model)), np.ravel(_logits(lm.model))
    assert (
        np.corrcoef(got, exact)[0, 1]
        > {Q.Q8_0: 0.999, Q.F16: 0.99999, Q.BF16: 0.9999, Q.Q4_1: 0.9}[qtype]
    )


def test_tokenizer_from_metadata(written, tmp_path):
    file, lm, _ = written("qwen2")
    tok = load_gguf(file, cache_dir=tmp_path / "cache").tokenizer
    for text in tiny_models.TEXTS:
        assert tok.encode(text) == lm.tokenizer.encode(text)
        assert tok.decode(tok.encode(text)) == text
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    chat = [{"role": "user", "content": "the otter"}]
    ours = tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    assert ours == lm.tokenizer.apply_chat_template(
        chat, add_generation_prompt=True, tokenize=False
    )


def test_dequant_cache_is_reused(written, tmp_path, monkeypatch):
    file, _, _ = written("llama", Q.Q8_0)
    cache_dir = tmp_path / "cache"
    first = _logits(load_gguf(file, cache_dir=cache_dir).model)
    cached = sorted((cache_dir / "dequant").iterdir())
    assert len(cached) == 1 and cached[0].suffix == ".safetensors"  # no temp files left

    def fail(*args):
        raise AssertionError("dequantised again")

    monkeypatch.setattr(gguf_module, "_dequantize", fail)
    monkeypatch.setattr(gguf_module, "read_gguf", fail)  # metadata comes from the cache too
    np.testing.assert_array_equal(_logits(load_gguf(file, cache_dir=cache_dir).model), first)
    os.utime(file, ns=(0, 0))  # a changed file gets a new cache entry
    monkeypatch.undo()
    monkeypatch.setattr(gguf_module, "_dequantize", fail)
    with pytest.raises(AssertionError, match="dequantised again"):
        load_gguf(file, cache_dir=cache_dir)
    assert sorted((cache_dir / "dequant").iterdir()) == cached  # failed write left nothing


def test_damaged_cache_file_is_rebuilt(written, tmp_path):
    file, _, _ = written("qwen2")
    first = _logits(load_gguf(file, cache_dir=tmp_path / "cache").model)
    (cached,) = (tmp_path / "cache" / "dequant").iterdir()
    cached.write_bytes(b"not safetensors")
    with pytest.warns(UserWarning, match="Rebuilding"):
        again = load_gguf(file, cache_dir=tmp_path / "cache")
    np.testing.assert_array_equal(_logits(again.model), first)


def test_cache_dir_from_environment(written, tmp_path, monkeypatch):
    file, _, _ = written("qwen2")
    monkeypatch.setenv("JAXCERT_CACHE", str(tmp_path / "env-cache"))
    load_gguf(file)
    assert len(list((tmp_path / "env-cache" / "dequant").glob("qwen2-F32-float32-*"))) == 1


@pytest.mark.parametrize("damage", ["truncated", "garbage"])
def test_corrupt_file_raises_naming_it(written, tmp_path, damage):
    file, _, _ = written("qwen2")
    data = file.read_bytes()
    bad = tmp_path / f"{damage}.gguf"
    bad.write_bytes(data[: len(data) // 2] if damage == "truncated" else b"GGUF" + bytes(100))
    with pytest.raises(ValueError, match=f"{damage}.gguf"):
        load_gguf(bad, cache_dir=tmp_path / "cache")


def test_unsupported_architecture_and_tensor(np_case, tmp_path):
    _, lm, tensors = np_case("qwen2")
    writer = gguf.GGUFWriter(str(tmp_path / "gemma.gguf"), "gemma")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="'gemma'"):
        load_gguf(tmp_path / "gemma.gguf", cache_dir=tmp_path / "cache")
    extra = {
        **tensors,
        "model.layers.0.self_attn.q_proj.weight": tensors["model.layers.0.self_attn.q_proj.weight"],
    }
    del extra["model.norm.weight"]
    file = tiny_models.write_gguf(tmp_path / "missing.gguf", lm.config, extra)
    with pytest.raises(ValueError, match="model.norm.weight"):
        load_gguf(file, cache_dir=tmp_path / "cache")
    with pytest.raises(ValueError, match="rope_freqs.weight"):
        gguf_module.hf_name("rope_freqs.weight")


def test_unsupported_tensor_type_is_named(written, tmp_path, monkeypatch):
    file, _, _ = written("qwen2", Q.Q8_0)

    def dequantize(data, qtype):
        raise NotImplementedError(f"Dequantization for {qtype.name} is not yet implemented")

    monkeypatch.setattr(gguf.quants, "dequantize", dequantize)
    with pytest.raises(ValueError, match="tensor 'token_embd.weight' has unsupported type Q8_0"):
        load_gguf(file, cache_dir=tmp_path / "cache")
    assert not list((tmp_path / "cache" / "dequant").iterdir())


def test_load_gguf_does_not_import_torch(written, tmp_path):
    file, _, _ = written("qwen2")
    code = (
        "import sys, models\n"
        f"lm = models.load_gguf({str(file)!r}, cache_dir={str(tmp_path / 'c')!r})\n"
        "lm.tokenizer.encode('the cat')\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=120)
