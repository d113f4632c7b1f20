"""Speculative decoding with a target and a drafter sharing a vocabulary (jitted, batched).

Shape letters (with ``jaxcert``'s B, T, V, M):

=====  ====================================================================
S      sequence / cache slots
K      draft length (depth of a chain or tree)
N      draft-tree nodes (the root excluded)
X      expanded nodes (whose drafter distribution was computed: root and frontier)
R      rounds of one jitted call
=====  ====================================================================

Any model with the :class:`~jaxcert.decoding.protocols.DecoderModel` surface can be a
target or a drafter.

Example::

  from jaxcert import models
  from jaxcert import decoding

  target = models.load("qwen2.5-coder-1.5b-instruct")
  drafter = models.load("qwen2.5-coder-0.5b-instruct")
  config = decoding.DecodeConfig(verification=decoding.parse_verify("greedy"),
                                 max_new_tokens=64, eos_ids=(151645,))
  out = decoding.speculative_decode(target, drafter, [prompt_ids],
                                    policy=decoding.parse_policy("svip:0.3"), config=config)
"""

from jaxcert.base.programs import Programs
from jaxcert.decoding.api import DecodeCall, DecodeOutput, speculative_decode, target_decode
from jaxcert.decoding.config import DecodeConfig
from jaxcert.decoding.costs import PassCosts
from jaxcert.decoding.goodput import GoodputController
from jaxcert.decoding.ngram import NgramDrafter, parse_ngram
from jaxcert.decoding.pairing import check_pair
from jaxcert.decoding.policies import (
    SVIP,
    Certified,
    Confidence,
    Constant,
    Goodput,
    Heuristic,
    Policy,
    parse_policy,
)
from jaxcert.decoding.protocols import Cache, DecoderModel
from jaxcert.decoding.state import NodeStats, RoundStats
from jaxcert.decoding.verify import parse_verify

__all__ = [
    "SVIP",
    "Cache",
    "Certified",
    "Confidence",
    "Constant",
    "DecodeCall",
    "DecodeConfig",
    "DecodeOutput",
    "DecoderModel",
    "Goodput",
    "GoodputController",
    "Heuristic",
    "NgramDrafter",
    "NodeStats",
    "PassCosts",
    "Policy",
    "Programs",
    "RoundStats",
    "check_pair",
    "parse_ngram",
    "parse_policy",
    "parse_verify",
    "speculative_decode",
    "target_decode",
]
