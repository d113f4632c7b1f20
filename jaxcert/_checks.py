"""Argument checks shared by the config objects and public functions."""

from __future__ import annotations

__all__ = ["check_int"]


def check_int(name: str, value, low: int = 1) -> int:
    """Returns ``value`` if it is a Python ``int`` (not ``bool``) ``>= low``.

    Raises:
      ValueError: naming ``name``, otherwise.
    """
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    return value
