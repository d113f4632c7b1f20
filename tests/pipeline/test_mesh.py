"""``--mesh``: parsing and errors here; ``certify`` and ``decode`` on virtual CPU devices.

The device count of a JAX process is fixed when its backend starts, so the multi-device runs
happen in a fresh interpreter with ``XLA_FLAGS=--xla_force_host_platform_device_count=N``
(``multidevice.run``: an XLA abort there fails the test instead of killing pytest). Their
tables are compared with one-device runs of this process.
"""

from __future__ import annotations

import json

import jax
import numpy as np
import pyarrow.parquet as pq
import pytest

from jaxcert import cli, models
from jaxcert.base import prompts
from jaxcert.base.programs import default_programs
from jaxcert.core import rules as R
from jaxcert.models import mesh as mesh_lib
from jaxcert.pipeline import engine as certify
from jaxcert.pipeline.store import read_positions
from tests.helpers import tiny_lm
from tests.helpers.multidevice import run

RULES = "greedy,additive:0.3,typical,tree:2"
# Columns that must match exactly in every run; the rest are float32 statistics.
EXACT = ["prompt_id", "category", "prompt_tokens", "position", "token"]


def _certify_args(checkpoint, prompt_file, out, *extra):
    return ["certify", "--target", str(checkpoint), "--prompts", str(prompt_file),
            "--rules", RULES, "--steps", "6", "--ignore-eos", "--no-plots", "--out", str(out),
            *extra]  # fmt: skip


def assert_same_table(got, want, *, exact: bool, rtol=1e-4, atol=2e-6):
    """Equal tables: bit for bit (``exact``), or to float32 rounding in the statistics."""
    assert got.column_names == want.column_names
    assert got.num_rows == want.num_rows
    for name in got.column_names:
        if exact or name in EXACT:
            assert got[name].equals(want[name]), name
        else:
            a = got[name].to_numpy().astype(np.float64)
            b = want[name].to_numpy().astype(np.float64)
            np.testing.assert_allclose(a, b, rtol=rtol, atol=atol, err_msg=name)


# ---------------------------------------------------------------------------------------------
# parsing and errors (this process: one CPU device)


def test_parse_mesh():
    assert mesh_lib.parse_mesh("data=2,model=4") == {"data": 2, "model": 4}
    assert mesh_lib.parse_mesh(" model=1 , data=8 ") == {"model": 1, "data": 8}
    for spec, message in [
        ("", "must look like data=2,model=4"),
        ("data", "'data' is not AXIS=SIZE"),
        ("data=2,", "'' is not AXIS=SIZE"),
        ("batch=2", "axis 'batch' is unknown; the axes are data, model"),
        ("data=2,data=2", "axis 'data' is given twice"),
        ("data=0", "data=0: the size must be a positive integer"),
        ("model=x", "model=x: the size must be a positive integer"),
    ]:
        with pytest.raises(ValueError, match=message):
            mesh_lib.parse_mesh(spec)


def test_make_mesh_defaults_and_errors():
    devices = jax.local_devices()
    mesh = mesh_lib.make_mesh(None)
    assert mesh.axis_names == ("data", "model")
    assert dict(mesh.shape) == {"data": len(devices), "model": 1}
    assert all(t == jax.sharding.AxisType.Auto for t in mesh.axis_types)
    assert mesh_lib.describe(mesh_lib.make_mesh("model=1")) == f"data={len(devices)},model=1"
    with pytest.raises(ValueError, match="--mesh data=3 needs 3 devices, this process sees 1"):
        mesh_lib.make_mesh("data=3", devices=devices[:1])
    with pytest.raises(
        ValueError, match="--mesh data=2,model=4 needs 8 devices, this process sees 1"
    ):
        mesh_lib.make_mesh({"data": 2, "model": 4}, devices=devices[:1])
    with pytest.raises(ValueError, match="do not split into groups of model=2"):
        mesh_lib.make_mesh("model=2", devices=devices[:1])


def test_mesh_axes_are_checked():
    class FakeMesh:
        shape = {"data": 8, "model": 1}

    assert mesh_lib.data_size(FakeMesh()) == 8
    FakeMesh.shape = {"rows": 8}
    with pytest.raises(ValueError, match="mesh axes must be data and model"):
        mesh_lib.data_size(FakeMesh())


def test_cli_mesh_errors(checkpoint, prompt_file, tmp_path, capsys):
    args = _certify_args(checkpoint, prompt_file, tmp_path / "o")
    assert cli.main(args + ["--mesh", "data=3"]) == 2
    assert "--mesh data=3 needs 3 devices, this process sees 1" in capsys.readouterr().err
    assert cli.main(args + ["--mesh", "data=1,tensor=2"]) == 2
    assert "axis 'tensor' is unknown" in capsys.readouterr().err
    decode = ["decode", "--target", str(checkpoint), "--drafter", str(checkpoint), "--prompts",
              str(prompt_file), "--out", str(tmp_path / "d"), "--mesh", "data=2"]  # fmt: skip
    assert cli.main(decode) == 2
    assert "--mesh data=2 needs 2 devices, this process sees 1" in capsys.readouterr().err


def test_parts_merge_into_the_one_process_table(checkpoint):
    """What each process of a multi-process run computes, without the processes."""
    lm = models.load(str(checkpoint))
    prompt_set = [
        prompts.Prompt(f"p{i}", t) for i, t in enumerate(tiny_lm.TEXTS + ["on", "a big one"])
    ]
    rules = R.parse_rules(RULES)
    options = certify.CertifyOptions(steps=5, batch_size=2, chunk=4, stop_at_eos=False)
    whole, _ = certify.certify_prompts(lm, prompt_set, rules, options)
    parts = [certify.certify_prompts(lm, prompt_set, rules, options, part=(i, 4))[0]
             for i in (2, 0, 3, 1)]  # fmt: skip
    assert all("prompt_index" in p.column_names for p in parts)
    assert sum(p.num_rows for p in parts) == whole.num_rows
    assert certify.merge_parts(parts).equals(whole)  # the same shapes: bit-identical
    with pytest.raises(ValueError, match="7 processes for 6 prompts"):
        certify.certify_prompts(lm, prompt_set, rules, options, part=(0, 7))


# ---------------------------------------------------------------------------------------------
# 8 virtual CPU devices


@pytest.mark.slow
def test_certify_on_8_devices_equals_one_device(checkpoint, prompt_file, tmp_path):
    base = {}
    for batch in (1, 8):  # one-device runs in this process
        out = tmp_path / f"one-bs{batch}"
        args = _certify_args(checkpoint, prompt_file, out, "--batch-size", str(batch))
        assert cli.main(args) == 0
        base[batch] = read_positions(out)
    meshes = {"default": [], "data8": ["--mesh", "data=8"], "tp": ["--mesh", "data=2,model=4"]}
    calls = {name: _certify_args(checkpoint, prompt_file, tmp_path / name, "--batch-size", "8",
                                 *flags) for name, flags in meshes.items()}  # fmt: skip
    got = run(f"""
        from jaxcert import cli
        meshes = {{}}
        for name, args in {calls!r}.items():
            assert cli.main(args) == 0, name
            meshes[name] = json.load(open(args[args.index("--out") + 1] + "/run.json"))["mesh"]
        print(json.dumps(meshes))
        """)  # fmt: skip
    assert got == {"default": {"data": 8, "model": 1}, "data8": {"data": 8, "model": 1},
                   "tp": {"data": 2, "model": 4}}  # fmt: skip
    for name in meshes:
        table = read_positions(tmp_path / name)
        if name == "tp":  # tensor parallel: other summation orders
            assert_same_table(table, base[8], exact=False)
            assert_same_table(table, base[1], exact=False)
        else:  # one row per device, as the batch-size-1 run: the same numbers
            assert_same_table(table, base[1], exact=True)
            assert_same_table(table, base[8], exact=False)


@pytest.mark.slow
def test_decode_on_4_devices_matches_one_device(tmp_path, monkeypatch):
    """Greedy speculative decoding gives the same tokens and certificates on a 2 x 2 mesh."""
    target = tiny_lm.save_tiny_checkpoint(tmp_path / "target", seed=0)
    drafter = tiny_lm.save_tiny_checkpoint(tmp_path / "drafter", seed=0, scale=0.41)
    prompt_file = tmp_path / "p.jsonl"
    prompt_file.write_text("".join(json.dumps({"id": i, "prompt": t}) + "\n" for i, t in
                                   enumerate(tiny_lm.TEXTS)))  # fmt: skip

    def args(out, *extra):
        return ["decode", "--target", str(target), "--drafter", str(drafter),
                "--prompts", str(prompt_file), "--policy", "constant:2", "--max-new-tokens",
                "6", "--batch-size", "4", "--no-baseline", "--out", str(tmp_path / out),
                *extra]  # fmt: skip

    got = run(f"""
        from jaxcert import cli
        from jaxcert.base.programs import default_programs
        default_programs().compiler_options["xla_backend_optimization_level"] = 0
        print(json.dumps({{"rc": cli.main({args("mesh", "--mesh", "data=2,model=2")!r})}}))
        """, devices=4)  # fmt: skip
    assert got == {"rc": 0}

    monkeypatch.setitem(default_programs().compiler_options, "xla_backend_optimization_level", 0)
    assert cli.main(args("one")) == 0  # one device: this process
    read = lambda out: [json.loads(x) for x in (tmp_path / out / "outputs.jsonl").open()]  # noqa: E731
    assert read("mesh") == read("one")
    mesh, one = (pq.read_table(tmp_path / out / "nodes.parquet") for out in ("mesh", "one"))
    assert mesh.num_rows == one.num_rows
    for name in ("kl", "cert"):
        np.testing.assert_allclose(mesh[name].to_numpy(), one[name].to_numpy(), rtol=1e-3,
                                   atol=1e-6, err_msg=name)  # fmt: skip
    assert mesh["certified"].equals(one["certified"])
    summary = json.loads((tmp_path / "mesh" / "summary.json").read_text())
    assert summary["mesh"] == {"data": 2, "model": 2}
