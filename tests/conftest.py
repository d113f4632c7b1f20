"""Shared test set-up: make the helper modules in tests/ (and tests/models/) importable."""

import pathlib
import sys

_HERE = pathlib.Path(__file__).resolve().parent
# Appended, not prepended: tests/models must never shadow the real `models` package.
for folder in (_HERE, _HERE / "models"):
    if str(folder) not in sys.path:
        sys.path.append(str(folder))
