"""A language model as the drafter: it reads the text, one token at a time when drafting."""

from __future__ import annotations

import dataclasses

import jax
from flax import nnx

from jaxcert.decoding.drafters.base import read_chunks
from jaxcert.decoding.protocols import Cache

__all__ = ["ModelDrafter"]


@dataclasses.dataclass(frozen=True)
class ModelDrafter:
    """A :class:`~jaxcert.decoding.protocols.DecoderModel` drafting for the target
    (:class:`~jaxcert.decoding.drafters.base.Drafter`).

    Its cache reads every prompt token but the last two (the first round re-reads them);
    after a chain round it keeps the accepted drafts' entries.
    """

    graphdef: nnx.GraphDef
    taps = None
    proposes_tokens = False
    keeps_drafts = True

    def _model(self, params):
        return nnx.merge(self.graphdef, params)

    def prefill(self, params, prompt, lengths, states, *, slots, chunk, copies, width):
        model = self._model(params)
        cache = model.init_cache(prompt.shape[0], slots)
        cache = read_chunks(prompt, lengths, chunk, lambda w, _, c: model.features(w, c)[1], cache)
        return cache.rollback(lengths - 2).repeat(copies), None, lengths - 2

    def read(self, params, tokens, cache: Cache, states):
        return self._model(params).features(tokens, cache)

    def step(self, params, tokens, cache: Cache, parent):
        model = self._model(params)
        hidden, cache = model.features(tokens[:, None], cache)
        return model.project(hidden[:, 0]), hidden[:, 0], cache

    def project(self, params, hidden: jax.Array) -> jax.Array:
        return self._model(params).project(hidden)

    def after_round(self, context, path_states, active):
        return context

    def after_step(self, context, states, at):
        return context

    def propose(self, params, tokens, length):
        raise NotImplementedError("a language-model drafter proposes no tokens")

    def catch_up(self, params, cache, tokens, length):
        raise NotImplementedError("a language-model drafter catches up in its re-read")
