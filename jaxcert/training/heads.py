"""The trainable head, the drafter that carries it, and a model's lm_head alone (nnx modules)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

import jax
import jax.numpy as jnp
from flax import nnx

from jaxcert.models import Transformer
from jaxcert.models.transformer import lm_head_logits

if TYPE_CHECKING:
    from jaxcert.models import KVCache, ModelConfig

__all__ = ["DraftHead", "HeadedDrafter", "LmHead", "Projection", "project"]


class LmHead(Protocol):
    """What training and evaluation read of a model: its ``config`` and its lm_head.

    ``models.Transformer``, :class:`HeadedDrafter` and :class:`Projection` all qualify
    (an ``nnx.Module``, so it splits into ``graphdef`` and ``params``).
    """

    config: ModelConfig

    def project(self, hidden: jax.Array) -> jax.Array:
        """``[..., E]`` final-norm hidden states -> ``[..., V]`` float32 logits."""
        ...


class DraftHead(nnx.Module):
    """``h + W_out silu(W_in h)`` on ``[..., E]`` hidden states; ``W_out`` starts at zero.

    At initialisation the head is the identity, so a headed drafter starts exactly as
    the plain drafter.
    """

    def __init__(self, hidden_size: int, width: int, *, rngs: nnx.Rngs) -> None:
        scale = hidden_size**-0.5
        self.w_in = nnx.Param(jax.random.normal(rngs.params(), (hidden_size, width)) * scale)
        self.w_out = nnx.Param(jnp.zeros((width, hidden_size)))  # [F, E]

    def __call__(self, hidden: jax.Array) -> jax.Array:
        h = hidden.astype(jnp.float32)
        out = h + jax.nn.silu(h @ self.w_in[...]) @ self.w_out[...]
        return out.astype(hidden.dtype)


class HeadedDrafter(nnx.Module):
    """A drafter ``models.Transformer`` with a :class:`DraftHead` before its lm_head.

    Same call signature and ``config`` as the base model, so it works with
    ``models.forward`` and the speculative decoder.
    """

    def __init__(self, base: Transformer, head: DraftHead) -> None:
        self.base = base
        self.head = head
        self.config = base.config
        self.dtype = base.dtype

    def init_cache(self, batch_size: int, max_length: int, **kwargs: Any) -> KVCache:
        """The base model's empty cache (see ``models.Transformer.init_cache``)."""
        return self.base.init_cache(batch_size, max_length, **kwargs)

    def features(
        self, tokens: jax.Array, cache: KVCache, **kwargs: Any
    ) -> tuple[jax.Array, KVCache]:
        hidden, cache = self.base.features(tokens, cache, **kwargs)
        return self.head(hidden), cache

    def project(self, hidden: jax.Array) -> jax.Array:
        return self.base.project(hidden)

    def __call__(
        self,
        tokens: jax.Array,
        cache: KVCache,
        *,
        positions: jax.Array | None = None,
        attention_mask: jax.Array | None = None,
        return_hidden: bool = False,
    ) -> tuple[jax.Array, KVCache] | tuple[jax.Array, KVCache, jax.Array]:
        hidden, cache = self.features(
            tokens, cache, positions=positions, attention_mask=attention_mask
        )
        logits = self.project(hidden)
        return (logits, cache, hidden) if return_hidden else (logits, cache)


class Projection(nnx.Module):
    """Only the lm_head of a model (``project`` and ``config``): frees the trunk's memory.

    :meth:`project` is ``models.Transformer.project``'s own computation
    (``models.transformer.lm_head_logits``) on the kept matrix.
    """

    def __init__(self, model: Transformer) -> None:
        self.tied = model.lm_head is None
        weights = model.embedding if model.lm_head is None else model.lm_head
        self.weights = nnx.Param(weights[...])  # [V, E] tied, else [E, V]
        self.layout = model.layout
        self.config = model.config

    def project(self, hidden: jax.Array) -> jax.Array:
        """``[..., E]`` final-norm hidden states -> ``[..., V]`` float32 logits (the model's)."""
        return lm_head_logits(hidden, self.weights[...], tied=self.tied, layout=self.layout)


def project(graphdef: nnx.GraphDef, params: nnx.State, hidden: jax.Array) -> jax.Array:
    """The lm_head (``project``) of the model split into ``graphdef`` and ``params``.

    Weights travel as ``params``, an argument of the jitted callers, not as closed-over
    constants (they are gigabytes).
    """
    return nnx.merge(graphdef, params).project(hidden)
