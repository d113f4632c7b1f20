"""Rule configs: validation, spelling, parsing."""

from __future__ import annotations

import math

import pytest

from jaxcert.core import rules as R

ALL = [
    R.StrictGreedy(),
    R.Additive(0.3),
    R.Multiplicative(0.1),
    R.TargetTopK(2),
    R.Typical(),
    R.Typical(0.5, 0.9),
    R.TreeCoverage(4),
    R.TreeCoverage(2, base=R.Additive(0.05)),
    R.TreeCoverage(3, base=R.Typical(0.2, 1.5)),
]


@pytest.mark.parametrize("rule", ALL, ids=[r.spec for r in ALL])
def test_spec_round_trips_and_rules_are_hashable(rule):
    assert R.parse_rule(rule.spec) == rule
    assert hash(R.parse_rule(rule.spec)) == hash(rule)
    assert str(rule) == rule.spec


def test_list_sizes_and_upper_sets():
    assert R.StrictGreedy().list_size == 1 and R.StrictGreedy().static_upper_size == 1
    assert R.TargetTopK(3).static_upper_size == 3
    assert R.Additive(0.1).static_upper_size is None
    tree = R.TreeCoverage(4, base=R.TargetTopK(2))
    assert tree.list_size == 4 and tree.static_upper_size == 2
    assert tree.upper_rule == R.TargetTopK(2)
    assert R.TreeCoverage(4, base=R.StrictGreedy()) == R.TreeCoverage(4)
    assert R.TreeCoverage(2, base=R.Typical()).needs_entropy


def test_parse_rules_and_aliases():
    rules = R.parse_rules(" greedy, additive:0.3,mult:0.1 ,topk:2,entropy,tree:8+add:0.2 ")
    assert [r.spec for r in rules] == [
        "greedy", "additive:0.3", "multiplicative:0.1", "topk:2", "typical",
        "tree:8+additive:0.2",
    ]  # fmt: skip
    assert R.parse_rule("typical:0.09:0.3") == R.Typical()


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: R.Additive(0.0), "Additive.t"),
        (lambda: R.Additive(1.5), "Additive.t"),
        (lambda: R.Additive(math.nan), "Additive.t"),
        (lambda: R.Additive("0.3"), "Additive.t"),
        (lambda: R.Multiplicative(1.0), "alpha"),
        (lambda: R.TargetTopK(0), "TargetTopK.k"),
        (lambda: R.TargetTopK(2.0), "TargetTopK.k"),
        (lambda: R.TargetTopK(True), "TargetTopK.k"),
        (lambda: R.Typical(eps=0.0), "Typical.eps"),
        (lambda: R.Typical(delta=-1.0), "Typical.delta"),
        (lambda: R.Typical(delta=math.inf), "Typical.delta"),
        (lambda: R.TreeCoverage(0), "TreeCoverage.m"),
        (lambda: R.TreeCoverage(2, base=R.TreeCoverage(2)), "single-token"),
        (lambda: R.parse_rule("nonsense"), "unknown rule"),
        (lambda: R.parse_rule("additive"), "wrong number"),
        (lambda: R.parse_rule("additive:x"), "not a valid float"),
        (lambda: R.parse_rule("greedy+additive:0.1"), "only tree rules"),
        (lambda: R.parse_rule("tree:2+tree:3"), "single-token"),
        (lambda: R.parse_rules("greedy,greedy"), "given twice"),
        (lambda: R.parse_rules(" , "), "no rules"),
    ],
    ids=[
        "Additive(0.0)",
        "Additive(1.5)",
        "Additive(math.nan)",
        "Additive(str)",
        "Multiplicative(1.0)",
        "TargetTopK(0)",
        "TargetTopK(2.0)",
        "TargetTopK(True)",
        "Typical(eps=0.0)",
        "Typical(delta=-1.0)",
        "Typical(delta=math.inf)",
        "TreeCoverage(0)",
        "TreeCoverage(2,base=TreeCoverage(2))",
        "parse_rule(nonsense)",
        "parse_rule(additive)",
        "parse_rule(additive:x)",
        "parse_rule(greedy+additive:0.1)",
        "parse_rule(tree:2+tree:3)",
        "parse_rules(greedy,greedy)",
        "parse_rules(,)",
    ],
)
def test_invalid_rules_raise_clear_errors(make, message):
    with pytest.raises(ValueError, match=message):
        make()


@pytest.mark.parametrize(
    "spec, message",
    [
        (
            "additive:1.5",
            "rule 'additive:1.5': T must be in \\(0, 1\\], got 1.5; expected additive:T",
        ),
        ("multiplicative:1", "rule 'multiplicative:1': ALPHA must be in \\(0, 1\\)"),
        ("topk:0", "rule 'topk:0': K must be an integer >= 1"),
        ("typical:0.5:-1", "rule 'typical:0.5:-1': DELTA must be a finite number > 0"),
        ("tree:0", "rule 'tree:0': M must be an integer >= 1"),
        ("tree:2+additive:0", "rule 'additive:0': T must be in"),
        ("topk:x", "rule 'topk:x': 'x' is not a valid int"),
    ],
)
def test_parse_errors_use_the_grammars_words_not_the_classes(spec, message):
    """`--rules additive:1.5` used to answer `Additive.t must be ...` (the Python class)."""
    with pytest.raises(ValueError, match=message) as info:
        R.parse_rule(spec)
    assert "." not in str(info.value).split(":")[0]
    assert not any(c in str(info.value) for c in ("Additive", "TreeCoverage", "Typical."))
