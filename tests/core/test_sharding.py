"""Certificates, statistics and losses on 8 virtual CPU devices equal the one-device results.

Each group runs tests/helpers/sharded_cases.py in a subprocess (8 devices must be set before jax is
imported, and an XLA abort must fail the test, not kill pytest). Layouts: batch-sharded,
vocabulary-sharded and both, under jit with GSPMD (Auto) axes and with explicit axes, eagerly
on concrete sharded arrays, and inside your own shard_map (batch only, and batch + vocabulary
with ``axis_name``). Every rule's certificate (value, margin, x0, competitors, pool, level,
q*), the distribution statistics and the gradients of KL + certificate violation w.r.t. both
logits are compared with the single-device run.
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

SCRIPT = pathlib.Path(__file__).parents[1] / "helpers" / "sharded_cases.py"
RULES = [
    "greedy",
    "additive:0.3",
    "multiplicative:0.1",
    "topk:2",
    "typical",
    "tree:4",
    "tree:2+additive:0.1",
]
GRAD_RULES = ["greedy", "typical", "tree:2+additive:0.1"]

# Expected partition specs of the outputs: the batch sharding is kept (the work is split,
# not replicated), q* and the gradients keep the input's full sharding.
EXPECTED = {
    "batch:auto": ("P(('data', 'model'),)", "P(('data', 'model'), None)"),
    "both:auto": ("P('data',)", "P('data', 'model')"),
    "batch:explicit": ("P(('data', 'model'),)", "P(('data', 'model'), None)"),
    "vocab:explicit": ("P(None,)", "P(None, 'model')"),
    "both:explicit": ("P('data',)", "P('data', 'model')"),
    "both:eager": ("P('data',)", "P('data', 'model')"),
    "shard_map:auto": ("P(('data', 'model'),)", "P(('data', 'model'), None)"),
    "shard_map_vocab:auto": ("P('data',)", "P('data', 'model')"),
    "shard_map_vocab:explicit": ("P('data',)", "P('data', 'model')"),
}


def _run(vocab: int, pairs: list[str]) -> dict:
    result = subprocess.run(
        [sys.executable, str(SCRIPT), str(vocab), *pairs],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 0, f"exit {result.returncode}:\n{result.stderr[-3000:]}"
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.parametrize(
    "vocab, pairs",
    [
        (1000, ["batch:auto", "vocab:auto", "both:auto"]),
        (1000, ["batch:explicit", "vocab:explicit", "both:explicit"]),
        (1000, ["shard_map:auto", "shard_map_vocab:auto", "shard_map_vocab:explicit"]),
        (32768, ["both:eager"]),  # 8,192 tokens a shard: the grouped top-k on every shard
    ],
    ids=["gspmd", "explicit", "shard_map", "eager-wide"],
)
def test_sharded_equals_single_device(vocab, pairs):
    results = _run(vocab, pairs)
    assert sorted(results) == sorted(pairs)
    for pair, out in results.items():
        expected_cases = (
            [f"cert {r}" for r in RULES] + ["stats"] + [f"grad {r}" for r in GRAD_RULES]
        )
        assert sorted(out["cases"]) == sorted(expected_cases), pair
        for case, diff in out["cases"].items():
            # Values in nats / probabilities, ids exactly (an id differs by >= 1).
            assert diff <= 1e-6, (pair, case, diff)
        if pair in EXPECTED:
            value_spec, full_spec = EXPECTED[pair]
            assert out["shardings"]["value"] == value_spec, pair
            assert out["shardings"]["grad"] == full_spec, pair
            if "q_star" in out["shardings"]:
                assert out["shardings"]["q_star"] == full_spec, pair


def _readme_block(marker: str) -> str:
    text = (pathlib.Path(__file__).parents[2] / "README.md").read_text()
    for block in text.split("```python\n")[1:]:
        code = block.split("```", 1)[0]
        if marker in code:
            return code
    raise AssertionError(f"no README python block contains {marker!r}")


@pytest.mark.slow
def test_readme_sharded_training_step_equals_one_device(tmp_path):
    """The README's training step on a (2, 4) mesh: same loss and parameters as one device.

    The block itself asserts the equality and prints the parameters' sharding.
    """
    code = _readme_block('mesh = jax.make_mesh((2, 4), ("data", "model"))')
    script = tmp_path / "step.py"
    script.write_text(
        "import os\nos.environ['XLA_FLAGS'] = os.environ.get('XLA_FLAGS', '') + "
        "' --xla_force_host_platform_device_count=8'\n" + code
    )
    result = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "P('data', None, 'model')" in result.stdout
