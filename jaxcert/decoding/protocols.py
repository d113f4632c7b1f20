"""What the decoder needs from a model: the surface any target or drafter must have.

:class:`jaxcert.models.Transformer` and :class:`jaxcert.models.KVCache` have it; so does
:class:`jaxcert.training.HeadedDrafter`. Any ``nnx.Module`` with this surface can be a
target or a drafter of :func:`jaxcert.decoding.speculative_decode` (the checks are
structural: ``isinstance(model, DecoderModel)`` works at run time). The model creates its
own cache (``init_cache``) and the decoder touches the cache only through the methods of
:class:`Cache` (defined beside ``KVCache`` in :mod:`jaxcert.models.cache`, re-exported
here), so a cache may hold anything (key/value buffers, a token history, nothing at all) as
long as it is a pytree.

Shape letters: ``B`` batch rows, ``T`` new tokens per call, ``S`` cache slots, ``E`` model
(hidden) width, ``V`` vocabulary.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import jax
import jax.numpy as jnp

from jaxcert.models.cache import Cache

__all__ = [
    "Cache",
    "DecoderModel",
    "FeatureDrafter",
    "ModelConfigLike",
    "ProposingDrafter",
    "TappedTarget",
    "context_before",
    "reads_target",
    "shifted_right",
]


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


@runtime_checkable
class TappedTarget(DecoderModel, Protocol):
    """A target that can feed a draft head (:class:`FeatureDrafter`): :class:`DecoderModel`'s
    surface and the residual streams after chosen blocks."""

    def tapped_features(
        self, tokens: jax.Array, cache: Cache, taps: tuple[int, ...], **kwargs
    ) -> tuple[jax.Array, Cache, jax.Array]:
        """:meth:`features` and the states after the blocks ``taps``, concatenated:
        ``(hidden [B, T, E], cache, [B, T, len(taps) * E])`` (``[B, T, 0]`` for ``()``)."""
        ...


@runtime_checkable
class FeatureDrafter(Protocol):
    """A draft head that reads the target's hidden states (EAGLE): :class:`DecoderModel`'s
    surface, with a ``context`` for every token it reads.

    The head reads token ``x_t`` with the feature of the position before it: the target's
    states at ``t - 1`` (through :meth:`fuse`) for tokens the target has verified, its own
    hidden output at the parent node for drafted ones. The decoder hands it the target's
    states of each round's accepted path and re-reads those tokens with them
    (``docs/design.md``, "Draft heads").

    Attributes:
      taps: the target blocks whose residual streams it fuses (``()``: the target's
        final-norm hidden states, ``[B, T, E]``).
    """

    config: ModelConfigLike
    taps: tuple[int, ...]

    def init_cache(self, batch_size: int, max_length: int) -> Cache: ...

    def fuse(self, target_states: jax.Array) -> jax.Array:
        """``[B, T, Z]`` target states (``Z = len(taps) * E``, or ``E``) -> ``[B, T, E]``."""
        ...

    def features(
        self, tokens: jax.Array, cache: Cache, *, context: jax.Array, **kwargs
    ) -> tuple[jax.Array, Cache]:
        """``[B, T]`` tokens and their ``[B, T, E]`` context -> ``([B, T, E]`` hidden, cache)."""
        ...

    def project(self, hidden: jax.Array) -> jax.Array:
        """``[..., E]`` hidden states -> ``[..., V]`` float32 logits (the full vocabulary)."""
        ...


@runtime_checkable
class ProposingDrafter(Protocol):
    """A drafter that proposes tokens from the text alone (prompt lookup,
    :class:`~jaxcert.decoding.ngram.NgramDrafter`): :class:`DecoderModel`'s surface with a
    one-hot ``q``, marked by ``proposes_tokens = True``, and two more methods that
    ``goodput`` uses to read it before every round and to skip it without its falling
    behind (``docs/goodput.md``, "Prompt lookup: looking before drafting").
    """

    proposes_tokens: bool

    def propose(self, tokens: jax.Array, length: jax.Array) -> jax.Array:
        """``[B, S]`` tokens, ``[B]`` lengths -> ``[B, 2]`` int32 (the proposal for the
        token after ``tokens[:length]``, its match length; ``(-1, 0)``: none)."""
        ...

    def catch_up(self, cache: Cache, tokens: jax.Array, length: jax.Array) -> Cache:
        """The cache after reading ``tokens[:length]``, without a pass."""
        ...


class _Fuses(Protocol):
    def fuse(self, target_states: jax.Array) -> jax.Array: ...


def context_before(head: _Fuses, target_states: jax.Array) -> jax.Array:
    """The feature each token of a teacher-forced sequence reads: ``[B, T, E]`` with row
    ``t`` the fused target states at ``t - 1`` and zeros at ``t = 0`` (no position before
    it). The decoder's prefill and the head's training both read tokens this way.

    Args:
      head: the draft head (its :meth:`FeatureDrafter.fuse`).
      target_states: ``[B, T, Z]`` the target's states after reading each token.
    """
    return shifted_right(head.fuse(target_states))  # [B, T, E]


def shifted_right(features: jax.Array) -> jax.Array:
    """``[B, T, E]`` features moved one position later: row ``t`` holds row ``t - 1``, row 0
    zeros. What a head reads at ``t`` is the feature of ``t - 1``: the fused target states
    (:func:`context_before`) or, in training-time test, its own earlier pass's hidden state
    (``jaxcert.training.eagle.unrolled_features``)."""
    return jnp.concatenate([jnp.zeros_like(features[:, :1]), features[:, :-1]], axis=1)


def reads_target(model: object) -> bool:
    """Whether ``model`` drafts from the target's hidden states (a :class:`FeatureDrafter`)."""
    return hasattr(model, "fuse") and hasattr(model, "taps")
