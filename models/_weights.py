"""Hugging Face tensor names -> `Transformer` state, shared by the safetensors and GGUF loaders."""

from __future__ import annotations

import dataclasses
import pathlib
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from jaxcert.models import sharding as sharding_lib
from jaxcert.models.config import ModelConfig
from jaxcert.models.transformer import Transformer

# Tensors some checkpoints carry that hold nothing the model needs.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


@dataclasses.dataclass(frozen=True)
class LoadedModel:
    """A model ready to run, with what is needed to feed it.

    Attributes:
      model: the NNX `Transformer` (split it with `nnx.split` for `models.forward`).
      tokenizer: a `transformers.PreTrainedTokenizerFast` (chat template included when the
        source has one).
      config: its `ModelConfig`.
      path: the checkpoint folder or GGUF file it was loaded from.
    """

    model: Transformer
    tokenizer: Any
    config: ModelConfig
    path: pathlib.Path

    @property
    def eos_ids(self) -> tuple[int, ...]:
        """Tokens that end generation: the config's and the tokenizer's end ids, sorted."""
        ids = set(self.config.eos_token_ids)
        if getattr(self.tokenizer, "eos_token_id", None) is not None:
            ids.add(int(self.tokenizer.eos_token_id))
        return tuple(sorted(ids))


def hf_layout(config: ModelConfig) -> dict[str, tuple[tuple, tuple[int, ...]]]:
    """Every tensor a Hugging Face checkpoint of `config` has.

    Returns:
      name -> (state path in `Transformer`, Hugging Face shape). Matrices are stored transposed
      (`[out, in]` -> `[in, out]`), except the embedding `[V, E]`.
    """
    c = config
    e, f, d = c.hidden_size, c.intermediate_size, c.head_dim
    h, g = c.num_heads, c.num_kv_heads
    out: dict[str, tuple[tuple, tuple[int, ...]]] = {
        "model.embed_tokens.weight": (("embedding",), (c.vocab_size, e)),
        "model.norm.weight": (("norm", "scale"), (e,)),
    }
    if not c.tie_embeddings:
        out["lm_head.weight"] = (("lm_head",), (c.vocab_size, e))
    for i in range(c.num_layers):
        p, s = f"model.layers.{i}.", ("layers", i)
        out[p + "input_layernorm.weight"] = (s + ("input_norm", "scale"), (e,))
        out[p + "post_attention_layernorm.weight"] = (s + ("post_attention_norm", "scale"), (e,))
        for name, rows in (("q", h * d), ("k", g * d), ("v", g * d)):
            out[p + f"self_attn.{name}_proj.weight"] = (s + ("attn", f"{name}_proj"), (rows, e))
            if c.qkv_bias:
                out[p + f"self_attn.{name}_proj.bias"] = (s + ("attn", f"{name}_bias"), (rows,))
        out[p + "self_attn.o_proj.weight"] = (s + ("attn", "o_proj"), (e, h * d))
        if c.o_bias:
            out[p + "self_attn.o_proj.bias"] = (s + ("attn", "o_bias"), (e,))
        if c.qk_norm:
            out[p + "self_attn.q_norm.weight"] = (s + ("attn", "q_norm", "scale"), (d,))
            out[p + "self_attn.k_norm.weight"] = (s + ("attn", "k_norm", "scale"), (d,))
        out[p + "mlp.gate_proj.weight"] = (s + ("mlp", "gate_proj"), (f, e))
        out[p + "mlp.up_proj.weight"] = (s + ("mlp", "up_proj"), (f, e))
        out[p + "mlp.down_proj.weight"] = (s + ("mlp", "down_proj"), (e, f))
    return out


def model_from_tensors(
    config: ModelConfig,
    tensors: Mapping[str, Any],
    *,
    dtype=jnp.float32,
    source: str = "weights",
    mesh: Mesh | None = None,
    rules=sharding_lib.LOGICAL_RULES,
) -> Transformer:
    """Builds a `Transformer` (params and compute in `dtype`) from Hugging Face-named tensors.

    Args:
      config: the model's config.
      tensors: name -> array-like (numpy, ml_dtypes bfloat16 or jax), read lazily one at a time.
        A tied model ignores a `lm_head.weight`; `*rotary_emb.inv_freq` buffers are ignored.
      dtype: parameter and compute dtype.
      source: what the tensors came from, for error messages.
      mesh: if given (a `jax.sharding.Mesh` with ``Auto`` axes), each tensor goes straight
        from host memory to its shards as it is read (`jaxcert.models.sharding.place`; no
        device ever holds more than its shard), and the model gets ``layout`` set (see
        `jaxcert.models.shard` for what is split how).
      rules: logical -> mesh axis rules, with `mesh`.

    Raises:
      ValueError: a missing or unexpected tensor, or a shape mismatch (each named); an
        ``Explicit`` mesh or malformed rules.
    """
    placement = None if mesh is None else sharding_lib.Layout.create(mesh, rules, config)
    layout = hf_layout(config)
    names = set(tensors.keys())
    ignored = {n for n in names if n.endswith(_IGNORED_SUFFIXES)}
    if config.tie_embeddings:
        ignored |= names & {"lm_head.weight"}
    missing = sorted(set(layout) - names)
    unexpected = sorted(names - set(layout) - ignored)
    if missing or unexpected:
        raise ValueError(
            f"{source}: tensors do not match the {config.architecture} config; "
            f"missing: {missing[:8]}{' ...' if len(missing) > 8 else ''}; "
            f"unexpected: {unexpected[:8]}{' ...' if len(unexpected) > 8 else ''}."
        )
    abstract = nnx.eval_shape(
        lambda: Transformer(config, rngs=nnx.Rngs(0), dtype=dtype, param_dtype=dtype)
    )
    graphdef, params = nnx.split(abstract)
    pure = nnx.to_pure_dict(params)
    if placement is not None:
        targets = nnx.to_pure_dict(sharding_lib.shardings(abstract, placement))
    for name, (path, hf_shape) in layout.items():
        value = tensors[name]
        if tuple(value.shape) != hf_shape:
            raise ValueError(
                f"{source}: tensor {name!r} has shape {tuple(value.shape)}, expected {hf_shape}."
            )
        node = pure
        for key in path[:-1]:
            node = node[key]
        target: jax.ShapeDtypeStruct = node[path[-1]]
        transpose = path != ("embedding",) and len(hf_shape) == 2  # [out, in] -> [in, out]
        if placement is None:
            array = jnp.asarray(np.asarray(value), dtype=dtype)
            array = array.T if transpose else array
        else:
            where: Any = targets  # nested dicts down to the NamedSharding
            for key in path:
                where = where[key]
            array = sharding_lib.place(np.asarray(value), where, dtype, transpose=transpose)
        del value
        if array.shape != target.shape:  # pragma: no cover - layout and module disagree
            raise AssertionError(f"{name}: {array.shape} vs params {target.shape}")
        node[path[-1]] = array
    nnx.replace_by_pure_dict(params, pure)
    model = nnx.merge(graphdef, params)
    model.layout = placement
    return model
