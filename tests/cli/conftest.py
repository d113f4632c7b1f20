"""Fixtures of the CLI tests: the decoder tests' tiny target and drafters (tests/decoding)."""

from tests.decoding.conftest import drafters, target  # noqa: F401
