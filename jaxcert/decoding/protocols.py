"""What the decoder needs from a model: the surface any target or drafter must have.

:class:`jaxcert.models.Transformer` and :class:`jaxcert.models.KVCache` have it; so does
:class:`jaxcert.training.HeadedDrafter`. Any ``nnx.Module`` with this surface can be a
target or a drafter of :func:`jaxcert.decoding.speculative_decode` (the checks are
structural: ``isinstance(model, DecoderModel)`` works at run time). The model creates its
own cache (``init_cache``) and the decoder touches the cache only through :class:`Cache`'s
methods, so a cache may hold anything (key/value buffers, token history, nothing at all)
as long as it is a pytree whose leaves have the batch rows first.

Shape letters: ``B`` batch rows, ``T`` new tokens per call, ``S`` cache slots, ``E`` model
(hidden) width, ``V`` vocabulary.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import jax
from jax.typing import ArrayLike

__all__ = ["Cache", "DecoderModel", "ModelConfigLike"]


@runtime_checkable
class Cache(Protocol):
    """A pure cache of committed entries per row: every method returns a new cache.

    A model call with ``T`` new tokens writes their entries at slots ``[length, length + T)``
    and returns a cache with the same ``length``; the decoder then commits, rolls back or
    selects. Every method must work under ``jax.jit`` with traced arguments.

    Attributes:
      length: ``[B]`` int32 committed entries per row.
    """

    length: jax.Array

    def commit(self, num_tokens: ArrayLike) -> Cache:
        """Marks ``num_tokens`` (scalar or ``[B]``) more entries per row as committed."""
        ...

    def rollback(self, length: ArrayLike) -> Cache:
        """Sets the committed length (scalar or ``[B]``); later entries become stale."""
        ...

    def select(self, offsets: ArrayLike, count: ArrayLike) -> Cache:
        """Keeps one path of the last call's ``T`` entries (``offsets`` ``[B, P]``, the entry
        at ``length + offsets[b, i]`` moves to ``length + i``) and commits ``count`` ``[B]`` of
        them (draft trees)."""
        ...

    def repeat(self, times: int) -> Cache:
        """Each row ``times`` times in a row: ``B`` rows -> ``B * times`` (row ``b`` becomes
        rows ``b * times`` to ``b * times + times - 1``); one row per tree branch."""
        ...

    def take_rows(self, rows: ArrayLike) -> Cache:
        """The rows ``rows`` (``[B']`` int32 indices), in that order."""
        ...

    def copy_segments(self, src: ArrayLike, start: ArrayLike, width: int) -> Cache:
        """Row ``r``'s entries at slots ``[start[r], start[r] + width)`` become row
        ``src[r]``'s (``src``, ``start``: ``[B]`` int32; ``width`` static). A dynamic tree
        re-points a branch to another parent this way."""
        ...


@runtime_checkable
class ModelConfigLike(Protocol):
    """The config fields the decoder reads."""

    vocab_size: int
    max_position_embeddings: int


@runtime_checkable
class DecoderModel(Protocol):
    """A causal language model with a KV cache, split into trunk and lm_head.

    Attributes:
      config: a :class:`ModelConfigLike` (vocabulary size, context length).
    """

    config: ModelConfigLike

    def init_cache(self, batch_size: int, max_length: int) -> Cache:
        """An empty :class:`Cache` (all lengths 0) of ``B = batch_size`` rows and
        ``S = max_length`` slots."""
        ...

    def __call__(self, tokens: jax.Array, cache: Cache, **kwargs) -> tuple[jax.Array, Cache]:
        """``[B, T]`` int tokens -> ``([B, T, V]`` float32 logits, cache); keyword
        arguments ``positions`` ``[B, T]`` and ``attention_mask`` ``[B, T, T]`` (trees)."""
        ...

    def features(self, tokens: jax.Array, cache: Cache, **kwargs) -> tuple[jax.Array, Cache]:
        """``__call__`` without the lm_head: ``([B, T, E]`` hidden states, cache)."""
        ...

    def project(self, hidden: jax.Array) -> jax.Array:
        """The lm_head: ``[..., E]`` hidden states -> ``[..., V]`` float32 logits."""
        ...
