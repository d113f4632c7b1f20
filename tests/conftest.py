"""Shared test set-up: make the helper modules in tests/ importable."""

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
