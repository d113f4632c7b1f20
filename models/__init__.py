"""Llama / Qwen2 / Qwen3 decoders in Flax NNX with a KV cache, and their loaders.

Installed as ``jaxcert.models`` (the repository keeps it in the top-level folder ``models/``).
``jaxcert.models.eagle`` adds an EAGLE-1/-3 draft head (`EagleHead`; `save_head`, `load_head`).

Shape letters, one meaning each across this package (and the same as in ``jaxcert``):

=====  =========================================  =====  ==================================
B      batch rows                                 E      hidden (model) width
T      new tokens of one call                     F      MLP width
S      cache slots                                H      query heads
V      vocabulary                                 G      key/value heads
L      layers                                     J      query heads per key/value head
P      entries kept by ``KVCache.select``         D      head dim
Q      flattened query width ``H * D``            O      a projection's output width
=====  =========================================  =====  ==================================

Example::

  from flax import nnx
  import jax
  from jaxcert import models

  lm = models.load("qwen2.5-coder-0.5b-instruct")
  graphdef, params = nnx.split(lm.model)
  cache = models.KVCache.create(lm.config, batch_size=1, max_length=512)
  step = jax.jit(models.forward, static_argnums=0, donate_argnames="cache")
  logits, cache = step(graphdef, params, tokens, cache)   # tokens: [1, T] int32
  cache = cache.commit(tokens.shape[1])

On several devices (`jaxcert.models.sharding`: tensor parallel over a ``"model"`` mesh axis,
data parallel over ``"data"``; ``Auto`` axes)::

  mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
  lm = models.load("qwen2.5-coder-0.5b-instruct", mesh=mesh)   # each weight onto its shards
  cache = models.KVCache.create(lm.config, batch_size=2, max_length=512, mesh=mesh)
  # or: model = models.shard(model, mesh) for a model already in memory
"""

from jaxcert.models._load import (
    check_context_length,
    check_same_vocabulary,
    config_of,
    load,
    model_path,
    read_config,
)
from jaxcert.models._weights import LoadedModel
from jaxcert.models.cache import KVCache
from jaxcert.models.config import ModelConfig
from jaxcert.models.eagle import EagleHead
from jaxcert.models.gguf import load_gguf
from jaxcert.models.hf import load_hf
from jaxcert.models.sharding import LOGICAL_RULES, Layout, shard
from jaxcert.models.transformer import Transformer, decode_step, forward, truncate

__all__ = [
    "LOGICAL_RULES",
    "EagleHead",
    "KVCache",
    "Layout",
    "LoadedModel",
    "ModelConfig",
    "Transformer",
    "check_context_length",
    "check_same_vocabulary",
    "config_of",
    "decode_step",
    "forward",
    "model_path",
    "load",
    "load_gguf",
    "load_hf",
    "read_config",
    "shard",
    "truncate",
]
