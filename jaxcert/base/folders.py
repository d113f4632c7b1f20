"""Writing a folder whole or not at all."""

from __future__ import annotations

import contextlib
import os
import pathlib
import shutil
import tempfile
from collections.abc import Iterator

__all__ = ["new_folder"]


@contextlib.contextmanager
def new_folder(out: str | os.PathLike, *, overwrite: bool = False) -> Iterator[pathlib.Path]:
    """A temporary folder beside `out` that becomes `out` when the block ends without error.

    The block writes into the yielded folder; on success it is renamed to `out` (an existing
    `out` is removed first, with `overwrite`); on any error it is removed, and `out` is left
    as it was. So a failed write leaves nothing behind.

    Raises:
      ValueError: `out` exists and `overwrite` is false, or it is a file.
    """
    out = pathlib.Path(out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"{out} exists and is not a folder.")
    if out.exists() and not overwrite:
        raise ValueError(f"{out} exists; pass overwrite=True (--overwrite) to replace it.")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    try:
        yield tmp
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
