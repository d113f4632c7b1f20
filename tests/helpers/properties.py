"""Target distributions for the property tests: peaked, flat, tied, sparse and offset logits.

Every generator returns float64 logits ``[V]``; the tests store them in float32 (with an
optional common offset) and compare the solver on the stored values against the float64
reference on the very same values.
"""

from __future__ import annotations

import numpy as np

from jaxcert.core import rules as R

RULES = (
    R.StrictGreedy(),
    R.Additive(0.05),
    R.Additive(0.5),
    R.Multiplicative(0.1),
    R.Multiplicative(0.6),
    R.TargetTopK(1),
    R.TargetTopK(4),
    R.Typical(),
    R.Typical(0.5, 2.0),
    R.TreeCoverage(2),
    R.TreeCoverage(5),
    R.TreeCoverage(3, base=R.Additive(0.1)),
    R.TreeCoverage(2, base=R.Multiplicative(0.3)),
    R.TreeCoverage(2, base=R.TargetTopK(2)),
    R.TreeCoverage(3, base=R.Typical()),
)

KINDS = ("peaked", "flat", "uniform", "tied", "random", "sparse", "llm")


def logits(kind: str, vocab: int, rng: np.random.Generator) -> np.ndarray:
    """float64 logits ``[vocab]`` of one kind of target distribution."""
    if kind == "peaked":  # p(x0) = 1 - 1e-12: the tail is given directly, never 1 - p(x0)
        x = np.log(1e-12 / max(vocab - 1, 1)) + 0.5 * rng.standard_normal(vocab)
        x[rng.integers(vocab)] = 0.0
    elif kind == "flat":  # near-uniform: tiny logit differences
        x = 1e-3 * rng.standard_normal(vocab)
    elif kind == "uniform":  # exact ties everywhere
        x = np.zeros(vocab)
    elif kind == "tied":  # exact ties at the top, random below
        x = rng.standard_normal(vocab) * 2.0
        top = rng.choice(vocab, min(vocab, int(rng.integers(2, 5))), replace=False)
        x[top] = x.max() + 1.0
    elif kind == "random":
        x = rng.standard_normal(vocab) * float(rng.choice([0.3, 1.0, 3.0, 8.0]))
    elif kind == "sparse":  # zero-probability tokens (-inf logits), at least 1 finite
        x = rng.standard_normal(vocab) * 2.0
        x[rng.random(vocab) < 0.4] = -np.inf
        x[rng.integers(vocab)] = 1.0
    elif kind == "llm":  # a language model's shape: a few large logits over a wide floor
        x = rng.standard_normal(vocab) * 1.5
        head = rng.choice(vocab, min(vocab, 8), replace=False)
        x[head] += rng.uniform(4.0, 14.0, head.size)
    else:
        raise ValueError(kind)
    return x


def softmax64(x32: np.ndarray) -> np.ndarray:
    """The exact (float64) distribution of stored float32 logits ``[..., V]``."""
    x = np.asarray(x32, np.float64)
    top = np.max(x, axis=-1, keepdims=True)
    e = np.exp(x - top)
    return e / e.sum(axis=-1, keepdims=True)


def near_threshold(p: np.ndarray, rule, rtol: float = 2e-5) -> bool:
    """Whether a token lies within float32 rounding of a relaxed rule's threshold (its
    membership in ``U`` may then differ between float32 and float64)."""
    base = rule.upper_rule
    top = p.max()
    if isinstance(base, R.Additive):
        level = top - base.t
    elif isinstance(base, R.Multiplicative):
        level = base.alpha * top
    elif isinstance(base, R.Typical):
        pos = p[p > 0]
        level = min(base.eps, base.delta * np.exp(np.sum(pos * np.log(pos))))
    else:
        return False
    scale = max(abs(level), 1e-30)
    return bool(np.any(np.abs(p - level) <= rtol * scale + 1e-12))
