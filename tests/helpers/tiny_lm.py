"""Tiny Hugging Face checkpoint folders built without torch, for pipeline and CLI tests."""

from __future__ import annotations

import json
import pathlib

import numpy as np
import safetensors.numpy
import transformers

from jaxcert.models._weights import hf_layout
from jaxcert.models.config import ModelConfig
from tests.helpers import tiny_models

# Four short prompts (the CLI tests that compare runs: mesh, processes).
TEXTS = ["the cat sat on the mat.", "an otter", "he is in the water, a big one!", "a, b?"]


def save_tiny_checkpoint(
    path: pathlib.Path, *, seed: int = 0, scale: float = 0.4, layers: int = 2
) -> pathlib.Path:
    """A random qwen2-architecture checkpoint (config.json, tokenizer, safetensors)."""
    tokenizer = tiny_models.hf_tokenizer()
    hf_config = transformers.AutoConfig.for_model(
        "qwen2",
        vocab_size=48,  # > the 42 tokenizer entries: padding rows, as in real Qwen checkpoints
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
    )
    path.mkdir(parents=True, exist_ok=True)
    hf_config.save_pretrained(path)
    config = ModelConfig.from_hf(json.loads((path / "config.json").read_text()))
    rng = np.random.default_rng(seed)
    tensors = {}
    for name, (_, shape) in hf_layout(config).items():
        if name.endswith("norm.weight"):
            tensors[name] = np.ones(shape, np.float32)
        else:
            tensors[name] = (rng.normal(0, scale, shape) / np.sqrt(shape[-1]) * 4).astype(
                np.float32
            )
    safetensors.numpy.save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    tokenizer.save_pretrained(path)
    return path


def save_noisy_copy(
    source: pathlib.Path, path: pathlib.Path, *, scale: float = 0.08, seed: int = 5
) -> pathlib.Path:
    """A copy of the checkpoint ``source`` whose every weight has Gaussian noise of ``scale``
    times that weight's standard deviation: a drafter of its vocabulary and tokenizer, close
    enough to be certified at some positions and not at others."""
    import shutil

    shutil.copytree(source, path)
    tensors = safetensors.numpy.load_file(source / "model.safetensors")
    rng = np.random.default_rng(seed)
    noisy = {k: (v + scale * rng.normal(size=v.shape) * v.std()).astype(v.dtype)
             for k, v in tensors.items()}  # fmt: skip
    safetensors.numpy.save_file(noisy, path / "model.safetensors", metadata={"format": "pt"})
    return path


def save_nan_head_checkpoint(path: pathlib.Path) -> pathlib.Path:
    """A tiny checkpoint (:func:`save_tiny_checkpoint`'s defaults) whose lm_head is NaN: a
    drafter whose every row of logits is no distribution."""
    save_tiny_checkpoint(path)
    tensors = safetensors.numpy.load_file(path / "model.safetensors")
    tensors["lm_head.weight"] = np.full_like(tensors["lm_head.weight"], np.nan)
    safetensors.numpy.save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    return path
