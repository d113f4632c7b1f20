"""Load a Hugging Face checkpoint folder (config.json, tokenizer, safetensors weights)."""

from __future__ import annotations

import json
import os
import pathlib
from collections.abc import Iterator, Mapping

import jax.numpy as jnp
import numpy as np
import safetensors
from jax.sharding import Mesh

from jaxcert.models._weights import LoadedModel, model_from_tensors
from jaxcert.models.config import ModelConfig
from jaxcert.models.sharding import LOGICAL_RULES

_SINGLE = "model.safetensors"
_INDEX = "model.safetensors.index.json"


class SafetensorsFolder(Mapping):
    """Lazy name -> numpy array view of a single or sharded safetensors checkpoint.

    bfloat16 tensors come back as `ml_dtypes.bfloat16` numpy arrays.

    Raises:
      ValueError: the folder has neither `model.safetensors` nor `model.safetensors.index.json`,
        or the index names a missing shard.
    """

    def __init__(self, path: str | os.PathLike):
        path = pathlib.Path(path)
        if (path / _INDEX).is_file():
            weight_map = json.loads((path / _INDEX).read_text())["weight_map"]
            self._where = {name: path / shard for name, shard in weight_map.items()}
        elif (path / _SINGLE).is_file():
            try:
                with safetensors.safe_open(path / _SINGLE, framework="numpy") as f:
                    self._where = {name: path / _SINGLE for name in f.keys()}
            except Exception as e:  # safetensors' own error type: a corrupt or partial file
                raise ValueError(f"{path / _SINGLE}: not a readable safetensors file ({e}).") from e
        else:
            raise ValueError(f"{path}: no {_SINGLE} or {_INDEX} (only safetensors is supported).")
        for shard in sorted(set(self._where.values())):
            if not shard.is_file():
                raise ValueError(f"{path}: shard {shard.name} named in {_INDEX} is missing.")
        self._path = path

    def __getitem__(self, name: str) -> np.ndarray:
        if name not in self._where:
            raise KeyError(name)
        try:
            with safetensors.safe_open(self._where[name], framework="numpy") as f:
                return f.get_tensor(name)
        except Exception as e:
            raise ValueError(f"{self._where[name]}: cannot read tensor {name!r} ({e}).") from e

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)


def hf_config(path: str | os.PathLike) -> ModelConfig:
    """The `ModelConfig` of a checkpoint folder, from its `config.json`: no weights are read.

    Raises:
      ValueError: not a folder, no or an unreadable `config.json`, or an unsupported config
        (see `ModelConfig.from_hf`).
    """
    import transformers

    path = pathlib.Path(path)
    if not path.is_dir():
        raise ValueError(f"{path}: not a Hugging Face checkpoint folder.")
    if not (path / "config.json").is_file():
        raise ValueError(f"{path}: no config.json (not a Hugging Face checkpoint folder).")
    try:
        config = transformers.AutoConfig.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise ValueError(f"{path / 'config.json'}: cannot be read ({e}).") from e
    return ModelConfig.from_hf(config)


def load_hf(
    path: str | os.PathLike,
    *,
    dtype=jnp.float32,
    mesh: Mesh | None = None,
    rules=LOGICAL_RULES,
) -> LoadedModel:
    """Loads a llama / qwen2 / qwen3 checkpoint folder saved by `save_pretrained`.

    Args:
      path: folder with `config.json`, a tokenizer `AutoTokenizer` can load, and
        `model.safetensors` or sharded `model-*.safetensors` + `model.safetensors.index.json`.
      dtype: parameter and compute dtype (bfloat16 weights are converted).
      mesh: place each weight directly on its shards of this `jax.sharding.Mesh` (``Auto``
        axes) as it is read; see `model_from_tensors` and `jaxcert.models.shard`.
      rules: logical -> mesh axis rules, with `mesh` (default `LOGICAL_RULES`).

    Returns:
      A `LoadedModel`.

    Raises:
      ValueError: not a folder, unsupported config (see `ModelConfig.from_hf`), a tokenizer that
        does not load, missing / unexpected / misshapen tensors (named), or an ``Explicit``
        mesh.
    """
    import transformers

    path = pathlib.Path(path)
    config = hf_config(path)
    tokenizer_files = ("tokenizer.json", "vocab.json", "tokenizer.model")
    if not any((path / name).is_file() for name in tokenizer_files):
        raise ValueError(f"{path}: no tokenizer files ({', '.join(tokenizer_files)}).")
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    except Exception as e:
        raise ValueError(f"{path}: cannot load the tokenizer ({e}).") from e
    tensors = SafetensorsFolder(path)
    model = model_from_tensors(
        config, tensors, dtype=dtype, source=str(path), mesh=mesh, rules=rules
    )
    return LoadedModel(model=model, tokenizer=tokenizer, config=config, path=path)
