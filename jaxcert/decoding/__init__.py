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

from jaxcert.decoding.api import (
    DecodeCall,
    DecodeOutput,
    check_pair,
    resolved_config,
    speculative_decode,
    split_model,
    target_decode,
)
from jaxcert.decoding.config import DecodeConfig, bucket
from jaxcert.decoding.costs import CostTracker, PassCosts, calibrate
from jaxcert.decoding.ngram import NgramDrafter, TokenCache, parse_ngram
from jaxcert.decoding.policies import (
    SVIP,
    Certified,
    Confidence,
    Constant,
    Goodput,
    Heuristic,
    Policy,
    PolicyParams,
    parse_policy,
)
from jaxcert.decoding.programs import Programs, default_programs
from jaxcert.decoding.protocols import Cache, DecoderModel
from jaxcert.decoding.state import (
    DecodeState,
    DraftTree,
    NodeStats,
    PolicyState,
    RoundStats,
    Settings,
)
from jaxcert.decoding.tree import Chain, DynamicTree, StaticTree, parse_tree
from jaxcert.decoding.verify import Verification, in_accepted_set, parse_verify

__all__ = [
    "Cache",
    "DecoderModel",
    "Certified",
    "Chain",
    "Confidence",
    "Constant",
    "DecodeConfig",
    "Programs",
    "default_programs",
    "DecodeCall",
    "DecodeOutput",
    "DecodeState",
    "DraftTree",
    "DynamicTree",
    "Goodput",
    "Heuristic",
    "NgramDrafter",
    "PassCosts",
    "CostTracker",
    "NodeStats",
    "Policy",
    "PolicyParams",
    "PolicyState",
    "RoundStats",
    "SVIP",
    "Settings",
    "TokenCache",
    "StaticTree",
    "Verification",
    "bucket",
    "calibrate",
    "check_pair",
    "in_accepted_set",
    "parse_ngram",
    "parse_policy",
    "parse_tree",
    "parse_verify",
    "resolved_config",
    "speculative_decode",
    "split_model",
    "target_decode",
]
