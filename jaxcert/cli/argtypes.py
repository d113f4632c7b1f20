"""argparse types built on :mod:`jaxcert.base.validate`: the command line rejects out-of-range
values when it is parsed, with the library's own checks."""

from __future__ import annotations

from jaxcert.base.validate import argtype, check_float, check_int, check_probability

__all__ = ["positive", "non_negative", "unit_float", "positive_float", "non_negative_float"]

positive = argtype(check_int)
non_negative = argtype(check_int, low=0)
unit_float = argtype(check_probability, float)
positive_float = argtype(check_float, float, strict=True)
non_negative_float = argtype(check_float, float)
