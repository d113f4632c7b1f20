"""Helpers shared by the tests: tiny models and checkpoints, golden cases, subprocess runners."""
