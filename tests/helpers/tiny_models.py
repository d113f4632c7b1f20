"""Tiny models, tokenizers and GGUF files built by the tests themselves (no downloads)."""

from __future__ import annotations

import pathlib

import gguf
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxcert.models._weights import hf_layout
from jaxcert.models.config import ModelConfig
from jaxcert.models.transformer import Transformer


def tiny_config(**overrides) -> ModelConfig:
    """A 2-layer GQA ``ModelConfig`` (qwen2 with q/k/v biases unless overridden)."""
    fields = dict(
        architecture="qwen2",
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        rope_theta=10_000.0,
        qkv_bias=True,
    )
    return ModelConfig(**(fields | overrides))


SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
_BASE = list("abcdefghijklmnopqrstuvwxyz") + ["Ġ", "Ċ", ".", ",", "!", "?"]
MERGES = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n"), ("Ġ", "a"), ("e", "r"), ("o", "n")]
TOKENS = _BASE + ["".join(m) for m in MERGES] + SPECIALS  # 42 byte-level tokens
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TEXTS = ["the cat sat on the mat.\nhe is in!", "<|im_start|>user\nan otter<|im_end|>", "a, b?"]

# Hugging Face config kwargs per case: GQA everywhere, biases for qwen2, q/k norm for qwen3,
# tied and untied heads, head_dim != hidden / heads for qwen3.
HF_CONFIGS = {
    "llama": dict(
        model_type="llama",
        vocab_size=96,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 10_000.0},
        tie_word_embeddings=False,
        max_position_embeddings=128,
    ),
    "llama_tied_bias": dict(
        model_type="llama",
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 500.0},
        attention_bias=True,
        tie_word_embeddings=True,
        max_position_embeddings=128,
    ),
    "qwen2": dict(
        model_type="qwen2",
        vocab_size=96,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        tie_word_embeddings=True,
        max_position_embeddings=128,
    ),
    "qwen3": dict(
        model_type="qwen3",
        vocab_size=128,
        hidden_size=48,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 10_000.0},
        tie_word_embeddings=False,
        max_position_embeddings=128,
    ),
}


def hf_tokenizer():
    """A byte-level BPE `PreTrainedTokenizerFast` over `TOKENS` with `MERGES`."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(TOKENS)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=MERGES))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=CHAT_TEMPLATE,
    )


def torch_model(name: str, seed: int = 0):
    """A randomly initialised float32 `*ForCausalLM` with O(1) weights (eval mode)."""
    import torch
    import transformers

    model_cls = {
        "llama": transformers.LlamaForCausalLM,
        "qwen2": transformers.Qwen2ForCausalLM,
        "qwen3": transformers.Qwen3ForCausalLM,
    }[HF_CONFIGS[name]["model_type"]]
    config = hf_config(name)
    torch.manual_seed(seed)
    model = model_cls._from_config(config, attn_implementation="eager").float().eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.copy_(0.2 * torch.randn_like(p))
    return model


def torch_logits(model, tokens: np.ndarray) -> np.ndarray:
    """Full-sequence float32 logits `[B, T, V]` of a torch model."""
    import torch

    with torch.no_grad():
        return model(torch.as_tensor(np.asarray(tokens), dtype=torch.long)).logits.numpy()


def save_checkpoint(model, path: pathlib.Path) -> pathlib.Path:
    """`save_pretrained` (safetensors) plus the tiny tokenizer."""
    model.save_pretrained(path, safe_serialization=True)
    hf_tokenizer().save_pretrained(path)
    return path


def hf_config(name: str):
    """The transformers config object of a case (no torch needed)."""
    import transformers

    kwargs = dict(HF_CONFIGS[name])
    config_cls = {
        "llama": transformers.LlamaConfig,
        "qwen2": transformers.Qwen2Config,
        "qwen3": transformers.Qwen3Config,
    }[kwargs.pop("model_type")]
    return config_cls(**kwargs, eos_token_id=TOKENS.index("<|im_end|>"))


def numpy_checkpoint(name: str, path: pathlib.Path, seed: int = 0) -> dict[str, np.ndarray]:
    """Writes a torch-free checkpoint folder (config, random O(1) weights, tokenizer).

    Returns:
      The Hugging Face-named float32 tensors that were saved.
    """
    import safetensors.numpy

    config = hf_config(name)
    rng = np.random.default_rng(seed)
    tensors = {}
    for tensor, (_, shape) in hf_layout(ModelConfig.from_hf(config)).items():
        noise = rng.standard_normal(shape).astype(np.float32)
        tensors[tensor] = 1.0 + 0.1 * noise if tensor.endswith("norm.weight") else 0.2 * noise
    config.save_pretrained(path)
    safetensors.numpy.save_file(tensors, path / "model.safetensors")
    hf_tokenizer().save_pretrained(path)
    return tensors


def random_model(config: ModelConfig, seed: int = 0, **kw) -> Transformer:
    """A `Transformer` with O(1) random weights (so masks and positions matter)."""
    model = Transformer(config, rngs=nnx.Rngs(seed), **kw)
    graphdef, state = nnx.split(model)
    leaves, treedef = jax.tree.flatten(state)
    keys = jax.random.split(jax.random.key(seed + 1), len(leaves))
    paths = [p for p, _ in jax.tree_util.tree_flatten_with_path(state)[0]]
    new = []
    for key, path, leaf in zip(keys, paths, leaves, strict=True):
        noise = jax.random.normal(key, leaf.shape, jnp.float32)
        is_norm = "scale" in jax.tree_util.keystr(path)
        new.append((1.0 + 0.1 * noise if is_norm else 0.2 * noise).astype(leaf.dtype))
    return nnx.merge(graphdef, jax.tree.unflatten(treedef, new))


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter permutation of q/k rows (half -> interleaved rotary layout)."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def llama_cpp_unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of `llama_cpp_permute`."""
    return (
        w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


_TO_GGUF = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_BLOCK_TO_GGUF = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.o_proj.bias": "attn_output.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    **{f"self_attn.{x}_proj.{p}": f"attn_{x}.{p}" for x in "qkv" for p in ("weight", "bias")},
}


def gguf_name(hf: str) -> str:
    if hf in _TO_GGUF:
        return _TO_GGUF[hf]
    _, _, i, rest = hf.split(".", 3)
    return f"blk.{i}.{_BLOCK_TO_GGUF[rest]}"


def gguf_tensors(tensors: dict[str, np.ndarray], config: ModelConfig) -> dict[str, np.ndarray]:
    """HF-named float32 tensors -> llama.cpp-named ones (q/k rows permuted for llama)."""
    out = {}
    for name, w in tensors.items():
        w = np.asarray(w, np.float32)
        if config.architecture == "llama" and ".self_attn.q_proj." in name:
            w = llama_cpp_permute(w, config.num_heads)
        elif config.architecture == "llama" and ".self_attn.k_proj." in name:
            w = llama_cpp_permute(w, config.num_kv_heads)
        out[gguf_name(name)] = w
    return out


def roundtrip(w: np.ndarray, qtype) -> np.ndarray:
    """What a tensor stored as `qtype` dequantises to."""
    if w.ndim < 2 or qtype is None:
        return w
    return gguf.quants.dequantize(gguf.quants.quantize(w, qtype), qtype).reshape(w.shape)


def write_gguf(
    path: pathlib.Path,
    config: ModelConfig,
    tensors: dict[str, np.ndarray],
    *,
    qtype=None,
    pre: str = "qwen2",
) -> pathlib.Path:
    """Writes a GGUF file the way llama.cpp's converter would (matrices as `qtype` if given)."""
    arch = config.architecture
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(config.num_layers)
    w.add_context_length(config.max_position_embeddings)
    w.add_embedding_length(config.hidden_size)
    w.add_feed_forward_length(config.intermediate_size)
    w.add_head_count(config.num_heads)
    w.add_head_count_kv(config.num_kv_heads)
    w.add_key_length(config.head_dim)
    w.add_value_length(config.head_dim)
    w.add_rope_dimension_count(config.head_dim)
    w.add_rope_freq_base(config.rope_theta)
    w.add_layer_norm_rms_eps(config.rms_norm_eps)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    pads = [f"[PAD{i}]" for i in range(len(TOKENS), config.vocab_size)]
    w.add_token_list(TOKENS + pads)
    w.add_token_types([3 if t in SPECIALS else 1 for t in TOKENS] + [5] * len(pads))
    w.add_token_merges([f"{a} {b}" for a, b in MERGES])
    w.add_eos_token_id(TOKENS.index("<|im_end|>"))
    w.add_pad_token_id(TOKENS.index("<|endoftext|>"))
    w.add_add_bos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)
    for name, t in gguf_tensors(tensors, config).items():
        if t.ndim == 2 and qtype is not None:
            w.add_tensor(name, gguf.quants.quantize(t, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(name, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
