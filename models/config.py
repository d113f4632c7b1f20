"""Frozen configuration of the llama / qwen2 / qwen3 decoder family.

`ModelConfig.from_hf` reads a Hugging Face config and checks every field against an allowlist of
handled and ignored fields; `ModelConfig.from_gguf` reads llama.cpp GGUF metadata. Anything this
package cannot run exactly raises a `ValueError` naming the field and its value.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any

from jaxcert.base.validate import check_int

ARCHITECTURES = ("llama", "qwen2", "qwen3")
ROPE_LAYOUTS = ("half", "interleaved")

# Fields of a Hugging Face config that carry no meaning for inference with this implementation.
_HF_IGNORED = frozenset(
    "architectures attention_dropout initializer_range use_cache pretraining_tp torch_dtype "
    "dtype transformers_version _name_or_path output_attentions output_hidden_states "
    "return_dict id2label label2id problem_type chunk_size_feed_forward is_encoder_decoder "
    "_attn_implementation_autoset tokenizer_class use_bfloat16 max_window_layers "
    "sliding_window".split()
)
# Fields handled explicitly by `from_hf` (anything else not generic raises).
_HF_HANDLED = frozenset(
    "model_type vocab_size hidden_size intermediate_size num_hidden_layers "
    "num_attention_heads num_key_value_heads head_dim hidden_act rms_norm_eps "
    "max_position_embeddings tie_word_embeddings rope_theta rope_scaling rope_parameters "
    "attention_bias mlp_bias use_sliding_window layer_types bos_token_id eos_token_id "
    "pad_token_id".split()
)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Hyper-parameters of a llama-like decoder-only transformer.

    Attributes:
      architecture: 'llama', 'qwen2' or 'qwen3'.
      vocab_size: V, rows of the embedding and of the lm_head (may exceed the tokenizer's size).
      hidden_size: E, width of the residual stream.
      intermediate_size: F, width of the SwiGLU MLP.
      num_layers: L, number of transformer blocks.
      num_heads: H, query heads.
      num_kv_heads: G, key/value heads (GQA); divides `num_heads`.
      head_dim: D, width of one head.
      rope_theta: RoPE base frequency.
      rope_layout: 'half' (Hugging Face rotate_half, NeoX: dims i and i + D/2 rotate together)
        or 'interleaved' (GPT-J / llama.cpp: dims 2i and 2i + 1 rotate together).
      rms_norm_eps: epsilon of every RMSNorm.
      qkv_bias: q/k/v projections have biases (qwen2; llama/qwen3 with `attention_bias`).
      o_bias: the output projection has a bias (llama/qwen3 with `attention_bias`).
      qk_norm: RMSNorm over D on queries and keys before RoPE (qwen3).
      tie_embeddings: the lm_head is the transpose of the embedding.
      max_position_embeddings: context length the model was trained for (informational).
      bos_token_id: beginning-of-sequence id, or None.
      eos_token_ids: ids that end generation (possibly several, e.g. `<|im_end|>`).
      pad_token_id: padding id, or None.
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10_000.0
    rope_layout: str = "half"
    rms_norm_eps: float = 1e-6
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False
    tie_embeddings: bool = False
    max_position_embeddings: int = 32_768
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None

    def __post_init__(self):
        if self.architecture not in ARCHITECTURES:
            raise ValueError(
                f"Unsupported architecture {self.architecture!r}; supported: {ARCHITECTURES}."
            )
        if self.rope_layout not in ROPE_LAYOUTS:
            raise ValueError(
                f"rope_layout must be one of {ROPE_LAYOUTS}, got {self.rope_layout!r}."
            )
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
        ):
            check_int(name, getattr(self, name))
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_kv_heads={self.num_kv_heads} must divide num_heads={self.num_heads}."
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}.")
        if self.rope_theta <= 0 or self.rms_norm_eps <= 0:
            raise ValueError("rope_theta and rms_norm_eps must be positive.")
        if not isinstance(self.eos_token_ids, tuple):
            raise ValueError(f"eos_token_ids must be a tuple, got {self.eos_token_ids!r}.")

    @classmethod
    def tiny(cls, **overrides: Any) -> ModelConfig:
        """A tiny qwen2 shape (8 blocks of width 64, 512 tokens) for a benchmark script's
        sanity run (``--tiny``), with ``overrides`` replacing fields."""
        fields: dict[str, Any] = dict(
            architecture="qwen2", vocab_size=512, hidden_size=64, intermediate_size=128,
            num_layers=8, num_heads=4, num_kv_heads=2, head_dim=16, qkv_bias=True,
        )  # fmt: skip
        return cls(**(fields | overrides))

    @property
    def queries_per_kv_head(self) -> int:
        """J = H // G, query heads sharing one key/value head."""
        return self.num_heads // self.num_kv_heads

    @classmethod
    def from_hf(cls, hf_config: Any) -> ModelConfig:
        """Builds a config from a `transformers.PretrainedConfig` or its `to_dict()`.

        Raises:
          ValueError: unsupported `model_type`, an unknown field, or a field value this
            implementation would not reproduce exactly (rope scaling, sliding-window attention in
            use, an activation other than silu, MLP biases, partial rotary embeddings).
        """
        d = dict(hf_config if isinstance(hf_config, Mapping) else hf_config.to_dict())
        arch = d.get("model_type")
        if arch not in ARCHITECTURES:
            raise ValueError(
                f"Unsupported architecture (model_type) {arch!r}; supported: {ARCHITECTURES}."
            )
        unknown = sorted(set(d) - _HF_HANDLED - _HF_IGNORED - _generic_hf_fields())
        if unknown:
            raise ValueError(f"Unsupported {arch} config field(s): {unknown}.")
        _require(d, "hidden_act", ("silu",))
        _require(d, "mlp_bias", (False, None))
        _require(d, "rope_scaling", (None,))
        rope = dict(d.get("rope_parameters") or {})
        _require(rope, "rope_type", ("default", None), where="rope_parameters")
        _require(rope, "partial_rotary_factor", (1.0, None), where="rope_parameters")
        extra = sorted(set(rope) - {"rope_type", "rope_theta", "partial_rotary_factor"})
        if extra:
            raise ValueError(f"Unsupported rope_parameters field(s): {extra}.")
        _check_no_sliding_window(d)
        heads = d["num_attention_heads"]
        bias = bool(d.get("attention_bias", False))
        eos = d.get("eos_token_id")
        theta = rope["rope_theta"] if "rope_theta" in rope else d.get("rope_theta", 10_000.0)
        return cls(
            architecture=arch,
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_layers=d["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=d.get("num_key_value_heads") or heads,
            head_dim=d.get("head_dim") or d["hidden_size"] // heads,
            rope_theta=float(theta),
            rope_layout="half",
            rms_norm_eps=float(d["rms_norm_eps"]),
            qkv_bias=True if arch == "qwen2" else bias,
            o_bias=False if arch == "qwen2" else bias,
            qk_norm=arch == "qwen3",
            tie_embeddings=bool(d.get("tie_word_embeddings", False)),
            max_position_embeddings=int(d.get("max_position_embeddings") or 32_768),
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=_as_tuple(eos),
            pad_token_id=d.get("pad_token_id"),
        )

    @classmethod
    def from_gguf(
        cls, metadata: Mapping[str, Any], *, tensor_names: Iterable[str] | None = None
    ) -> ModelConfig:
        """Builds a config from GGUF key/values (`general.architecture`, `<arch>.*`, `tokenizer.*`).

        Args:
          metadata: GGUF key -> Python value (strings, numbers, lists).
          tensor_names: names of the file's tensors; when given, decides `tie_embeddings` (no
            `output.weight`) and `qkv_bias` (`blk.0.attn_q.bias` present). Otherwise the family's
            defaults: untied, biases for qwen2 only.

        Raises:
          ValueError: unsupported architecture, rope scaling, sliding window, partial rotary
            dimension, or a missing required key (named).
        """
        arch = metadata.get("general.architecture")
        if arch not in ARCHITECTURES:
            raise ValueError(f"Unsupported GGUF architecture {arch!r}; supported: {ARCHITECTURES}.")

        def get(key, default=None, *, required=False):
            full = f"{arch}.{key}"
            if required and full not in metadata:
                raise ValueError(f"GGUF metadata lacks required key {full!r}.")
            return metadata.get(full, default)

        scaling = get("rope.scaling.type")
        if scaling not in (None, "none"):
            raise ValueError(f"Unsupported GGUF {arch}.rope.scaling.type={scaling!r}.")
        if get("attention.sliding_window") is not None:
            raise ValueError(f"Unsupported GGUF {arch}.attention.sliding_window (in use).")
        hidden = int(get("embedding_length", required=True))
        heads = int(get("attention.head_count", required=True))
        head_dim = int(get("attention.key_length") or hidden // heads)
        rot = get("rope.dimension_count")
        if rot is not None and int(rot) != head_dim:
            raise ValueError(f"Unsupported partial rotary: {arch}.rope.dimension_count={rot}.")
        tokens = metadata.get("tokenizer.ggml.tokens")
        vocab = get("vocab_size") or (len(tokens) if tokens is not None else None)
        if vocab is None:
            raise ValueError(f"GGUF metadata gives no vocabulary size ({arch}.vocab_size).")
        names = None if tensor_names is None else set(tensor_names)
        eos = [metadata.get(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot")]
        return cls(
            architecture=arch,
            vocab_size=int(vocab),
            hidden_size=hidden,
            intermediate_size=int(get("feed_forward_length", required=True)),
            num_layers=int(get("block_count", required=True)),
            num_heads=heads,
            num_kv_heads=int(get("attention.head_count_kv") or heads),
            head_dim=head_dim,
            rope_theta=float(get("rope.freq_base", 10_000.0)),
            rope_layout="interleaved" if arch == "llama" else "half",
            rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", required=True)),
            qkv_bias=(arch == "qwen2") if names is None else "blk.0.attn_q.bias" in names,
            o_bias=False if names is None else "blk.0.attn_output.bias" in names,
            qk_norm=arch == "qwen3",
            tie_embeddings=False if names is None else "output.weight" not in names,
            max_position_embeddings=int(get("context_length", 32_768)),
            bos_token_id=metadata.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=tuple(dict.fromkeys(int(e) for e in eos if e is not None)),
            pad_token_id=metadata.get("tokenizer.ggml.padding_token_id"),
        )


def _generic_hf_fields() -> frozenset[str]:
    """Fields every `PretrainedConfig` carries in the installed transformers version."""
    try:
        import transformers

        return frozenset(transformers.PretrainedConfig().to_dict())
    except Exception:  # pragma: no cover - transformers missing or changed
        return frozenset()


def _require(d: Mapping[str, Any], key: str, allowed: tuple, *, where: str = "config") -> None:
    if key in d and d[key] not in allowed:
        raise ValueError(f"Unsupported {where} field value {key}={d[key]!r}; supported: {allowed}.")


def _check_no_sliding_window(d: Mapping[str, Any]) -> None:
    layer_types = d.get("layer_types")
    if layer_types is not None:
        other = sorted(set(layer_types) - {"full_attention"})
        if other:
            raise ValueError(f"Unsupported layer_types {other} (sliding-window attention in use).")
    elif d.get("use_sliding_window") and d.get("max_window_layers", 0) < d["num_hidden_layers"]:
        raise ValueError(
            f"Unsupported use_sliding_window=True with sliding_window={d.get('sliding_window')}."
        )


def _as_tuple(eos: Any) -> tuple[int, ...]:
    if eos is None:
        return ()
    if isinstance(eos, int):
        return (eos,)
    return tuple(int(e) for e in eos)
