"""The jaxcert cache root, shared by the assets, the GGUF dequantisation cache and others.

A leaf module (it imports nothing from jaxcert).
"""

from __future__ import annotations

import os
import pathlib

__all__ = ["cache_dir"]


def cache_dir() -> pathlib.Path:
    """The cache root: ``$JAXCERT_CACHE``, ``$XDG_CACHE_HOME/jaxcert`` or ``~/.cache/jaxcert``."""
    if os.environ.get("JAXCERT_CACHE"):
        return pathlib.Path(os.environ["JAXCERT_CACHE"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache"
    return pathlib.Path(base).expanduser() / "jaxcert"
