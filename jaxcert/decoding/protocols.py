"""What the decoder needs from a model: the surface any target or drafter must have.

:class:`jaxcert.models.Transformer` and :class:`jaxcert.models.KVCache` have it; so does
:class:`jaxcert.training.HeadedDrafter`. Any ``nnx.Module`` with this surface can be a
target or a drafter of :func:`jaxcert.decoding.speculative_decode` (the checks are
structural: ``isinstance(model, DecoderModel)`` works at run time).

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
    """A pure KV cache: every method returns a new cache.

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
        """Keeps one path of the last call's ``T`` entries (``offsets`` ``[B, T]``) and
        commits ``count`` ``[B]`` of them (draft trees)."""
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
      dtype: the compute dtype (the cache is created in it).
    """

    config: ModelConfigLike
    dtype: object

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
