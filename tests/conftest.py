"""Shared test set-up: XLA flags, the --run-slow option, fixtures (helpers: tests.helpers)."""

import atexit
import json
import os
import shutil
import tempfile

import pytest

# The suite is mostly XLA compilation of tiny programs: cheaper CPU code generation (no
# LLVM optimisation, no expensive passes: a fifth off the suite; XLA's older loop emitters
# instead of its fusion emitters: a tiny decoder compiles in 4.7 s instead of 7.9 s, and
# tests/decoding takes 209 s instead of 354 s). Same semantics; JAXCERT_TEST_XLA_OPT=1 keeps
# XLA's defaults. Set before jax is imported; subprocesses
# inherit it (tests that add device-count flags append to it).
# JAXCERT_TEST_XLA_FLAGS=0 adds no flag at all: on an accelerator machine (the GPU tests
# of scripts/device_check.sh), whose XLA may reject these CPU flags and abort the process.
_FLAGS = os.environ.get("JAXCERT_TEST_XLA_FLAGS") != "0"
if _FLAGS and os.environ.get("JAXCERT_TEST_XLA_OPT") != "1":
    _CHEAP = [
        "--xla_backend_optimization_level=0",
        "--xla_llvm_disable_expensive_passes=true",
        "--xla_cpu_use_fusion_emitters=false",  # the older emitters: a decoder compiles 40% faster
    ]
    _flags = os.environ.get("XLA_FLAGS", "").split()
    os.environ["XLA_FLAGS"] = " ".join(_flags + [f for f in _CHEAP if f not in _flags])

# XLA:CPU aborts the process when a collective's participants (one thread per simulated
# device) do not all arrive within 40 s. On 2 loaded cores, 8 simulated devices can lag that
# long behind each other (CI saw it once): the tests allow 15 minutes. Kept with
# JAXCERT_TEST_XLA_OPT=1 too; inherited by the subprocesses.
_TIMEOUT = "--xla_cpu_collective_call_terminate_timeout_seconds=900"
if _FLAGS and "collective_call_terminate_timeout" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _TIMEOUT).strip()

# goodput's calibrations: a fresh folder per session too, so no test reads or rewrites the
# user's (a stale file there changed what a test measured).
if "JAXCERT_COSTS" not in os.environ:
    _COSTS = tempfile.mkdtemp(prefix="jaxcert-costs-")
    os.environ["JAXCERT_COSTS"] = _COSTS
    atexit.register(shutil.rmtree, _COSTS, ignore_errors=True)

# The CLI turns on JAX's persistent compilation cache: in tests, a fresh folder per session
# (inherited by the subprocesses and pytest-xdist's workers) instead of the user's cache,
# removed when the process that made it exits (a run leaves ~60 MB of programs there).
if "JAXCERT_COMPILE_CACHE" not in os.environ:
    _COMPILE_CACHE = tempfile.mkdtemp(prefix="jaxcert-xla-")
    os.environ["JAXCERT_COMPILE_CACHE"] = _COMPILE_CACHE
    atexit.register(shutil.rmtree, _COMPILE_CACHE, ignore_errors=True)


def pytest_addoption(parser):
    parser.addoption(
        "--run-slow",
        action="store_true",
        help="also run the tests marked slow (multi-device and multi-process runs, the widest "
        "vocabularies) and the real-model tests (marked real, when their assets are cached); "
        "CI and the README's test command do",
    )


def pytest_collection_modifyitems(config, items):
    if config.getoption("--run-slow"):
        return
    skip = pytest.mark.skip(reason="slow: run with --run-slow (CI does)")
    for item in items:
        # Tests of the real (0.5B) models take minutes each: part of the full run only.
        if "slow" in item.keywords or "real" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True, scope="module")
def _free_compiled_programs():
    """Frees each module's compiled programs after it: a CPU executable holds hundreds of
    memory maps until freed, and the whole suite in one process would otherwise reach the
    system's limit (65,530) and crash inside XLA."""
    yield
    import gc

    import jax

    from jaxcert.base.programs import default_programs

    default_programs().clear()
    jax.clear_caches()
    gc.collect()


# A tiny checkpoint and four short prompts for the CLI tests that compare runs (mesh, processes).


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from tests.helpers import tiny_lm

    return tiny_lm.save_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "ckpt")


@pytest.fixture(scope="module")
def prompt_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    from tests.helpers import tiny_lm

    texts = tiny_lm.TEXTS
    lines = [json.dumps({"id": f"p{i}", "prompt": t, "category": "c"}) for i, t in enumerate(texts)]
    path.write_text("\n".join(lines) + "\n")
    return path
