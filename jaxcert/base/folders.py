"""Writing a file or a folder whole or not at all, and refusing to reuse a folder written
with other options."""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import secrets
import shutil
import tempfile
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

__all__ = [
    "atomic_file",
    "atomic_write",
    "check_new_folder",
    "check_options",
    "check_writable",
    "differing_options",
    "manifest_path",
    "new_folder",
    "read_manifest",
    "refuse_other_options",
]


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


def check_writable(path: str | os.PathLike, option: str) -> pathlib.Path:
    """Checks, before any work, that a command can write the folder `path` (it need not
    exist): `path` is no file and its nearest existing folder (itself or one above) is a
    writable folder, which is returned.

    Args:
      path: the folder to be written.
      option: the option that named it, for the errors (``"--out"``).

    Raises:
      ValueError: ``"OPTION PATH is a file, not a folder"``, or ``"OPTION PATH: ABOVE is not
        a writable folder"`` (a file above it, or no write permission).
    """
    path = pathlib.Path(path)
    if path.exists() and not path.is_dir():
        raise ValueError(f"{option} {path} is a file, not a folder")
    parent = path.absolute()
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        raise ValueError(f"{option} {path}: {parent} is not a writable folder")
    return parent


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


@contextlib.contextmanager
def atomic_file(
    path: str | os.PathLike,
    *,
    fsync: bool = True,
    keep_on_error: str | os.PathLike | None = None,
) -> Iterator[pathlib.Path]:
    """A new, empty temporary file beside `path` that becomes `path` when the block ends
    without error.

    The block writes the yielded file (by its path, or by opening it); on success it is
    flushed to disk (with `fsync`) and renamed over `path` in one step, so a reader, or a
    run killed at any moment (``kill -9`` included), sees the old `path` or the new one,
    never a part. On any error the temporary file is removed and `path` is left as it was.
    The temporary name is hidden, unique and ends in ``.tmp`` (``.NAME.RANDOM.tmp``): two
    writers never share one, and ``.*.tmp`` finds a leftover of a killed run.

    Args:
      path: the file to write; its folder must exist.
      fsync: flush the file to disk before the rename (survives a power cut, not only a kill).
      keep_on_error: on an error, a non-empty temporary file is renamed to this path (what
        was written is kept there, e.g. the rows computed before a failure) instead of
        being removed; `path` is still left as it was.

    Raises:
      OSError: the temporary file cannot be created, written or renamed (``path`` unchanged).
    """
    path = pathlib.Path(path)
    while True:  # a unique name, created with the ordinary permissions (umask), unlike mkstemp
        tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
        try:
            os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
            break
        except FileExistsError:
            continue
    try:
        yield tmp
        if fsync:
            fd = os.open(tmp, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        if keep_on_error is not None and tmp.exists() and tmp.stat().st_size:
            os.replace(tmp, keep_on_error)
        raise
    finally:
        tmp.unlink(missing_ok=True)


def atomic_write(
    path: str | os.PathLike, data: bytes | str, *, fsync: bool = True, encoding: str = "utf-8"
) -> None:
    """Writes `data` (bytes, or text in `encoding`) to `path` whole or not at all
    (:func:`atomic_file`: a temporary file beside it, then a rename).

    Raises:
      OSError: as :func:`atomic_file` (``path`` unchanged).
    """
    raw = data.encode(encoding) if isinstance(data, str) else data
    with atomic_file(path, fsync=fsync) as tmp:
        tmp.write_bytes(raw)


def differing_options(saved: Mapping, now: Mapping, prefix: str = "") -> list[str]:
    """The names of the options that differ between `saved` and `now` (a key missing on
    one side differs), sorted; where both values are mappings, their differing keys are
    named too, as ``key.sub`` (after ``key``)."""
    out = []
    for key in sorted(set(saved) | set(now), key=str):
        a, b = saved.get(key), now.get(key)
        if a != b:
            out.append(f"{prefix}{key}")
            if isinstance(a, Mapping) and isinstance(b, Mapping):
                out += differing_options(a, b, prefix=f"{prefix}{key}.")
    return out


def _shown(value: Any, width: int = 40) -> str:
    text = repr(value)
    return text if len(text) <= width else text[: width - 3] + "..."


def refuse_other_options(
    folder: str | os.PathLike, saved: Mapping, now: Mapping, *, advice: str
) -> None:
    """Raises the one error for reusing `folder` with options other than those it was
    written with (`saved`); does nothing when `saved == now`.

    Args:
      folder: named in the error.
      saved, now: the options, as mappings (nested mappings are compared key by key).
      advice: what to do instead (e.g. ``"rerun with the same options, or --overwrite"``).

    Raises:
      ValueError: ``"FOLDER was written with other options: NAME (then A, now B), ...;
        ADVICE"``, each differing option named with both values (long ones cut short;
        ``unset`` where one side does not record the option).
    """
    names = differing_options(saved, now)
    if not names:
        return
    leaves = [n for n in names if not any(m.startswith(n + ".") for m in names)]

    def shown(options: Mapping, name: str) -> str:
        for part in name.split("."):
            if not isinstance(options, Mapping) or part not in options:
                return "unset"  # a key one side does not record
            options = options[part]
        return _shown(options)

    shown_all = ", ".join(f"{n} (then {shown(saved, n)}, now {shown(now, n)})" for n in leaves)
    raise ValueError(f"{folder} was written with other options: {shown_all}; {advice}")


def check_options(
    folder: str | os.PathLike,
    options: Mapping,
    *,
    name: str = "options.json",
    advice: str = "choose another folder",
    record: bool = True,
) -> None:
    """Records `options` in ``folder / name`` (JSON), or, when the folder already records
    some, checks they are the same: a folder is reused only with the options it was
    written with. The folder is created if needed; the record is written atomically.
    With ``record=False`` only the check is made (nothing is written).

    Args:
      folder: the run's or output's folder.
      options: JSON-able options (compared after a JSON round trip: tuples equal lists).
      name: the record's file name in `folder`.
      advice: the error's last words (:func:`refuse_other_options`).

    Raises:
      ValueError: the folder records other options (each named, with both values), or its
        record is not a JSON object.
    """
    folder = pathlib.Path(folder)
    now = json.loads(json.dumps(dict(options), default=str))
    path = folder / name
    if path.is_file():
        try:
            saved = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise ValueError(f"{path} is corrupt ({err}); {advice}") from None
        if not isinstance(saved, dict):
            raise ValueError(f"{path} is corrupt (not a JSON object); {advice}")
        refuse_other_options(folder, saved, now, advice=advice)
        return
    if record:
        folder.mkdir(parents=True, exist_ok=True)
        atomic_write(path, json.dumps(now, indent=1) + "\n")


def manifest_path(folder: str | os.PathLike) -> pathlib.Path:
    """Where a streamed folder (a record store, a drafter's states) keeps its manifest."""
    return pathlib.Path(folder) / "manifest.json"


def read_manifest(
    folder: str | os.PathLike, *, version: int, keys: tuple[str, ...], what: str
) -> dict:
    """The ``manifest.json`` of a streamed folder (a record store, a drafter's states): a
    JSON object of ``version`` holding ``keys``.

    Args:
      folder: the folder.
      version: the format version the reader knows.
      keys: the fields the reader needs.
      what: what the folder holds, for the error (``"head-record store"``).

    Raises:
      FileNotFoundError: no ``manifest.json`` there.
      ValueError: a manifest that is no JSON object, lacks one of ``keys`` (each named
        with the file, in one line), or is of another version.
    """
    path = manifest_path(folder)
    if not path.is_file():
        raise FileNotFoundError(f"{folder}: no {what} (manifest.json) there")
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise ValueError(f"{path} is damaged ({err}); move the folder away") from None
    if not isinstance(record, dict) or any(k not in record for k in keys):
        raise ValueError(f"{path} is damaged (it lacks {', '.join(keys)}); move the folder away")
    if record.get("version") != version:
        raise ValueError(f"{path}: version {record.get('version')}, expected {version}")
    return record
