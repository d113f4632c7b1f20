"""A loaded model written as a Hugging Face folder that transformers and vLLM load.

`save_hf` writes ``config.json`` and ``generation_config.json`` (through transformers' own
config classes, so the fields are the ones transformers writes), the weights as safetensors
(``model.safetensors``, or shards of at most ``max_shard_bytes`` with
``model.safetensors.index.json``), and the tokenizer with its chat template
(``save_pretrained``). `jaxcert.models.load` reads the folder back bit-exact in the dtype
it was written in.

A GGUF llama keeps its q/k rows in llama.cpp's interleaved rotary order
(``rope_layout='interleaved'``); Hugging Face folders use rotate-half, so those rows are put
back into that order on the way out (the logits do not change).
"""

from __future__ import annotations

import json
import os
import pathlib
from collections.abc import Iterable
from typing import Any

import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxcert.base.folders import new_folder
from jaxcert.base.validate import check_int
from jaxcert.models._weights import LoadedModel, hf_layout
from jaxcert.models.config import ModelConfig

__all__ = ["hf_config_dict", "save_hf"]

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
_CLASSES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}


def hf_config_dict(config: ModelConfig, dtype: str = "float32") -> dict[str, Any]:
    """The keyword arguments of transformers' config class for `config`.

    Raises:
      ValueError: a config Hugging Face's classes cannot express (a llama or qwen3 with q/k/v
        biases but no output bias, or the reverse; a qwen2 without q/k/v biases or with an
        output bias).
    """
    c = config
    out: dict[str, Any] = {
        "architectures": [_CLASSES[c.architecture]],
        "model_type": c.architecture,
        "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads,
        "head_dim": c.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope_theta,
        "max_position_embeddings": c.max_position_embeddings,
        "tie_word_embeddings": c.tie_embeddings,
        "bos_token_id": c.bos_token_id,
        "eos_token_id": list(c.eos_token_ids) if len(c.eos_token_ids) > 1 else
        (c.eos_token_ids[0] if c.eos_token_ids else None),
        "pad_token_id": c.pad_token_id,
        "torch_dtype": dtype,
    }  # fmt: skip
    if c.qk_norm != (c.architecture == "qwen3"):
        raise ValueError(
            f"a {c.architecture} config {'has no' if c.qk_norm else 'has'} q/k norms in Hugging "
            f"Face's classes; this model has qk_norm={c.qk_norm}."
        )
    if c.rope_layout != "half" and c.architecture != "llama":
        raise ValueError(
            f"only a llama's interleaved rotary rows are put back in rotate-half order; this "
            f"{c.architecture} has rope_layout={c.rope_layout!r}."
        )
    if c.architecture == "qwen2":
        if not c.qkv_bias or c.o_bias:
            raise ValueError("a qwen2 config has q/k/v biases and no output bias.")
        out["use_sliding_window"] = False
    else:
        if c.qkv_bias != c.o_bias:
            raise ValueError(
                f"a {c.architecture} config has biases on q/k/v and output together "
                f"(attention_bias); this model has qkv_bias={c.qkv_bias}, o_bias={c.o_bias}."
            )
        out["attention_bias"] = c.qkv_bias
    return out


def _half_order(w: np.ndarray, head_dim: int) -> np.ndarray:
    """Columns of a `[..., N*D]` q/k projection (or bias) from llama.cpp's interleaved rotary
    order (pairs ``2i, 2i + 1``) to rotate-half order (pairs ``i, i + D/2``)."""
    lead = w.shape[:-1]
    heads = w.shape[-1] // head_dim
    w = w.reshape(*lead, heads, head_dim // 2, 2)
    return np.swapaxes(w, -1, -2).reshape(*lead, heads * head_dim)


def save_hf(
    loaded: LoadedModel,
    out: str | os.PathLike,
    *,
    dtype: str = "float32",
    max_shard_bytes: int = 2 * 1024**3,
    overwrite: bool = False,
    keep: Iterable[str | os.PathLike] = (),
) -> pathlib.Path:
    """Writes `loaded` (a model from `jaxcert.models.load`) as a Hugging Face folder.

    Args:
      loaded: the model and its tokenizer (the weights are written as `loaded.model.config`
        lays them out: a model untied after loading writes its own lm_head).
      out: the folder to create (written beside it first; renamed when complete, so a failed
        write leaves nothing).
      dtype: ``"float32"`` or ``"bfloat16"`` weights.
      max_shard_bytes: the most bytes of one safetensors file (a larger model is sharded
        with an index, as transformers does); one file is converted at a time, so the extra
        memory is one shard.
      overwrite: replace an existing `out`.
      keep: folders `out` must not hold (the model's own; `jaxcert.base.folders.new_folder`).

    Returns:
      The folder.

    Raises:
      ValueError: an unknown `dtype`, a `max_shard_bytes` that is not a positive integer,
        an `out` that exists without `overwrite` or may not be written (`new_folder`), a
        config Hugging Face cannot express (`hf_config_dict`).
    """
    import transformers
    from safetensors.numpy import save_file

    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {tuple(_DTYPES)}, got {dtype!r}.")
    check_int("max_shard_bytes", max_shard_bytes)
    config = loaded.model.config  # the weights' own (an untied fine-tune of a tied model)
    kwargs = hf_config_dict(config, dtype)
    model_type = kwargs.pop("model_type")
    hf = transformers.AutoConfig.for_model(model_type, **kwargs)
    params = nnx.to_pure_dict(nnx.state(loaded.model))
    layout = hf_layout(config)
    interleaved = config.rope_layout == "interleaved"

    def tensor(name: str, path: tuple) -> np.ndarray:
        node: Any = params
        for key in path:
            node = node[key]
        value = np.asarray(jnp.asarray(node).astype(_DTYPES[dtype]))
        if interleaved and path[-1] in ("q_proj", "k_proj", "q_bias", "k_bias"):
            value = _half_order(value, config.head_dim)
        if path != ("embedding",) and value.ndim == 2:  # [in, out] -> [out, in]
            value = value.T
        return np.ascontiguousarray(value)

    shards: list[list[str]] = [[]]
    size = 0
    itemsize = np.dtype(_DTYPES[dtype]).itemsize
    for name, (_, shape) in layout.items():
        nbytes = int(np.prod(shape)) * itemsize
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    with new_folder(out, overwrite=overwrite, keep=keep) as tmp:
        hf.save_pretrained(tmp)
        generation = transformers.GenerationConfig(
            bos_token_id=config.bos_token_id,
            eos_token_id=list(config.eos_token_ids) or None,
            pad_token_id=config.pad_token_id,
        )
        generation.save_pretrained(tmp)
        loaded.tokenizer.save_pretrained(tmp)
        files = (
            ["model.safetensors"]
            if len(shards) == 1
            else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
        )
        weight_map = {}
        for file, names in zip(files, shards, strict=True):
            save_file(
                {n: tensor(n, layout[n][0]) for n in names}, str(tmp / file), {"format": "pt"}
            )
            weight_map.update(dict.fromkeys(names, file))
        if len(files) > 1:
            total = sum(int(np.prod(s)) * itemsize for _, s in layout.values())
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return pathlib.Path(out)
