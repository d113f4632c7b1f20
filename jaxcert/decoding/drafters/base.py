"""The drafter protocol: what the decoder's loop calls of a drafter, and nothing else.

A drafter object is static (hashable, holds no arrays: it is a static argument of the
jitted programs); its parameters travel beside it as a traced ``nnx.State``. Shape letters
as in :mod:`jaxcert.decoding`: ``B`` rows, ``T`` prompt width, ``S`` cache slots, ``E`` the
drafter's hidden width (what :meth:`Drafter.step` hands a drafted token's children), ``Z``
the width of the target states a drafter reads (``docs/glossary.md``).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

from jaxcert.decoding.protocols import Cache

__all__ = ["Drafter", "read_chunks"]


@runtime_checkable
class Drafter(Protocol):
    """What the decoder calls of a drafter.

    Attributes:
      graphdef: the drafter model's graph definition (``nnx.split``).
      taps: the target blocks whose states the drafter reads with every token (``()``:
        the target's final-norm hidden states), or ``None``: it reads none. The target's
        passes then return them.
      proposes_tokens: its ``q`` is one-hot, a proposal read from the text.
      keeps_drafts: after a chain round its cache already holds the accepted drafts'
        entries, so it re-reads only what follows them (a head re-reads them: their
        entries were made with its own hidden states, not the target's).
    """

    @property
    def graphdef(self) -> nnx.GraphDef: ...

    @property
    def taps(self) -> tuple[int, ...] | None: ...

    @property
    def proposes_tokens(self) -> bool: ...

    @property
    def keeps_drafts(self) -> bool: ...

    def prefill(
        self, params: nnx.State, prompt: jax.Array, lengths: jax.Array, states, *,
        slots: int, chunk: int, copies: int, width: int,
    ) -> tuple[Cache, jax.Array | None, jax.Array]:  # fmt: skip
        """Reads the ``[B, T]`` prompts (``lengths`` ``[B]``) in chunks of ``chunk`` tokens;
        ``states`` ``[B, T, Z]`` the target's states (``None`` unless :attr:`taps`).

        Returns ``(cache, context, start)``: its cache of ``B * copies`` rows and ``slots``
        slots, the ``[B, width, Z]`` target states its first re-read reads (``None``: it
        reads none), and ``[B]`` the first position that re-read reads."""
        ...

    def read(
        self, params: nnx.State, tokens: jax.Array, cache: Cache, states: jax.Array | None
    ) -> tuple[jax.Array, Cache]:
        """A re-read: ``[B, T]`` tokens (with the target's ``[B, T, Z]`` states before each,
        or ``None``) -> ``([B, T, E]`` hidden, cache)`` (nothing committed)."""
        ...

    def step(
        self, params: nnx.State, tokens: jax.Array, cache: Cache, parent: jax.Array
    ) -> tuple[jax.Array, jax.Array, Cache]:
        """One drafted token a row: ``[R]`` tokens and their parents' ``[R, E]`` hidden
        states -> ``([R, V]`` float32 logits, ``[R, E]`` hidden, cache)``."""
        ...

    def project(self, params: nnx.State, hidden: jax.Array) -> jax.Array:
        """``[..., E]`` hidden -> ``[..., V]`` float32 logits."""
        ...

    def after_round(self, context, path_states, active: jax.Array):
        """The context after a round: ``path_states`` ``[B, P, Z]`` the target's states at
        the root and the accepted path (``None`` unless :attr:`taps`), for ``active`` rows."""
        ...

    def after_step(self, context, states, at: jax.Array):
        """The context after a target-only step: ``states`` ``[B, 1, Z]`` at the token it
        read (``None`` unless :attr:`taps`) go to slot ``at`` ``[B]`` (past the end:
        dropped)."""
        ...

    def propose(self, params: nnx.State, tokens: jax.Array, length: jax.Array) -> jax.Array:
        """``[B, 2]`` int32 the proposal after ``tokens[:length]`` and its match length
        (:attr:`proposes_tokens` only)."""
        ...

    def catch_up(self, params: nnx.State, cache: Cache, tokens, length) -> Cache:
        """The cache after reading ``tokens[:length]`` without a pass (:attr:`proposes_tokens`
        only: a skipped lookup drafter is never stale)."""
        ...


def read_chunks(prompt: jax.Array, lengths: jax.Array, chunk: int, read, cache: Cache) -> Cache:
    """``cache`` after ``read(window, start, cache)`` of each ``[B, chunk]`` window of the
    ``[B, T]`` prompts that holds a prompt token (``T`` a multiple of ``chunk``); every
    window is committed in full (the caller rolls back to the lengths)."""
    count = -(-jnp.max(lengths) // chunk)  # windows that hold a token

    def body(carry):
        i, cache = carry
        window = lax.dynamic_slice_in_dim(prompt, i * chunk, chunk, axis=1)
        return i + 1, read(window, i * chunk, cache).commit(chunk)

    return lax.while_loop(lambda c: c[0] < count, body, (jnp.asarray(0, jnp.int32), cache))[1]
