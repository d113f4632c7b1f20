"""The decoder's drafters: one object per drafting method, behind one protocol.

:class:`~jaxcert.decoding.drafters.base.Drafter` says everything the decoder's loop calls of
a drafter; :func:`for_model` wraps a split model in the object for its method (the one
place that tells the methods apart):

- :class:`~jaxcert.decoding.drafters.model.ModelDrafter`: a language model that reads the
  text (``decoding.protocols.DecoderModel``);
- :class:`~jaxcert.decoding.drafters.head.HeadDrafter`: an EAGLE head that reads the
  target's states (``decoding.protocols.FeatureDrafter``);
- :class:`~jaxcert.decoding.drafters.lookup.LookupDrafter`: prompt lookup, one-hot
  proposals read from the text (``decoding.protocols.ProposingDrafter``).
"""

from flax import nnx

from jaxcert.decoding.drafters.base import Drafter
from jaxcert.decoding.drafters.head import HeadDrafter
from jaxcert.decoding.drafters.lookup import LookupDrafter
from jaxcert.decoding.drafters.model import ModelDrafter
from jaxcert.decoding.protocols import reads_target

__all__ = ["Drafter", "HeadDrafter", "LookupDrafter", "ModelDrafter", "for_model"]


def for_model(graphdef: nnx.GraphDef, module) -> Drafter:
    """The drafter object of a split model: a head if it reads the target's states
    (:func:`~jaxcert.decoding.protocols.reads_target`), prompt lookup if it proposes
    tokens, else a language model."""
    if reads_target(module):
        return HeadDrafter(graphdef, tuple(int(i) for i in module.taps))
    if getattr(module, "proposes_tokens", False):
        return LookupDrafter(graphdef)
    return ModelDrafter(graphdef)
