"""A drafter's frozen-bottom states over a record store, streamed to a resumable folder.

Fine-tuning a drafter's top blocks (:mod:`jaxcert.training.finetune`) runs only those blocks
each step: the residual stream after the first ``s`` blocks is the same at every step, so it
is computed once per record shard (:mod:`jaxcert.training.head_data`) and written beside it:

==================  ===============  ======================================================
file                shape, dtype     meaning
==================  ===============  ======================================================
``states-NNNNN``    ``[B, T, E]``    the drafter's residual stream after block ``s - 1``
(safetensors)       f32              at every position of record shard ``NNNNN``
``manifest.json``                    drafter name, ``s`` (``blocks``), per shard its file
                                     and the record shard's digest
==================  ===============  ======================================================

Each shard is written under a temporary name and renamed, and the manifest rewritten after
it; a rerun skips the shards whose record shard is unchanged, so a grown store is extended,
and a folder of another drafter, ``s`` or store is refused (``docs/training.md``,
"Fine-tuning a drafter at the boundary").
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
from collections.abc import Callable
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxcert.base.folders import (
    atomic_file,
    atomic_write,
    manifest_path,
    read_manifest,
    refuse_other_options,
)
from jaxcert.base.validate import check_int
from jaxcert.training import head_data

if TYPE_CHECKING:
    from jaxcert.models import Transformer

__all__ = ["DrafterStates", "read_drafter_states", "write_drafter_states"]

STATES_VERSION = 1


@dataclasses.dataclass(frozen=True)
class DrafterStates:
    """The drafter's frozen-bottom states of a record store (its manifest).

    Attributes:
      folder: where the shards are.
      drafter: a name for the drafter (asset name or path).
      blocks: ``s``, the frozen blocks the states come after.
      shards: per record shard: ``file`` and the record shard's ``digest``.
    """

    folder: pathlib.Path
    drafter: str
    blocks: int
    shards: tuple[dict, ...]

    def load(self) -> np.ndarray:
        """``[N, T, E]`` float32, every shard in order."""
        from safetensors.numpy import load_file

        if not self.shards:
            raise ValueError(f"{self.folder}: no drafter states written yet")
        return np.concatenate([load_file(self.folder / s["file"])["states"] for s in self.shards])


def read_drafter_states(folder: str | os.PathLike) -> DrafterStates:
    """The drafter states in ``folder``.

    Raises:
      FileNotFoundError: no ``manifest.json`` there.
      ValueError: a damaged manifest or one of another version.
    """
    folder = pathlib.Path(folder)
    record = read_manifest(
        folder, version=STATES_VERSION, keys=("drafter", "blocks", "shards"), what="drafter states"
    )
    return DrafterStates(folder, record["drafter"], record["blocks"], tuple(record["shards"]))


@jax.jit(static_argnames=("graphdef", "blocks"))
def _bottom(graphdef, params, tokens, *, blocks):
    model = nnx.merge(graphdef, params)
    cache = model.init_cache(tokens.shape[0], tokens.shape[1])
    _, _, states = model.tapped_features(tokens, cache, (blocks - 1,))
    return states.astype(jnp.float32)


def write_drafter_states(
    drafter: Transformer,
    store: head_data.Store,
    folder: str | os.PathLike,
    *,
    blocks: int,
    name: str,
    progress: Callable[[int, int], None] | None = None,
) -> DrafterStates:
    """Writes (or resumes) the drafter's residual stream after its first ``blocks`` blocks
    at every position of ``store``'s sequences, one shard per record shard.

    Each shard is written under a temporary name and renamed, and the manifest rewritten
    after it; a rerun skips the shards whose record shard is unchanged (same digest), so a
    store grown since is extended.

    Args:
      drafter: the drafter model (its vocabulary holds the store's tokens).
      store: the target's record store.
      folder: the states' folder (created if missing).
      blocks: ``s`` in ``[1, L)``: the blocks below the fine-tuned ones.
      name: the drafter's name (asset or path), recorded and checked on resume.
      progress: called as ``progress(shards_done, shards)`` after each shard.

    Returns:
      The manifest.

    Raises:
      ValueError: ``blocks`` outside ``[1, L)``; a folder written for another drafter or
        ``blocks``, or from other record shards; a token outside the drafter's vocabulary.
    """
    from safetensors.numpy import load_file, save_file

    check_int("blocks", blocks)
    layers = drafter.config.num_layers
    if not 1 <= blocks < layers:
        raise ValueError(f"blocks must be in [1, {layers}) (the drafter's blocks), got {blocks}")
    folder = pathlib.Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    done: list[dict] = []
    if manifest_path(folder).is_file():
        old = read_drafter_states(folder)
        refuse_other_options(
            folder,
            {"drafter": old.drafter, "blocks": old.blocks},
            {"drafter": name, "blocks": blocks},
            advice="use another folder",
        )
        for mine, theirs in zip(old.shards, store.shards, strict=False):
            if mine["digest"] != theirs["digest"]:
                raise ValueError(f"{folder}: written from other record shards than {store.folder}")
            done.append(mine)
    graphdef, params = nnx.split(drafter)
    vocab = drafter.config.vocab_size

    def manifest() -> None:
        record = {"version": STATES_VERSION, "drafter": name, "blocks": blocks, "shards": done}
        atomic_write(manifest_path(folder), json.dumps(record, indent=1))

    if not manifest_path(folder).is_file():
        manifest()
    for i in range(len(done), len(store.shards)):
        shard = store.shards[i]
        tokens = load_file(store.folder / shard["file"])["tokens"]
        if tokens.size and (tokens.min() < 0 or tokens.max() >= vocab):
            raise ValueError(f"record shard {i}: a token outside the drafter's vocabulary")
        states = np.asarray(_bottom(graphdef, params, jnp.asarray(tokens), blocks=blocks))
        out = f"states-{i:05d}.safetensors"
        with atomic_file(folder / out) as tmp:
            save_file({"states": np.ascontiguousarray(states)}, tmp)
        done.append({"file": out, "digest": shard["digest"]})
        manifest()
        if progress is not None:
            progress(i + 1, len(store.shards))
    return read_drafter_states(folder)
