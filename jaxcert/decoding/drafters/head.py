"""An EAGLE draft head as the drafter: it reads each token with the target's states at the
position before it (``docs/design.md``, "Draft heads")."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from jaxcert.decoding.drafters.base import read_chunks
from jaxcert.decoding.protocols import Cache, context_before

__all__ = ["HeadDrafter"]


@dataclasses.dataclass(frozen=True)
class HeadDrafter:
    """A :class:`~jaxcert.decoding.protocols.FeatureDrafter` drafting for the target
    (:class:`~jaxcert.decoding.drafters.base.Drafter`).

    The target's states travel in the decode state's ``drafter_context`` ``[B, width, Z]``:
    slot ``i`` holds the states before the re-read's ``i``-th token. Its cache reads every
    prompt token but the last (re-read in the first round with the states before it).
    """

    graphdef: nnx.GraphDef
    taps: tuple[int, ...]
    proposes_tokens = False
    keeps_drafts = False

    def _model(self, params):
        return nnx.merge(self.graphdef, params)

    def prefill(self, params, prompt, lengths, states, *, slots, chunk, copies, width):
        head = self._model(params)
        b = prompt.shape[0]
        before = context_before(head, states)  # [B, T, E]: the fused states before each token

        def read(window, start, cache):
            ctx = jax.lax.dynamic_slice_in_dim(before, start, window.shape[1], axis=1)
            return head.features(window, cache, context=ctx)[1]

        cache = read_chunks(prompt, lengths, chunk, read, head.init_cache(b, slots))
        context = jnp.zeros((b, width, states.shape[-1]), states.dtype)
        context = context.at[:, 0].set(states[jnp.arange(b), lengths - 2])
        return cache.rollback(lengths - 1).repeat(copies), context, lengths - 1

    def read(self, params, tokens, cache: Cache, states):
        head = self._model(params)
        return head.features(tokens, cache, context=head.fuse(states))

    def step(self, params, tokens, cache: Cache, parent):
        head = self._model(params)
        hidden, cache = head.features(tokens[:, None], cache, context=parent[:, None])
        return head.project(hidden[:, 0]), hidden[:, 0], cache

    def project(self, params, hidden: jax.Array) -> jax.Array:
        return self._model(params).project(hidden)

    def after_round(self, context, path_states, active):
        pad = context.shape[1] - path_states.shape[1]  # room for skipped steps' states
        path_states = jnp.pad(path_states, ((0, 0), (0, pad), (0, 0)))
        return jnp.where(active[:, None, None], path_states.astype(context.dtype), context)

    def after_step(self, context, states, at):
        rows = jnp.arange(context.shape[0])
        return context.at[rows, at].set(states[:, 0].astype(context.dtype), mode="drop")

    def propose(self, params, tokens, length):
        raise NotImplementedError("a draft head proposes no tokens")

    def catch_up(self, params, cache, tokens, length):
        raise NotImplementedError("a draft head catches up in its re-read")
