"""ModelConfig.from_hf / from_gguf: allowlists and clear errors."""

import pytest
import transformers

from jaxcert.models import ModelConfig

# The config.json of Qwen2.5-0.5B-Instruct as written by transformers 4.x.
QWEN25_JSON = {
    "architectures": ["Qwen2ForCausalLM"],
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "hidden_act": "silu",
    "hidden_size": 896,
    "initializer_range": 0.02,
    "intermediate_size": 4864,
    "max_position_embeddings": 32768,
    "max_window_layers": 21,
    "model_type": "qwen2",
    "num_attention_heads": 14,
    "num_hidden_layers": 24,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000.0,
    "sliding_window": 32768,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.43.1",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}


@pytest.mark.parametrize("source", ["dict", "pretrained_config"])
def test_from_hf_qwen25(source):
    d = dict(QWEN25_JSON)
    if source == "pretrained_config":
        d.pop("model_type")
        d = transformers.Qwen2Config(**d)
    c = ModelConfig.from_hf(d)
    assert (c.architecture, c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim) == (
        "qwen2",
        24,
        14,
        2,
        64,
    )
    assert c.rope_theta == 1e6 and c.rope_layout == "half"
    assert c.qkv_bias and not c.o_bias and not c.qk_norm and c.tie_embeddings
    assert c.eos_token_ids == (151645,) and c.bos_token_id == 151643


def test_from_hf_llama_and_qwen3_defaults():
    llama = ModelConfig.from_hf(transformers.LlamaConfig(attention_bias=True, eos_token_id=[1, 2]))
    assert llama.qkv_bias and llama.o_bias and llama.eos_token_ids == (1, 2)
    qwen3 = ModelConfig.from_hf(transformers.Qwen3Config(head_dim=64))
    assert qwen3.qk_norm and qwen3.head_dim == 64 and not qwen3.qkv_bias


@pytest.mark.parametrize(
    "change, match",
    [
        ({"model_type": "mistral"}, "'mistral'"),
        ({"rope_scaling": {"type": "yarn", "factor": 4.0}}, "rope_scaling"),
        ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
        ({"use_sliding_window": True, "max_window_layers": 2}, "sliding_window"),
        ({"layer_types": ["full_attention", "sliding_attention"]}, "sliding_attention"),
        ({"mlp_bias": True}, "mlp_bias"),
        ({"rope_parameters": {"rope_type": "llama3", "factor": 8.0}}, "rope_type='llama3'"),
        ({"quantization_config": {"bits": 4}}, "quantization_config"),
    ],
    ids=["arch", "rope-scaling", "act", "sliding", "layer-types", "mlp-bias", "rope-type", "quant"],
)
def test_from_hf_rejects(change, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_hf({**QWEN25_JSON, **change})


def test_from_hf_rejects_in_pretrained_config():
    with pytest.raises(ValueError, match="sliding"):
        ModelConfig.from_hf(
            transformers.Qwen2Config(
                use_sliding_window=True, max_window_layers=1, num_hidden_layers=2
            )
        )


GGUF_META = {
    "general.architecture": "qwen2",
    "qwen2.block_count": 24,
    "qwen2.context_length": 32768,
    "qwen2.embedding_length": 896,
    "qwen2.feed_forward_length": 4864,
    "qwen2.attention.head_count": 14,
    "qwen2.attention.head_count_kv": 2,
    "qwen2.rope.freq_base": 1e6,
    "qwen2.attention.layer_norm_rms_epsilon": 1e-6,
    "tokenizer.ggml.tokens": ["a"] * 151936,
    "tokenizer.ggml.eos_token_id": 151645,
    "tokenizer.ggml.bos_token_id": 151643,
}


def test_from_gguf():
    c = ModelConfig.from_gguf(GGUF_META, tensor_names=["output.weight", "blk.0.attn_q.bias"])
    assert c.vocab_size == 151936 and c.head_dim == 64 and c.rope_layout == "half"
    assert c.qkv_bias and not c.tie_embeddings and c.eos_token_ids == (151645,)
    llama = {k.replace("qwen2", "llama"): v for k, v in GGUF_META.items()}
    c = ModelConfig.from_gguf({**llama, "general.architecture": "llama"}, tensor_names=[])
    assert c.rope_layout == "interleaved" and c.tie_embeddings and not c.qkv_bias


@pytest.mark.parametrize(
    "change, match",
    [
        ({"general.architecture": "gemma2"}, "'gemma2'"),
        ({"qwen2.rope.scaling.type": "yarn"}, "rope.scaling.type"),
        ({"qwen2.attention.sliding_window": 4096}, "sliding_window"),
        ({"qwen2.rope.dimension_count": 32}, "partial rotary"),
        ({"qwen2.block_count": None}, "block_count"),
    ],
    ids=["arch", "rope-scaling", "sliding", "partial-rotary", "missing"],
)
def test_from_gguf_rejects(change, match):
    meta = {k: v for k, v in {**GGUF_META, **change}.items() if v is not None}
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_gguf(meta)
