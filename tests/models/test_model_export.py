"""save_hf: a loaded model written as a Hugging Face folder reads back bit-exact (jaxcert) and
gives the same logits in transformers; GGUF llama's interleaved q/k rows go back to
rotate-half order."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxcert.models import KVCache, forward, load_gguf, load_hf
from jaxcert.models.export import hf_config_dict, save_hf
from tests.helpers import tiny_models

STEP = jax.jit(forward, static_argnums=0)
TOKENS = np.random.default_rng(3).integers(0, 64, (2, 9)).astype(np.int32)


def _logits(model):
    graphdef, state = nnx.split(model)
    cache = KVCache.create(model.config, *TOKENS.shape)
    return np.asarray(STEP(graphdef, state, jnp.asarray(TOKENS), cache)[0])


def _flat(model):
    return {p: np.asarray(v.get_value()) for p, v in nnx.to_flat_state(nnx.state(model))}


@pytest.mark.parametrize("name", ["llama", "qwen2", "qwen3"])
def test_written_folder_loads_back_bit_exact(np_case, tmp_path, name):
    _, lm, _ = np_case(name)
    out = save_hf(lm, tmp_path / "out")
    back = load_hf(out)
    assert back.config == lm.config
    a, b = _flat(lm.model), _flat(back.model)
    assert a.keys() == b.keys()
    for path in a:
        np.testing.assert_array_equal(a[path], b[path], err_msg=str(path))
    assert back.tokenizer.chat_template == lm.tokenizer.chat_template
    text = "the cat sat on the mat."
    assert back.tokenizer.encode(text) == lm.tokenizer.encode(text)


def test_transformers_gives_the_same_logits(np_case, tmp_path):
    torch = pytest.importorskip("torch")
    import transformers

    _, lm, _ = np_case("qwen2")
    out = save_hf(lm, tmp_path / "out")
    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        want = model(torch.as_tensor(TOKENS, dtype=torch.long)).logits.numpy()
    np.testing.assert_allclose(_logits(lm.model), want, rtol=1e-4, atol=1e-4)
    config = json.loads((out / "generation_config.json").read_text())
    assert config["eos_token_id"] == list(lm.config.eos_token_ids)


def test_gguf_llama_goes_out_in_rotate_half_order(np_case, tmp_path):
    _, lm, tensors = np_case("llama")
    file = tiny_models.write_gguf(tmp_path / "l.gguf", lm.config, tensors, pre="default")
    gguf_lm = load_gguf(file)
    assert gguf_lm.config.rope_layout == "interleaved"
    out = save_hf(gguf_lm, tmp_path / "out")
    back = load_hf(out)
    assert back.config.rope_layout == "half"
    np.testing.assert_allclose(_logits(back.model), _logits(gguf_lm.model), rtol=1e-5, atol=1e-5)
    # the original checkpoint's rows, exactly: the permutation is undone, not approximated
    np.testing.assert_array_equal(
        np.asarray(back.model.layers[0].attn.q_proj[...]),
        np.asarray(lm.model.layers[0].attn.q_proj[...]),
    )


def test_shards_and_bfloat16(np_case, tmp_path):
    _, lm, _ = np_case("qwen2")
    out = save_hf(lm, tmp_path / "out", dtype="bfloat16", max_shard_bytes=20_000)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 2 and all((out / f).is_file() for f in files)
    back = load_hf(out, dtype=jnp.bfloat16)
    again = save_hf(back, tmp_path / "again", dtype="bfloat16", max_shard_bytes=20_000)
    a, b = _flat(back.model), _flat(load_hf(again, dtype=jnp.bfloat16).model)
    for path in a:
        np.testing.assert_array_equal(a[path], b[path], err_msg=str(path))
    want = np.asarray(lm.model.embedding[...].astype(jnp.bfloat16))
    np.testing.assert_array_equal(np.asarray(back.model.embedding[...]), want)


def test_refusals_leave_nothing(np_case, tmp_path, monkeypatch):
    _, lm, _ = np_case("qwen2")
    with pytest.raises(ValueError, match="dtype must be one of"):
        save_hf(lm, tmp_path / "a", dtype="int8")
    save_hf(lm, tmp_path / "b")
    with pytest.raises(ValueError, match="exists; pass overwrite"):
        save_hf(lm, tmp_path / "b")
    import safetensors.numpy

    monkeypatch.setattr(safetensors.numpy, "save_file", _broken)
    with pytest.raises(OSError, match="disk full"):
        save_hf(lm, tmp_path / "c")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b"]


def _broken(*args, **kwargs):
    raise OSError("disk full")


def test_configs_hugging_face_cannot_express_are_named():
    config = tiny_models.tiny_config(architecture="llama", qkv_bias=True, o_bias=False)
    with pytest.raises(ValueError, match="qkv_bias=True, o_bias=False"):
        hf_config_dict(config)


@pytest.mark.parametrize(
    "overrides,message",
    [
        (dict(architecture="qwen2", qk_norm=True), "has no q/k norms"),
        (dict(architecture="qwen3", qkv_bias=False, qk_norm=False), "has q/k norms"),
        (
            dict(architecture="qwen3", qkv_bias=False, qk_norm=True, rope_layout="interleaved"),
            "rope_layout='interleaved'",
        ),
    ],
)
def test_configs_whose_folder_would_load_wrong_are_refused(overrides, message):
    with pytest.raises(ValueError, match=message):
        hf_config_dict(tiny_models.tiny_config(**overrides))


@pytest.mark.parametrize("size", [0, -1, 1.5, True, None])
def test_shard_size_must_be_a_positive_integer(np_case, tmp_path, size):
    _, lm, _ = np_case("qwen2")
    with pytest.raises(ValueError, match="max_shard_bytes"):
        save_hf(lm, tmp_path / "out", max_shard_bytes=size)
    assert list(tmp_path.iterdir()) == []
