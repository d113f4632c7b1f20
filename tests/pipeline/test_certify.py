"""The certification pipeline and ``jaxcert certify`` on a tiny model built by the test."""

from __future__ import annotations

import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from flax import nnx

import jaxcert
from jaxcert import cli, models
from jaxcert.base import prompts
from jaxcert.base.programs import default_programs
from jaxcert.core import rules as R
from jaxcert.pipeline import engine as certify
from jaxcert.pipeline import report as certify_report
from tests.helpers import tiny_lm

RULES = (R.StrictGreedy(), R.Additive(0.3), R.Typical(), R.TreeCoverage(2),
         R.TreeCoverage(2, base=R.Multiplicative(0.5)))  # fmt: skip
TEXTS = ["the cat sat on the mat.", "an otter", "he is in the water, a big one!", "a, b?", "on"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return tiny_lm.save_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "ckpt")


@pytest.fixture(scope="module")
def lm(checkpoint):
    return models.load(str(checkpoint))


@pytest.fixture
def prompt_file(tmp_path):
    path = tmp_path / "prompts.jsonl"
    lines = [json.dumps({"id": f"p{i}", "prompt": t, "category": "c"}) for i, t in enumerate(TEXTS)]
    path.write_text("\n".join(lines) + "\n")
    return path


def _teacher_forced_logits(lm, ids):
    """Logits at every generated position from one fresh prefill of prompt + continuation."""
    graphdef, state = nnx.split(lm.model)
    cache = models.KVCache.create(lm.config, 1, len(ids) + 1)
    logits, _ = models.forward(graphdef, state, jnp.asarray([ids], jnp.int32), cache)
    return np.asarray(logits[0])


def test_pipeline_matches_an_unbatched_teacher_forced_reference(lm):
    prompt_set = [prompts.Prompt(str(i), t) for i, t in enumerate(TEXTS)]
    options = certify.CertifyOptions(steps=9, batch_size=2, chunk=4, stop_at_eos=False)
    table, info = certify.certify_prompts(lm, prompt_set, RULES, options)
    assert info["prompts_used"] == len(TEXTS)
    assert table.num_rows == len(TEXTS) * 9
    encoded = prompts.encode_prompts(lm.tokenizer, prompt_set)
    rows = table.to_pydict()
    for i, ids in enumerate(encoded):
        mine = [r for r in range(table.num_rows) if rows["prompt_id"][r] == str(i)]
        assert [rows["position"][r] for r in mine] == list(range(9))
        generated = [rows["token"][r] for r in mine]
        full = _teacher_forced_logits(lm, ids + generated)
        logits = full[len(ids) - 1 : len(ids) - 1 + 9]
        np.testing.assert_array_equal(generated, np.argmax(logits, -1))
        certs = jaxcert.certificates(jnp.asarray(logits), RULES)
        for rule, cert in zip(RULES, certs, strict=True):
            got = np.array([rows[certify.rule_column(rule)][r] for r in mine])
            np.testing.assert_allclose(got, cert.value, rtol=2e-4, atol=1e-6)
        stats = jaxcert.core.stats.distribution_stats(jnp.asarray(logits))
        np.testing.assert_allclose([rows["top1"][r] for r in mine], stats.top1, rtol=1e-4)
        np.testing.assert_allclose([rows["entropy"][r] for r in mine], stats.entropy, rtol=1e-4)


def test_a_run_compiles_through_its_programs_and_counts_the_time(lm):
    """The pieces compile ahead of time through the run's ``Programs``: the first run
    compiles each one (prefill widths, install, decode chunk) and counts the time; a second
    run with the same ``Programs`` and shapes compiles nothing and computes the same rows."""
    from jaxcert.decoding import Programs

    prompt_set = [prompts.Prompt(str(i), t) for i, t in enumerate(TEXTS)]
    options = certify.CertifyOptions(steps=3, batch_size=2, chunk=4, stop_at_eos=False)
    programs, stages = Programs(), []
    first = certify.Certifier(lm, prompt_set, RULES[:1], options, programs=programs,
                              progress=lambda p: stages.append(p.stage))  # fmt: skip
    tables = list(first)
    widths = {w for ids in first.encoded
              for w, _ in certify.prefill_pieces(len(ids), options.prefill_widths)}  # fmt: skip
    assert programs.compiled == len(widths) + 2
    assert len(programs.of(certify._decode_chunk)) == 1
    assert first.info["compile_s"] > 0 and stages.count("compile") == programs.compiled
    second = certify.Certifier(lm, prompt_set, RULES[:1], options, programs=programs)
    assert certify.merge_parts(list(second)).equals(certify.merge_parts(tables))
    assert second.info["compile_s"] == 0 and programs.compiled == len(widths) + 2
    # By default a run compiles in its own Programs: the decoders' options do not apply.

    own = certify.Certifier(lm, prompt_set, RULES[:1], options).programs
    assert own.compiled == 0 and own is not default_programs()


def test_stop_at_eos_and_min_prompt_tokens(lm):
    prompt_set = [prompts.Prompt(str(i), t) for i, t in enumerate(TEXTS)]
    lengths = [len(x) for x in prompts.encode_prompts(lm.tokenizer, prompt_set)]
    cutoff = sorted(lengths)[2]
    options = certify.CertifyOptions(steps=20, batch_size=3, chunk=8, min_prompt_tokens=cutoff)
    table, info = certify.certify_prompts(lm, prompt_set, RULES[:1], options)
    assert info["prompts_used"] == sum(n >= cutoff for n in lengths)
    eos = set(lm.config.eos_token_ids)
    rows = table.to_pydict()
    for pid in set(rows["prompt_id"]):
        tokens = [t for p, t in zip(rows["prompt_id"], rows["token"], strict=True) if p == pid]
        assert not any(t in eos for t in tokens[:-1])  # nothing recorded after an end of turn
    with pytest.raises(ValueError, match="the target supports 512"):
        certify.certify_prompts(lm, prompt_set, RULES, certify.CertifyOptions(steps=600))
    options = certify.CertifyOptions(steps=2, max_prompt_tokens=cutoff)
    table, info = certify.certify_prompts(lm, prompt_set, RULES[:1], options)
    assert info["prompts_skipped_long"] == sum(n > cutoff for n in lengths) > 0
    assert set(table["prompt_index"].to_pylist()) == {
        i for i, n in enumerate(lengths) if n <= cutoff
    }
    with pytest.raises(ValueError, match="no prompt has between 10000 and"):
        certify.certify_prompts(
            lm, prompt_set, RULES, certify.CertifyOptions(min_prompt_tokens=10_000)
        )


def test_cli_certify_writes_tables_and_plots(checkpoint, prompt_file, tmp_path, capsys):
    out = tmp_path / "run"
    rc = cli.main(["certify", "--target", str(checkpoint), "--prompts", str(prompt_file),
                   "--rules", "greedy,tree:2,typical", "--steps", "5", "--batch-size", "2",
                   "--max-prompts", "3", "--ignore-eos", "--out", str(out)])  # fmt: skip
    assert rc == 0
    table = pq.read_table(out / "positions.parquet")
    assert table.num_rows == 15
    assert {"cert_greedy", "cert_tree:2", "cert_typical", "margin", "top10_coverage"} <= set(
        table.column_names
    )
    summary = (out / "summary.md").read_text()
    assert "| cert_tree:2 |" in summary and "eps=0.1" in summary
    assert (out / "certificate_cdf.png").stat().st_size > 1000
    assert (out / "certificate_vs_margin.png").stat().st_size > 1000
    meta = json.loads((out / "run.json").read_text())
    assert meta["status"] == "ok" and meta["positions"] == 15
    captured = capsys.readouterr()
    assert "cert_greedy" in captured.out
    assert meta["compile_s"] >= 0 and f"compile {meta['compile_s']:.1f} s" in captured.err


@pytest.mark.parametrize(
    "override, message",
    [
        ({"--rules": "greedy,bogus:1"}, "argument --rules: unknown rule 'bogus:1'"),
        ({"--rules": "additive:2"}, "argument --rules: rule 'additive:2': T must be in (0, 1]"),
        ({"--prompts": "/nonexistent/p.jsonl"}, "--prompts: no prompt file '/nonexistent/p.jsonl'"),
        ({"--prompts": "smollm2-135m-instruct"}, "--prompts: 'smollm2-135m-instruct' is a model"),
        ({"--target": "/nonexistent/model"}, "--target: cannot load '/nonexistent/model'"),
        ({"--target": "mtbench"}, "--target: 'mtbench' is a prompt set, not a model"),
    ],
    ids=["unknown-rule", "bad-parameter", "missing-prompts", "model-as-prompts", "missing-model",
         "prompts-as-model"],
)  # fmt: skip
def test_cli_errors_are_clear(override, message, checkpoint, prompt_file, tmp_path, capsys):
    """Errors name the option and what the user typed, and list only what fits the option
    (`--target /nope` used to list `mtbench` among the loadable models)."""
    flags = {"--target": str(checkpoint), "--prompts": str(prompt_file), "--steps": "2",
             "--out": str(tmp_path / "o")} | override  # fmt: skip
    args = ["certify"] + [item for pair in flags.items() for item in pair]
    if "argument" in message:  # refused by the parser
        with pytest.raises(SystemExit) as exit_info:
            cli.main(args)
        assert exit_info.value.code == 2
    else:
        assert cli.main(args) == 2
    err = capsys.readouterr().err
    assert message in err, err
    if "--target" in override:
        assert "sharegpt" not in err and "mtbench, " not in err  # no prompt set as a model
    if "--prompts" in override:
        assert "qwen2.5" not in err  # no model as a prompt set


def test_cli_certify_mixed_categories_and_out_errors(checkpoint, tmp_path, capsys):
    """Categories missing on some lines or not strings still make one table."""
    path = tmp_path / "mixed.jsonl"
    path.write_text('{"prompt": "the cat sat", "category": "a"}\n{"prompt": "an otter"}\n'
                    '{"prompt": "he is in", "category": 3}\n')  # fmt: skip
    out = tmp_path / "run"
    args = ["certify", "--target", str(checkpoint), "--prompts", str(path), "--rules", "greedy",
            "--steps", "2", "--batch-size", "1", "--ignore-eos", "--no-plots"]  # fmt: skip
    assert cli.main(args + ["--out", str(out)]) == 0
    table = pq.read_table(out / "positions.parquet")
    ids, cats = table.column("prompt_id").to_pylist(), table.column("category").to_pylist()
    pairs = zip(ids, cats, strict=True)
    assert sorted(pairs, key=str) == [("1", "a")] * 2 + [("2", None)] * 2 + [("3", "3")] * 2
    (tmp_path / "file").write_text("x")
    assert cli.main(args + ["--out", str(tmp_path / "file")]) == 2
    assert "file" in capsys.readouterr().err


def test_load_prompts_formats_and_errors(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text(
        '{"question_id": 7, "category": "math", "turns": ["first", "second"]}\n\n'
        '{"prompt": "plain"}\n{"turns": ["only one"]}\n'
    )
    got = prompts.load_prompts(str(path))
    assert [(p.id, p.text, p.category) for p in got] == [
        ("7", "first", "math"), ("3", "plain", None), ("4", "only one", None)
    ]  # fmt: skip
    assert [p.text for p in prompts.load_prompts(str(path), turn=1)] == ["second"]
    with pytest.raises(ValueError, match="none of its 3 records has a turn 2 \\(counting from 0"):
        prompts.load_prompts(str(path), turn=2)
    assert len(prompts.load_prompts(str(path), max_prompts=2)) == 2
    path.write_text('{"prompt": "ok"}\n{"prompt": 3}\n')
    with pytest.raises(ValueError, match=r"p.jsonl:2"):
        prompts.load_prompts(str(path))
    path.write_text('{"prompt": "ok"}\nnot json\n')
    with pytest.raises(ValueError, match=r"p.jsonl:2: invalid JSON"):
        prompts.load_prompts(str(path))
    with pytest.raises(FileNotFoundError):
        prompts.load_prompts(str(tmp_path / "missing.jsonl"))


def test_summary_handles_infinite_certificates_and_runs():
    table = pa.table({
        "prompt_id": ["a", "a", "a", "b", "b"],
        "position": [0, 1, 2, 0, 1],
        "cert": [0.5, math.inf, 0.01, 0.2, 0.3],
    })  # fmt: skip
    (row,) = certify_report.summarize_positions(table, ["cert"])
    assert row["inf_share"] == pytest.approx(0.2)
    assert row["finite_mean"] == pytest.approx((0.5 + 0.01 + 0.2 + 0.3) / 4)
    assert row["median"] == pytest.approx(0.3)
    (runs,) = certify_report.run_lengths(table, ["cert"], budgets=(0.1, 0.25))
    # eps=0.1: a -> [2, 1, 0], b -> [2, 1]; eps=0.25: a -> [2, 1, 0], b -> [1, 1]... b: 0.2<0.25
    assert runs["eps=0.1"] == pytest.approx((2 + 1 + 0 + 2 + 1) / 5)
    assert runs["eps=0.25"] == pytest.approx((2 + 1 + 0 + 0 + 1) / 5)
    assert "| cert |" in certify_report.markdown_table([row])


def test_distribution_stats_by_hand():
    p = jnp.array([[0.5, 0.2, 0.2, 0.1], [0.25, 0.25, 0.25, 0.25]])
    st = jaxcert.core.stats.distribution_stats(jnp.log(p), top=2)
    np.testing.assert_allclose(st.top1, [0.5, 0.25], rtol=1e-6)
    np.testing.assert_allclose(st.top_coverage, [0.7, 0.5], rtol=1e-6)
    np.testing.assert_allclose(st.margin, [0.3, 0.0], atol=1e-7)
    np.testing.assert_allclose(st.entropy, -np.sum(np.asarray(p) * np.log(p), -1), rtol=1e-6)
    np.testing.assert_array_equal(st.greedy_token, [0, 0])
    assert jax.jit(jaxcert.core.stats.distribution_stats)(jnp.log(p)).top1.shape == (2,)


def test_sharegpt_files_keep_the_complete_conversations(tmp_path):
    """A ShareGPT-format array cut off mid-record (as the registry's copy is)."""
    records = [
        {"id": "a", "conversations": [{"from": "human", "value": "first?"},
                                      {"from": "gpt", "value": "yes"},
                                      {"from": "human", "value": "second?"}]},
        {"id": "b", "conversations": [{"from": "gpt", "value": "hello"}]},  # no human turn
        {"id": "c", "conversations": [{"from": "system", "value": "s"},
                                      {"from": "human", "value": "third"}]},
        {"id": "d", "conversations": [{"from": "human", "value": "cut off"}]},
    ]  # fmt: skip
    text = json.dumps(records, indent=1)
    path = tmp_path / "sharegpt.json"
    path.write_text(text[: text.index('"cut off"') + 4])  # the last record is incomplete
    got = prompts.load_prompts(str(path))
    assert [(p.id, p.text) for p in got] == [("a", "first?"), ("c", "third")]
    assert [p.response for p in got] == ["yes", None]  # the gpt reply right after the turn
    assert [p.text for p in prompts.load_prompts(str(path), turn=1)] == ["second?"]
    assert len(prompts.load_prompts(str(path), max_prompts=1)) == 1
    start = text.index('{\n  "id": "d"')
    for cut in range(start + 1, text.rindex("}")):  # cut anywhere in the last record
        path.write_text(text[:cut])
        assert [p.id for p in prompts.load_prompts(str(path))] == ["a", "c"], text[start:cut]
    path.write_text(text.replace('"id": "c"', '"id" "c"'))  # invalid JSON mid-file
    with pytest.raises(ValueError, match=r"invalid JSON in record 2 \(Expecting ':' delimiter"):
        prompts.load_prompts(str(path))
    path.write_text(json.dumps([records[0], "b", *records[2:]]))
    with pytest.raises(ValueError, match="record 1 has no 'conversations' list"):
        prompts.load_prompts(str(path))
    path.write_text('{"not": "an array"}')
    with pytest.raises(ValueError, match="JSON array of conversations"):
        prompts.load_prompts(str(path))


def test_prefill_pieces_pad_below_the_narrowest_width():
    widths = (16, 64, 256)
    for n in range(1, 700):
        pieces = certify.prefill_pieces(n, widths)
        assert sum(c for _, c in pieces) == n
        assert all(w in widths and 0 < c <= w for w, c in pieces)
        assert sum(w for w, _ in pieces) - n < 16
        assert all(c == w for w, c in pieces[:-1])  # only the last piece is padded


def test_counts_are_singular_or_plural():
    from jaxcert.base.tables import counted

    assert counted(1, "prompt") == "1 prompt"
    assert [counted(n, "prompt") for n in (0, 2)] == ["0 prompts", "2 prompts"]
    assert counted(1024, "position", digits=",") == "1,024 positions"
    assert counted(3, "entry", "entries") == "3 entries"


def test_cli_says_one_prompt_not_one_prompts(checkpoint, tmp_path, capsys):
    one = tmp_path / "one.jsonl"
    one.write_text(json.dumps({"id": "a", "prompt": "the cat sat"}) + "\n")
    out = tmp_path / "out"
    args = ["certify", "--target", str(checkpoint), "--prompts", str(one), "--rules", "greedy",
            "--steps", "1", "--no-plots", "--out", str(out)]  # fmt: skip
    assert cli.main(args) == 0
    captured = capsys.readouterr()
    assert "loaded in" in captured.err and "; 1 prompt, rules: greedy" in captured.err
    assert "[jaxcert] compiling the certificate programs first" in captured.err
    assert "## Positions: 1 (1 prompt x up to 1 greedy step)" in (out / "summary.md").read_text()


_NO_TORCH = """
import logging, sys
sys.modules["torch"] = None  # as where PyTorch is not installed
from jaxcert import cli
code = cli.main({args!r})
logging.getLogger("transformers").warning("a real warning still shows")
sys.exit(code)
"""


def test_transformers_no_pytorch_advice_is_silenced_and_nothing_else(checkpoint, prompt_file):
    import os
    import subprocess
    import sys

    args = ["certify", "--target", str(checkpoint), "--prompts", str(prompt_file),
            "--max-prompt-tokens", "1", "--out", "unused"]  # fmt: skip
    proc = subprocess.run([sys.executable, "-c", _NO_TORCH.format(args=args)], text=True,
                          capture_output=True, timeout=300)  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "loading target" in proc.stderr and "no prompt has between 1 and 1" in proc.stderr
    assert "PyTorch" not in proc.stderr
    assert "a real warning still shows" in proc.stderr
    assert not os.path.exists("unused")
