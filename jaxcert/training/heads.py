"""The trainable head, the drafter that carries it, and a model's lm_head alone (nnx modules)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
from flax import nnx

if TYPE_CHECKING:
    from jaxcert.models import KVCache, Transformer

__all__ = ["DraftHead", "HeadedDrafter", "Projection", "project"]


class DraftHead(nnx.Module):
    """``h + W_out silu(W_in h)`` on ``[..., E]`` hidden states; ``W_out`` starts at zero.

    At initialisation the head is the identity, so a headed drafter starts exactly as
    the plain drafter.
    """

    def __init__(self, hidden_size: int, width: int, *, rngs: nnx.Rngs):
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

    def __init__(self, base: Transformer, head: DraftHead):
        self.base = base
        self.head = head
        self.config = base.config
        self.dtype = base.dtype

    def init_cache(self, batch_size: int, max_length: int, **kwargs) -> KVCache:
        """The base model's empty cache (see ``models.Transformer.init_cache``)."""
        return self.base.init_cache(batch_size, max_length, **kwargs)

    def features(self, tokens: jax.Array, cache: KVCache, **kwargs) -> tuple[jax.Array, KVCache]:
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
    """Only the lm_head of a model (``project`` and ``config``): frees the trunk's memory."""

    def __init__(self, model: Transformer):
        tied = model.lm_head is None
        self.weight = nnx.Param(model.embedding[...] if tied else model.lm_head[...])
        self.spec = "...E,VE->...V" if tied else "...E,EV->...V"
        self.config = model.config

    def project(self, hidden: jax.Array) -> jax.Array:
        w = self.weight[...]
        return jnp.einsum(self.spec, hidden.astype(w.dtype), w, preferred_element_type=jnp.float32)


def project(graphdef: nnx.GraphDef, state: nnx.State, hidden: jax.Array) -> jax.Array:
    """The lm_head (``project``) of the model split into ``graphdef`` and ``state``.

    Weights travel as ``state``, an argument of the jitted callers, not as closed-over
    constants (they are gigabytes).
    """
    return nnx.merge(graphdef, state).project(hidden)
