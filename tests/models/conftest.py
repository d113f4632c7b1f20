"""Fixtures for the models tests: tiny checkpoints (built once per session) and real assets."""

from __future__ import annotations

import os
import pathlib

import pytest

from tests.helpers import tiny_models


@pytest.fixture(scope="session")
def hf_case(tmp_path_factory):
    """`hf_case(name) -> (checkpoint folder, torch model, LoadedModel)`, built once per name."""
    pytest.importorskip("torch")
    from jaxcert.models import load_hf

    built = {}

    def get(name: str):
        if name not in built:
            model = tiny_models.torch_model(name)
            path = tiny_models.save_checkpoint(model, tmp_path_factory.mktemp(name))
            built[name] = (path, model, load_hf(path))
        return built[name]

    return get


@pytest.fixture(scope="session")
def np_case(tmp_path_factory):
    """`np_case(name) -> (checkpoint folder, LoadedModel, HF tensors)` without torch."""
    from jaxcert.models import load_hf

    built = {}

    def get(name: str):
        if name not in built:
            path = tmp_path_factory.mktemp(f"np-{name}")
            tensors = tiny_models.numpy_checkpoint(name, path)
            built[name] = (path, load_hf(path), tensors)
        return built[name]

    return get


@pytest.fixture
def real_asset():
    """`real_asset(name) -> path` of a cached real asset, or skip the test (never downloads).

    `$JAXCERT_ASSET_<NAME>` (name upper-cased, non-alphanumerics as `_`) overrides; otherwise
    `jaxcert.base.assets.cached_path(name)`, i.e. the verified file under `$JAXCERT_CACHE`.
    """

    def find(name: str) -> pathlib.Path:
        env = "JAXCERT_ASSET_" + "".join(c if c.isalnum() else "_" for c in name.upper())
        if os.environ.get(env):
            if not pathlib.Path(os.environ[env]).is_file():
                pytest.fail(f"{env}={os.environ[env]} is not a file")
            return pathlib.Path(os.environ[env])
        try:
            from jaxcert.base import assets

            path = assets.cached_path(name)
        except ImportError:
            path = None
        if path is None:
            pytest.skip(f"real asset {name!r} is not cached (jaxcert fetch {name}, or set {env})")
        return path

    return find
