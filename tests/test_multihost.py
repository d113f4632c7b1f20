"""Multi-process ``jaxcert certify``: two CPU processes on localhost (``jax.distributed``, gloo).

Each process certifies its share of the prompts and sends it to process 0, which writes the
table of a one-process run. The processes are separate interpreters (as on a cluster), each
with a timeout, so a hang or an XLA abort fails the test instead of killing pytest.
"""

from __future__ import annotations

import json
import os
import pathlib
import socket
import subprocess
import sys

import pytest

from jaxcert import cli
from jaxcert import mesh as mesh_lib
from jaxcert.certify_store import read_positions

TESTS = pathlib.Path(__file__).resolve().parent
TIMEOUT = 240


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _args(checkpoint, prompt_file, out):
    return ["certify", "--target", str(checkpoint), "--prompts", str(prompt_file),
            "--rules", "greedy,additive:0.3,tree:2", "--steps", "5", "--batch-size", "2",
            "--ignore-eos", "--no-plots", "--out", str(out)]  # fmt: skip


def _launch(argvs: list[list[str]], tmp_path) -> list[subprocess.CompletedProcess]:
    """Runs one ``jaxcert`` process per argument list, all at once; waits for every one."""
    env = dict(os.environ)
    paths = [str(TESTS), str(TESTS / "models"), env.get("PYTHONPATH", "")]
    env["PYTHONPATH"] = os.pathsep.join(paths).rstrip(os.pathsep)
    for name in ("XLA_FLAGS", "JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
        env.pop(name, None)
    code = "import sys; from jaxcert import cli; sys.exit(cli.main(sys.argv[1:]))"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, *argv],
            env=env,
            cwd=tmp_path,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        for argv in argvs
    ]
    results = []
    try:
        for proc, argv in zip(procs, argvs, strict=True):
            out, err = proc.communicate(timeout=TIMEOUT)
            results.append(subprocess.CompletedProcess(argv, proc.returncode, out, err))
    finally:
        for proc in procs:  # only after a timeout: the ones still running
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    return results


def _distributed(base: list[str], n: int) -> list[list[str]]:
    flags = ["--coordinator", f"127.0.0.1:{_free_port()}", "--num-processes", str(n)]
    return [base + flags + ["--process-id", str(i)] for i in range(n)]


@pytest.mark.slow
def test_two_processes_write_the_one_process_table(checkpoint, prompt_file, tmp_path):
    one = tmp_path / "one"
    assert cli.main(_args(checkpoint, prompt_file, one)) == 0  # one process, this one
    out = tmp_path / "two"
    results = _launch(_distributed(_args(checkpoint, prompt_file, out), 2), tmp_path)
    for i, r in enumerate(results):
        assert r.returncode == 0, f"process {i}: exit {r.returncode}\n{r.stderr[-5000:]}"
    assert "positions of 2 prompts sent to process 0" in results[1].stderr
    assert "| cert_tree:2 |" in results[0].stdout
    want = read_positions(one)
    got = read_positions(out)
    assert got.equals(want)  # same shapes in every process: bit-identical
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in one.iterdir())
    assert (out / "summary.md").read_text() == (one / "summary.md").read_text()
    run = json.loads((out / "run.json").read_text())
    assert run["status"] == "ok" and run["positions"] == want.num_rows
    assert [p["part"] for p in run["processes"]] == [
        {"index": 0, "count": 2, "prompts": 2}, {"index": 1, "count": 2, "prompts": 2}
    ]  # fmt: skip


@pytest.mark.slow
def test_a_failing_process_stops_the_others(checkpoint, prompt_file, tmp_path):
    """Process 1 cannot read its prompts: both processes exit with a clear error, no hang."""
    argvs = _distributed(_args(checkpoint, prompt_file, tmp_path / "out"), 2)
    argvs[1][argvs[1].index("--prompts") + 1] = str(tmp_path / "missing.jsonl")
    results = _launch(argvs, tmp_path)
    assert [r.returncode for r in results] == [2, 2], [r.stderr[-3000:] for r in results]
    assert "process 1 of 2 failed: ValueError" in results[0].stderr
    assert "--prompts: no prompt file" in results[1].stderr


def test_distributed_arguments_are_checked(monkeypatch, capsys):
    for name in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
        monkeypatch.delenv(name, raising=False)
    assert mesh_lib.initialize_distributed() == mesh_lib.Distributed(0, 1)
    assert mesh_lib.initialize_distributed(num_processes=1) == mesh_lib.Distributed(0, 1)
    with pytest.raises(ValueError, match=r"needs --coordinator \(or \$JAX_COORDINATOR_ADDRESS\)"):
        mesh_lib.initialize_distributed(num_processes=2, process_id=0)
    with pytest.raises(ValueError, match=r"--process-id must be in \[0, 2\)"):
        mesh_lib.initialize_distributed("localhost:1234", 2, 2)
    with pytest.raises(ValueError, match="--coordinator must be HOST:PORT"):
        mesh_lib.initialize_distributed("localhost", 2, 1)
    monkeypatch.setenv("JAX_NUM_PROCESSES", "two")
    with pytest.raises(ValueError, match=r"\$JAX_NUM_PROCESSES must be an integer"):
        mesh_lib.initialize_distributed()
    monkeypatch.setenv("JAX_NUM_PROCESSES", "3")
    with pytest.raises(ValueError, match=r"--process-id \(or \$JAX_PROCESS_ID\)"):
        mesh_lib.initialize_distributed()
    assert cli.main(["certify", "--num-processes", "2", "--process-id", "0"]) == 2
    assert "a multi-process run needs --coordinator" in capsys.readouterr().err
    dist = mesh_lib.Distributed(1, 4)
    assert dist.part_name("positions", ".parquet") == "positions.part-00001-of-00004.parquet"
    assert mesh_lib.process_share(list(range(10)), dist) == [1, 5, 9]
