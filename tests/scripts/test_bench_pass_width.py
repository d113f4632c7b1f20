"""scripts/bench_pass_width.py --random-weights: a model's passes timed from its config alone
(no weights read), and the shapes of the default models kept in scripts/shapes/ (which
scripts/bench_head_cost.py falls back to)."""

import json
import shutil

import jax.numpy as jnp
import pytest

from jaxcert import models
from tests.helpers import tiny_lm
from tests.helpers.scripts_loader import ROOT, load_script

SHAPES = ROOT / "scripts" / "shapes"


@pytest.fixture(scope="module")
def config_only(tmp_path_factory):
    """A folder with a tiny checkpoint's config.json and nothing else (no weights)."""
    root = tmp_path_factory.mktemp("pass_width")
    checkpoint = tiny_lm.save_tiny_checkpoint(root / "checkpoint", seed=0)
    folder = root / "config_only"
    folder.mkdir()
    shutil.copy(checkpoint / "config.json", folder / "config.json")
    return folder


def test_random_weights_take_the_config_shape_and_dtype(config_only):
    model = load_script("bench_pass_width")._model(str(config_only), True, "bfloat16")
    assert model.config == models.read_config(config_only)
    assert model.embedding[...].dtype == jnp.bfloat16
    assert model.embedding[...].shape == (48, 32)  # [V, E] of the tiny config


def test_passes_are_timed_without_weights(config_only, tmp_path):
    out = tmp_path / "costs.json"
    argv = [
        "--model", str(config_only), "--drafter", str(config_only), "--random-weights",
        "--dtype", "bfloat16", "--rows", "1,2", "--widths", "1,3", "--repeats", "1",
        "--context", "8", "--json", str(out),
    ]  # fmt: skip
    assert load_script("bench_pass_width").main(argv) == 0
    results = json.loads(out.read_text())
    assert sorted(results) == ["1", "2"]
    for rows, measured in results.items():
        assert measured["rows"] == int(rows)
        assert sorted(measured["target_s"]) == ["1", "3"]
        assert all(0 < s < 60 for s in measured["target_s"].values())
        assert 0 < measured["drafter_s"] < 60


def test_without_the_flag_a_folder_without_weights_is_refused(config_only):
    with pytest.raises(ValueError, match="config_only: no "):  # names what is missing
        load_script("bench_pass_width")._model(str(config_only), False, "float32")


@pytest.mark.parametrize(
    "name, hidden, layers, heads",
    [("qwen2.5-coder-1.5b-instruct", 1536, 28, 12), ("qwen2.5-coder-0.5b-instruct", 896, 24, 14)],
)
def test_the_kept_shapes_are_the_default_models(name, hidden, layers, heads):
    config = models.read_config(SHAPES / name)
    assert (config.vocab_size, config.hidden_size) == (151_936, hidden)
    assert (config.num_layers, config.num_heads, config.num_kv_heads) == (layers, heads, 2)
    assert config.qkv_bias and not config.tie_embeddings


@pytest.mark.real
@pytest.mark.parametrize("name", ["qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"])
def test_the_kept_shapes_equal_the_cached_models_configs(name):
    from jaxcert.base import assets

    if assets.cached_path(name) is None:
        pytest.skip(f"{name} is not cached (jaxcert fetch {name})")
    assert models.read_config(SHAPES / name) == models.read_config(name)


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--random-weights", "--dtype", "int8"], "argument --dtype: invalid choice"),
        (["--random-weights", "--model", "no/such/folder"], "cannot load 'no/such/folder'"),
    ],
)
def test_bad_options_are_named(extra, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        load_script("bench_pass_width").main(extra)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_the_head_cost_falls_back_to_the_kept_shape(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXCERT_CACHE", str(tmp_path))  # nothing cached
    head_cost = load_script("bench_head_cost")
    name = "qwen2.5-coder-1.5b-instruct"
    config, source = head_cost.target_config(name, False)
    assert config == models.read_config(SHAPES / name)
    assert source == f"kept shape {name}"
    with pytest.raises(SystemExit, match="'smollm2-135m-instruct': not cached and no kept shape"):
        head_cost.target_config("smollm2-135m-instruct", False)
