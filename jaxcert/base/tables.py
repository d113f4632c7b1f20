"""Markdown tables of dict rows, for every report that prints one."""

from __future__ import annotations

import math
from collections.abc import Sequence

__all__ = ["counted", "markdown_table"]


def counted(n: int, noun: str, plural: str | None = None, *, digits: str = "") -> str:
    """``n`` and the noun in the right number: ``counted(1, "prompt") == "1 prompt"``,
    ``counted(2, "prompt") == "2 prompts"`` (``plural``: the plural if not ``noun + "s"``;
    ``digits``: a format spec for ``n``, e.g. ``","`` gives ``"1,024 positions"``)."""
    return f"{n:{digits}} {noun if n == 1 else plural or noun + 's'}"


def markdown_table(rows: Sequence[dict], digits: int = 3, *, blank_none: bool = False) -> str:
    """Renders dict rows as a GitHub markdown table.

    The first row's keys are the columns. A float cell is written with ``digits`` decimals
    (``inf`` as ``inf``); any other cell as ``str`` (pass a string to format it yourself).
    With ``blank_none`` a ``None`` cell is left blank (``| |``; an empty string is ``|  |``).
    No rows: an empty string.
    """
    if not rows:
        return ""
    keys = list(rows[0])

    def cell(v) -> str:
        if v is None and blank_none:
            return " |"
        if isinstance(v, float):
            v = "inf" if math.isinf(v) else f"{v:.{digits}f}"
        return f" {v} |"

    lines = ["|" + "".join(f" {k} |" for k in keys), "|" + "---|" * len(keys)]
    lines += ["|" + "".join(cell(r[k]) for k in keys) for r in rows]
    return "\n".join(lines)
