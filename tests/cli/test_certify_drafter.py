"""``jaxcert certify --drafter`` and ``jaxcert certify-logits --drafter-logits`` end to end, on
tiny checkpoints and dumps written by the test."""

from __future__ import annotations

import csv
import json

import numpy as np
import pyarrow.parquet as pq
import pytest
from flax import nnx

from jaxcert import cli, models
from jaxcert.base import prompts
from jaxcert.core import rules as R
from jaxcert.decoding.protocols import context_before
from jaxcert.models import EagleHead
from jaxcert.models.eagle import load_head, save_head
from jaxcert.pipeline import report
from jaxcert.training.eagle import target_states
from tests.helpers import tiny_lm
from tests.helpers.drafter_reference import drafter_reference, teacher_forced_logits

SPECS = "greedy,additive:0.1,topk:2,tree:3"
RULES = R.parse_rules(SPECS)
STEPS = 6


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("certify-drafter")
    target = tiny_lm.save_tiny_checkpoint(root / "target")
    prompt_file = root / "prompts.jsonl"
    lines = [json.dumps({"id": f"p{i}", "prompt": t}) for i, t in enumerate(tiny_lm.TEXTS)]
    prompt_file.write_text("\n".join(lines) + "\n")
    return {
        "root": root,
        "target": target,
        "drafter": tiny_lm.save_noisy_copy(target, root / "drafter"),
        "other": tiny_lm.save_noisy_copy(target, root / "other", seed=9),
        "prompts": prompt_file,
    }


def _certify(files, out, *extra):
    return cli.main(["certify", "--target", str(files["target"]), "--prompts",
                     str(files["prompts"]), "--rules", SPECS, "--steps", str(STEPS),
                     "--batch-size", "2", "--ignore-eos", "--out", str(out), *extra])  # fmt: skip


@pytest.fixture(scope="module")
def drafted(files):
    out = files["root"] / "drafted"
    assert _certify(files, out, "--drafter", str(files["drafter"])) == 0
    return out


def test_certify_with_a_drafter_writes_its_columns_summary_and_plot(files, drafted, capsys):
    table = pq.read_table(drafted / "positions.parquet")
    assert table.num_rows == len(tiny_lm.TEXTS) * STEPS
    names = {"kl", "tv", "drafter_token", *(f"certified_{r.spec}" for r in RULES),
             *(f"accepted_{r.spec}" for r in RULES)}  # fmt: skip
    assert names <= set(table.column_names)
    meta = json.loads((drafted / "run.json").read_text())
    assert meta["drafter"] == str(files["drafter"])
    summary = meta["drafter_summary"]
    kl = table.column("kl").to_numpy().astype(np.float64)
    assert summary["mean_kl"] == pytest.approx(kl.mean()) and summary["mean_kl"] > 0
    with open(drafted / "drafter.csv") as f:
        rows = list(csv.DictReader(f))
    assert [r["rule"] for r in rows] == [r.spec for r in RULES]
    for row, rule in zip(rows, RULES, strict=True):
        certified = table.column(report.certified_column(rule)).to_numpy()
        accepted = table.column(report.accepted_column(rule)).to_numpy()
        assert float(row["certified"]) == pytest.approx(certified.mean())
        assert float(row["accepted"]) == pytest.approx(accepted.mean())
        assert not np.any(certified & ~accepted)
    text = (drafted / "summary.md").read_text()
    assert "## Drafter drafter against the target" in text and "| kl |" in text
    assert (drafted / "kl_vs_certificate.png").stat().st_size > 1000
    assert summary["kl_undefined"] == 0 and "no distribution" not in text


def test_a_drafter_of_nan_logits_gets_a_warning_line(files, tmp_path, capsys):
    folder = tiny_lm.save_nan_head_checkpoint(tmp_path / "nan")
    capsys.readouterr()
    assert _certify(files, tmp_path / "out", "--drafter", str(folder), "--no-plots") == 0
    rows = len(tiny_lm.TEXTS) * STEPS
    warned = [x for x in capsys.readouterr().err.splitlines() if "warning" in x]
    assert warned == [
        "[jaxcert] warning: the drafter's logits are no distribution (NaN or +inf, or none "
        f"finite) at {rows} positions of {rows}: KL undefined there, counted as neither "
        "certified nor accepted"
    ]
    assert (
        json.loads((tmp_path / "out" / "run.json").read_text())["drafter_summary"]["kl_undefined"]
        == rows
    )


def test_the_columns_are_the_teacher_forced_reference(files, drafted):
    """The drafter read the target's greedy text: its logits from one prefill of the prompt
    and that text give the same KL, TV, certified and accepted."""
    table = pq.read_table(drafted / "positions.parquet").sort_by(
        [("prompt_index", "ascending"), ("position", "ascending")]
    )
    target, drafter = models.load(str(files["target"])), models.load(str(files["drafter"]))
    prompt_set = [prompts.Prompt(f"p{i}", t) for i, t in enumerate(tiny_lm.TEXTS)]
    encoded = prompts.encode_prompts(target.tokenizer, prompt_set)
    tokens = table.column("token").to_numpy().reshape(len(encoded), STEPS)
    p, q = [], []
    for ids, generated in zip(encoded, tokens, strict=True):
        full, span = ids + generated.tolist(), slice(len(ids) - 1, len(ids) - 1 + STEPS)
        p.append(teacher_forced_logits(target, full)[span])
        q.append(teacher_forced_logits(drafter, full)[span])
    ref = drafter_reference(np.concatenate(p), np.concatenate(q), RULES)
    np.testing.assert_allclose(table.column("kl").to_numpy(), ref["kl"], rtol=5e-4, atol=1e-5)
    np.testing.assert_allclose(table.column("tv").to_numpy(), ref["tv"], rtol=5e-4, atol=1e-5)
    for j, rule in enumerate(RULES):
        got = table.column(report.accepted_column(rule)).to_numpy()
        np.testing.assert_array_equal(got, ref["accepted"][:, j], err_msg=rule.spec)
        apart = np.abs(ref["kl"] - ref["cert"][:, j]) > 1e-3 * (1 + ref["kl"])
        got = table.column(report.certified_column(rule)).to_numpy()
        np.testing.assert_array_equal(got[apart], ref["certified"][apart, j], err_msg=rule.spec)


def test_resume_refuses_another_drafter_or_none(files, drafted, capsys):
    args = ["--drafter", str(files["other"]), "--resume"]
    assert _certify(files, drafted, *args) == 2
    err = capsys.readouterr().err
    assert "was written with other options: drafter (then 'drafter', now 'other')" in err
    assert err.count("\n") == 1  # one line
    assert _certify(files, drafted, "--resume") == 2
    assert "drafter (then 'drafter', now unset)" in capsys.readouterr().err
    plain = files["root"] / "plain"
    assert _certify(files, plain) == 0
    assert _certify(files, plain, "--drafter", str(files["drafter"]), "--resume") == 2
    assert "drafter (then unset, now 'drafter')" in capsys.readouterr().err
    assert _certify(files, drafted, "--drafter", str(files["drafter"]), "--resume") == 0
    assert "already complete" in capsys.readouterr().err  # the same drafter resumes


@pytest.mark.slow
def test_certify_with_a_drafter_on_a_2x2_mesh_matches_one_device(files, drafted, tmp_path):
    """Slots over data, both models' weights over model (tensor parallel): the same tokens,
    and the drafter's terms to float32 rounding of the other summation orders."""
    from jaxcert.pipeline.store import read_positions
    from tests.helpers.multidevice import run

    out = tmp_path / "mesh"
    args = ["certify", "--target", str(files["target"]), "--drafter", str(files["drafter"]),
            "--prompts", str(files["prompts"]), "--rules", SPECS, "--steps", str(STEPS),
            "--batch-size", "2", "--ignore-eos", "--no-plots", "--mesh", "data=2,model=2",
            "--out", str(out)]  # fmt: skip
    got = run(f"""
        from jaxcert import cli
        print(json.dumps({{"rc": cli.main({args!r})}}))
        """, devices=4)  # fmt: skip
    assert got == {"rc": 0}
    mesh, one = read_positions(out), read_positions(drafted)
    assert mesh.column_names == one.column_names
    for name in ("token", "drafter_token"):
        assert mesh[name].equals(one[name]), name
    kl = one["kl"].to_numpy()
    np.testing.assert_allclose(mesh["kl"].to_numpy(), kl, rtol=1e-3, atol=1e-6)
    np.testing.assert_allclose(mesh["tv"].to_numpy(), one["tv"].to_numpy(), rtol=1e-3, atol=1e-6)
    for rule in RULES:
        assert mesh[report.accepted_column(rule)].equals(one[report.accepted_column(rule)])
        apart = np.abs(kl - one[f"cert_{rule.spec}"].to_numpy()) > 1e-3 * (1 + kl)
        name = report.certified_column(rule)
        np.testing.assert_array_equal(mesh[name].to_numpy()[apart], one[name].to_numpy()[apart])


@pytest.fixture(scope="module")
def headed(files):
    out = files["root"] / "headed"
    assert _certify(files, out, "--drafter", str(_head(files))) == 0
    return out


def test_certify_with_a_head_gives_its_teacher_forced_columns(files, headed):
    """The head read each token with the target's states at the position before it: its
    pass over the whole text (``jaxcert.training.eagle``'s) gives the same columns, ``q``
    over the full vocabulary with the shared out-of-vocabulary logit."""
    table = pq.read_table(headed / "positions.parquet").sort_by(
        [("prompt_index", "ascending"), ("position", "ascending")]
    )
    meta = json.loads((headed / "run.json").read_text())
    assert meta["drafter"] == str(_head(files)) and (headed / "drafter.csv").is_file()
    target, head = models.load(str(files["target"])).model, load_head(_head(files))
    prompt_set = [prompts.Prompt(f"p{i}", t) for i, t in enumerate(tiny_lm.TEXTS)]
    encoded = prompts.encode_prompts(models.load(str(files["target"])).tokenizer, prompt_set)
    tokens = table.column("token").to_numpy().reshape(len(encoded), STEPS)
    p, q = [], []
    for ids, generated in zip(encoded, tokens, strict=True):
        full, span = ids + generated.tolist(), slice(len(ids) - 1, len(ids) - 1 + STEPS)
        ts = target_states(target, np.asarray([full]), np.asarray([len(full)]), head.taps)
        context = context_before(head, ts.states)
        logits, _ = head(ts.tokens, head.init_cache(1, len(full)), context=context)
        p.append(np.asarray(ts.logits[0])[span])
        q.append(np.asarray(logits[0])[span])
    ref = drafter_reference(np.concatenate(p), np.concatenate(q), RULES)
    np.testing.assert_allclose(table.column("kl").to_numpy(), ref["kl"], rtol=5e-4, atol=1e-5)
    np.testing.assert_allclose(table.column("tv").to_numpy(), ref["tv"], rtol=5e-4, atol=1e-5)
    np.testing.assert_array_equal(table.column("drafter_token"), ref["drafter_token"])
    for j, rule in enumerate(RULES):
        accepted = table.column(report.accepted_column(rule)).to_numpy()
        np.testing.assert_array_equal(accepted, ref["accepted"][:, j], err_msg=rule.spec)
        certified = table.column(report.certified_column(rule)).to_numpy()
        apart = np.abs(ref["kl"] - ref["cert"][:, j]) > 1e-3 * (1 + ref["kl"])
        np.testing.assert_array_equal(certified[apart], ref["certified"][apart, j])
        assert not np.any(certified & ~accepted), rule.spec


def test_resume_refuses_another_head(files, headed, capsys):
    other = _head(files, "head2", seed=3)
    assert _certify(files, headed, "--drafter", str(other), "--resume") == 2
    err = capsys.readouterr().err
    assert "was written with other options: drafter (then 'head', now 'head2')" in err
    assert err.count("\n") == 1  # one line
    assert _certify(files, headed, "--drafter", str(_head(files)), "--resume") == 0
    assert "already complete" in capsys.readouterr().err  # the same head resumes


def _bad_vocabulary(files):
    folder = files["root"] / "small"
    if not folder.exists():
        tiny_lm.save_noisy_copy(files["target"], folder)
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps(config | {"vocab_size": 44}))
    return folder


def _head(files, name="head", seed=0, layers=None):
    """A saved draft head of the target (``layers``: of another target with that many)."""
    folder = files["root"] / name
    if not folder.exists():
        target = files["target"]
        if layers is not None:
            target = tiny_lm.save_tiny_checkpoint(files["root"] / f"target{layers}", layers=layers)
        model = models.load(str(target)).model
        head = EagleHead.from_target(
            model, rngs=nnx.Rngs(seed), taps=(0, 1), draft_vocab=np.arange(0, 48, 2)
        )
        save_head(head, folder)
    return folder


@pytest.mark.parametrize(
    "drafter, message",
    [
        (_bad_vocabulary, "--drafter: vocabulary mismatch: the target has 48 logit rows, the "
         "drafter 44"),
        (lambda files: "/nonexistent/drafter", "--drafter: cannot load '/nonexistent/drafter'"),
        (lambda files: "ngram:3", "--drafter ngram:3: prompt lookup proposes tokens"),
        (lambda files: _head(files, "deeper-head", layers=3), "--drafter: the draft head was "
         "built for another target: num_layers 3 (head) vs 2 (target)"),
    ],
    ids=["vocabulary", "missing", "prompt-lookup", "head-of-another-target"],
)  # fmt: skip
def test_bad_drafters_are_one_line_errors_before_anything_is_written(
    files, drafter, message, capsys
):
    out = files["root"] / "refused"
    assert _certify(files, out, "--drafter", str(drafter(files))) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err
    assert not out.exists()


# ---------------------------------------------------------------------------------------------
# certify-logits --drafter-logits


@pytest.fixture(scope="module")
def dumps(tmp_path_factory):
    root = tmp_path_factory.mktemp("dumps")
    rng = np.random.default_rng(0)
    target = rng.normal(0, 2.0, (3, 7, 17)).astype(np.float32)
    scale = rng.choice([0.02, 0.3, 2.0], size=(3, 7, 1))
    drafter = (target + scale * rng.normal(size=target.shape)).astype(np.float32)
    files = {"target": target, "drafter": drafter, "short": drafter[:, :5],
             "narrow": drafter[..., :16]}  # fmt: skip
    for name, array in files.items():
        np.save(root / f"{name}.npy", array)
    (root / "records.jsonl").write_text("{}\n")
    (root / "text.npy").write_text("not an array\n")
    np.savez(root / "drafter.npz", drafter)
    return root, target, drafter


def test_certify_logits_with_a_drafter_dump_gives_the_reference_columns(dumps, capsys):
    root, target, drafter = dumps
    out = root / "out"
    argv = [
        "certify-logits",
        str(root / "target.npy"),
        "--drafter-logits",
        str(root / "drafter.npy"),
        "--rules",
        SPECS,
        "--chunk-rows",
        "4",
        "--out",
        str(out),
    ]
    assert cli.main(argv) == 0  # fmt: skip
    table = pq.read_table(out / "certificates.parquet")
    ref = drafter_reference(target.reshape(-1, 17), drafter.reshape(-1, 17), RULES)
    np.testing.assert_allclose(table.column("kl").to_numpy(), ref["kl"], rtol=2e-4, atol=2e-6)
    np.testing.assert_allclose(table.column("tv").to_numpy(), ref["tv"], rtol=1e-4, atol=1e-6)
    np.testing.assert_array_equal(table.column("drafter_token"), ref["drafter_token"])
    certified_any = False
    for j, rule in enumerate(RULES):
        accepted = table.column(report.accepted_column(rule)).to_numpy()
        certified = table.column(report.certified_column(rule)).to_numpy()
        np.testing.assert_array_equal(accepted, ref["accepted"][:, j])
        np.testing.assert_array_equal(certified, ref["certified"][:, j])
        certified_any |= certified.any()
    assert certified_any
    meta = json.loads((out / "run.json").read_text())
    assert meta["drafter_summary"]["mean_kl"] == pytest.approx(ref["kl"].mean(), rel=1e-4)
    printed = capsys.readouterr().out
    assert "## Drafter drafter.npy against the target" in printed
    assert (out / "drafter.csv").is_file() and (out / "kl_vs_certificate.png").is_file()
    # Rerun over it without a drafter: no stale drafter files describe the new run.
    assert cli.main(["certify-logits", str(root / "target.npy"), "--out", str(out),
                     "--overwrite"]) == 0  # fmt: skip
    assert not (out / "drafter.csv").exists() and not (out / "kl_vs_certificate.png").exists()
    assert "kl" not in pq.read_table(out / "certificates.parquet").column_names


@pytest.mark.parametrize(
    "input_name, drafter_name, message",
    [
        ("target.npy", "short.npy", "have shape (3, 5, 17), the target's"),
        ("target.npy", "narrow.npy", "vocabulary mismatch: the target's logits"),
        ("target.npy", "missing.npy", "--drafter-logits: logits file not found"),
        ("target.npy", "records.jsonl", "records.jsonl is not a dense dump: give a .npy or"),
        ("target.npy", "drafter.npz", "drafter.npz is not a dense dump: give a .npy or"),
        ("target.npy", "text.npy", "text.npy: not a .npy array of numbers"),
        ("records.jsonl", "drafter.npy", "--drafter-logits pairs two dense dumps"),
    ],
    ids=["positions", "vocabulary", "missing", "records-drafter", "npz", "text", "records-target"],
)
def test_certify_logits_refuses_a_drafter_dump_it_cannot_pair(
    dumps, input_name, drafter_name, message, capsys
):
    root = dumps[0]
    out = root / f"refused-{drafter_name}"
    argv = ["certify-logits", str(root / input_name), "--drafter-logits",
            str(root / drafter_name), "--out", str(out)]  # fmt: skip
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err
    assert not out.exists()


def test_certify_logits_names_drafter_rows_that_are_no_distribution(dumps, capsys):
    root, target, drafter = dumps
    bad = drafter.copy()
    bad[0, 2] = np.nan  # position 2
    bad[1, 0, 3] = np.inf  # position 7
    np.save(root / "bad.npy", bad)
    out = root / "bad-out"
    argv = ["certify-logits", str(root / "target.npy"), "--drafter-logits",
            str(root / "bad.npy"), "--rules", SPECS, "--out", str(out)]  # fmt: skip
    assert cli.main(argv) == 0
    err = capsys.readouterr().err
    rows = bad.shape[0] * bad.shape[1]
    assert [line for line in err.splitlines() if "warning" in line] == [
        "[jaxcert] warning: the drafter's logits are no distribution (NaN or +inf, or none "
        f"finite) at 2 positions of {rows} ((sequence 0, position 2), (sequence 1, position 0)): "
        "KL undefined there, counted as neither certified nor accepted"
    ]
    table = pq.read_table(out / "certificates.parquet")
    kl = table.column("kl").to_numpy()
    assert np.isnan(kl[[2, 7]]).all() and np.isfinite(np.delete(kl, [2, 7])).all()
