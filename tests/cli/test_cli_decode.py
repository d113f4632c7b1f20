"""`jaxcert decode`'s command line: its output folder, console report, progress bar, --verify
errors and the vocabulary check before any weights are read (tiny GGUF / HF files)."""

import dataclasses
import io
import json
import shutil
import time

import pytest

from jaxcert import cli, decoding, models
from jaxcert.cli import decode as decode_cli
from jaxcert.decoding import costs as costs_lib
from jaxcert.decoding import run_report
from jaxcert.models import gguf as gguf_loader
from jaxcert.models import hf as hf_loader
from tests.helpers import tiny_lm
from tests.helpers.tiny_decoding import CONFIG, random_model, write_gguf


@pytest.fixture(scope="module")
def files(tmp_path_factory, target, drafters):
    root = tmp_path_factory.mktemp("cli-decode")
    prompts = root / "prompts.jsonl"
    prompts.write_text('{"id": "a", "prompt": "the cat sat"}\n{"id": "b", "prompt": "an otter"}\n')
    small = dataclasses.replace(CONFIG, vocab_size=44)
    hf_target = tiny_lm.save_tiny_checkpoint(root / "hf-target")  # vocabulary 48
    hf_small = root / "hf-small"
    shutil.copytree(hf_target, hf_small)
    config = json.loads((hf_small / "config.json").read_text())
    (hf_small / "config.json").write_text(json.dumps(config | {"vocab_size": 44}))
    return {
        "target": write_gguf(target, root / "target.gguf"),
        "drafter": write_gguf(drafters["similar"], root / "drafter.gguf"),
        "small": write_gguf(random_model(small, seed=5), root / "small.gguf"),
        "hf-target": hf_target,
        "hf-small": hf_small,  # its weights do not fit its config: only the config is read
        "prompts": prompts,
        "root": root,
    }


def _argv(files, out, *extra):
    return ["decode", "--target", str(files["target"]), "--drafter", str(files["drafter"]),
            "--prompts", str(files["prompts"]), "--policy", "svip:0.3/4", "--verify", "greedy",
            "--max-new-tokens", "8", "--batch-size", "2", "--out", str(out), *extra]  # fmt: skip


def _no_loading(monkeypatch):
    """Makes loading a model, or reading or dequantising any weights, an error."""

    def boom(*args, **kwargs):
        raise AssertionError("weights were read")

    monkeypatch.setattr(models, "load", boom)
    for module, name in (
        (gguf_loader, "write_dequantized"),
        (gguf_loader, "_dequantize"),
        (gguf_loader, "model_from_tensors"),
        (hf_loader, "model_from_tensors"),
        (hf_loader, "SafetensorsFolder"),
    ):
        monkeypatch.setattr(module, name, boom)


def test_decode_refuses_a_previous_run_unless_overwrite(files, monkeypatch, capsys):
    monkeypatch.setenv("JAXCERT_CACHE", str(files["root"] / "cache"))
    out = files["root"] / "out"
    assert cli.main(_argv(files, out)) == 0
    first = json.loads((out / "summary.json").read_text())
    printed = capsys.readouterr().out
    # The console names the compile time and prints no Python None for untested depths.
    assert "None" not in printed
    line = next(x for x in printed.splitlines() if x.startswith("acceptance by position"))
    rates = first["speculative"]["acceptance_by_depth"]
    assert rates[0] is not None and rates[-1] is None  # depth 8 is past the policy's cap 4
    assert line.split(": ", 1)[1].split() == ["n/a" if x is None else f"{x:.3f}" for x in rates]
    compiled = first["programs_compiled"]
    assert compiled >= 1
    plural = "" if compiled == 1 else "s"
    assert f"compiled {compiled} program{plural} in {first['compile_s']:.1f} s" in printed
    (out / "notes.txt").write_text("mine")
    with monkeypatch.context() as m:
        _no_loading(m)  # refused before any model is read
        assert cli.main(_argv(files, out)) == 2
    err = capsys.readouterr().err
    assert f"{out} already holds a decode run" in err and "--overwrite" in err
    assert json.loads((out / "summary.json").read_text()) == first
    assert cli.main(_argv(files, out, "--overwrite", "--seed", "1")) == 0
    again = json.loads((out / "summary.json").read_text())
    assert again["seed"] == 1 and again["identical_outputs"] == "2/2"  # the new run's
    assert (out / "notes.txt").read_text() == "mine"  # not a jaxcert file: left alone


def test_decode_out_that_is_a_file_is_named_before_loading(files, monkeypatch, capsys):
    _no_loading(monkeypatch)
    path = files["root"] / "a-file"
    path.write_text("x")
    assert cli.main(_argv(files, path)) == 2
    err = capsys.readouterr().err
    assert f"--out {path} is a file, not a folder" in err and "Errno" not in err
    assert cli.main(_argv(files, path / "under")) == 2  # a folder under a file
    assert f"{path} is not a writable folder" in capsys.readouterr().err


def test_decode_that_fails_to_load_leaves_no_folder(files, tmp_path, capsys):
    junk = tmp_path / "junk.gguf"  # its header and metadata whole, its tensors cut short
    data = files["drafter"].read_bytes()
    junk.write_bytes(data[: len(data) - 4096])
    argv = _argv(files, tmp_path / "out")
    argv[argv.index("--drafter") + 1] = str(junk)
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "loading target" in err and "Traceback" not in err  # it failed while loading
    assert not (tmp_path / "out").exists()


def test_check_output_and_remove_outputs(tmp_path):
    assert run_report.check_output(tmp_path / "new", overwrite=False) is False
    for name in run_report.OUTPUT_FILES:
        (tmp_path / name).write_text("old")
    (tmp_path / "mine.txt").write_text("keep")
    with pytest.raises(ValueError, match="already holds a decode run"):
        run_report.check_output(tmp_path, overwrite=False)
    assert run_report.check_output(tmp_path, overwrite=True) is True
    run_report.remove_outputs(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine.txt"]
    assert run_report.OUTPUT_FILES == (
        "summary.json",
        "rounds.parquet",
        "nodes.parquet",
        "outputs.jsonl",
    )


@pytest.mark.parametrize("kind", ["gguf", "hf"])
def test_decode_refuses_mismatched_vocabularies_before_reading_weights(
    kind, files, monkeypatch, capsys
):
    monkeypatch.setenv("JAXCERT_CACHE", str(files["root"] / f"cache-{kind}"))
    _no_loading(monkeypatch)
    pair = {"gguf": ("target", "small"), "hf": ("hf-target", "hf-small")}[kind]
    target, drafter = (files[name] for name in pair)
    argv = ["decode", "--target", str(target), "--drafter", str(drafter),
            "--prompts", str(files["prompts"]), "--out", str(files["root"] / "bad")]  # fmt: skip
    assert cli.main(argv) == 2
    assert "the target has 48 logit rows, the drafter 44" in capsys.readouterr().err
    assert not (files["root"] / f"cache-{kind}" / "dequant").exists()  # nothing dequantised


def test_markdown_summary_formats_untested_depths_and_compile_time():
    summary = {
        "speculative": {
            "tokens": 64,
            "tokens_per_s": 12.5,
            "mean_accepted": 1.5,
            "tokens_per_round": 2.5,
            "acceptance_rate": 0.75,
            "acceptance_by_depth": [0.9, 0.5, None, None],
        },
        "compile_s": 12.34,
        "programs_compiled": 4,
    }
    text = run_report.markdown_summary(summary)
    assert "None" not in text
    assert "acceptance by position (depth 1-4; n/a = never tested): 0.900 0.500 n/a n/a" in text
    assert "compiled 4 programs in 12.3 s (excluded from tokens/s)" in text


def test_progress_bar_shows_no_rate_while_compiling():
    stream = io.StringIO()
    progress = decode_cli.DecodeProgress(total=100, file=stream)
    progress.advance(10)
    progress.compiling("run_rounds")
    line = str(progress.bar)
    assert line.startswith("compiling run_rounds") and "tok/s" not in line and "<" not in line
    start = progress.bar.start_t
    time.sleep(0.3)
    progress.advance(20)  # compiling is over: its time leaves the bar's clock
    assert progress.bar.start_t - start >= 0.3
    line = str(progress.bar)
    assert line.startswith("decode") and "tok/s" in line and "20/100" in line
    progress.close()


@pytest.mark.parametrize("value", ["foo", "topk", "tree:2x4+foo", "greedy+x", "tree:2x4+tree:4"])
def test_decode_verify_errors_show_decodes_grammar(value, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["decode", "--verify", value])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert f"argument --verify: verify {value!r}" in err
    assert "tree:MxD" in err and "dyntree:MxDxN" in err and "sample" in err
    assert "tree:M |" not in err and "tree:M+" not in err and "tree:M[" not in err
    with pytest.raises(ValueError, match="expected \\[SHAPE\\+\\]RULE"):
        decoding.parse_verify(value)


def test_decode_with_the_ngram_drafter(files, monkeypatch, capsys):
    """``--drafter ngram:2``: no drafter weights; outputs equal the target's (greedy), the
    summary names the drafter and reports no KL or certificates for its one-hot q."""
    monkeypatch.setenv("JAXCERT_CACHE", str(files["root"] / "cache"))
    out = files["root"] / "out-ngram"
    argv = _argv(files, out, "--policy", "constant:3")
    argv[argv.index("--drafter") + 1] = "ngram:2"
    assert cli.main(argv) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["drafter"] == "ngram:2"
    rows = [json.loads(line) for line in (out / "outputs.jsonl").read_text().splitlines()]
    assert rows and all(r["identical"] for r in rows)
    assert summary["speculative"]["mean_kl"] is None  # no KL for a one-hot q
    assert "prompt lookup" in capsys.readouterr().err


@pytest.mark.parametrize("spec", ["ngram:0", "ngram:2:3", "ngram:x"])
def test_decode_refuses_a_bad_ngram_drafter_before_loading(files, monkeypatch, capsys, spec):
    _no_loading(monkeypatch)
    argv = _argv(files, files["root"] / "out-bad-ngram")
    argv[argv.index("--drafter") + 1] = spec
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "--drafter" in err and "ngram" in err


def test_decode_with_goodput_and_given_costs(files, monkeypatch, capsys, tmp_path):
    """``--policy goodput --costs FILE``: no measuring; the costs make every round a plain
    target step, so the outputs are the target's and nothing is drafted. A file without the
    run's batch size is refused before any weights are read."""
    monkeypatch.setenv("JAXCERT_CACHE", str(files["root"] / "cache"))
    dear = decoding.PassCosts(rows=2, target_s={1: 1.0, 2: 5.0, 9: 40.0}, drafter_s=1.0)
    costs = tmp_path / "costs.json"
    costs.write_text(json.dumps({"2": dear.to_json()}))
    out = files["root"] / "out-goodput"
    argv = _argv(files, out, "--costs", str(costs))
    argv[argv.index("--policy") + 1] = "goodput"
    assert cli.main(argv) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["policy"] == "goodput"
    assert summary["speculative"]["mean_drafted"] == 0
    assert "measuring pass costs" not in capsys.readouterr().err
    rows = [json.loads(line) for line in (out / "outputs.jsonl").read_text().splitlines()]
    assert rows and all(r["identical"] for r in rows)
    argv = _argv(files, files["root"] / "out-not-goodput", "--costs", str(costs))
    assert cli.main(argv) == 2  # svip weighs no costs: the flag is refused, not ignored
    assert "--costs is goodput's pass costs" in capsys.readouterr().err
    costs.write_text(json.dumps({"4": dataclasses.replace(dear, rows=4).to_json()}))
    _no_loading(monkeypatch)
    argv = _argv(files, files["root"] / "out-goodput-2", "--costs", str(costs))
    argv[argv.index("--policy") + 1] = "goodput"
    assert cli.main(argv) == 2
    assert "no costs for batches of [2] rows" in capsys.readouterr().err
    assert not (files["root"] / "out-goodput-2").exists()  # refused before the folder is made


def test_decode_with_goodput_corrects_and_keeps_its_costs(files, monkeypatch, tmp_path):
    """``jaxcert decode --policy goodput`` takes the library's path: its calibration is
    corrected from the decode's own calls and what the decode learnt is kept. (It used to
    calibrate and pass fixed costs: after two runs the file still read ``round_overhead_s
    0.0, round_scale 1.0, drafting {}``.) A ``--costs`` file is read, never written."""
    monkeypatch.setenv("JAXCERT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("JAXCERT_COSTS", str(tmp_path / "cache" / "costs"))

    def cheap(target, drafter, *, rows, config, **kw):  # drafting pays: the runs draft
        widths = {1} | {b + 1 for b in config.verify_buckets()}
        return decoding.PassCosts(rows=rows, target_s=dict.fromkeys(widths, 1.0), drafter_s=0.01)

    monkeypatch.setattr(costs_lib, "measure", cheap)
    kept = []
    for run in range(2):
        argv = _argv(files, tmp_path / f"out-{run}", "--no-baseline")
        argv[argv.index("--policy") + 1] = "goodput"
        assert cli.main(argv) == 0
        (path,) = (tmp_path / "cache" / "costs").glob("*.json")
        kept.append(json.loads(path.read_text()))
    for data in kept:  # what the drafting rounds emitted is kept after each run
        assert set(data["drafting"]) == {"greedy"} and sum(data["drafting"]["greedy"]["rounds"])
    # The first run's one call is its programs' first execution, which is not timed; the
    # second run's is timed: the tiny pair's rounds take far less than the passes claim.
    assert kept[0]["round_overhead_s"] == 0.0 and kept[1]["round_overhead_s"] < 0.0
    given = tmp_path / "given.json"
    decoding.GoodputController(decoding.PassCosts.from_json(kept[1])).save(given)
    before = given.read_bytes()
    argv = _argv(files, tmp_path / "out-given", "--no-baseline", "--costs", str(given))
    argv[argv.index("--policy") + 1] = "goodput"
    assert cli.main(argv) == 0 and given.read_bytes() == before


def test_progress_bar_names_the_run_it_counts():
    stream = io.StringIO()
    progress = decode_cli.DecodeProgress(total=100, file=stream)
    progress.label("target-only, batch 1/2")
    progress.advance(10)
    assert str(progress.bar).startswith("decode [target-only, batch 1/2]")
    progress.label("speculative, batch 1/2")
    progress.compiling("run_rounds")
    assert str(progress.bar).startswith("compiling run_rounds")
    progress.advance(20)  # compiling is over: the run's name comes back
    assert str(progress.bar).startswith("decode [speculative, batch 1/2]")
    progress.close()


def test_clamp_kls_leaves_no_negative_kl():
    from jaxcert.cli._common import clamp_kls

    summary = {
        "speculative": {"mean_kl": -0.0, "mean_drafter_entropy": -0.0, "tokens": -1},
        "rows": [{"kl": -1e-9}, {"kl": 0.25}, {"kl": None}],
        "node_kl": -3e-7,
    }
    got = clamp_kls(summary)
    assert json.dumps(got) == json.dumps({
        "speculative": {"mean_kl": 0.0, "mean_drafter_entropy": -0.0, "tokens": -1},
        "rows": [{"kl": 0.0}, {"kl": 0.25}, {"kl": None}],
        "node_kl": 0.0,
    })  # fmt: skip
    assert summary["speculative"]["mean_kl"] == 0.0 and str(summary["node_kl"]) == "-3e-07"


def test_decode_says_what_it_does_and_writes_no_negative_kl(files, monkeypatch, capsys):
    """A new user saw ``"mean_kl": -0.0`` in summary.json, minutes of silence while the
    models loaded and compiled, and one bar counting both runs without saying so."""
    monkeypatch.setenv("JAXCERT_CACHE", str(files["root"] / "cache"))
    real = run_report.summarize_runs

    def rounded_below_zero(runs):  # a mean KL of float-rounded zeros
        summary = real(runs)
        summary["speculative"]["mean_kl"] = -0.0
        return summary

    monkeypatch.setattr(run_report, "summarize_runs", rounded_below_zero)
    out = files["root"] / "out-kl"
    assert cli.main(_argv(files, out, "--batch-size", "1")) == 0
    text = (out / "summary.json").read_text()
    assert '"mean_kl": 0.0,' in text and "-0.0" not in text
    err = capsys.readouterr().err
    assert "[jaxcert] loading target" in err and "[jaxcert] compiling the decoding programs" in err
    for run in ("target-only, batch 1/2", "speculative, batch 1/2", "speculative, batch 2/2"):
        assert f"decode [{run}]" in err
