"""Tiny models and prompts for the decoder tests (float32, vocabulary 48, 2 layers).

A module of its own (not `conftest`) so that test modules can import it by a unique name.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxcert.models import ModelConfig
from jaxcert.models._weights import hf_layout
from jaxcert.models.transformer import Transformer
from tests.helpers import tiny_models
from tests.helpers.tiny_models import tiny_config

CONFIG = tiny_config(vocab_size=48)
PROMPTS = [[5, 17, 3, 44, 9], [1, 2, 3, 4, 5, 6, 7, 8, 9], [30, 12, 7]]
WIDTH = 9  # every run pads prompts to this width, so equal batch sizes share compilations
MAX_NEW = 20


def random_model(config: ModelConfig, seed: int, noise_of: Transformer | None = None, scale=0.0):
    """A `Transformer` with O(1) random weights, or `noise_of`'s weights plus `scale` noise."""
    graphdef, state = nnx.split(Transformer(config, rngs=nnx.Rngs(seed)))
    if noise_of is not None:
        _, state = nnx.split(noise_of)
    leaves, treedef = jax.tree.flatten(state)
    keys = jax.random.split(jax.random.key(seed + 1), len(leaves))
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(state)[0]]
    new = []
    for key, path, leaf in zip(keys, paths, leaves, strict=True):
        noise = jax.random.normal(key, leaf.shape, jnp.float32)
        if noise_of is not None:
            new.append(leaf + scale * noise)
        elif "scale" in path:
            new.append(1.0 + 0.1 * noise)
        else:
            new.append(0.2 * noise)
    return nnx.merge(graphdef, jax.tree.unflatten(treedef, new))


def write_gguf(model, path):
    """The model's weights under Hugging Face names, written as an f32 GGUF."""
    pure = nnx.to_pure_dict(nnx.split(model)[1])
    tensors = {}
    for name, (state_path, _) in hf_layout(model.config).items():
        value = pure
        for key in state_path:
            value = value[key]
        value = np.asarray(value)
        tensors[name] = value if state_path == ("embedding",) or value.ndim != 2 else value.T
    return tiny_models.write_gguf(path, model.config, tensors)
