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

from jaxcert.decoding.drafters.base import Drafter, for_model
from jaxcert.decoding.drafters.head import HeadDrafter
from jaxcert.decoding.drafters.lookup import LookupDrafter
from jaxcert.decoding.drafters.model import ModelDrafter

__all__ = ["Drafter", "HeadDrafter", "LookupDrafter", "ModelDrafter", "for_model"]
