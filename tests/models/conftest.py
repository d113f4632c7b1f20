"""Fixtures for the models tests: tiny checkpoints (built once per session) and real assets."""

from __future__ import annotations

import os
import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import tiny_models  # noqa: E402


@pytest.fixture(scope="session")
def hf_case(tmp_path_factory):
    """`hf_case(name) -> (checkpoint folder, torch model, LoadedModel)`, built once per name."""
    pytest.importorskip("torch")
    from models import load_hf

    built = {}

    def get(name: str):
        if name not in built:
            model = tiny_models.torch_model(name)
            path = tiny_models.save_checkpoint(model, tmp_path_factory.mktemp(name))
            built[name] = (path, model, load_hf(path))
        return built[name]

    return get


def _asset_roots() -> list[pathlib.Path]:
    roots = []
    if os.environ.get("JAXCERT_CACHE"):
        roots.append(pathlib.Path(os.environ["JAXCERT_CACHE"]))
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    roots.append(pathlib.Path(xdg) / "jaxcert")
    return roots


@pytest.fixture
def real_asset():
    """`real_asset(name) -> path` of a cached real GGUF asset, or skip the test.

    Looks for `$JAXCERT_ASSET_<NAME>` (name upper-cased, non-alphanumerics as `_`), then for
    `<name>*.gguf` anywhere under `$JAXCERT_CACHE` or `$XDG_CACHE_HOME/jaxcert`. Never downloads.
    """

    def find(name: str) -> pathlib.Path:
        env = "JAXCERT_ASSET_" + "".join(c if c.isalnum() else "_" for c in name.upper())
        if os.environ.get(env) and pathlib.Path(os.environ[env]).is_file():
            return pathlib.Path(os.environ[env])
        for root in _asset_roots():
            if root.is_dir():
                hits = sorted(p for p in root.rglob(f"{name}*.gguf") if "dequant" not in p.parts)
                if hits:
                    return hits[0]
        pytest.skip(f"real asset {name!r} not cached (set {env} or fetch it first)")

    return find
