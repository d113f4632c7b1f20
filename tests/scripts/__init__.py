"""Tests of the benchmark scripts of scripts/."""
