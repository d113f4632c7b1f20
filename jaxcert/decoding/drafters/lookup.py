"""Prompt lookup as the drafter: one-hot proposals read from the text
(:class:`~jaxcert.decoding.ngram.NgramDrafter`), read before every round by ``goodput``
and caught up after skipped ones without a pass (``docs/goodput.md``, "Prompt lookup:
looking before drafting")."""

from __future__ import annotations

import dataclasses

from flax import nnx

from jaxcert.decoding.drafters.model import ModelDrafter

__all__ = ["LookupDrafter"]


@dataclasses.dataclass(frozen=True)
class LookupDrafter(ModelDrafter):
    """A :class:`~jaxcert.decoding.protocols.ProposingDrafter`: a language model's surface
    (its ``hidden`` are ``[..., 2]`` proposals and match lengths) that proposes tokens."""

    graphdef: nnx.GraphDef
    proposes_tokens = True

    def propose(self, params, tokens, length):
        return self._model(params).propose(tokens, length)

    def catch_up(self, params, cache, tokens, length):
        return self._model(params).catch_up(cache, tokens, length)
