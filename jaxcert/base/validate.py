"""Argument checks: one home for every config object, public function and CLI type.

A leaf module (it imports nothing from jaxcert), used by ``jaxcert`` and ``jaxcert.models``
alike. Each check returns the value it accepted and raises ``ValueError`` naming the
argument otherwise; :func:`argtype` turns a check into an ``argparse`` type, so the command
line rejects what the library rejects, in the same words.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

__all__ = [
    "argtype",
    "check_float",
    "check_int",
    "check_mask_shape",
    "check_probability",
    "in_user_words",
    "parsed_by",
    "round_up",
]


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_int(name: str, value, low: int = 1) -> int:
    """Returns ``value`` if it is a Python ``int`` (not ``bool``) ``>= low``.

    Raises:
      ValueError: naming ``name``, otherwise.
    """
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    return value


def check_float(name: str, value, *, low: float = 0.0, strict: bool = False) -> float:
    """Returns ``value`` if it is a finite real number (not ``bool``) ``>= low``.

    Args:
      name: the argument's name, as the caller spells it.
      value: the value to check.
      low: the lower bound.
      strict: require ``value > low`` instead of ``>= low``.

    Raises:
      ValueError: naming ``name``, otherwise.
    """
    ok = _is_number(value) and math.isfinite(value) and (value > low if strict else value >= low)
    if not ok:
        raise ValueError(
            f"{name} must be a finite number {'>' if strict else '>='} {low:g}, got {value!r}"
        )
    return value


def check_probability(name: str, value, *, closed_right: bool = True) -> float:
    """Returns ``value`` if it is a number in ``(0, 1]`` (``(0, 1)`` if not ``closed_right``).

    Raises:
      ValueError: naming ``name``, otherwise.
    """
    ok = _is_number(value) and (0.0 < value <= 1.0 if closed_right else 0.0 < value < 1.0)
    if not ok:
        bound = "(0, 1]" if closed_right else "(0, 1)"
        raise ValueError(f"{name} must be in {bound}, got {value!r}")
    return value


def check_mask_shape(name: str, shape: tuple, expected: tuple, *, what: str) -> None:
    """Raises ``ValueError`` unless a mask of ``shape`` fits ``expected`` axis by axis.

    Each axis must equal the expected one or be 1, and the ranks must be equal: a mask is
    never broadcast from the right, where a ``[T]`` mask meant as ``[B]`` (or the converse,
    when ``B == T``) would silently mask the wrong axis.

    Args:
      name: the argument's name, as the caller spells it.
      shape: the mask's shape.
      expected: the shape it masks.
      what: what the axes are, for the message (e.g. ``"the logits' leading shape [...]"``).
    """
    shape, expected = tuple(shape), tuple(expected)
    fits = len(shape) == len(expected) and all(
        a in (b, 1) for a, b in zip(shape, expected, strict=True)
    )
    if not fits:
        raise ValueError(
            f"{name} has shape {shape}; expected {what} {expected} (each axis that size or "
            "1, same rank: a mask is not broadcast from the right, so a per-row mask of "
            "[B, T] positions is where[:, None])"
        )


def round_up(n: int, multiple: int) -> int:
    """The smallest multiple of ``multiple`` that is ``>= n`` (padded widths, cache sizes).

    >>> round_up(33, 16), round_up(32, 16)
    (48, 32)
    """
    return -(-n // multiple) * multiple


def argtype(check: Callable, parse: Callable = int, **kwargs) -> Callable[[str], object]:
    """An ``argparse`` type: ``parse(text)``, then ``check("value", parsed, **kwargs)``.

    Errors become ``argparse.ArgumentTypeError`` (argparse prefixes the option's name).
    """

    def convert(text: str):
        try:
            value = parse(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid {parse.__name__} value: {text!r}") from None
        try:
            return check("value", value, **kwargs)
        except ValueError as err:
            raise argparse.ArgumentTypeError(str(err).removeprefix("value ")) from None

    convert.__name__ = f"{parse.__name__}"
    return convert


def in_user_words(err: ValueError, names: dict[str, str]) -> str:
    """The message of a check's error with the Python name replaced by the user's spelling.

    The config classes name their fields (``Additive.t must be ...``); a parser of the
    command-line grammar knows what the user typed (``T`` in ``additive:T``).

    >>> in_user_words(ValueError("Additive.t must be in (0, 1], got 1.5"), {"Additive.t": "T"})
    'T must be in (0, 1], got 1.5'
    """
    text = str(err)
    for python_name, user_name in names.items():
        if text.startswith(python_name + " "):
            return user_name + text[len(python_name) :]
    return text


def parsed_by(parse: Callable[[str], object]) -> Callable[[str], str]:
    """An ``argparse`` type that checks a spec with ``parse`` when the command line is parsed
    and keeps the text (the command parses it again where it needs the object)."""

    def convert(text: str) -> str:
        try:
            parse(text)
        except ValueError as err:
            raise argparse.ArgumentTypeError(str(err)) from None
        return text

    convert.__name__ = getattr(parse, "__name__", "spec")
    return convert
