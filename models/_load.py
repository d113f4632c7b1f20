"""`load` and `read_config`: one entry point for checkpoint folders, GGUF files and asset names."""

from __future__ import annotations

import os
import pathlib

import jax.numpy as jnp
from jax.sharding import Mesh

from jaxcert.base import assets
from jaxcert.models._weights import LoadedModel
from jaxcert.models.config import ModelConfig
from jaxcert.models.gguf import gguf_config, load_gguf
from jaxcert.models.hf import hf_config, load_hf
from jaxcert.models.sharding import LOGICAL_RULES, check_mesh


def load(
    name_or_path: str | os.PathLike,
    *,
    dtype=jnp.float32,
    mesh: Mesh | None = None,
    rules=LOGICAL_RULES,
) -> LoadedModel:
    """Loads a model from a Hugging Face folder, a `.gguf` file, or a `jaxcert.base.assets` name.

    Args:
      name_or_path: a checkpoint directory (`load_hf`), a `.gguf` file (`load_gguf`), or an
        asset name such as 'qwen2.5-coder-0.5b-instruct' (fetched with `jaxcert.base.assets.fetch`,
        then `load_gguf`).
      dtype: parameter and compute dtype. The logits are float32 whatever it is, and
        jaxcert computes every verification quantity from them in float32; with bfloat16,
        though, the rounding inside the layers depends on the batch shape, so one row's
        logits differ between batch sizes (measured: 4e-2 between batch 1 and 4000 on a
        tiny model). Use float32 where results must not depend on the batch.
      mesh: place each weight directly on its shards of this `jax.sharding.Mesh` (``Auto``
        axes) as it is read; see `model_from_tensors` and `jaxcert.models.shard`.
      rules: logical -> mesh axis rules, with `mesh` (default `LOGICAL_RULES`).

    Raises:
      ValueError: nothing could be loaded: not a folder or `.gguf` file, and not a model
        asset (a prompt-set name is refused as such), or the asset could not be fetched; the
        message lists the model names. Also an ``Explicit`` mesh (see `load_hf` /
        `load_gguf` for errors of a found checkpoint).
    """
    kw = dict(dtype=dtype, mesh=mesh, rules=rules)
    if mesh is not None:
        check_mesh(mesh)  # before any download
    kind, path = _resolve(name_or_path)
    return load_hf(path, **kw) if kind == "hf" else load_gguf(path, **kw)


def read_config(name_or_path: str | os.PathLike) -> ModelConfig:
    """The `ModelConfig` of what `load` would load, without reading or dequantising weights.

    From a folder's `config.json`, or a GGUF file's header (its metadata and tensor names; a
    cheap read even of a 151,936-token vocabulary), so that settings such as the vocabulary
    size are checked before a long load. An asset name is fetched (downloaded on first use),
    as `load` would.

    Args:
      name_or_path: as for `load`.

    Returns:
      The `ModelConfig` (equal to the loaded model's config).

    Raises:
      ValueError: as `load` for names and paths; an unreadable or unsupported config.
    """
    kind, path = _resolve(name_or_path)
    return hf_config(path) if kind == "hf" else gguf_config(path)


def model_path(name_or_path: str | os.PathLike) -> pathlib.Path:
    """The checkpoint folder or `.gguf` file that `load` would read (`LoadedModel.path`),
    without reading weights: an asset name is fetched (downloaded on first use), as `load`
    would.

    Raises:
      ValueError: as `load` for names and paths.
    """
    return _resolve(name_or_path)[1]


def _resolve(name_or_path: str | os.PathLike) -> tuple[str, pathlib.Path]:
    """``("hf" | "gguf", path)`` of a folder, a `.gguf` file or a model asset (fetched).

    Raises:
      ValueError: as `load` (not a folder or `.gguf` file and no model asset, a prompt set's
        name, or a failed download).
    """
    path = pathlib.Path(name_or_path).expanduser()
    if path.is_dir():
        return "hf", path
    if path.is_file() and path.suffix == ".gguf":
        return "gguf", path
    name = str(name_or_path)
    models_ = ", ".join(assets.names("model"))
    asset = assets.ASSETS.get(name)
    if asset is not None and asset.kind != "model":
        raise ValueError(f"{name!r} is a prompt set, not a model (models: {models_})")
    if asset is None:
        what = (
            f"{name!r} is a file but not a .gguf file"
            if path.is_file()
            else f"no folder or .gguf file {name!r}"
        )
        raise ValueError(
            f"cannot load {name!r}: {what}, and it is no model name ({models_}); give a Hugging "
            "Face checkpoint folder (config.json, tokenizer, *.safetensors), a .gguf file or "
            "a model name"
        )
    try:
        return "gguf", assets.fetch(name)
    except (assets.AssetError, OSError) as e:  # download failure
        raise ValueError(f"cannot load model {name!r}: {e}") from None


def config_of(model):
    """The `ModelConfig` of a `LoadedModel`, a module with a `config`, or a config itself.

    Returns `None` for anything else (e.g. a `(graphdef, params)` pair).
    """
    if hasattr(model, "vocab_size"):  # a ModelConfig
        return model
    module = getattr(model, "model", model)
    return getattr(module, "config", None)


def check_same_vocabulary(target, drafter) -> None:
    """Raises ``ValueError`` unless target and drafter share one vocabulary (and tokenizer).

    The one vocabulary check of the package (speculative decoding, drafter training).

    Args:
      target, drafter: each a :class:`LoadedModel`, an ``nnx.Module`` with a ``config``, or a
        :class:`ModelConfig`; sides without a config (a ``(graphdef, params)`` pair) or
        without a tokenizer are not compared.

    Raises:
      ValueError: the vocabulary sizes (logit rows) differ, or both sides carry tokenizers
        whose vocabularies differ.
    """
    tc, dc = config_of(target), config_of(drafter)
    if tc is not None and dc is not None and tc.vocab_size != dc.vocab_size:
        raise ValueError(
            f"vocabulary mismatch: the target has {tc.vocab_size} logit rows, the drafter "
            f"{dc.vocab_size}; speculative decoding needs one vocabulary"
        )
    tt, dt = getattr(target, "tokenizer", None), getattr(drafter, "tokenizer", None)
    if tt is not None and dt is not None and tt.get_vocab() != dt.get_vocab():
        raise ValueError(
            f"tokenizer mismatch: the target has {len(tt)} tokens, the drafter {len(dt)}; "
            "speculative decoding needs one tokenizer"
        )


def check_context_length(
    models_: dict, *, prompt_tokens: int, new_tokens: int, draft_positions: int = 0
) -> None:
    """Raises ``ValueError`` if a run would read positions past a model's context length.

    A run reads ``prompt_tokens + new_tokens + draft_positions`` positions at most: the
    longest prompt, the new tokens, and (speculative decoding) the draft tree's depth, which
    the last rounds draft beyond the last emitted token. Past ``max_position_embeddings`` a
    model's rotary positions leave the range it was trained on and its outputs are
    meaningless, without any error of their own; this check runs before anything compiles.

    Args:
      models_: ``{"target": model, ...}``, each a :class:`LoadedModel`, a module with a
        ``config`` or a :class:`ModelConfig`; sides without a config are not checked.
      prompt_tokens: tokens of the longest prompt.
      new_tokens: new tokens per prompt (``max_new_tokens``, certify's ``--steps``).
      draft_positions: extra positions of the draft (the draft depth ``K``), ``0`` without.

    Raises:
      ValueError: naming the model, the positions needed and the ones it supports.
    """
    needed = prompt_tokens + new_tokens + draft_positions
    for name, model in models_.items():
        config = config_of(model)
        limit = getattr(config, "max_position_embeddings", None)
        if limit is not None and needed > limit:
            extra = f" plus {draft_positions} draft positions" if draft_positions else ""
            raise ValueError(
                f"context too long for the {name}: prompts of up to {prompt_tokens} tokens plus "
                f"{new_tokens} new tokens{extra} need {needed} positions, but the {name} "
                f"supports {limit} (its max_position_embeddings); use shorter prompts or "
                "fewer new tokens"
            )
