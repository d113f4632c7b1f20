"""Writing a folder whole or not at all."""

from __future__ import annotations

import contextlib
import os
import pathlib
import shutil
import tempfile
from collections.abc import Iterable, Iterator

__all__ = ["check_new_folder", "new_folder"]


def check_new_folder(
    out: str | os.PathLike,
    *,
    overwrite: bool = False,
    keep: Iterable[str | os.PathLike] = (),
) -> pathlib.Path:
    """`out` as an absolute path if `new_folder` may write it (see there); nothing is
    written, so a command can check its ``--out`` before loading anything.

    Raises:
      ValueError: as `new_folder`.
    """
    given = out
    out = pathlib.Path(os.path.abspath(os.fspath(out) or "."))
    if out.exists() and not out.is_dir():
        raise ValueError(f"{given} exists and is not a folder.")
    for parent in out.parents:
        if parent.exists() and not parent.is_dir():
            raise ValueError(f"{given}: {parent} is not a folder.")
    guarded = [pathlib.Path.cwd(), *(pathlib.Path(os.path.abspath(k)) for k in keep)]
    if (
        out == out.parent
        or out == pathlib.Path.home()
        or any(g == out or out in g.parents for g in guarded)
    ):
        raise ValueError(
            f"{given} is the working folder, the home folder, a root or holds what is being "
            "written out; choose a new folder."
        )
    if out.exists() and not overwrite:
        raise ValueError(f"{given} exists; pass overwrite=True (--overwrite) to replace it.")
    return out


@contextlib.contextmanager
def new_folder(
    out: str | os.PathLike,
    *,
    overwrite: bool = False,
    keep: Iterable[str | os.PathLike] = (),
) -> Iterator[pathlib.Path]:
    """A temporary folder beside `out` that becomes `out` when the block ends without error.

    The block writes into the yielded folder; on success it is renamed to `out` (an existing
    `out` is removed first, with `overwrite`); on any error it is removed, and `out` is left
    as it was. So a failed write leaves nothing behind.

    Args:
      out: the folder to create.
      overwrite: replace an existing `out` folder.
      keep: paths that must survive (the sources being written out): an `out` that is or
        holds one of them is refused, as is one that holds the working directory.

    Raises:
      ValueError: `out` exists and `overwrite` is false; `out` is a file, or a folder
        above it is; `out` is a filesystem root, the home folder, holds the working
        directory or one of `keep`; the folder beside it cannot be created (each named).
    """
    given = out
    out = check_new_folder(out, overwrite=overwrite, keep=keep)
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    except OSError as e:
        raise ValueError(f"cannot write beside {given} ({e.strerror}).") from None
    try:
        yield tmp
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
