"""Engines' log-probability records as engines write them: no record overstates a certificate."""

from __future__ import annotations

import json
import math

import jax.numpy as jnp
import numpy as np
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

import jaxcert
from jaxcert import cli
from jaxcert.core import rules as R
from jaxcert.pipeline import logits as certify_logits
from jaxcert.pipeline import records

RULES = (R.StrictGreedy(), R.Additive(0.3), R.Multiplicative(0.1), R.Typical(),
         R.TargetTopK(2), R.TreeCoverage(2), R.TreeCoverage(3, base=R.Additive(0.05)))  # fmt: skip


def _certify(documents, vocab, rules=RULES):
    got = records.parse_logprob_records(documents)
    return got, certify_logits.certify_top_logprobs(got.logprobs, rules, vocab_size=vocab)


def _dense(logp, rule) -> float:
    return float(jaxcert.certificate(jnp.asarray(logp, jnp.float32), rule).value)


def test_completions_sampled_token_appended_outside_the_top_n_is_not_taken_as_rank_two():
    """The completions format lists the sampled token even outside the top N ("up to
    logprobs + 1 elements"): here E, rank 5, with logprobs = 1. Read as the top 2 it gave
    greedy "determined" at 0.2757 (truth 0.0253) and margin 0.48 (truth 0.20)."""
    lp = np.log([0.50, 0.30, 0.12, 0.05, 0.02, 0.01])
    record = {"choices": [{"logprobs": {"tokens": ["E"], "token_logprobs": [lp[4]],
                                        "top_logprobs": [{"A": lp[0], "E": lp[4]}]}}]}  # fmt: skip
    got, cols = _certify([record], 6, (R.StrictGreedy(),))
    assert got.counts.sampled_dropped == 1
    assert got.logprobs.tolist() == [[lp[0]]]
    assert not cols["determined_greedy"][0] and math.isnan(cols["cert_greedy"][0])
    assert math.isnan(cols["margin"][0])
    assert _dense(lp, R.StrictGreedy()) == pytest.approx(0.02527, abs=1e-5)
    # The sampled token heavier than everything unseen (0.3 > 1 - 0.8) is surely rank 2.
    record["choices"][0]["logprobs"].update(tokens=["B"], token_logprobs=[lp[1]],
                                            top_logprobs=[{"A": lp[0], "B": lp[1]}])  # fmt: skip
    got, cols = _certify([record], 6, (R.StrictGreedy(),))
    assert got.counts.sampled_dropped == 0 and cols["determined_greedy"][0]
    assert cols["cert_greedy"][0] == pytest.approx(_dense(lp, R.StrictGreedy()), rel=1e-5)
    # Lighter than the unseen mass (0.2 < 0.4), it could be an appended extra: left out,
    # though here it is the true rank 2 (the price of never overstating).
    lp = np.log([0.4, 0.2, 0.15, 0.15, 0.1])
    record["choices"][0]["logprobs"].update(tokens=["B"], token_logprobs=[lp[1]],
                                            top_logprobs=[{"A": lp[0], "B": lp[1]}])  # fmt: skip
    got, cols = _certify([record], 5, (R.StrictGreedy(),))
    assert got.counts.sampled_dropped == 1 and not cols["determined_greedy"][0]


def test_duplicated_entries_make_no_fake_tie():
    """vLLM lists the sampled token twice (same token, bytes and logprob): [A .25, A .25,
    B .20, C .15], V = 50. Read as is, greedy was determined at 0.0 (true 0.00278) and
    tree:2 at 0.00278 (true 0.01263)."""
    v = 50
    p = np.r_[0.25, 0.20, 0.15, np.full(v - 3, 0.40 / (v - 3))]
    entry = lambda t, q: {"token": t, "logprob": math.log(q), "bytes": [ord(t)]}  # noqa: E731
    top = [entry("A", 0.25), entry("A", 0.25), entry("B", 0.2), entry("C", 0.15)]
    position = {**entry("A", 0.25), "top_logprobs": top}
    record = {"choices": [{"logprobs": {"content": [position]}}]}
    rules = (R.StrictGreedy(), R.TreeCoverage(2))
    got, cols = _certify([record], v, rules)
    assert got.counts.duplicates_removed == 1 and got.logprobs.shape == (1, 3)
    assert cols["cert_greedy"][0] == pytest.approx(0.0027835, rel=1e-4)
    assert cols["cert_tree:2"][0] == pytest.approx(0.0126336, rel=1e-4)
    for rule in rules:
        assert cols[f"cert_{rule.spec}"][0] == pytest.approx(_dense(np.log(p), rule), rel=1e-5)
    # One token id with two different values is an inconsistent record, not a guess.
    bad = [{"id": 7, "logprob": -1.0}, {"id": 7, "logprob": -2.0}]
    with pytest.raises(ValueError, match=r"record:1: token id 7 is listed with two different"):
        records.parse_logprob_records([{"completion_probabilities": [
            {"id": 7, "logprob": -1.0, "top_logprobs": bad}]}])  # fmt: skip


def test_null_positions_post_sampling_probs_and_bad_lines(tmp_path):
    lp = np.log([0.6, 0.3, 0.1])
    # echo: the first prompt token has no top_logprobs: a missing position, not a refusal.
    completions = {"choices": [{"logprobs": {
        "tokens": ["a", "b", "c"], "token_logprobs": [None, lp[0], lp[0]],
        "top_logprobs": [None, {"b": lp[0], "x": lp[1]}, {"c": lp[0], "y": lp[1]}]}}]}  # fmt: skip
    got = records.parse_logprob_records([completions])
    assert got.index["position"].tolist() == [1, 2] and got.counts.missing_positions == 1
    # llama.cpp's post_sampling_probs spelling: prob / top_probs.
    llama = {"completion_probabilities": [
        {"id": 5, "token": "b", "bytes": [98], "prob": 0.6,
         "top_probs": [{"id": 5, "token": "b", "bytes": [98], "prob": 0.6},
                       {"id": 9, "token": "x", "bytes": [120], "prob": 0.3}]}]}  # fmt: skip
    got = records.parse_logprob_records([llama])
    np.testing.assert_allclose(got.logprobs, [lp[:2]])
    # SGLang native and TGI native.
    sglang = {"text": "b", "meta_info": {"output_token_logprobs": [[lp[0], 5, "b"]],
              "output_top_logprobs": [[[lp[0], 5, "b"], [lp[1], 9, "x"]]]}}  # fmt: skip
    tgi = {"generated_text": "b", "details": {"tokens": [{"id": 5, "text": "b", "logprob": lp[0]}],
           "top_tokens": [[{"id": 5, "text": "b", "logprob": lp[0]},
                           {"id": 9, "text": "x", "logprob": lp[1]}]]}}  # fmt: skip
    for record in (sglang, tgi):
        np.testing.assert_allclose(records.parse_logprob_records([record]).logprobs, [lp[:2]])
    # A truncated last line: refused with the way out named, or skipped and counted.
    path = tmp_path / "r.jsonl"
    path.write_text(json.dumps(completions) + "\n" + json.dumps(completions)[:40] + "\n")
    with pytest.raises(ValueError, match=r"r.jsonl:2: invalid JSON .*--skip-bad-lines"):
        records.read_logprob_records(path)
    got = records.read_logprob_records(path, skip_bad_lines=True)
    assert got.counts.bad_lines_skipped == 1 and got.counts.positions == 2
    out = tmp_path / "out"
    rc = cli.main(["certify-logits", str(path), "--skip-bad-lines", "--vocab-size", "3",
                   "--rules", "greedy,tree:4", "--out", str(out)])  # fmt: skip
    assert rc == 0
    summary = (out / "summary.md").read_text()
    assert "unreadable lines skipped: 1" in summary
    assert "positions without log-probabilities (null or empty lists), skipped: 1" in summary
    assert "tree:4: needs K >= 5 entries per position" in summary  # the records have K = 2
    assert json.loads((out / "run.json").read_text())["records"]["bad_lines_skipped"] == 1


def test_sentinel_entries_are_left_out():
    lp = np.log([0.5, 0.3, 0.2])
    position = {"token": "a", "logprob": lp[0], "top_logprobs": [
        {"token": "a", "logprob": lp[0]}, {"token": "b", "logprob": -9999.0},
        {"token": "c", "logprob": lp[1]}]}  # fmt: skip
    got = records.parse_logprob_records([{"content": [position]}])
    assert got.counts.sentinel_entries == 1
    np.testing.assert_allclose(got.logprobs, [lp[:2]])


def _record(rng, fmt, logp, n, duplicate, sentinel, spelt_alike=False):
    """One position of an engine record for the distribution ``exp(logp)``: top ``n`` and a
    sampled token, as the engine ``fmt`` spells it (its quirks included). ``spelt_alike``:
    every third token is spelt U+FFFD with its UTF-8 bytes, as vLLM spells byte tokens."""
    v = logp.size

    def text(i):
        return "\ufffd" if spelt_alike and i % 3 == 0 else f"t{i}"

    def raw(i):
        return list(text(i).encode())

    order = np.argsort(-logp, kind="stable")
    sampled = int(rng.choice(v, p=np.exp(logp) / np.exp(logp).sum()))
    lp = logp.astype(np.float32).astype(float)  # engines return float32 values
    top = [int(i) for i in order[:n]]
    if fmt.startswith("completions"):  # the sampled token is appended outside the top n
        listed = top + ([sampled] if sampled not in top else [])
    elif fmt == "vllm-chat":  # sampled token first, then the first n kept
        listed = list(dict.fromkeys([sampled, *top]))[:n]
    else:  # the true top n
        listed = top
    listed = [(i, lp[i]) for i in listed]
    if sentinel:
        outside = [int(i) for i in order[n:] if int(i) != sampled]
        if outside:
            listed.append((outside[0], records.SENTINEL_LOGPROB))
    rng.shuffle(listed)
    if duplicate and not fmt.startswith("completions"):  # a dict cannot repeat a key
        listed.insert(int(rng.integers(len(listed) + 1)), listed[int(rng.integers(len(listed)))])
    if fmt == "completions":
        return {"tokens": [f"t{sampled}"], "token_logprobs": [lp[sampled]],
                "top_logprobs": [{f"t{i}": x for i, x in listed}]}  # fmt: skip
    if fmt == "completions-untold":  # the sampled token appended, but not named
        return {"tokens": [], "token_logprobs": [],
                "top_logprobs": [{f"t{i}": x for i, x in listed}]}  # fmt: skip
    if fmt == "llamacpp-post":
        return {"id": sampled, "token": f"t{sampled}", "prob": math.exp(lp[sampled]),
                "top_probs": [{"id": i, "token": f"t{i}", "prob": math.exp(x)}
                              for i, x in listed]}  # fmt: skip
    if fmt == "sglang":
        return [[lp[sampled], sampled, f"t{sampled}"], [[x, i, f"t{i}"] for i, x in listed]]
    return {"token": text(sampled), "logprob": lp[sampled], "bytes": raw(sampled),
            "top_logprobs": [{"token": text(i), "logprob": x, "bytes": raw(i)}
                             for i, x in listed]}  # fmt: skip


def _document(fmt: str, positions: list):
    if fmt.startswith("completions"):
        merged = {k: [x for p in positions for x in p[k]]
                  for k in ("tokens", "token_logprobs", "top_logprobs")}  # fmt: skip
        return {"choices": [{"logprobs": merged}]}
    if fmt == "llamacpp-post":
        return {"completion_probabilities": positions}
    if fmt == "sglang":
        return {"meta_info": {"output_token_logprobs": [p[0] for p in positions],
                              "output_top_logprobs": [p[1] for p in positions]}}  # fmt: skip
    return {"choices": [{"logprobs": {"content": positions}}]}


FORMATS = ("chat", "completions", "completions-untold", "vllm-chat", "llamacpp-post", "sglang")


@pytest.mark.slow  # two minutes: part of the full run
@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    phases=[Phase.explicit, Phase.reuse, Phase.generate],
)  # shrinking takes minutes
@given(
    seed=st.integers(0, 2**31 - 1),
    fmt=st.sampled_from(FORMATS),
    vocab=st.integers(3, 40),
    n=st.integers(1, 6),
    duplicates=st.booleans(),
    sentinels=st.booleans(),
    spelt_alike=st.booleans(),
)
def test_no_record_yields_a_determined_certificate_other_than_the_dense_solvers(
    seed, fmt, vocab, n, duplicates, sentinels, spelt_alike
):
    """Records built from known distributions, with random top-n lengths, appended,
    substituted or unnamed sampled tokens, duplicated entries, sentinels, exact ties and
    tokens spelt alike, in each engine's spelling: every determined certificate equals
    the full-vocabulary solver's."""
    rng = np.random.default_rng(seed)
    rows = 24
    scale = rng.choice([0.3, 1.0, 3.0, 8.0], size=(rows, 1))
    logits = rng.normal(size=(rows, vocab)) * scale
    logits[: rows // 4, 1] = logits[: rows // 4, 0]  # exact ties at the top
    logp = logits - np.logaddexp.reduce(logits, axis=-1, keepdims=True)
    n = min(n, vocab)
    logits[rows // 4 : rows // 2, 3 % vocab] = logits[rows // 4 : rows // 2, 1]  # ties lower
    logp = logits - np.logaddexp.reduce(logits, axis=-1, keepdims=True)
    alike = spelt_alike and fmt in ("chat", "vllm-chat")
    positions = [_record(rng, fmt, logp[t], n, rng.random() < 0.5 and duplicates,
                         rng.random() < 0.5 and sentinels, alike) for t in range(rows)]  # fmt: skip
    got, cols = _certify([_document(fmt, positions)], vocab)
    logp = logp[got.index["position"]]  # a position whose only entry was dropped is missing
    assert got.counts.missing_positions == rows - len(logp)
    full = jaxcert.certificates(jnp.asarray(logp, jnp.float32), RULES)
    determined_any = 0
    for rule, cert in zip(RULES, full, strict=True):
        det = cols[f"determined_{rule.spec}"]
        determined_any += int(det.sum())
        want = np.asarray(cert.value, np.float64)[det]
        np.testing.assert_allclose(cols[f"cert_{rule.spec}"][det], want, rtol=1e-4, atol=1e-6,
                                   err_msg=f"{fmt} {rule.spec}")  # fmt: skip
    if n >= 3 and fmt in ("chat", "llamacpp-post", "sglang") and not spelt_alike:
        assert determined_any > 0  # the true top 3 determine greedy and topk:2 everywhere


def test_spellings_that_may_stand_for_several_tokens_never_overstate():
    """Found by an adversarial pass: vLLM spells byte tokens U+FFFD (bytes of the decoded
    text), so the sampled byte token was matched to the wrong listed one, and two byte
    tokens tied at one value were taken for a duplicate; a completions record without
    ``tokens`` kept its appended entry; a NaN ``prob`` was read as a sentinel."""
    log, f = math.log, "\ufffd"
    rules = (R.TargetTopK(2), R.TreeCoverage(2), R.Additive(0.3))

    def chat(sampled, top):
        listed = [{"token": t, "logprob": log(q), "bytes": list(t.encode())} for t, q in top]
        position = {"token": sampled[0], "logprob": log(sampled[1]),
                    "bytes": list(sampled[0].encode()), "top_logprobs": listed}  # fmt: skip
        return {"choices": [{"logprobs": {"content": [position]}}]}

    cases = [
        (chat((f, 0.01), [("a", 0.4), (f, 0.3), (f, 0.01)]), [0.4, 0.3, 0.15, 0.1, 0.04, 0.01]),
        (chat(("a", 0.4), [("a", 0.4), (f, 0.2), (f, 0.2), ("c", 0.1)]),
         [0.4, 0.2, 0.2, 0.1, 0.06, 0.04]),
        ([[log(0.4), log(0.2), log(0.2), log(0.1), log(0.06)]], [0.4, 0.2, 0.2, 0.1, 0.06, 0.04]),
        ({"choices": [{"logprobs": {"top_logprobs": [{"a": log(0.5), "b": log(0.3),
                                                      "z": log(0.01)}]}}]},
         [0.5, 0.3, 0.1, 0.05, 0.04, 0.01]),
    ]  # fmt: skip
    for i, (document, p) in enumerate(cases):
        _, cols = _certify([document], len(p), rules)
        for rule in rules:
            if cols[f"determined_{rule.spec}"][0]:
                want = _dense(np.log(p), rule)
                assert cols[f"cert_{rule.spec}"][0] == pytest.approx(want, rel=1e-5), (i, rule)
    got = records.parse_logprob_records([cases[1][0]])
    assert got.counts.ambiguous_cuts == 1 and np.allclose(got.logprobs, [[log(0.4), log(0.2)]])
    # Two such doubts: the window ends at the first (the higher) one, not at the last,
    # which kept 0.1 as the third value where a second 0.2 may stand.
    twice = chat(("a", 0.4), [("a", 0.4), (f, 0.2), (f, 0.2), ("c", 0.1), (f, 0.05), (f, 0.05)])
    got = records.parse_logprob_records([twice])
    assert got.counts.ambiguous_cuts == 1 and np.allclose(got.logprobs, [[log(0.4), log(0.2)]])
    nan_prob = {"completion_probabilities": [{"content": "a", "probs": [
        {"tok_str": "a", "prob": 0.4}, {"tok_str": "b", "prob": float("nan")},
        {"tok_str": "c", "prob": 0.2}]}]}  # fmt: skip
    with pytest.raises(ValueError, match=r"\(1 position without any\)"):
        records.parse_logprob_records([nan_prob])
    with pytest.raises(ValueError, match="a log-probability above 0 .1000"):
        records.parse_logprob_records([[[1000.0, -1.0]]])


def test_streams_byte_order_marks_big_endian_dumps_and_lines_in_errors(tmp_path, capsys):
    """Also from the adversarial pass: a saved stream (role and finish chunks without
    logprobs, ``data:`` lines) was refused, a BOM made line 1 invalid JSON, a big-endian
    dump raised a raw TypeError, and errors named a window row instead of the file line."""
    lp = np.log([0.6, 0.3, 0.1])
    chunk = lambda choice: {"id": "s1", "object": "chat.completion.chunk", "choices": [choice]}  # noqa: E731
    position = lambda t: {
        "token": t,
        "logprob": lp[0],
        "top_logprobs": [  # noqa: E731
            {"token": t, "logprob": lp[0]},
            {"token": "z", "logprob": lp[1]},
        ],
    }
    lines = [chunk({"index": 0, "delta": {"role": "assistant"}, "logprobs": None})]
    lines += [chunk({"index": 0, "delta": {"content": t}, "logprobs": {"content": [position(t)]}})
              for t in "abc"]  # fmt: skip
    lines += [chunk({"index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop"})]
    path = tmp_path / "stream.jsonl"
    path.write_text("\ufeff" + "".join(f"data: {json.dumps(x)}\n\n" for x in lines)
                    + "data: [DONE]\n")  # fmt: skip
    got = records.read_logprob_records(path)
    assert got.index["record"].tolist() == [0, 0, 0]  # one stream, one record
    assert got.index["position"].tolist() == [0, 1, 2]
    np.testing.assert_allclose(got.logprobs, np.tile(lp[:2], (3, 1)))
    # A big-endian dump is certified like the native one.
    x = np.random.default_rng(0).normal(size=(4, 6)).astype(np.float32)
    np.save(tmp_path / "big.npy", x.astype(">f4"))
    out = tmp_path / "o"
    assert cli.main(["certify-logits", str(tmp_path / "big.npy"), "--rules", "greedy",
                     "--out", str(out)]) == 0  # fmt: skip
    want = jaxcert.certificates(jnp.asarray(x), (R.StrictGreedy(),))[0].value
    got = pq.read_table(out / "certificates.parquet")["cert_greedy"].to_numpy()
    np.testing.assert_allclose(got, want, rtol=1e-6)
    # Values that are no log-probabilities are named by the file's line.
    bad = tmp_path / "bad.jsonl"
    good = {"content": [position("a")]}
    logits = {
        "content": [
            {
                "token": "a",
                "logprob": -0.1,
                "top_logprobs": [{"token": "a", "logprob": -0.1}, {"token": "b", "logprob": -0.2}],
            }
        ]
    }  # sums past 1
    bad.write_text("\n".join(json.dumps(d) for d in (good, good, logits)) + "\n")
    assert cli.main(["certify-logits", str(bad), "--out", str(tmp_path / "b")]) == 2
    assert "bad.jsonl:3 (choice 0, position 0): these are not log-probabilities" in (
        capsys.readouterr().err
    )
