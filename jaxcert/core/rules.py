"""Verification rules as small frozen configs.

Every rule of ``docs/certificates.md`` §2 is described by three ingredients: an upper set ``U`` of
the target distribution ``p`` (the tokens whose proposal is accepted), its complement
``L`` (a lower level set of ``p``) and a list size ``m``. The rule rejects a drafter
``q`` iff its worst-case top-``m`` list lies inside ``L``.

In this module a rule only says how to find ``U`` and ``m``; the solver in
:mod:`jaxcert.core.solver` does the rest. ``U`` is always a prefix of the tokens
sorted by decreasing ``p`` (stable: lower index first), given either by a static size
(strict greedy, target top-k, tree) or by a probability threshold (additive,
multiplicative, typical).

Source: "When Is a Draft Accepted?" (2026), sections 2-3; ``docs/certificates.md`` §§2 and 5.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from jaxcert.base.validate import check_float, check_int, check_probability, in_user_words

__all__ = [
    "Rule",
    "SingleTokenRule",
    "SINGLE_TOKEN_RULES",
    "ALL_RULES",
    "in_upper_set",
    "StrictGreedy",
    "Additive",
    "Multiplicative",
    "TargetTopK",
    "Typical",
    "TreeCoverage",
    "parse_rule",
    "parse_rules",
]


class _RuleBase:
    """Shared behaviour of all rules (not part of the public API)."""

    @property
    def list_size(self) -> int:
        """``m``: how many of the drafter's top tokens are checked."""
        return 1

    @property
    def upper_rule(self) -> SingleTokenRule:
        """The single-token rule that defines ``U`` (the rule itself for m = 1)."""
        return self  # type: ignore[return-value]

    @property
    def static_upper_size(self) -> int | None:
        """``|U|`` when it does not depend on ``p``, else ``None``."""
        return None

    def upper_threshold(self, p_max, entropy):
        """Relative threshold for membership in ``U``.

        Args:
          p_max: ``[...]`` probability of the greedy token ``x0``.
          entropy: ``[...]`` entropy ``H(p)`` in nats (only used by :class:`Typical`).

        Returns:
          ``(threshold, inclusive)``: a token ``x`` is in ``U`` iff
          ``p_x / p_max >= threshold`` (``inclusive``) or ``> threshold``.
        """
        raise NotImplementedError

    @property
    def needs_entropy(self) -> bool:
        return False

    @property
    def spec(self) -> str:
        """Canonical command-line spelling, e.g. ``'additive:0.3'``."""
        raise NotImplementedError

    def __str__(self) -> str:
        return self.spec


@dataclasses.dataclass(frozen=True)
class StrictGreedy(_RuleBase):
    """Strict greedy verification: accept iff ``argmax q = x0``.

    Source: ``docs/certificates.md`` §2, rule 1.

    ``U = {x0}``, ``L`` = all other tokens, ``m = 1``. ``C_p < log 2``.
    """

    @property
    def static_upper_size(self) -> int:
        return 1

    @property
    def spec(self) -> str:
        return "greedy"


@dataclasses.dataclass(frozen=True)
class Additive(_RuleBase):
    """Additive relaxation: accept ``x`` iff ``p_x >= p_x0 - t``.

    Source: ``docs/certificates.md`` §2, rule 2.

    Attributes:
      t: the additive slack, a probability in ``(0, 1]``.
    """

    t: float

    def __post_init__(self):
        check_probability("Additive.t", self.t)

    def upper_threshold(self, p_max, entropy):
        del entropy
        return 1.0 - self.t / p_max, True

    @property
    def spec(self) -> str:
        return f"additive:{self.t:g}"


@dataclasses.dataclass(frozen=True)
class Multiplicative(_RuleBase):
    """Multiplicative relaxation: accept ``x`` iff ``p_x >= alpha p_x0``.

    Source: ``docs/certificates.md`` §2, rule 3.

    Attributes:
      alpha: the ratio, in ``(0, 1)``.
    """

    alpha: float

    def __post_init__(self):
        check_probability("Multiplicative.alpha", self.alpha, closed_right=False)

    def upper_threshold(self, p_max, entropy):
        del entropy
        return jnp.full_like(p_max, self.alpha), True

    @property
    def spec(self) -> str:
        return f"multiplicative:{self.alpha:g}"


@dataclasses.dataclass(frozen=True)
class TargetTopK(_RuleBase):
    """Target top-k acceptance: accept ``x`` iff it is in the top-k of ``p``.

    Source: ``docs/certificates.md`` §2, rule 4.

    Attributes:
      k: how many target tokens are accepted, an integer ``>= 1``.
    """

    k: int

    def __post_init__(self):
        check_int("TargetTopK.k", self.k)

    @property
    def static_upper_size(self) -> int:
        return self.k

    @property
    def spec(self) -> str:
        return f"topk:{self.k}"


@dataclasses.dataclass(frozen=True)
class Typical(_RuleBase):
    """Medusa's typical (entropy) acceptance (``docs/certificates.md`` §2, rule 5).

    Accept ``x`` iff ``p_x > min(eps, delta * exp(-H(p)))``. The defaults are Medusa's.

    Attributes:
      eps: hard threshold on ``p_x``, a probability in ``(0, 1]``.
      delta: entropy-scaled threshold factor, ``> 0``.
    """

    eps: float = 0.09
    delta: float = 0.3

    def __post_init__(self):
        check_probability("Typical.eps", self.eps)
        check_float("Typical.delta", self.delta, strict=True)

    @property
    def needs_entropy(self) -> bool:
        return True

    def upper_threshold(self, p_max, entropy):
        threshold = jnp.minimum(self.eps, self.delta * jnp.exp(-entropy))
        return threshold / p_max, False

    @property
    def spec(self) -> str:
        if (self.eps, self.delta) == (0.09, 0.3):
            return "typical"
        return f"typical:{self.eps:g}:{self.delta:g}"


SingleTokenRule = StrictGreedy | Additive | Multiplicative | TargetTopK | Typical
SINGLE_TOKEN_RULES = (StrictGreedy, Additive, Multiplicative, TargetTopK, Typical)
"""The single-token rule classes, for ``isinstance`` checks (``m = 1``)."""


@dataclasses.dataclass(frozen=True)
class TreeCoverage(_RuleBase):
    """Tree / top-m coverage (``docs/certificates.md`` §2, rules 6 and 7).

    The draft is accepted iff the drafter's top-``m`` list contains a token of ``U``.
    With ``base=None`` (or :class:`StrictGreedy`) ``U = {x0}`` (rule 6); with a relaxed
    base rule ``U`` is that rule's accepted set (rule 7). ``C_p < log(m + 1)`` for rule 6.

    Attributes:
      m: list size, an integer ``>= 1``.
      base: the single-token rule defining ``U``; ``None`` means strict greedy.
    """

    m: int
    base: SingleTokenRule | None = None

    def __post_init__(self):
        check_int("TreeCoverage.m", self.m)
        if self.base is not None and not isinstance(self.base, SINGLE_TOKEN_RULES):
            raise ValueError(
                "TreeCoverage.base must be a single-token rule (StrictGreedy, Additive, "
                f"Multiplicative, TargetTopK or Typical), got {self.base!r}"
            )
        if isinstance(self.base, StrictGreedy):  # one spelling per rule: equal and hash alike
            object.__setattr__(self, "base", None)

    @property
    def list_size(self) -> int:
        return self.m

    @property
    def upper_rule(self) -> SingleTokenRule:
        return StrictGreedy() if self.base is None else self.base

    @property
    def static_upper_size(self) -> int | None:
        return self.upper_rule.static_upper_size

    @property
    def needs_entropy(self) -> bool:
        return self.upper_rule.needs_entropy

    def upper_threshold(self, p_max, entropy):
        return self.upper_rule.upper_threshold(p_max, entropy)

    @property
    def spec(self) -> str:
        if self.base is None:
            return f"tree:{self.m}"
        return f"tree:{self.m}+{self.base.spec}"


Rule = StrictGreedy | Additive | Multiplicative | TargetTopK | Typical | TreeCoverage
ALL_RULES = SINGLE_TOKEN_RULES + (TreeCoverage,)
"""Every rule class, for ``isinstance`` checks."""


def in_upper_set(rule: Rule, rel_logits, log_p_max, entropy=None):
    """Membership in a threshold rule's accepted set ``U``: the one definition.

    The certificate solver and the decoder's verification both call this, so "certified"
    and "accepted" come from the same test. Computed from logits relative to the greedy
    token (no ``exp`` of the token's logit).

    Args:
      rule: a rule whose ``U`` is given by a probability threshold (additive,
        multiplicative, typical, or a tree rule over one of them).
      rel_logits: ``[...]`` ``log p_x - log p(x0)`` of the tokens asked about (``<= 0``).
      log_p_max: ``log p(x0)``, broadcastable to ``rel_logits``.
      entropy: ``H(p)`` in nats, broadcastable (only read by :class:`Typical`).

    Returns:
      ``[...]`` bool, ``x in U``.

    Source: ``docs/certificates.md`` §§2 and 8 (the accepted set of each rule, thresholds).
    """
    threshold, inclusive = rule.upper_threshold(jnp.exp(log_p_max), entropy)
    positive = threshold > 0
    log_threshold = jnp.where(positive, jnp.log(jnp.where(positive, threshold, 1.0)), -jnp.inf)
    return rel_logits >= log_threshold if inclusive else rel_logits > log_threshold


_ALIASES = {
    "greedy": "greedy",
    "strict": "greedy",
    "strict_greedy": "greedy",
    "additive": "additive",
    "add": "additive",
    "multiplicative": "multiplicative",
    "mult": "multiplicative",
    "topk": "topk",
    "top-k": "topk",
    "typical": "typical",
    "entropy": "typical",
    "medusa": "typical",
    "tree": "tree",
}

_GRAMMAR = (
    "greedy | additive:T | multiplicative:ALPHA | topk:K | typical[:EPS[:DELTA]] | "
    "tree:M | tree:M+<single-token rule>"
)


# The config fields as the command-line grammar spells them.
_USER_NAMES = {
    "Additive.t": "T",
    "Multiplicative.alpha": "ALPHA",
    "TargetTopK.k": "K",
    "Typical.eps": "EPS",
    "Typical.delta": "DELTA",
    "TreeCoverage.m": "M",
}
_SPELLING = {
    "additive": "additive:T",
    "multiplicative": "multiplicative:ALPHA",
    "topk": "topk:K",
    "typical": "typical[:EPS[:DELTA]]",
    "tree": "tree:M[+<single-token rule>]",
}


def _build(spec: str, name: str, cls, *args, **kwargs):
    """``cls(*args)``, its errors in the words of the rule grammar."""
    try:
        return cls(*args, **kwargs)
    except ValueError as err:
        message = in_user_words(err, _USER_NAMES)
        raise ValueError(f"rule {spec!r}: {message}; expected {_SPELLING[name]}") from None


def _number(text: str, kind, what: str):
    try:
        return kind(text)
    except ValueError:
        raise ValueError(f"rule {what!r}: {text!r} is not a valid {kind.__name__}") from None


def parse_rule(spec: str) -> Rule:
    """Parses one rule from its command-line spelling.

    Examples: ``'greedy'``, ``'additive:0.3'``, ``'multiplicative:0.1'``, ``'topk:2'``,
    ``'typical'`` (Medusa's eps=0.09, delta=0.3), ``'typical:0.5:0.9'``, ``'tree:4'``,
    ``'tree:4+additive:0.3'``.

    Raises:
      ValueError: unknown rule name, wrong number of parameters or invalid values.

    Example:
      >>> from jaxcert.core.rules import parse_rule
      >>> parse_rule("tree:4+additive:0.3")
      TreeCoverage(m=4, base=Additive(t=0.3))
    """
    text = spec.strip().lower()
    head, _, tail = text.partition("+")
    parts = head.split(":")
    name = _ALIASES.get(parts[0])
    args = parts[1:]
    if name is None:
        raise ValueError(f"unknown rule {spec!r}; expected one of: {_GRAMMAR}")
    if tail and name != "tree":
        raise ValueError(f"rule {spec!r}: only tree rules take a '+base' part")
    expected = {
        "greedy": (0, 0),
        "additive": (1, 1),
        "multiplicative": (1, 1),
        "topk": (1, 1),
        "typical": (0, 2),
        "tree": (1, 1),
    }[name]
    if not expected[0] <= len(args) <= expected[1]:
        raise ValueError(f"rule {spec!r}: wrong number of parameters; expected {_GRAMMAR}")
    if name == "greedy":
        return StrictGreedy()
    if name == "additive":
        return _build(spec, name, Additive, _number(args[0], float, spec))
    if name == "multiplicative":
        return _build(spec, name, Multiplicative, _number(args[0], float, spec))
    if name == "topk":
        return _build(spec, name, TargetTopK, _number(args[0], int, spec))
    if name == "typical":
        values = [_number(a, float, spec) for a in args]
        return _build(spec, name, Typical, *values)
    base = parse_rule(tail) if tail else None
    if isinstance(base, TreeCoverage):
        raise ValueError(f"rule {spec!r}: the base of a tree rule must be a single-token rule")
    return _build(spec, name, TreeCoverage, _number(args[0], int, spec), base=base)


def parse_rules(specs: str) -> tuple[Rule, ...]:
    """Parses a comma-separated list such as ``'greedy,additive:0.3,tree:4'``.

    Raises:
      ValueError: an empty list, a repeated rule, or any error of :func:`parse_rule`.
    """
    items = [s for s in (t.strip() for t in specs.split(",")) if s]
    if not items:
        raise ValueError("no rules given")
    rules = tuple(parse_rule(s) for s in items)
    seen = [r.spec for r in rules]
    dupes = sorted({s for s in seen if seen.count(s) > 1})
    if dupes:
        raise ValueError(f"rule(s) given twice: {', '.join(dupes)}")
    return rules
