"""Llama / Qwen2 / Qwen3 decoders in Flax NNX with a KV cache, and their loaders.

Example::

  from flax import nnx
  import jax
  from jaxcert import models

  lm = models.load("qwen2.5-coder-0.5b-instruct")
  graphdef, state = nnx.split(lm.model)
  cache = models.KVCache.create(lm.config, batch_size=1, max_length=512)
  step = jax.jit(models.forward, static_argnums=0, donate_argnames="cache")
  logits, cache = step(graphdef, state, tokens, cache)   # tokens: [1, T] int32
  cache = cache.commit(tokens.shape[1])
"""

from jaxcert.models._load import load
from jaxcert.models._weights import LoadedModel
from jaxcert.models.cache import KVCache
from jaxcert.models.config import ModelConfig
from jaxcert.models.gguf import load_gguf
from jaxcert.models.hf import load_hf
from jaxcert.models.transformer import Transformer, forward, truncate

__all__ = [
    "KVCache",
    "LoadedModel",
    "ModelConfig",
    "Transformer",
    "forward",
    "load",
    "load_gguf",
    "load_hf",
    "truncate",
]
