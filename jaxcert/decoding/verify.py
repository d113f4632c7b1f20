"""Verification: which drafted tokens does the target accept?

* Deterministic rules (:mod:`jaxcert.core.rules`): a drafted token ``x`` at a position with target
  distribution ``p`` passes iff ``x`` is in the rule's accepted set ``U(p)``, the same set the
  certificate solver uses (a prefix of the tokens sorted by decreasing ``p``, stable: ties go
  to the lower id). ``StrictGreedy``: ``U = {argmax p}``. The target then appends its greedy
  token after the accepted path, so with ``StrictGreedy`` the output is target-only greedy
  decoding, token for token.
* Speculative sampling (Leviathan et al., 2023; Chen et al., 2023), extended to trees by
  recursive rejection sampling without replacement (Jeon et al., 2024): at a node whose
  children ``c_1, c_2, ...`` were drawn without replacement from ``q``, accept ``c_i`` with
  probability ``min(1, p_i(c_i) / q_i(c_i))``; on rejection ``p_{i+1} = norm((p_i - q_i)+)``
  and ``q_{i+1}`` is ``q_i`` without ``c_i``, renormalised. If no child is accepted the token
  is drawn from the last residual. ``p`` and ``q`` are the models' distributions at
  temperature ``T`` with optional nucleus (top-p) truncation; the output is distributed
  exactly as target-only sampling with the same settings.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from jaxcert.core import numerics
from jaxcert.core import rules as rules_lib
from jaxcert.decoding.tree import Chain, DynamicTree, TreeShape, parse_tree

__all__ = [
    "Verification",
    "parse_verify",
    "in_accepted_set",
    "sampling_log_probs",
    "sample_tree",
]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Verification:
    """What is drafted and how it is verified.

    Attributes:
      tree: the draft shape (:class:`~jaxcert.decoding.tree.Chain` by default).
      rule: a single-token rule of :mod:`jaxcert.core.rules`, or ``None`` for speculative sampling.
    """

    tree: TreeShape = Chain()
    rule: rules_lib.SingleTokenRule | None = rules_lib.StrictGreedy()

    def __post_init__(self):
        if self.rule is not None and not isinstance(self.rule, rules_lib.SINGLE_TOKEN_RULES):
            raise ValueError(
                f"verification rule must be a single-token rule or None (sampling), got "
                f"{self.rule!r}; a tree is given by the tree shape (tree:MxD)"
            )
        if self.rule is None and isinstance(self.tree, DynamicTree):
            raise ValueError(
                "dynamic trees (dyntree) select nodes by their own drafter probability, which "
                "biases speculative sampling; use a chain or a static tree (tree:MxD) to sample"
            )

    @property
    def sampling(self) -> bool:
        return self.rule is None

    @property
    def spec(self) -> str:
        rule = "sample" if self.rule is None else self.rule.spec
        return rule if isinstance(self.tree, Chain) else f"{self.tree.spec}+{rule}"


# What `parse_verify` accepts, for its errors (certify's grammar has tree *rules*, tree:M).
_GRAMMAR = (
    "[SHAPE+]RULE with RULE = greedy | additive:T | multiplicative:A | topk:K | "
    "typical[:EPS:DELTA] | sample and SHAPE = tree:MxD | dyntree:MxDxN, e.g. tree:2x4+greedy"
)


def parse_verify(spec: str) -> Verification:
    """Parses ``[SHAPE+]RULE``: e.g. ``greedy``, ``additive:0.3``, ``sample``, ``tree:4x6``,
    ``tree:2x4+sample``, ``dyntree:4x6x24+typical``. A shape alone means greedy.

    Raises:
      ValueError: unknown shape or rule, or a tree rule (``tree:M``, certify's spelling) where
        a single-token rule belongs; a misspelling's message gives this grammar. A bad
        parameter value is named in the rule's own words.
    """
    text = spec.strip().lower()
    head, _, tail = text.partition("+")
    if head.split(":")[0] in ("chain", "tree", "dyntree"):
        tree, rule_text = parse_tree(head), tail or "greedy"
    elif tail:
        raise ValueError(f"verify {spec!r}: only a tree shape goes before '+'; expected {_GRAMMAR}")
    else:
        tree, rule_text = Chain(), text
    if rule_text == "sample":
        return Verification(tree=tree, rule=None)
    try:
        rule = rules_lib.parse_rule(rule_text)
    except ValueError as err:
        message = str(err)
        if "tree:M" not in message:  # a bad value, e.g. additive:2: the rule's own words
            raise
        # A misspelt rule: the rules' message offers certify's grammar; give this one.
        raise ValueError(
            f"verify {spec!r}: {message.partition('; expected')[0]}; expected {_GRAMMAR}"
        ) from None
    if isinstance(rule, rules_lib.TreeCoverage):
        raise ValueError(
            f"verify {spec!r}: {rule.spec} is a tree rule (certify's spelling); here a tree "
            f"is a shape before '+'; expected {_GRAMMAR}"
        )
    return Verification(tree=tree, rule=rule)


def in_accepted_set(logits: jax.Array, tokens: jax.Array, rule) -> jax.Array:
    """Whether each token is in the rule's accepted set ``U(p)``, ``p = softmax(logits)``.

    Args:
      logits: ``[..., V]`` target logits.
      tokens: ``[...]`` int token ids.
      rule: a single-token rule (``TreeCoverage`` uses its ``upper_rule``).

    Returns:
      ``[...]`` bool. Matches the certificate solver's ``U`` (``docs/certificates.md`` §§2 and 8).
    """
    rule = rule.upper_rule
    x = logits.astype(numerics.compute_dtype(logits.dtype))
    tokens = tokens.astype(jnp.int32)
    x_t = jnp.take_along_axis(x, tokens[..., None], axis=-1)[..., 0]
    if isinstance(rule, rules_lib.StrictGreedy):
        return tokens == jnp.argmax(x, axis=-1)
    ids = jnp.arange(x.shape[-1], dtype=jnp.int32)
    if isinstance(rule, rules_lib.TargetTopK):
        ahead = (x > x_t[..., None]) | ((x == x_t[..., None]) & (ids < tokens[..., None]))
        return jnp.sum(ahead, axis=-1) < rule.k
    x_max, total = numerics.normalizer(x)
    entropy = numerics.entropy(x, x_max, total) if rule.needs_entropy else None
    return rules_lib.in_upper_set(rule, x_t - x_max, -jnp.log(total), entropy)


def sampling_log_probs(logits: jax.Array, temperature, top_p=1.0) -> jax.Array:
    """Log-probabilities actually sampled from: ``softmax(logits / T)``, nucleus-truncated.

    Args:
      logits: ``[..., V]``.
      temperature: ``T > 0``, a Python number or a traced scalar.
      top_p: keep the smallest set of most probable tokens whose mass reaches ``top_p`` (ties
        at the cut are kept); ``1.0`` keeps everything. A Python number decides when
        tracing; a traced scalar decides at run time (the sort of the nucleus runs only
        when ``top_p < 1``).

    Returns:
      ``[..., V]`` float32 normalised log-probabilities, ``-inf`` outside the nucleus.
    """
    x = logits.astype(jnp.float32)
    # Shift before scaling: a tiny T then sends the argmax to 0 and the rest to -inf
    # instead of overflowing to inf - inf = NaN.
    x = x - lax.stop_gradient(jnp.max(x, axis=-1, keepdims=True))
    logp = jax.nn.log_softmax(x / jnp.asarray(temperature, jnp.float32), axis=-1)
    if isinstance(top_p, (int, float)):
        return logp if top_p >= 1.0 else _nucleus(logp, top_p)
    return lax.cond(top_p >= 1.0, lambda: logp, lambda: _nucleus(logp, top_p))


def _nucleus(logp, top_p):
    """``logp`` truncated to its top-``top_p`` nucleus and renormalised."""
    desc = -jnp.sort(-logp, axis=-1)
    before = jnp.cumsum(jnp.exp(desc), axis=-1) - jnp.exp(desc)  # mass strictly ahead
    kept = jnp.sum(before < top_p, axis=-1, keepdims=True)  # >= 1
    cut = jnp.take_along_axis(desc, kept - 1, axis=-1)
    logp = jnp.where(logp >= cut, logp, -jnp.inf)
    return jax.nn.log_softmax(logp, axis=-1)


def _probs(log_probs):
    return jnp.exp(log_probs)


def _residual(p, q):
    """``norm((p - q)+)``; falls back to ``p`` if the residual has no mass (rounding)."""
    r = jnp.maximum(p - q, 0.0)
    total = jnp.sum(r, axis=-1, keepdims=True)
    return jnp.where(total > 0, r / jnp.where(total > 0, total, 1.0), p)


def _without(q, token):
    """``q`` with ``token`` removed, renormalised (zero if nothing is left)."""
    q = q.at[jnp.arange(q.shape[0]), token].set(0.0)
    total = jnp.sum(q, axis=-1, keepdims=True)
    return q / jnp.where(total > 0, total, 1.0)


def sample_tree(
    key: jax.Array,
    target_logits: jax.Array,
    tokens: jax.Array,
    children: jax.Array,
    expanded: jax.Array,
    q_logits: jax.Array,
    *,
    max_depth: int,
    temperature: float,
    top_p: float = 1.0,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Recursive rejection sampling down a draft tree (a chain when every node has one child).

    Args:
      key: PRNG key.
      target_logits: ``[B, T, V]`` target logits at the positions (root first).
      tokens: ``[B, T - 1]`` int32 node tokens.
      children: ``[B, T, M]`` int32 children of each position in drafting order (their node
        indices; ``-1``: none). Siblings must be draws without replacement from ``q``.
      expanded: ``[B, T]`` int32 row of ``q_logits`` holding each position's drafter logits.
      q_logits: ``[B, X, V]`` drafter logits at the expanded nodes.
      max_depth: the deepest node.
      temperature, top_p: sampling settings (numbers or traced scalars), applied to both
        models.

    Returns:
      ``(passes, last, token)``: ``[B, T - 1]`` bool nodes accepted by their test, ``[B]``
      int32 position of the accepted path's end (0: the root) and ``[B]`` int32 the token
      sampled after it.
    """
    b, t, v = target_logits.shape
    rows = jnp.arange(b)

    def dist_p(pos):
        return _probs(sampling_log_probs(target_logits[rows, pos], temperature, top_p))

    def dist_q(pos):
        return _probs(sampling_log_probs(q_logits[rows, expanded[rows, pos]], temperature, top_p))

    zeros = jnp.zeros((b,), jnp.int32)
    init = (
        jnp.asarray(0, jnp.int32),
        key,
        zeros,  # current position
        jnp.ones((b,), bool),  # alive: every ancestor accepted, still descending
        dist_p(zeros),
        dist_q(zeros),
        jnp.zeros((b, t - 1), bool),
    )

    def cond(carry):
        level, _, _, alive, _, _, _ = carry
        return (level < max_depth) & jnp.any(alive)

    def body(carry):
        level, key, pos, alive, p_res, q_res, passes = carry
        chosen = jnp.full((b,), -1, jnp.int32)
        for k in range(children.shape[-1]):
            key, sub = jax.random.split(key)
            child = children[rows, pos, k]
            has = alive & (child >= 0) & (chosen < 0)
            x = tokens[rows, jnp.maximum(child, 0)]
            px, qx = p_res[rows, x], q_res[rows, x]
            u = jax.random.uniform(sub, (b,))
            accept = has & (qx > 0) & (u * qx < px)
            reject = has & ~accept
            p_res = jnp.where(reject[:, None], _residual(p_res, q_res), p_res)
            q_res = jnp.where(reject[:, None], _without(q_res, x), q_res)
            chosen = jnp.where(accept, child, chosen)
            slot = jnp.maximum(child, 0)
            passes = passes.at[rows, slot].set(passes[rows, slot] | accept)
        moved = chosen >= 0
        pos = jnp.where(moved, chosen + 1, pos)
        p_res = jnp.where(moved[:, None], dist_p(pos), p_res)
        q_res = jnp.where(moved[:, None], dist_q(pos), q_res)
        return level + 1, key, pos, alive & moved, p_res, q_res, passes

    _, key, pos, _, p_res, _, passes = lax.while_loop(cond, body, init)
    token = jax.random.categorical(key, jnp.log(p_res), axis=-1).astype(jnp.int32)
    return passes, pos, token
