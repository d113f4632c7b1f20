"""Certificates of logits from elsewhere: dense dumps, top-K records, and the determined split."""

from __future__ import annotations

import json

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import safetensors.numpy

import jaxcert
from jaxcert import cli, models
from jaxcert.base import prompts
from jaxcert.core import rules as R
from jaxcert.pipeline import engine as certify
from jaxcert.pipeline import logits as certify_logits
from tests.helpers import tiny_lm

RULES = (R.StrictGreedy(), R.Additive(0.3), R.Multiplicative(0.1), R.Typical(),
         R.TargetTopK(2), R.TreeCoverage(2), R.TreeCoverage(4),
         R.TreeCoverage(3, base=R.Additive(0.05)))  # fmt: skip


def _random_logits(rng, n, v):
    """Peaked, flat and near-tied rows (the adversarial cases of the solver tests)."""
    scale = rng.choice([0.3, 1.0, 3.0, 8.0], size=(n, 1))
    x = rng.normal(size=(n, v)) * scale
    x[: n // 4, 1] = x[: n // 4, 0]  # exact ties at the top
    return x.astype(np.float32)


def _top(x, k):
    logp = x - np.logaddexp.reduce(x.astype(np.float64), axis=-1, keepdims=True)
    return -np.sort(-logp, axis=-1)[:, :k]


@pytest.mark.parametrize("k", [2, 3, 5, 12])
def test_determined_certificates_equal_the_full_vocabulary_solver(k):
    rng = np.random.default_rng(k)
    x = _random_logits(rng, 400, 40)
    full = jaxcert.certificates(jnp.asarray(x), RULES)
    got = certify_logits.certify_top_logprobs(_top(x, k), RULES, vocab_size=40)
    for rule, cert in zip(RULES, full, strict=True):
        det = got[f"determined_{rule.spec}"]
        value = got[f"cert_{rule.spec}"]
        assert np.all(np.isnan(value[~det]))
        np.testing.assert_allclose(value[det], np.asarray(cert.value)[det], rtol=2e-5, atol=1e-6,
                                   err_msg=rule.spec)  # fmt: skip
        if rule.static_upper_size is not None:  # fixed |U|: determined iff K >= |U| + m
            assert det.all() == (k >= rule.static_upper_size + rule.list_size), rule.spec
    # With a dozen entries the threshold rules are determined on most peaked rows.
    if k == 12:
        peaked = got["top1"] > 0.3
        assert peaked.sum() > 50
        for rule in (R.Additive(0.3), R.Multiplicative(0.1), R.Typical()):
            assert got[f"determined_{rule.spec}"][peaked].mean() > 0.7, rule.spec


def test_undetermined_means_the_tail_could_change_the_certificate():
    """Two distributions with the same top-2 but different certificates: not determined."""
    a = np.log(np.array([0.35, 0.30, 0.20, 0.15]))
    b = np.log(np.array([0.35, 0.30, 0.34, 0.01]) / 1.0)
    b = b - np.logaddexp.reduce(b)
    rule = R.Additive(0.3)
    ca, cb = (float(jaxcert.certificate(jnp.asarray(v, jnp.float32), rule).value) for v in (a, b))
    assert abs(ca - cb) > 1e-3
    got = certify_logits.certify_top_logprobs(np.stack([a[:2], a[:2]]), (rule,), vocab_size=4)
    assert not got["determined_additive:0.3"].any()
    assert np.isnan(got["cert_additive:0.3"]).all()
    # The whole vocabulary as the window: always determined.
    got = certify_logits.certify_top_logprobs(a[None], (rule, R.Typical()), vocab_size=4)
    assert got["determined_additive:0.3"].all() and got["determined_typical"].all()
    assert got["cert_additive:0.3"][0] == pytest.approx(ca, rel=1e-5)


def test_entropy_bounds_hold_and_are_reached():
    rng = np.random.default_rng(0)
    for _ in range(200):
        v, k = int(rng.integers(5, 30)), int(rng.integers(1, 5))
        p = rng.dirichlet(np.full(v, rng.choice([0.1, 1.0, 10.0])))
        top = -np.sort(-p)[:k]
        lo, hi = certify_logits.entropy_bounds(top[None], v)
        h = -np.sum(p * np.log(p))
        assert lo[0] - 1e-9 <= h <= hi[0] + 1e-9
    # Reached: the tail spread evenly (upper) or packed at the smallest seen value (lower).
    top = np.array([[0.5, 0.2]])
    even = np.r_[0.5, 0.2, np.full(6, 0.05)]
    packed = np.r_[0.5, 0.2, 0.2, 0.1, np.zeros(4)]
    h = lambda p: -np.sum(p[p > 0] * np.log(p[p > 0]))  # noqa: E731
    lo, hi = certify_logits.entropy_bounds(top, 8)
    assert lo[0] == pytest.approx(h(packed)) and hi[0] == pytest.approx(h(even))
    assert certify_logits.entropy_bounds(top, None)[1][0] == np.inf


def test_bad_top_logprobs_are_named():
    with pytest.raises(ValueError, match="not log-probabilities"):
        certify_logits.certify_top_logprobs(np.array([[0.0, 2.0]]), RULES)  # logits, not logprobs
    with pytest.raises(ValueError, match=r"row 1 has no log-probability"):
        certify_logits.certify_top_logprobs(np.array([[-0.1, -3.0], [np.nan, -np.inf]]), RULES)
    with pytest.raises(ValueError, match=r"\[N, K\]"):
        certify_logits.certify_top_logprobs(np.zeros(3), RULES)


def _chat_record(top):
    """One OpenAI chat-completions response carrying these [T, K] top log-probabilities."""
    content = [
        {"token": "t0", "logprob": float(row[0]), "bytes": [116],
         "top_logprobs": [{"token": f"t{i}", "logprob": float(lp), "bytes": [116]}
                          for i, lp in enumerate(row)]}
        for j, row in enumerate(top)
    ]  # fmt: skip
    message = {"role": "assistant", "content": "..."}
    choice = {"index": 0, "message": message, "logprobs": {"content": content}}
    return {"id": "chatcmpl-1", "object": "chat.completion", "choices": [choice]}


def test_record_formats(tmp_path):
    rng = np.random.default_rng(1)
    top = _top(_random_logits(rng, 6, 30), 5)
    want = certify_logits.certify_top_logprobs(top, RULES, vocab_size=30)
    spellings = {
        "chat": _chat_record(top),
        "completions": {"choices": [{"logprobs": {
            "tokens": ["t0"] * len(top), "token_logprobs": [float(row[0]) for row in top],
            "top_logprobs": [
            {f"t{i}": float(lp) for i, lp in enumerate(row)} for row in top]}}]},
        "tgi": {"generated_text": "..", "details": {"top_tokens": [
            [{"id": i, "text": "x", "logprob": float(lp)} for i, lp in enumerate(row)]
            for row in top]}},
        "llamacpp": {"completion_probabilities": [
            {"content": "t0", "probs": [{"tok_str": f"t{i}", "prob": float(np.exp(lp))}
                                        for i, lp in enumerate(row)]}
            for row in top]},
    }  # fmt: skip
    for name, record in spellings.items():
        path = tmp_path / f"{name}.jsonl"
        path.write_text(json.dumps(record) + "\n\n" + json.dumps(record) + "\n")
        index, logprobs, _ = certify_logits.read_logprob_records(path)
        assert index["record"].tolist() == [0] * 6 + [2] * 6, name
        assert index["position"].tolist() == list(range(6)) * 2, name
        got = certify_logits.certify_top_logprobs(logprobs, RULES, vocab_size=30)
        for rule in RULES:
            col = f"cert_{rule.spec}"
            np.testing.assert_allclose(got[col][:6], want[col], rtol=1e-5, err_msg=name)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(_chat_record(top)) + "\n{oops\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:2: invalid JSON"):
        certify_logits.read_logprob_records(bad)
    bad.write_text('{"choices": [{"text": "no logprobs", "logprobs": null}]}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:1: a choice without logprobs"):
        certify_logits.read_logprob_records(bad)


def test_dense_files_stream_in_chunks_and_match_the_solver(tmp_path):
    rng = np.random.default_rng(2)
    x = _random_logits(rng, 3 * 7, 50).reshape(3, 7, 50)
    want = jaxcert.certificates(jnp.asarray(x.reshape(21, 50)), RULES)
    safetensors.numpy.save_file(
        {"logits": x.astype(ml_dtypes.bfloat16)}, tmp_path / "x.safetensors"
    )
    np.save(tmp_path / "x.npy", x.reshape(21, 50).astype(np.float16))
    for name, shape in (("x.safetensors", "btv"), ("x.npy", "nv")):
        out = tmp_path / f"out-{name}"
        rc = cli.main(["certify-logits", str(tmp_path / name), "--chunk-rows", "4",
                       "--rules", ",".join(r.spec for r in RULES), "--out", str(out)])  # fmt: skip
        assert rc == 0
        table = pq.read_table(out / "certificates.parquet")
        assert table.num_rows == 21
        if shape == "btv":
            assert table["sequence"].to_pylist() == [b for b in range(3) for _ in range(7)]
            assert table["position"].to_pylist() == list(range(7)) * 3
        else:
            assert table["row"].to_pylist() == list(range(21))
        stored = x.astype(ml_dtypes.bfloat16 if shape == "btv" else np.float16).astype(np.float32)
        exact = jaxcert.certificates(jnp.asarray(stored.reshape(21, 50)), RULES)
        for rule, cert in zip(RULES, exact, strict=True):
            np.testing.assert_allclose(table[f"cert_{rule.spec}"].to_numpy(), cert.value,
                                       rtol=1e-6, err_msg=rule.spec)  # fmt: skip
        assert "cert_tree:4" in (out / "summary.md").read_text()
    del want
    # Refuses to overwrite; clear errors for bad inputs.
    args = ["certify-logits", str(tmp_path / "x.npy"), "--out", str(tmp_path / "out-x.npy")]
    assert cli.main(args) == 2
    np.save(tmp_path / "ints.npy", np.zeros((2, 5), np.int32))
    (tmp_path / "junk.safetensors").write_bytes(b"not a safetensors file")
    for name in ("ints.npy", "junk.safetensors", "missing.npy"):
        out = tmp_path / f"o-{name}"
        assert cli.main(["certify-logits", str(tmp_path / name), "--out", str(out)]) == 2, name
        assert not (out / "certificates.parquet").exists()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tiny_lm.save_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "ckpt")
    return path, models.load(str(path))


@pytest.mark.slow
def test_a_real_engine_transformers_gives_the_certificates_of_jaxcert_certify(tiny, tmp_path):
    """transformers (PyTorch, CPU) generates greedily with ``output_logits``; its logits as
    a dense dump and as OpenAI-style top-20 records give jaxcert certify's certificates."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    path, lm = tiny
    steps = 12
    prompt_set = [prompts.Prompt(f"p{i}", t) for i, t in enumerate(tiny_lm.TEXTS)]
    options = certify.CertifyOptions(steps=steps, batch_size=2, stop_at_eos=False)
    table, _ = certify.certify_prompts(lm, prompt_set, RULES, options)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    records, dense = [], []
    for ids in prompts.encode_prompts(lm.tokenizer, prompt_set):
        with torch.no_grad():
            # An explicit mask: generate would otherwise mask prompt tokens equal to the pad id.
            mask = torch.ones(1, len(ids), dtype=int)
            out = hf.generate(torch.tensor([ids]), attention_mask=mask,
                              max_new_tokens=steps, min_new_tokens=steps, do_sample=False,
                              output_logits=True, return_dict_in_generate=True,
                              pad_token_id=0)  # fmt: skip
        logits = certify_logits.stack_generate_logits(out.logits)[0]  # [T, V]
        dense.append(logits)
        records.append(_chat_record(_top(logits, 20)))
    (tmp_path / "engine.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n")
    safetensors.numpy.save_file({"logits": np.stack(dense)}, tmp_path / "engine.safetensors")
    spec = ",".join(r.spec for r in RULES)
    for name, extra in (("engine.jsonl", ["--vocab-size", "48"]), ("engine.safetensors", [])):
        out = tmp_path / name.replace(".", "-")
        assert cli.main(["certify-logits", str(tmp_path / name), "--rules", spec, "--out",
                         str(out), *extra]) == 0  # fmt: skip
        got = pq.read_table(out / "certificates.parquet").to_pydict()
        seq = got["record"] if name.endswith("jsonl") else got["sequence"]
        mine = table.to_pydict()
        compared = 0
        for r in range(len(seq)):
            i, t = seq[r], got["position"][r]
            row = i * steps + t  # the certify table: prompt order, then position
            assert mine["prompt_index"][row] == i and mine["position"][row] == t
            for rule in RULES:
                col = f"cert_{rule.spec}"
                if name.endswith("jsonl") and not got[f"determined_{rule.spec}"][r]:
                    continue
                where = f"{name} {rule.spec} prompt {i} pos {t}"
                np.testing.assert_allclose(got[col][r], mine[col][row], rtol=2e-4, atol=1e-5,
                                           err_msg=where)  # fmt: skip
                compared += 1
        assert compared > 0.8 * len(seq) * len(RULES), name


def test_more_bad_inputs_are_named(tmp_path, capsys):
    top = np.log(np.array([[0.6, 0.3, 0.05]]))
    for bad in (0, -5, 2, 2.5, True):
        with pytest.raises(ValueError, match="vocab_size"):
            certify_logits.certify_top_logprobs(top, RULES, vocab_size=bad)
    got = certify_logits.certify_top_logprobs(np.array([[5e-4, -9.0]]), RULES)
    assert got["top1"][0] == 1.0  # within the tolerance above 0: clipped, not 1.0005
    with pytest.raises(ValueError, match="N >= 1 rows"):
        certify_logits.certify_dense(np.zeros((0, 5), np.float32), RULES)
    np.save(tmp_path / "empty.npy", np.zeros((0, 10), np.float32))
    (tmp_path / "zero.npy").write_bytes(b"")
    for name, message in (("empty.npy", "no positions"), ("zero.npy", "not a readable")):
        with pytest.raises(ValueError, match=message):
            list(certify_logits.iter_dense_file(tmp_path / name))
    # A pretty-printed single response is one document, not JSON Lines.
    (tmp_path / "pretty.json").write_text(json.dumps(_chat_record(top), indent=2))
    index, logprobs, _ = certify_logits.read_logprob_records(tmp_path / "pretty.json")
    assert index["position"].tolist() == [0] and np.allclose(logprobs, top)
    # A row that is no distribution is flagged (valid = false, nan), the file still certified,
    # and named by its index in the file, not in the chunk.
    x = np.zeros((10, 4), np.float32)
    x[7, 1] = np.nan
    np.save(tmp_path / "nan.npy", x)
    rc = cli.main(["certify-logits", str(tmp_path / "nan.npy"), "--chunk-rows", "3",
                   "--out", str(tmp_path / "o")])  # fmt: skip
    assert rc == 0 and "row 7" in capsys.readouterr().err
    table = pq.read_table(tmp_path / "o" / "certificates.parquet")
    assert table["valid"].to_pylist() == [i != 7 for i in range(10)]
    assert np.isnan(table["cert_greedy"][7].as_py()) and table["token"][7].as_py() == -1
    assert table["cert_greedy"][6].as_py() == pytest.approx(0.0, abs=1e-7)  # a uniform row
    assert "no distribution" in (tmp_path / "o" / "summary.md").read_text()


def test_summary_percentiles_of_infinite_columns_are_infinite():
    from jaxcert.pipeline import report as certify_report

    table = pa.table({"c": [np.inf] * 19 + [0.5]})
    (row,) = certify_report.summarize_positions(table, ["c"])  # numpy alone gives p5 = nan
    assert row["p5"] == np.inf and row["median"] == np.inf and row["inf_share"] == 0.95


def test_dense_dump_shapes_invalid_rows_and_stale_partials(tmp_path, capsys):
    # A transposed [V, N] dump is refused when the vocabulary size is known.
    np.save(tmp_path / "t.npy", np.zeros((151_936, 3), np.float16))
    out = tmp_path / "o"
    argv = ["certify-logits", str(tmp_path / "t.npy"), "--vocab-size", "151936", "--out", str(out)]
    assert cli.main(argv) == 2
    assert "looks transposed" in capsys.readouterr().err
    assert not (out / "certificates.parquet").exists()
    # A NaN row of a [2, 100, V] dump is named by (sequence, position), not flattened (150).
    x = np.random.default_rng(0).normal(size=(2, 100, 8)).astype(np.float32)
    x[1, 50, 3] = np.nan
    safetensors.numpy.save_file({"logits": x}, tmp_path / "x.safetensors")
    # An earlier failed run left certificates.partial.parquet: a successful run removes it.
    out.mkdir(exist_ok=True)
    (out / "certificates.partial.parquet").write_bytes(b"stale")
    assert cli.main(["certify-logits", str(tmp_path / "x.safetensors"), "--out", str(out)]) == 0
    assert "(sequence 1, position 50)" in capsys.readouterr().err
    assert not (out / "certificates.partial.parquet").exists()
    table = pq.read_table(out / "certificates.parquet")
    assert table.num_rows == 200 and (~np.asarray(table["valid"])).sum() == 1
    want = jaxcert.certificates(jnp.asarray(x[0, :50]), (R.StrictGreedy(),))[0].value
    np.testing.assert_allclose(table["cert_greedy"].to_numpy()[:50], want, rtol=1e-6)


def test_a_failure_keeps_what_was_certified_in_the_partial_file(tmp_path):
    x = np.random.default_rng(0).normal(size=(5, 8)).astype(np.float32)

    def tables():
        yield pa.table({"row": np.arange(5), **certify_logits.certify_dense(x, RULES)})
        raise RuntimeError("disk gone")

    kept = []
    with pytest.raises(RuntimeError, match="disk gone"):
        certify_logits.write_certificates(tmp_path / "o", tables(), kept=lambda *a: kept.append(a))
    partial = tmp_path / "o" / certify_logits.PARTIAL
    assert kept == [(5, partial)] and pq.read_table(partial).num_rows == 5
    assert not (tmp_path / "o" / certify_logits.CERTIFICATES).exists()
    assert not list((tmp_path / "o").glob(".*tmp*"))


def test_summary_shows_no_nan_mean_beside_an_infinite_median(tmp_path):
    """Every additive:0.3 certificate of a uniform row is inf: the summary said mean nan
    beside median inf; the mean is now of the finite values, blank when there are none."""
    np.save(tmp_path / "u.npy", np.zeros((4, 48), np.float32))
    out = tmp_path / "o"
    argv = ["certify-logits", str(tmp_path / "u.npy"), "--rules", "greedy,additive:0.3",
            "--out", str(out)]  # fmt: skip
    assert cli.main(argv) == 0
    text = (out / "summary.md").read_text()
    assert "| column | n | finite_mean | median | p5 | inf_share |" in text
    assert "| cert_additive:0.3 | 4 | | inf | inf | 1.000 |" in text and "nan" not in text
