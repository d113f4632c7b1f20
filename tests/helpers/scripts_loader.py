"""Loads a benchmark script of scripts/ as a module (the scripts are not a package)."""

import importlib.util
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def load_script(name: str):
    """``scripts/<name>.py`` as the module ``name``, registered in ``sys.modules`` (its
    dataclasses look their module up there)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
