"""EAGLE-3 heads in the layouts the serving engines load: export and import.

Two layouts, both a folder with ``config.json`` and ``model.safetensors``:

- ``eagle3``: what SpecForge and the EAGLE repository write and vLLM (``method="eagle3"``),
  SGLang (``EAGLE3``), tpu-inference and TensorRT-LLM read. ``config.json`` is a Llama config
  with ``architectures = ["LlamaForCausalLMEagle3"]``, ``num_hidden_layers = 1``,
  ``vocab_size`` (the target's V), ``draft_vocab_size`` (V'), ``target_hidden_size`` and
  ``eagle_aux_hidden_state_layer_ids``; the tensors are ``fc.weight`` `[E, 3E]`,
  ``midlayer.{input_layernorm,hidden_norm,post_attention_layernorm}.weight`` `[E]`,
  ``midlayer.self_attn.{q,k,v}_proj.weight`` `[O, 2E]`, ``midlayer.self_attn.o_proj.weight``
  `[E, Q]`, ``midlayer.mlp.{gate,up}_proj.weight`` `[F, E]`, ``midlayer.mlp.down_proj.weight``
  `[E, F]`, ``norm.weight`` `[E]`, ``lm_head.weight`` `[V', E]`, ``d2t`` int64 `[V']`
  (target id = draft id + ``d2t[draft id]``) and ``t2d`` bool `[V]` (which target ids are
  in the draft vocabulary). No embedding: the engines use the target's.
- ``speculators``: the `speculators` library's variant (vLLM reads it too): the same tensors
  with ``layers.0.`` for ``midlayer.``, plus ``embed_tokens.weight`` `[V, E]`, and ``d2t`` /
  ``t2d`` only with a reduced draft vocabulary; a ``config.json`` with
  ``speculators_model_type = "eagle3"``, the layer's Llama config under
  ``transformer_layer_config`` and the verifier under ``speculators_config``.

Aux layers: vLLM and speculators count an aux layer ``i`` as the residual stream *entering*
target layer ``i`` (``eagle_aux_hidden_state_layer_ids`` at the config's top level), which
is the stream *after* block ``i - 1``, jaxcert's tap ``i - 1``; SpecForge and SGLang count it
by the layer it *leaves* (``eagle_config.eagle_aux_hidden_state_layer_ids``, jaxcert's tap
``i``). Their defaults name the same states: ``(2, L // 2, L - 3)`` entering, jaxcert's taps
``(1, L // 2 - 1, L - 4)``. An ``eagle3`` export writes both fields, each in its own count,
so either engine taps what the head was trained on; an import reads the top-level field
first, then ``eagle_config``, then takes the default.

What only jaxcert has travels in the safetensors header's metadata (which the engines ignore):
the shared out-of-vocabulary logit (`EagleHead.oov_logit`, as a float32 bit pattern), so an
exported head comes back bit-exact. A head written elsewhere gets the initial shared logit
(`jaxcert.models.eagle.OOV_INIT_MASS`).

Only ``arch="eagle3"`` heads (`jaxcert.models.eagle.EagleHead`) have these layouts; a
``jaxcert`` head (its own ``fc`` over normalised embedding and context, ordinary blocks)
stays in `jaxcert.models.eagle.save_head`'s layout, and so does EAGLE-1 (``taps=()``): vLLM's
``eagle`` method expects EAGLE-1's own layer (``fc`` over the raw concatenation, no input
norm), which neither arch is.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxcert.base.folders import new_folder
from jaxcert.models.config import ModelConfig
from jaxcert.models.eagle import EagleHead, is_head_folder, load_head
from jaxcert.models.export import hf_config_dict
from jaxcert.models.transformer import Transformer

__all__ = [
    "FORMATS",
    "engine_format",
    "engine_taps",
    "export_head",
    "head_target_config",
    "import_head",
    "read_head",
]

FORMATS = ("eagle3", "speculators")
ARCHITECTURE = "LlamaForCausalLMEagle3"
SPECULATORS_ARCHITECTURE = "Eagle3Speculator"
_WEIGHTS = "model.safetensors"
_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
_OOV_KEY = "jaxcert.oov_logit"  # safetensors metadata: the shared logit's float32 bits


def engine_taps(num_layers: int) -> tuple[int, ...]:
    """The states the engines' EAGLE-3 heads read by default: the streams entering target
    layers ``2``, ``L // 2`` and ``L - 3`` (vLLM, speculators; SpecForge's leaving
    ``1``, ``L // 2 - 1``, ``L - 4``), jaxcert's taps ``(1, L // 2 - 1, L - 4)``.

    Raises:
      ValueError: fewer than 6 target blocks (the three would not be distinct).
    """
    if num_layers < 6:
        raise ValueError(f"the engines' EAGLE-3 taps need >= 6 target blocks, got {num_layers}.")
    return (1, num_layers // 2 - 1, num_layers - 4)


def _layer_tensors(bias: bool) -> dict[str, tuple[tuple, bool]]:
    """Engine name (after the layer prefix) -> (path in `Eagle3Layer`, stored transposed)."""
    out: dict[str, tuple[tuple, bool]] = {
        "input_layernorm.weight": (("input_norm", "scale"), False),
        "hidden_norm.weight": (("hidden_norm", "scale"), False),
        "post_attention_layernorm.weight": (("post_attention_norm", "scale"), False),
        "self_attn.o_proj.weight": (("attn", "o_proj"), True),
        "mlp.gate_proj.weight": (("mlp", "gate_proj"), True),
        "mlp.up_proj.weight": (("mlp", "up_proj"), True),
        "mlp.down_proj.weight": (("mlp", "down_proj"), True),
    }
    for name in "qkv":
        out[f"self_attn.{name}_proj.weight"] = (("attn", f"{name}_proj"), True)
        if bias:
            out[f"self_attn.{name}_proj.bias"] = (("attn", f"{name}_bias"), False)
    if bias:
        out["self_attn.o_proj.bias"] = (("attn", "o_bias"), False)
    return out


def _tensor_map(bias: bool, fmt: str) -> dict[str, tuple[tuple, bool]]:
    """Every weight tensor of a head in layout `fmt`: name -> (state path, transposed)."""
    prefix = "midlayer." if fmt == "eagle3" else "layers.0."
    out = {
        prefix + name: (("layers", 0) + path, t) for name, (path, t) in _layer_tensors(bias).items()
    }
    out["fc.weight"] = (("fuse_fc",), True)
    out["norm.weight"] = (("norm", "scale"), False)
    out["lm_head.weight"] = (("lm_head",), True)
    return out


def _layer_config(head: EagleHead, dtype: str) -> dict[str, Any]:
    """The Llama config of the head's layer, as the engines read it."""
    t = head.target_config
    out = hf_config_dict(head.config, dtype)  # a one-layer Llama of the target's sizes
    out.update(
        architectures=[ARCHITECTURE],
        tie_word_embeddings=False,
        draft_vocab_size=head.draft_size,
        target_hidden_size=t.hidden_size,
        mlp_bias=False,
        norm_before_residual=head.norm_before_residual,
        # vLLM and speculators count an aux layer by the layer it enters; SpecForge and
        # SGLang (``eagle_config``) by the layer it leaves: both, each in its own count
        eagle_aux_hidden_state_layer_ids=[i + 1 for i in head.taps],
        eagle_config={"eagle_aux_hidden_state_layer_ids": list(head.taps)},
    )
    return out


def _vocab_tensors(head: EagleHead) -> dict[str, np.ndarray]:
    """``d2t`` int64 `[V']` and ``t2d`` bool `[V]` of the head's draft vocabulary."""
    v = head.target_config.vocab_size
    ids = np.arange(v) if head.draft_vocab is None else np.asarray(head.draft_vocab[...])
    ids = ids.astype(np.int64)
    return {"d2t": ids - np.arange(ids.size, dtype=np.int64), "t2d": _t2d(ids, v)}


def _t2d(ids: np.ndarray, vocab: int) -> np.ndarray:
    """``t2d``: bool `[V]`, which target ids are in the draft vocabulary `ids`."""
    t2d = np.zeros(vocab, bool)
    t2d[ids] = True
    return t2d


def export_head(
    head: EagleHead,
    out: str | os.PathLike,
    *,
    format: str = "eagle3",
    dtype: str = "float32",
    verifier: str | os.PathLike | None = None,
    overwrite: bool = False,
    keep: Iterable[str | os.PathLike] = (),
) -> pathlib.Path:
    """Writes `head` as a folder the engines load (see the module docstring); returns it.

    Args:
      head: an ``arch="eagle3"`` `EagleHead`.
      out: the folder to create (written beside it first, renamed when complete).
      format: ``"eagle3"`` (SpecForge, EAGLE) or ``"speculators"``.
      dtype: ``"float32"`` or ``"bfloat16"`` for the weights (``d2t`` int64, ``t2d`` bool).
      verifier: the target's name or folder, recorded in a ``speculators`` config.
      overwrite: replace an existing `out`.
      keep: the head's and target's folders, which `out` must not hold
        (`jaxcert.base.folders.new_folder`).

    Raises:
      ValueError: a ``jaxcert``-arch head, an unknown `format` or `dtype`, an `out` that
        exists without `overwrite` or may not be written (`new_folder`); nothing is left
        behind.
    """
    from safetensors.numpy import save_file

    if head.arch != "eagle3":
        raise ValueError(
            f"only an eagle3 head has the engines' layout; this head's arch is {head.arch!r} "
            "(train one with --arch eagle3)."
        )
    if format not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}, got {format!r}.")
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {tuple(_DTYPES)}, got {dtype!r}.")
    params = nnx.to_pure_dict(nnx.state(head))
    tensors: dict[str, np.ndarray] = {}
    for name, (path, transposed) in _tensor_map(head.config.qkv_bias, format).items():
        value = jnp.asarray(_at(params, path)).astype(_DTYPES[dtype])
        tensors[name] = np.ascontiguousarray(np.asarray(value.T if transposed else value))
    if format == "eagle3" or head.draft_vocab is not None:  # speculators: only if reduced
        tensors.update(_vocab_tensors(head))
    if format == "speculators":  # speculators saves the (frozen) embedding too
        embedding = jnp.asarray(head.embedding[...]).astype(_DTYPES[dtype])
        tensors["embed_tokens.weight"] = np.asarray(embedding)
    metadata = {"format": "pt"}
    if head.oov_logit is not None:
        bits = np.asarray([head.oov_logit[...]], np.float32).view(np.uint32)[0]
        metadata[_OOV_KEY] = f"{int(bits):08x}"
    config = _layer_config(head, dtype)
    if format == "speculators":
        config = _speculators_config(
            config, None if verifier is None else str(verifier), head.target_config
        )
    with new_folder(out, overwrite=overwrite, keep=keep) as tmp:
        save_file(tensors, str(tmp / _WEIGHTS), metadata=metadata)
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return pathlib.Path(out)


def _speculators_config(
    layer: dict[str, Any], verifier: str | None, target: ModelConfig
) -> dict[str, Any]:
    """The speculators library's config around the layer's Llama config."""
    layer = dict(layer)
    top = {
        k: layer.pop(k)
        for k in ("draft_vocab_size", "norm_before_residual", "target_hidden_size", "torch_dtype")
    }
    aux = layer.pop("eagle_aux_hidden_state_layer_ids")  # counted by the layer it enters
    for key in ("architectures", "eagle_config", "norm_before_residual"):
        layer.pop(key, None)
    family = {"llama": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3"}[target.architecture]
    return {
        "architectures": [SPECULATORS_ARCHITECTURE],
        "speculators_model_type": "eagle3",
        "speculators_version": "0.3.0",
        **top,
        "norm_before_fc": False,
        "fc_norm": False,
        "norm_output": False,
        "embed_requires_grad": False,
        "eagle_aux_hidden_state_layer_ids": aux,
        "transformer_layer_config": layer,
        "speculators_config": {
            "algorithm": "eagle3",
            "default_proposal_method": "greedy",
            "proposal_methods": [
                {
                    "proposal_type": "greedy",
                    "speculative_tokens": 5,
                    "verifier_accept_k": 1,
                    "accept_tolerance": 0.0,
                }
            ],
            "verifier": {
                "name_or_path": verifier,
                "architectures": [f"{family}ForCausalLM"],
            },
        },
    }


def _at(tree: Mapping, path: tuple) -> Any:
    for key in path:
        tree = tree[key]
    return tree


def _set(tree: dict, path: tuple, value: Any) -> None:
    for key in path[:-1]:
        tree = tree[key]
    tree[path[-1]] = value


def engine_format(folder: str | os.PathLike) -> str | None:
    """``"eagle3"`` or ``"speculators"`` if `folder` holds a head in that layout (judged from
    its ``config.json``), else ``None``.

    Raises:
      ValueError: a ``config.json`` that is not a readable JSON object.
    """
    path = pathlib.Path(folder) / "config.json"
    if not path.is_file():
        return None
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: not readable JSON ({e}).") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path}: not a JSON object.")
    if config.get("speculators_model_type") == "eagle3":
        return "speculators"
    if any("eagle3" in str(a).lower() for a in config.get("architectures") or ()):
        return "eagle3"
    return None


def head_target_config(folder: str | os.PathLike, target: ModelConfig) -> ModelConfig:
    """`target` with the vocabulary size an engine folder's head drafts over (for comparing
    vocabularies before anything is loaded).

    Raises:
      ValueError: no readable ``config.json`` of an engine head, or no ``vocab_size``.
    """
    import dataclasses

    _, _, layer, where = _read_config(folder)
    return dataclasses.replace(target, vocab_size=_fields(layer, where)("vocab_size"))


def _read_config(folder: str | os.PathLike) -> tuple[str, dict[str, Any], dict[str, Any], str]:
    """``(format, config, layer, where)`` of an engine folder: its ``config.json``, the
    layer's Llama config in it (a speculators config's ``transformer_layer_config`` with
    the top-level head fields merged in) and the file's name for messages.

    Raises:
      ValueError: no ``config.json`` of an engine head, or a layer config that is not an
        object.
    """
    path = pathlib.Path(folder) / "config.json"
    fmt = engine_format(folder)
    if fmt is None:
        raise ValueError(f"{folder}: no config.json of an EAGLE-3 or speculators head.")
    config = json.loads(path.read_text())
    where = str(path)
    if fmt != "speculators":
        return fmt, config, config, where
    layer = config.get("transformer_layer_config")
    if not isinstance(layer, dict):
        raise ValueError(f"{where}: transformer_layer_config must be a JSON object.")
    layer = dict(layer)
    for key in (
        "draft_vocab_size",
        "norm_before_residual",
        "target_hidden_size",
        "eagle_aux_hidden_state_layer_ids",
    ):
        if key in config:
            layer.setdefault(key, config[key])
    return fmt, config, layer, where


def read_head(folder: str | os.PathLike, target: Transformer | None = None) -> EagleHead:
    """A head in any of the three layouts: jaxcert's (`save_head`), ``eagle3`` or
    ``speculators`` (`import_head`, which needs the `target`).

    Raises:
      ValueError: not a head folder; an engine folder without `target`; the errors of
        `load_head` and `import_head`.
    """
    if is_head_folder(folder):
        return load_head(folder)
    if engine_format(folder) is None:
        raise ValueError(
            f"{folder}: not a draft head (no head.json, and no config.json of an EAGLE-3 or "
            "speculators head)."
        )
    if target is None:
        raise ValueError(f"{folder}: an EAGLE-3 head folder is read against its target model.")
    return import_head(folder, target)


def import_head(folder: str | os.PathLike, target: Transformer) -> EagleHead:
    """The head an ``eagle3`` or ``speculators`` folder holds, drafting for `target`.

    The embedding is the folder's ``embed_tokens.weight`` when it has one, else the
    target's (as the engines do). Parameters keep the stored dtype (compute in it too).

    Args:
      folder: the head's folder (``config.json`` + ``model.safetensors``).
      target: the target model it drafts for (its config and embedding).

    Raises:
      ValueError: one line naming the problem: an unreadable config or weights file; a
        hidden size, vocabulary or aux layer list that does not fit the target; a missing or
        unexpected tensor, or one of the wrong shape; a ``d2t`` that is not int64 or points
        outside the vocabulary or twice at one id; a ``t2d`` that disagrees with ``d2t``.
    """
    import dataclasses

    import safetensors

    folder = pathlib.Path(folder)
    fmt, config, layer, where = _read_config(folder)
    t = target.config
    field = _fields(layer, where)
    for name, want in (
        ("vocab_size", t.vocab_size),
        ("target_hidden_size", t.hidden_size),
        ("hidden_size", t.hidden_size),
    ):
        got = field(name, **({"default": t.hidden_size} if name == "target_hidden_size" else {}))
        if got != want:
            raise ValueError(f"{where}: {name} is {got}, the target's is {want}.")
    _check_layer_options(layer, where)
    if field("num_hidden_layers", default=1) != 1:
        raise ValueError(f"{where}: num_hidden_layers must be 1 (one EAGLE-3 layer).")
    aux, shift = _aux_layers(layer, t.num_layers, where)
    heads = field("num_attention_heads")
    rope = layer.get("rope_parameters") or {}
    if not isinstance(rope, dict):
        raise ValueError(f"{where}: rope_parameters must be a JSON object.")
    theta = rope.get("rope_theta", layer.get("rope_theta", 1e4))
    head_cfg: dict[str, Any] = dict(
        num_heads=heads,
        num_kv_heads=field("num_key_value_heads", default=heads),
        head_dim=field("head_dim", default=t.hidden_size // heads),
        intermediate_size=field("intermediate_size"),
        rms_norm_eps=_positive(layer.get("rms_norm_eps", t.rms_norm_eps), "rms_norm_eps", where),
        rope_theta=_positive(theta, "rope_theta", where),
    )
    for option in ("fc_norm", "norm_before_fc", "norm_output"):
        if _flag(layer, option, where) or _flag(config, option, where):
            raise ValueError(f"{where}: {option} heads are not supported (only plain EAGLE-3).")

    try:
        with safetensors.safe_open(folder / _WEIGHTS, framework="numpy") as f:
            names = set(f.keys())
            meta = f.metadata() or {}
            stored = {name: f.get_tensor(name) for name in names}
    except Exception as e:  # safetensors' own error types: missing, corrupt or partial
        raise ValueError(f"{folder / _WEIGHTS}: cannot be read ({e}).") from e

    t_cfg = dataclasses.replace(t, **head_cfg)  # the layer's sizes, the target's vocabulary
    draft_size = field("draft_vocab_size", default=t.vocab_size)
    ids = _draft_ids(stored, draft_size, t.vocab_size, folder / _WEIGHTS)
    bias = _flag(layer, "attention_bias", where)
    expected = _tensor_map(bias, fmt)
    optional = {"embed_tokens.weight", "d2t", "t2d"}
    missing = sorted(set(expected) - names)
    extra = sorted(names - set(expected) - optional)
    if missing or extra:
        raise ValueError(
            f"{folder / _WEIGHTS}: missing tensors {missing[:6]}, unexpected {extra[:6]}."
        )
    dtypes = {stored[name].dtype.name for name in expected} | (
        {stored["embed_tokens.weight"].dtype.name} if "embed_tokens.weight" in stored else set()
    )
    if len(dtypes) != 1 or not dtypes <= {"float32", "bfloat16", "float16"}:
        raise ValueError(
            f"{folder / _WEIGHTS}: the weights must share one float dtype (float32, bfloat16 "
            f"or float16), got {sorted(dtypes)}."
        )
    param_dtype = jnp.dtype(dtypes.pop())
    if not _same_sizes(t, t_cfg):
        raise ValueError(
            f"{where}: the layer's sizes {head_cfg} differ from the target's; jaxcert runs "
            "EAGLE-3 heads whose layer has the target's heads, head dim and MLP width."
        )
    head = EagleHead(
        dataclasses.replace(t, rms_norm_eps=t_cfg.rms_norm_eps, rope_theta=t_cfg.rope_theta),
        rngs=nnx.Rngs(0),
        taps=tuple(i - shift for i in aux),
        draft_vocab=ids,
        arch="eagle3",
        dtype=param_dtype,
        param_dtype=param_dtype,
        # absent: SpecForge's layer (after); vLLM reads an absent speculators field as True
        norm_before_residual=_flag(layer, "norm_before_residual", where, fmt == "speculators"),
        attention_bias=bias,
    )
    graphdef, params = nnx.split(head)
    pure = nnx.to_pure_dict(params)
    for name, (path, transposed) in expected.items():
        value = stored[name]
        want = _at(pure, path)
        shape = tuple(want.shape[::-1]) if transposed else tuple(want.shape)
        if tuple(value.shape) != shape:
            raise ValueError(
                f"{folder / _WEIGHTS}: {name} has shape {tuple(value.shape)}, expected {shape}."
            )
        array = jnp.asarray(value, param_dtype)
        _set(pure, path, array.T if transposed else array)
    embed = stored.get("embed_tokens.weight")
    if embed is not None and tuple(embed.shape) != (t.vocab_size, t.hidden_size):
        raise ValueError(
            f"{folder / _WEIGHTS}: embed_tokens.weight has shape {tuple(embed.shape)}, expected "
            f"{(t.vocab_size, t.hidden_size)}."
        )
    source = target.embedding[...] if embed is None else embed
    _set(pure, ("embedding",), jnp.asarray(source, param_dtype))
    if _OOV_KEY in meta and head.oov_logit is not None:
        text = meta[_OOV_KEY]
        hex_ok = len(text) == 8 and all(c in "0123456789abcdef" for c in text)
        bits = np.asarray([int(text, 16) if hex_ok else 0x7FC00000], np.uint32)
        value = bits.view(np.float32)[0]
        if not np.isfinite(value):
            raise ValueError(
                f"{folder / _WEIGHTS}: metadata {_OOV_KEY}={text!r} is not a finite float32."
            )
        _set(pure, ("oov_logit",), jnp.asarray(value))
    nnx.replace_by_pure_dict(params, pure)
    return nnx.merge(graphdef, params)


def _flag(config: Mapping[str, Any], name: str, where: str, default: bool = False) -> bool:
    """A boolean field of the config (JSON ``true`` / ``false``), named when it is not one."""
    value = config.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ValueError(f"{where}: {name} must be true or false, got {value!r}.")
    return value


def _positive(value: Any, name: str, where: str) -> float:
    """A positive finite number of the config, named when it is not one."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        raise ValueError(f"{where}: {name} must be a positive number, got {value!r}.")
    return float(value)


def _check_layer_options(layer: Mapping[str, Any], where: str) -> None:
    """Refuses config fields that would change the layer jaxcert runs."""
    model_type = layer.get("model_type", "llama")
    if model_type != "llama":
        raise ValueError(f"{where}: model_type {model_type!r}; jaxcert runs Llama EAGLE-3 layers.")
    if layer.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{where}: hidden_act {layer['hidden_act']!r}; only silu is supported.")
    if layer.get("rope_scaling") not in (None, {}):
        raise ValueError(f"{where}: rope_scaling is not supported.")
    rope = layer.get("rope_parameters")
    if isinstance(rope, dict) and rope.get("rope_type", "default") != "default":
        raise ValueError(
            f"{where}: rope_parameters.rope_type {rope['rope_type']!r} is not supported."
        )
    for name in ("mlp_bias", "tie_word_embeddings"):
        if _flag(layer, name, where):
            raise ValueError(f"{where}: {name} is not supported in an EAGLE-3 head.")


def _aux_layers(layer: Mapping[str, Any], n: int, where: str) -> tuple[list[int], int]:
    """The three aux layers in ascending order (the engines concatenate the states in layer
    order) and the count they use: 1 for the layer entered (top level), 0 for the layer left
    (``eagle_config``)."""
    name = "eagle_aux_hidden_state_layer_ids"
    top = layer.get(name)
    nested = layer.get("eagle_config")
    if nested is not None and not isinstance(nested, dict):
        raise ValueError(f"{where}: eagle_config must be a JSON object, got {nested!r}.")
    inner = None if nested is None else nested.get(name)
    if top is not None:
        aux, shift, field = top, 1, name
        if inner is not None and (
            not isinstance(inner, list)
            or not isinstance(top, list)
            or sorted(i + 1 for i in inner if isinstance(i, int)) != sorted(top)
        ):
            raise ValueError(f"{where}: {name} {top!r} and eagle_config's {inner!r} disagree.")
    elif inner is not None:
        aux, shift, field = inner, 0, f"eagle_config.{name}"
    else:
        return list(engine_taps(n)), 0  # the engines' default
    if (
        not isinstance(aux, list)
        or len(aux) != 3
        or any(
            isinstance(i, bool) or not isinstance(i, int) or not shift <= i < n + shift for i in aux
        )
        or len(set(aux)) != 3
    ):
        raise ValueError(
            f"{where}: {field} must be three distinct target layers in [{shift}, {n + shift}), "
            f"got {aux!r}."
        )
    return sorted(aux), shift


def _same_sizes(a: ModelConfig, b: ModelConfig) -> bool:
    keys = ("num_heads", "num_kv_heads", "head_dim", "intermediate_size")
    return all(getattr(a, k) == getattr(b, k) for k in keys)


def _fields(config: Mapping[str, Any], where: str) -> Callable[..., int]:
    """A reader of the config's integer fields that names a missing or non-integer one."""
    missing = object()

    def field(name: str, default: Any = missing) -> int:
        value = config.get(name, default)
        if value is missing or value is None and default is missing:
            raise ValueError(f"{where}: no {name}.")
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{where}: {name} must be a positive integer, got {value!r}.")
        return value

    return field


def _draft_ids(
    stored: Mapping[str, np.ndarray], size: int, vocab: int, where: pathlib.Path
) -> np.ndarray | None:
    """The sorted target ids `[V']` of the draft vocabulary from ``d2t`` (``None``: the full
    vocabulary), after checking ``d2t`` and ``t2d``."""
    d2t, t2d = stored.get("d2t"), stored.get("t2d")
    if d2t is None:
        if size != vocab:
            raise ValueError(f"{where}: no d2t, but draft_vocab_size {size} < vocab_size {vocab}.")
        if t2d is not None and not (t2d.dtype == np.bool_ and bool(t2d.all())):
            raise ValueError(f"{where}: t2d marks ids outside a full draft vocabulary.")
        return None
    if d2t.dtype != np.int64:
        raise ValueError(f"{where}: d2t must be int64, got {d2t.dtype}.")
    if d2t.shape != (size,):
        raise ValueError(f"{where}: d2t has shape {d2t.shape}, draft_vocab_size is {size}.")
    ids = np.arange(size, dtype=np.int64) + d2t
    bad = ids[(ids < 0) | (ids >= vocab)]
    if bad.size:
        raise ValueError(f"{where}: d2t points outside the vocabulary [0, {vocab}): {bad[:5]}.")
    if np.unique(ids).size != ids.size:
        raise ValueError(f"{where}: d2t maps two draft ids to one target id.")
    if np.any(np.diff(ids) < 0):
        raise ValueError(f"{where}: d2t's target ids are not increasing (the engines' order).")
    if t2d is not None:
        if t2d.dtype != np.bool_ or t2d.shape != (vocab,):
            raise ValueError(f"{where}: t2d must be bool [{vocab}], got {t2d.dtype} {t2d.shape}.")
        want = _t2d(ids, vocab)
        if not np.array_equal(t2d, want):
            diff = np.flatnonzero(t2d != want)
            raise ValueError(f"{where}: t2d disagrees with d2t at target ids {diff[:5]}.")
    if size == vocab:
        return None
    return ids
