"""Streaming, resumable output of a certification run: Parquet shards plus a manifest.

Layout of an output folder::

  out/manifest.json                  what was run (fingerprint), which prompts are done
  out/positions.parquet/             a Parquet dataset: one file per shard
      part-00000.parquet             every row of a prompt is in one shard
      part-00001.parquet
      .part-00002.parquet.*.tmp      a shard being written (hidden; ignored by readers)

``pyarrow.parquet.read_table(out / "positions.parquet")`` (or ``pandas.read_parquet``, if
installed) and :func:`read_positions` (sorted by prompt, then position) read the dataset.

Guarantees:

* A shard is written to a hidden temporary file, flushed to disk, then renamed: a shard
  file is complete or absent, also after ``kill -9``. The manifest is replaced the same way
  after each shard. A resumed run takes the finished prompts from the shards themselves
  (the manifest may lag one shard behind), deletes temporary leftovers, and certifies only
  the prompts that no shard holds.
* Existing output is never overwritten silently: a folder that holds a run is refused
  unless ``resume`` (same fingerprint: target, prompts, rules and options) or
  ``overwrite`` (its jaxcert files are removed; other files are left alone).
* Nothing is created before the first shard: a run that fails before its first result
  leaves no folder behind. Memory holds at most one shard of rows.
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import shutil
import time
from collections.abc import Callable, Mapping

import pyarrow as pa
import pyarrow.parquet as pq

from jaxcert.base.folders import atomic_file, check_writable, refuse_other_options
from jaxcert.base.tables import counted

__all__ = [
    "OutputExists",
    "ShardWriter",
    "check_output",
    "drafter_fingerprint",
    "finish",
    "fingerprint_path",
    "read_positions",
    "run_fingerprint",
    "write_all",
    "MANIFEST",
    "DATASET",
]

MANIFEST = "manifest.json"
DATASET = "positions.parquet"
FORMAT = 1
# Files a certify run writes next to the dataset (removed by ``overwrite``).
REPORT_FILES = (
    "summary.md",
    "summary.csv",
    "run_lengths.csv",
    "run.json",
    "certificate_cdf.png",
    "certificate_vs_margin.png",
    "drafter.csv",
    "kl_vs_certificate.png",
)


class OutputExists(ValueError):
    """The output folder already holds a run (and neither resume nor overwrite was asked)."""


def fingerprint_path(path: str | os.PathLike) -> str:
    """A cheap content fingerprint of a checkpoint file or folder (hex sha256).

    Hashes each file's name, size, first and last MiB (``.json``/``.jinja`` files in
    full): it tells different checkpoints apart without reading gigabytes.
    """
    path = pathlib.Path(path)
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    h = hashlib.sha256()
    for f in files:
        if f.name.startswith("."):
            continue
        size = f.stat().st_size
        h.update(f"{f.relative_to(path) if path.is_dir() else f.name}:{size}\n".encode())
        with open(f, "rb") as fh:
            if f.suffix in (".json", ".jinja", ".txt"):
                h.update(fh.read())
            else:
                h.update(fh.read(1 << 20))
                if size > 2 << 20:
                    fh.seek(size - (1 << 20))
                    h.update(fh.read())
    return h.hexdigest()


def _spelling(source: str) -> str:
    """A file or folder argument by its name alone (``./x``, ``/abs/x`` and another host's
    copy are one run: the content is fingerprinted beside it); a registry name as it is."""
    path = pathlib.Path(source)
    return path.resolve().name if path.exists() else source


def _prompts_digest(prompt_set) -> str:
    h = hashlib.sha256()
    for p in prompt_set:
        h.update(json.dumps([p.id, p.text, p.category]).encode())
    return h.hexdigest()


def run_fingerprint(
    *, target: str, model_path, dtype: str, prompts: str, prompt_set, turn: int, **settings
) -> dict:
    """What a resumed run, and every process of a multi-process run, must agree on.

    The target and prompt set by name (:func:`_spelling`) and content (:func:`fingerprint_path`
    of ``model_path``, a digest of ``prompt_set``), the ``dtype`` and ``turn``, then
    ``settings`` as they are (rules, options, mesh, jaxcert's version). Not the process
    count: a row's numbers do not depend on it (each part has the whole run's shapes), so a
    run may be resumed with more or fewer processes.
    """
    return {
        "target": _spelling(target),
        "model_sha256": fingerprint_path(model_path),
        "dtype": dtype,
        "prompts": _spelling(prompts),
        "prompts_sha256": _prompts_digest(prompt_set),
        "turn": turn,
        **settings,
    }


def drafter_fingerprint(drafter: str, model_path) -> dict:
    """The fingerprint entries of a run's drafter, to pass to :func:`run_fingerprint`:
    ``drafter`` by name (:func:`_spelling`) and ``drafter_sha256`` by content
    (:func:`fingerprint_path`). A run without a drafter has neither, so a resumed run with
    another drafter, or with one where there was none, is refused."""
    return {"drafter": _spelling(drafter), "drafter_sha256": fingerprint_path(model_path)}


def _jsonable(value):
    return json.loads(json.dumps(value, default=str))


def _write_atomic(path: pathlib.Path, data: bytes | Callable) -> None:
    """Writes ``data`` (bytes, or a function writing to a binary file) to ``path`` with
    :func:`jaxcert.base.folders.atomic_file` (a hidden ``.*.tmp`` file, fsync, rename)."""
    with atomic_file(path) as tmp, open(tmp, "wb") as f:
        if callable(data):
            data(f)
        else:
            f.write(data)


def _shard_index(name: str) -> int | None:
    if name.startswith("part-") and name.endswith(".parquet"):
        digits = name[len("part-") : -len(".parquet")]
        return int(digits) if digits.isdigit() else None
    return None


def check_output(out: str | os.PathLike, *, resume: bool, overwrite: bool) -> bool:
    """Checks that ``out`` may receive a run, before any work is done.

    Returns:
      Whether ``out`` already holds a run (manifest or dataset).

    Raises:
      OutputExists: ``out`` holds a run and neither ``resume`` nor ``overwrite`` is set.
      ValueError: both flags; ``out`` or its dataset is a file; the nearest existing folder
        is not writable; ``resume`` of shards without a manifest (their settings could not
        be checked). ``resume`` where nothing was saved yet (a run interrupted before its
        first shard) is no error: the run starts afresh (the return value is ``False``).
    """
    if resume and overwrite:
        raise ValueError("--resume and --overwrite exclude each other")
    out = pathlib.Path(out)
    dataset, manifest = out / DATASET, out / MANIFEST
    check_writable(out, "--out")  # fail now, not after hours of work
    if dataset.exists() and not dataset.is_dir():
        raise ValueError(f"{dataset} is a file, not a certify dataset; move it away")
    held = manifest.exists() or dataset.exists()
    if resume and dataset.exists() and not manifest.exists():
        raise ValueError(
            f"cannot resume {out}: its shards have no {MANIFEST} (without it their settings "
            "cannot be checked); use --overwrite"
        )
    if held and not (resume or overwrite):
        raise OutputExists(
            f"{out} already holds a certify run; pass --resume to continue it or "
            "--overwrite to replace it (or choose another --out)"
        )
    return held


def read_positions(out: str | os.PathLike, columns: list[str] | None = None) -> pa.Table:
    """The positions of a certify output folder, sorted by ``prompt_index`` then ``position``.

    Args:
      out: the run's output folder (holding ``positions.parquet/``), or that dataset folder.
      columns: read only these columns (``prompt_index`` and ``position`` are added).

    Raises:
      FileNotFoundError: no dataset in ``out``.
    """
    out = pathlib.Path(out)
    dataset = out if out.name == DATASET and out.is_dir() else out / DATASET
    if not dataset.exists():
        raise FileNotFoundError(f"no {DATASET} in {out}")
    if columns is not None:
        columns = list(dict.fromkeys(["prompt_index", "position", *columns]))
    table = pq.read_table(dataset, columns=columns)
    return table.sort_by([("prompt_index", "ascending"), ("position", "ascending")])


class ShardWriter:
    """Writes finished prompts' tables as Parquet shards into ``out``, with a manifest.

    Args:
      out: the output folder (created at the first shard).
      fingerprint: what identifies the run (JSON-able); a resumed run must match it.
      resume: continue the run in ``out`` (``done_prompts`` lists what is finished).
      overwrite: remove a previous run's jaxcert files from ``out`` first.
      shard_rows: a shard is written once this many rows are buffered ...
      shard_seconds: ... or this many seconds after the last shard (bounds what a kill
        loses); and the first shard as soon as the first prompt is finished, so a run's
        folder, manifest and first rows are on disk early however short the run.

    Raises:
      OutputExists, ValueError: as :func:`check_output`; also ``resume`` with a different
        fingerprint, a corrupt manifest or an unreadable shard.
    """

    def __init__(
        self,
        out: str | os.PathLike,
        fingerprint: Mapping,
        *,
        resume: bool = False,
        overwrite: bool = False,
        shard_rows: int = 65_536,
        shard_seconds: float = 60.0,
    ):
        held = check_output(out, resume=resume, overwrite=overwrite)
        self.out = pathlib.Path(out)
        self.dataset = self.out / DATASET
        self.manifest_path = self.out / MANIFEST
        self.fingerprint = _jsonable(dict(fingerprint))
        self.shard_rows, self.shard_seconds = shard_rows, shard_seconds
        self.shards: list[dict] = []
        self._buffer: list[pa.Table] = []
        self._rows = 0
        self._last = time.monotonic()
        self._created = False
        self._flushed = False  # no shard written by this writer yet
        # With overwrite, the previous run is removed only when this one writes its first
        # shard: a run that fails before that leaves the previous one intact.
        self._replace = held and overwrite
        #: the resumed run's manifest status (``complete``, ``failed``, ...), or ``None``.
        self.resumed_status: str | None = None
        self._manifest_done: set[int] = set()
        if resume and held:
            self._load_for_resume()

    # -- set-up -----------------------------------------------------------------------------

    def _remove_run(self) -> None:
        shutil.rmtree(self.dataset, ignore_errors=True)
        for name in (MANIFEST, *REPORT_FILES):
            (self.out / name).unlink(missing_ok=True)

    def _load_for_resume(self) -> None:
        try:
            manifest = json.loads(self.manifest_path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise ValueError(f"{self.manifest_path} is corrupt ({err}); use --overwrite") from None
        if not isinstance(manifest, dict) or not isinstance(manifest.get("fingerprint"), dict):
            raise ValueError(f"{self.manifest_path} is corrupt (no fingerprint); use --overwrite")
        try:
            refuse_other_options(
                self.out, manifest["fingerprint"], self.fingerprint,
                advice="rerun with the same options, or --overwrite",
            )  # fmt: skip
        except ValueError as err:
            raise ValueError(f"cannot resume: {err}") from None
        self._created = True
        self.resumed_status = str(manifest.get("status"))
        try:
            self._manifest_done = {int(i) for i in manifest.get("prompts_done", ())}
        except (TypeError, ValueError):
            raise ValueError(
                f"{self.manifest_path} is corrupt (prompts_done); use --overwrite"
            ) from None
        if not self.dataset.is_dir():
            return
        for leftover in self.dataset.glob(".*.tmp"):  # a shard cut short by a kill
            leftover.unlink()
        for path in sorted(self.dataset.glob("part-*.parquet")):
            if _shard_index(path.name) is None:
                continue
            try:
                column = pq.read_table(path, columns=["prompt_index"]).column("prompt_index")
            except (pa.ArrowInvalid, OSError) as err:
                raise ValueError(f"cannot resume: shard {path} is unreadable ({err})") from None
            prompts = sorted({int(i) for i in column.to_pylist()})
            seen = {i: s["file"] for s in self.shards for i in s["prompts"]}
            twice = [i for i in prompts if i in seen]
            if twice:
                raise ValueError(
                    f"cannot resume {self.out}: prompt {twice[0]} is in two shards "
                    f"({seen[twice[0]]} and {path.name}); remove the copy, or --overwrite"
                )
            self.shards.append({"file": path.name, "rows": len(column), "prompts": prompts})

    @property
    def resumed_complete(self) -> bool:
        """Whether the resumed run is finished: its manifest says ``complete`` and its shards
        hold every prompt the manifest lists (the shards decide: a complete run missing a
        shard goes on). Known before any model is loaded, since the fingerprint matched."""
        return self.resumed_status == "complete" and self._manifest_done <= self.done_prompts

    @property
    def done_prompts(self) -> set[int]:
        """Prompt indices held by the shards written so far (resumed ones included)."""
        return {i for s in self.shards for i in s["prompts"]}

    @property
    def rows_written(self) -> int:
        return sum(s["rows"] for s in self.shards)

    # -- writing ----------------------------------------------------------------------------

    def write(self, table: pa.Table) -> None:
        """Buffers one finished prompt's rows; writes a shard at this writer's first prompt,
        then whenever ``shard_rows`` rows are buffered or ``shard_seconds`` have passed
        since the last shard."""
        self._buffer.append(table)
        self._rows += table.num_rows
        stale = time.monotonic() - self._last >= self.shard_seconds
        if self._rows >= self.shard_rows or stale or not self._flushed:
            self.flush()

    def flush(self) -> None:
        """Writes the buffered rows as one shard (atomically) and updates the manifest."""
        if not self._buffer:
            return
        table = pa.concat_tables(self._buffer)
        if self._replace:
            self._remove_run()
            self._replace = False
        if not self._created:  # the fingerprint is on disk before the first shard
            self._created = True
            self.write_manifest("running")
        self._write_shard(table, self._next_name())
        self._flushed = True
        self._buffer, self._rows = [], 0
        self._last = time.monotonic()
        self.write_manifest("running")

    def write_manifest(self, status: str, **extra) -> None:
        """Replaces ``manifest.json`` atomically (only once the folder exists)."""
        if not self._created:
            return
        manifest = {
            "format": FORMAT,
            "status": status,
            "fingerprint": self.fingerprint,
            "rows": self.rows_written,
            "prompts_done": sorted(self.done_prompts),
            "shards": self.shards,
            **_jsonable(extra),
        }
        self.out.mkdir(parents=True, exist_ok=True)
        _write_atomic(self.manifest_path, json.dumps(manifest, indent=1).encode())

    def add_shard(self, table: pa.Table) -> None:
        """Adds a shard made elsewhere (another process's part) as the next shard, atomically."""
        self._created = True
        self._write_shard(table, self._next_name())

    def _next_name(self) -> str:
        # every shard is a part-NNNNN file (resuming skips other names; this writer makes none)
        taken = (_shard_index(s["file"]) for s in self.shards)
        index = 1 + max((i for i in taken if i is not None), default=-1)
        return f"part-{index:05d}.parquet"

    def _write_shard(self, table: pa.Table, name: str) -> None:
        """``table`` as ``name`` in the dataset (hidden temporary file, fsync, rename)."""
        self.dataset.mkdir(parents=True, exist_ok=True)
        _write_atomic(self.dataset / name, lambda f: pq.write_table(table, f))
        prompts = sorted({int(i) for i in table.column("prompt_index").to_pylist()})
        self.shards.append({"file": name, "rows": table.num_rows, "prompts": prompts})

    def close(self, status: str, **extra) -> None:
        """Writes what is buffered and the final manifest (``status``: complete, failed...)."""
        self.flush()
        self.write_manifest(status, **extra)


def write_all(writer: ShardWriter, run) -> None:
    """Streams each table of ``run`` (an iterable with an ``info`` dict, e.g.
    :class:`jaxcert.pipeline.engine.Certifier`) into ``writer``.

    On an error or an interrupt the manifest says ``failed`` or ``interrupted`` (with the
    error and ``run.info``), everything computed so far is kept, and the error goes on.
    """
    try:
        for table in run:
            writer.write(table)
    except BaseException as err:
        status = "interrupted" if isinstance(err, KeyboardInterrupt) else "failed"
        writer.close(status, error=f"{type(err).__name__}: {err}", info=run.info)
        raise


def finish(writer: ShardWriter, usable, info: dict) -> None:
    """The manifest's last word: ``complete`` once every prompt of ``usable`` is in the
    dataset (every part of a multi-process run merged).

    Raises:
      ValueError: prompts are missing (the manifest then says ``incomplete`` and lists them).
    """
    missing = sorted(set(usable) - writer.done_prompts)
    if missing:  # every part arrived, yet prompts are missing: never call this complete
        writer.close("incomplete", info=info, missing_prompts=missing)
        raise ValueError(
            f"{counted(len(missing), 'prompt')} {'is' if len(missing) == 1 else 'are'} missing "
            f"from {writer.out} after the merge"
        )
    writer.close("complete", info=info)
