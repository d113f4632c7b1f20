"""A draft head certified against its target in the certify pipeline: its columns against
the head's teacher-forced pass (``jaxcert.training.eagle``) and a NumPy float64 reference,
on a tiny target and heads built by the test."""

from __future__ import annotations

import numpy as np
import pytest
from flax import nnx

from jaxcert import models
from jaxcert.base import prompts
from jaxcert.core import rules as R
from jaxcert.decoding.protocols import context_before
from jaxcert.models import EagleHead
from jaxcert.pipeline import engine as certify
from jaxcert.training.eagle import target_states, train_eagle_head
from jaxcert.training.train import Objective
from tests.helpers import tiny_lm
from tests.helpers.drafter_reference import check_drafter_rows, drafter_reference

RULES = (R.StrictGreedy(), R.Additive(0.1), R.TargetTopK(2), R.TreeCoverage(3),
         R.TreeCoverage(2, base=R.Additive(0.05)))  # fmt: skip
STEPS = 8
# Narrow prefill pieces: the prompts take several, so a head reads across their seams.
OPTIONS = certify.CertifyOptions(
    steps=STEPS, batch_size=2, chunk=4, stop_at_eos=False, prefill_widths=(4, 8)
)
PROMPTS = [prompts.Prompt(str(i), t) for i, t in enumerate(tiny_lm.TEXTS)]
TRAINED_ON = (0, 2)  # the prompts whose text the trained head learnt: the others are new


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return models.load(str(tiny_lm.save_tiny_checkpoint(tmp_path_factory.mktemp("t") / "t")))


@pytest.fixture(scope="module")
def plain(target):
    return certify.certify_prompts(target, PROMPTS, RULES, OPTIONS)[0]


def _texts(target, table) -> list[list[int]]:
    """Each prompt's tokens and the target's greedy continuation in ``table``."""
    encoded = prompts.encode_prompts(target.tokenizer, PROMPTS)
    tokens = table.column("token").to_numpy().reshape(len(PROMPTS), STEPS)
    return [ids + t.tolist() for ids, t in zip(encoded, tokens, strict=True)]


def _trained(target, texts) -> EagleHead:
    """An EAGLE-3-style head (taps 0 and 1) trained on two of the texts: close to the target
    there (certified), not on the others."""
    head = EagleHead.from_target(target.model, rngs=nnx.Rngs(1), taps=(0, 1))
    chosen = [texts[i] for i in TRAINED_ON]
    ids = np.zeros((len(chosen), max(map(len, chosen))), np.int32)
    for i, t in enumerate(chosen):
        ids[i, : len(t)] = t
    data = target_states(target.model, ids, np.asarray([len(t) for t in chosen]), head.taps)
    head, _ = train_eagle_head(head, data, Objective("kl"), steps=60, learning_rate=2e-2)
    return head


def _reduced(target) -> EagleHead:
    """An EAGLE-1 head (the target's final hidden state) over a third of the vocabulary that
    drafts with -inf outside it, its shared logit high: its q's top token is outside the draft
    vocabulary, its proposals inside."""
    head = EagleHead.from_target(
        target.model, rngs=nnx.Rngs(2), taps=(), draft_vocab=np.arange(0, 48, 3), outside="-inf"
    )
    head.oov_logit.set_value(np.float32(3.0))
    return head


@pytest.fixture(scope="module")
def heads(target, plain):
    texts = _texts(target, plain)
    out = {}
    for name, head in (("trained", _trained(target, texts)), ("reduced", _reduced(target))):
        table, _ = certify.certify_prompts(target, PROMPTS, RULES, OPTIONS, drafter=head)
        out[name] = (head, table)
    return out


def _reference(target, head, text, prompt_tokens):
    """The float64 terms at the recorded positions from the head's teacher-forced pass over
    the whole text (token t with the target's states at t - 1, as training reads it):
    ``(by q, by the proposals)``."""
    ts = target_states(target.model, np.asarray([text]), np.asarray([len(text)]), head.taps)
    cache = head.init_cache(1, len(text))
    hidden, _ = head.features(ts.tokens, cache, context=context_before(head, ts.states))
    span = slice(prompt_tokens - 1, prompt_tokens - 1 + STEPS)
    p = np.asarray(ts.logits[0])[span]
    q = np.asarray(head.project(hidden, outside="oov")[0])[span]
    shown = np.asarray(head.project(hidden)[0])[span]  # as it drafts
    with np.errstate(divide="ignore", invalid="ignore"):  # q = 0 outside: KL unused
        return drafter_reference(p, q, RULES), drafter_reference(p, shown, RULES)


@pytest.mark.parametrize("name", ["trained", "reduced"])
def test_head_columns_are_the_teacher_forced_reference(target, plain, heads, name):
    head, table = heads[name]
    rows = table.to_pydict()
    encoded = prompts.encode_prompts(target.tokenizer, PROMPTS)
    seen = {"certified": 0, "uncertified": 0, "moved": 0}
    for i, text in enumerate(_texts(target, table)):
        mine = [r for r in range(table.num_rows) if rows["prompt_index"][r] == i]
        ref, shown = _reference(target, head, text, len(encoded[i]))
        check_drafter_rows(rows, mine, ref, shown, RULES, seen)
        seen["moved"] += int((ref["drafter_token"] != shown["drafter_token"]).sum())
    if name == "trained":  # both cases were seen
        assert seen["certified"] > 0 and seen["uncertified"] > 0, seen
    else:  # the proposals are not q's top tokens: inside the draft vocabulary
        assert seen["moved"] > 0
        assert np.isin(table.column("drafter_token").to_numpy(), np.arange(0, 48, 3)).all()


def test_the_targets_columns_are_those_of_a_run_without_a_drafter(plain, heads):
    for name, (_, table) in heads.items():
        assert table.column_names[: plain.num_columns] == plain.column_names
        for column in plain.column_names:
            assert table.column(column).equals(plain.column(column)), (name, column)


def test_a_head_of_another_target_is_refused(target, tmp_path):
    deeper = models.load(str(tiny_lm.save_tiny_checkpoint(tmp_path / "deeper", layers=3))).model
    head = EagleHead.from_target(deeper, rngs=nnx.Rngs(0), taps=(0, 2))
    with pytest.raises(
        ValueError, match=r"^the draft head was built for another target: num_layers 3 \(head\) "
        r"vs 2 \(target\)$"
    ):  # fmt: skip
        certify.Certifier(target, PROMPTS, RULES, drafter=head)
