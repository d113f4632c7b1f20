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
from jaxcert.pipeline import distributed
from jaxcert.pipeline.store import read_positions

ROOT = pathlib.Path(__file__).resolve().parents[2]
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
    paths = [str(ROOT), env.get("PYTHONPATH", "")]
    env["PYTHONPATH"] = os.pathsep.join(paths).rstrip(os.pathsep)
    for name in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
        env.pop(name, None)
    # One device per process, but the suite's code-generation flags stay: the processes'
    # tables are compared bit for bit with this process's.
    flags = [f for f in env.get("XLA_FLAGS", "").split() if "host_platform_device_count" not in f]
    env["XLA_FLAGS"] = " ".join(flags)
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
def test_a_failing_process_leaves_an_incomplete_run_that_resume_finishes(
    checkpoint, prompt_file, tmp_path
):
    """Process 1 cannot read its prompts: both exit with a clear error, no hang; process 0's
    manifest says incomplete (never complete) over its own share, and --resume, with one
    process or with two, finishes the one-process table."""
    import shutil

    one = tmp_path / "one"
    assert cli.main(_args(checkpoint, prompt_file, one)) == 0
    out = tmp_path / "out"
    argvs = _distributed(_args(checkpoint, prompt_file, out), 2)
    argvs[1][argvs[1].index("--prompts") + 1] = str(tmp_path / "missing.jsonl")
    results = _launch(argvs, tmp_path)
    assert [r.returncode for r in results] == [2, 2], [r.stderr[-3000:] for r in results]
    assert "process 1 of 2 failed: ValueError" in results[0].stderr
    assert "run again with --resume" in results[0].stderr
    assert "--prompts: no prompt file" in results[1].stderr
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["status"] == "incomplete" and "process 1 of 2 failed" in manifest["error"]
    assert len(manifest["prompts_done"]) == 2  # process 0's share of the 4 prompts
    assert not (out / "run.json").exists()
    two = tmp_path / "two"
    shutil.copytree(out, two)
    # A plain rerun is still refused; one process resumes ...
    assert cli.main(_args(checkpoint, prompt_file, out)) == 2
    assert cli.main(_args(checkpoint, prompt_file, out) + ["--resume"]) == 0
    assert read_positions(out).equals(read_positions(one))
    assert json.loads((out / "manifest.json").read_text())["status"] == "complete"
    # ... and so do two (the two prompts left are dealt over both).
    results = _launch(_distributed(_args(checkpoint, prompt_file, two) + ["--resume"], 2),
                      tmp_path)  # fmt: skip
    assert [r.returncode for r in results] == [0, 0], [r.stderr[-3000:] for r in results]
    assert "of 1 prompt sent to process 0" in results[1].stderr
    assert read_positions(two).equals(read_positions(one))
    assert json.loads((two / "run.json").read_text())["prompts_resumed"] == 2


def test_a_process_that_never_joins_is_an_error_after_the_join_timeout(capsys):
    port = _free_port()
    argv = ["certify", "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2",
            "--join-timeout", "2"]  # fmt: skip
    assert cli.main([*argv, "--process-id", "0"]) == 2
    assert "processes [1] of 2 did not join within 2 s (--join-timeout" in capsys.readouterr().err
    assert cli.main([*argv, "--process-id", "1"]) == 2
    assert "process 0 could not be reached at 127.0.0.1:" in capsys.readouterr().err


def test_distributed_arguments_are_checked(monkeypatch, capsys):
    for name in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
        monkeypatch.delenv(name, raising=False)
    assert distributed.initialize_distributed() == distributed.Distributed(0, 1)
    assert distributed.initialize_distributed(num_processes=1) == distributed.Distributed(0, 1)
    with pytest.raises(ValueError, match=r"needs --coordinator \(or \$JAX_COORDINATOR_ADDRESS\)"):
        distributed.initialize_distributed(num_processes=2, process_id=0)
    with pytest.raises(ValueError, match=r"--process-id must be in \[0, 2\)"):
        distributed.initialize_distributed("localhost:1234", 2, 2)
    with pytest.raises(ValueError, match="--coordinator must be HOST:PORT"):
        distributed.initialize_distributed("localhost", 2, 1)
    monkeypatch.setenv("JAX_NUM_PROCESSES", "two")
    with pytest.raises(ValueError, match=r"\$JAX_NUM_PROCESSES must be an integer"):
        distributed.initialize_distributed()
    monkeypatch.setenv("JAX_NUM_PROCESSES", "3")
    with pytest.raises(ValueError, match=r"--process-id \(or \$JAX_PROCESS_ID\)"):
        distributed.initialize_distributed()
    assert cli.main(["certify", "--num-processes", "2", "--process-id", "0"]) == 2
    assert "a multi-process run needs --coordinator" in capsys.readouterr().err


@pytest.mark.slow
def test_a_process_running_another_job_is_not_merged(checkpoint, prompt_file, tmp_path):
    """Process 1 runs other rules: its rows are not merged, the manifest says incomplete
    (it stayed 'running' before), and the error names what differs."""
    out = tmp_path / "out"
    argvs = _distributed(_args(checkpoint, prompt_file, out), 2)
    argvs[1][argvs[1].index("--rules") + 1] = "greedy"
    results = _launch(argvs, tmp_path)
    assert [r.returncode for r in results] == [2, 2], [r.stderr[-3000:] for r in results]
    assert "process 1 ran a different job than process 0 (rules differ)" in results[0].stderr
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["status"] == "incomplete" and len(manifest["prompts_done"]) == 2
