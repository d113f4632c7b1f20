"""A drafter certified against the target: its terms against a NumPy float64 reference, on
random logits and in the certify pipeline on a pair of tiny models built by the test."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jaxcert import models
from jaxcert.base import prompts
from jaxcert.core import rules as R
from jaxcert.core.reference import certificate_np
from jaxcert.pipeline import drafter as drafter_lib
from jaxcert.pipeline import engine as certify
from jaxcert.pipeline import report
from tests.helpers import tiny_lm, tiny_models
from tests.helpers.drafter_reference import (
    check_drafter_rows,
    drafter_reference,
    teacher_forced_logits,
)

RULES = (R.StrictGreedy(), R.Additive(0.1), R.Multiplicative(0.3), R.TargetTopK(2),
         R.Typical(), R.TreeCoverage(3), R.TreeCoverage(2, base=R.Additive(0.05)))  # fmt: skip
TEXTS = ["the cat sat on the mat.", "an otter", "he is in the water, a big one!", "a, b?"]
STEPS = 8


def _pairs(seed: int, n: int = 64, v: int = 13):
    """Target logits and drafters at several distances from them (identical, close, far),
    with ties in both: rows where the certificate holds and rows where it fails."""
    rng = np.random.default_rng(seed)
    p = rng.normal(0, 2.0, (n, v)).astype(np.float32)
    p[: n // 8, :2] = p[: n // 8, :1]  # tied tops: C_p = 0 for strict greedy
    scale = np.repeat([0.0, 0.01, 0.1, 0.5, 2.0, 5.0, 0.05, 1.0], n // 8)[:, None]
    q = (p + scale * rng.normal(size=(n, v))).astype(np.float32)
    q[n // 2 : n // 2 + 4, 3:5] = q[n // 2 : n // 2 + 4, 3:4]  # ties in the drafter
    return p, q


@pytest.mark.parametrize("seed", [0, 1, 2], ids=["seed0", "seed1", "seed2"])
def test_terms_match_the_float64_reference_and_certified_implies_accepted(seed):
    p, q = _pairs(seed)
    got = drafter_lib.drafter_terms(q, p, RULES)  # jitted; C_p computed inside
    ref = drafter_reference(p, q, RULES)
    np.testing.assert_allclose(got.kl, ref["kl"], rtol=2e-4, atol=2e-6)
    np.testing.assert_allclose(got.tv, ref["tv"], rtol=1e-4, atol=1e-6)
    np.testing.assert_array_equal(got.drafter_token, ref["drafter_token"])
    np.testing.assert_array_equal(got.accepted, ref["accepted"])
    # Certified wherever KL and C_p are apart by more than float32 rounding.
    apart = np.abs(ref["kl"][:, None] - ref["cert"]) > 1e-4 * (1 + ref["kl"][:, None])
    np.testing.assert_array_equal(np.asarray(got.certified)[apart], ref["certified"][apart])
    certified, accepted = np.asarray(got.certified), np.asarray(got.accepted)
    assert not np.any(certified & ~accepted)  # the guarantee: certified => accepted
    # Not vacuous: every rule is certified somewhere, and accepted somewhere uncertified.
    assert certified.any(axis=0).all()
    assert (accepted & ~certified).any()


def test_given_certificates_are_used_and_shapes_are_checked():
    p, q = _pairs(3, n=8)
    certs = np.stack([certificate_np(row, RULES[0]).value for row in _softmax(p)])[:, None]
    got = drafter_lib.drafter_terms(q, p, RULES[:1], jnp.asarray(certs, jnp.float32))
    np.testing.assert_array_equal(
        got.certified[:, 0], np.asarray(got.kl) < certs[:, 0].astype(np.float32)
    )
    zero = drafter_lib.drafter_terms(q, p, RULES[:1], jnp.zeros((8, 1)))  # C_p = 0: never
    assert not np.asarray(zero.certified).any()
    with pytest.raises(ValueError, match=r"certificates must be \[..., R\]"):
        drafter_lib.drafter_terms(q, p, RULES[:1], jnp.zeros((8, 2)))
    with pytest.raises(ValueError, match="same shape"):
        drafter_lib.drafter_terms(q[:, :5], p, RULES[:1])


def _softmax(x):
    x = np.asarray(x, np.float64)
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def test_batched_terms_equal_row_by_row_terms():
    p, q = _pairs(4, n=16)
    batched = drafter_lib.drafter_terms(q.reshape(4, 4, -1), p.reshape(4, 4, -1), RULES)
    for i in range(16):
        one = drafter_lib.drafter_terms(q[i], p[i], RULES)
        b, t = divmod(i, 4)
        np.testing.assert_allclose(batched.kl[b, t], one.kl, rtol=1e-6, atol=1e-7)
        np.testing.assert_array_equal(batched.accepted[b, t], one.accepted)
        np.testing.assert_array_equal(batched.certified[b, t], one.certified)


# ---------------------------------------------------------------------------------------------
# The pipeline on a tiny model pair


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A tiny target, and a drafter of its vocabulary: the target's weights with noise (close
    enough that some positions are certified, far enough that others are not)."""
    root = tmp_path_factory.mktemp("pair")
    target = tiny_lm.save_tiny_checkpoint(root / "target")
    drafter = tiny_lm.save_noisy_copy(target, root / "drafter")
    return {"target": models.load(str(target)), "drafter": models.load(str(drafter))}


@pytest.fixture(scope="module")
def runs(pair):
    prompt_set = [prompts.Prompt(str(i), t) for i, t in enumerate(TEXTS)]
    options = certify.CertifyOptions(steps=STEPS, batch_size=2, chunk=4, stop_at_eos=False)
    target, drafter = pair["target"], pair["drafter"]
    plain, _ = certify.certify_prompts(target, prompt_set, RULES, options)
    drafted, _ = certify.certify_prompts(target, prompt_set, RULES, options, drafter=drafter)
    itself, _ = certify.certify_prompts(target, prompt_set, RULES, options, drafter=target)
    return {"plain": plain, "drafted": drafted, "itself": itself, "prompts": prompt_set}


def test_pipeline_columns_match_the_teacher_forced_float64drafter_reference(pair, runs):
    table = runs["drafted"]
    rows = table.to_pydict()
    encoded = prompts.encode_prompts(pair["target"].tokenizer, runs["prompts"])
    checked = {"certified": 0, "uncertified": 0}
    for i, ids in enumerate(encoded):
        mine = [r for r in range(table.num_rows) if rows["prompt_index"][r] == i]
        generated = [rows["token"][r] for r in mine]
        full = ids + generated
        span = slice(len(ids) - 1, len(ids) - 1 + STEPS)
        p = teacher_forced_logits(pair["target"], full)[span]
        q = teacher_forced_logits(pair["drafter"], full)[span]  # the drafter reads the same tokens
        ref = drafter_reference(p, q, RULES)
        check_drafter_rows(rows, mine, ref, ref, RULES, checked)
    assert checked["certified"] > 0 and checked["uncertified"] > 0  # both cases were seen


def test_the_targets_columns_are_those_of_a_run_without_a_drafter(runs):
    plain, drafted = runs["plain"], runs["drafted"]
    names = [f"cert_{r.spec}" for r in RULES]
    assert plain.column_names == ["prompt_index", "prompt_id", "category", "prompt_tokens",
                                  "position", "token", "top1", "top10_coverage", "margin",
                                  "entropy", *names]  # fmt: skip
    assert drafted.column_names[: plain.num_columns] == plain.column_names
    for name in plain.column_names:
        assert drafted.column(name).equals(plain.column(name)), name
    extra = drafted.column_names[plain.num_columns :]
    assert extra == ["kl", "tv", "drafter_token",
                     *[f"certified_{r.spec}" for r in RULES],
                     *[f"accepted_{r.spec}" for r in RULES]]  # fmt: skip


def test_the_target_as_its_own_drafter_is_certified_wherever_c_is_positive(runs):
    table = runs["itself"]
    np.testing.assert_array_equal(table.column("kl").to_numpy(), 0.0)
    np.testing.assert_array_equal(table.column("tv").to_numpy(), 0.0)
    np.testing.assert_array_equal(table.column("drafter_token"), table.column("token"))
    for rule in RULES:
        cert = table.column(f"cert_{rule.spec}").to_numpy()
        certified = table.column(report.certified_column(rule)).to_numpy()
        np.testing.assert_array_equal(certified, cert > 0, err_msg=rule.spec)
        assert table.column(report.accepted_column(rule)).to_numpy().all(), rule.spec


def test_summary_counts_match_the_columns(runs, tmp_path):
    table = runs["drafted"]
    summary = report.drafter_summary(table, RULES)
    kl = table.column("kl").to_numpy()
    assert summary["positions"] == table.num_rows == len(TEXTS) * STEPS
    assert summary["mean_kl"] == pytest.approx(float(np.mean(kl.astype(np.float64))))
    for row, rule in zip(summary["rules"], RULES, strict=True):
        certified = table.column(report.certified_column(rule)).to_numpy()
        assert row["rule"] == rule.spec
        assert row["certified"] == pytest.approx(certified.mean())
        assert row["certified_rejected"] == 0
    text = report.drafter_markdown(summary, "d")
    assert "## Drafter d against the target" in text
    first = summary["rules"][0]
    assert f"| greedy | {first['certified']:.1%} | {first['accepted']:.1%} |" in text
    figure = report.kl_figure(table, RULES)
    assert len(figure.axes) == len(RULES)
    assert figure.axes[0].get_title().startswith(f"greedy: certified {first['certified']:.0%}")


def test_drafters_that_cannot_be_certified_are_refused(pair):
    target, prompt_set = pair["target"], [prompts.Prompt("0", "an otter")]
    other = tiny_models.random_model(tiny_models.tiny_config(vocab_size=44, hidden_size=32), seed=1)
    with pytest.raises(ValueError, match="target has 48 logit rows, the drafter 44"):
        certify.Certifier(target, prompt_set, RULES, drafter=other)


def test_proposal_logits_set_the_proposals_and_leave_kl_and_tv():
    p, q = _pairs(5, n=16)
    shown = q.copy()
    shown[:, 0] = -np.inf  # the drafter never proposes token 0 (outside its draft vocabulary)
    got = drafter_lib.drafter_terms(q, p, RULES, proposal_logits=shown)
    plain = drafter_lib.drafter_terms(q, p, RULES)
    with np.errstate(divide="ignore", invalid="ignore"):  # its KL is inf: not compared
        by_shown = drafter_reference(p, shown, RULES)
    np.testing.assert_array_equal(got.kl, plain.kl)
    np.testing.assert_array_equal(got.tv, plain.tv)
    np.testing.assert_array_equal(got.certified, plain.certified)
    np.testing.assert_array_equal(got.drafter_token, by_shown["drafter_token"])
    np.testing.assert_array_equal(got.accepted, by_shown["accepted"])
    assert (np.asarray(plain.drafter_token) == 0).any()  # not vacuous: some proposals moved
    with pytest.raises(ValueError, match="proposal_logits must have the drafter's shape"):
        drafter_lib.drafter_terms(q, p, RULES, proposal_logits=shown[:, :5])


def test_a_drafter_of_nan_logits_proposes_nothing_and_the_summary_says_so(pair, tmp_path):
    """A drafter whose logits are NaN (here its lm_head): KL undefined, no drafted token
    (-1, not the argmax of NaN), neither certified nor accepted, counted in the summary."""
    folder = tiny_lm.save_nan_head_checkpoint(tmp_path / "nan")
    options = certify.CertifyOptions(steps=4, batch_size=2, chunk=4, stop_at_eos=False)
    prompt_set = [prompts.Prompt(str(i), t) for i, t in enumerate(TEXTS[:2])]
    table, _ = certify.certify_prompts(
        pair["target"], prompt_set, RULES, options, drafter=models.load(str(folder))
    )
    assert table.num_rows == 8
    assert np.isnan(table.column("kl").to_numpy()).all()
    assert np.isnan(table.column("tv").to_numpy()).all()
    np.testing.assert_array_equal(table.column("drafter_token").to_numpy(), -1)
    for rule in RULES:
        assert not table.column(report.certified_column(rule)).to_numpy().any(), rule.spec
        assert not table.column(report.accepted_column(rule)).to_numpy().any(), rule.spec
    summary = report.drafter_summary(table, RULES)
    assert summary["kl_undefined"] == 8 and summary["mean_kl"] is None
    assert "At 8 positions a row is no distribution" in report.drafter_markdown(summary)
