"""Frozen pytrees carried by the speculative decoder.

Shape letters: the package's (see :mod:`jaxcert.decoding`): B batch rows, S sequence / cache
slots, V vocabulary, N draft-tree nodes (the root excluded), X expanded nodes (nodes whose
drafter distribution was computed: the root and every frontier node), M branching (top-m),
K draft depth (the draft length of a chain), R rounds of one call.

Sequence bookkeeping, per row ``b`` with ``n = length[b]`` tokens ``s[0..n)`` (prompt and
output): the target cache has committed ``n - 1`` entries (every token but the last, the
*root* of the next draft tree, which the verification pass feeds first); the drafter cache is
rolled back to ``drafter_start[b]`` at the start of a round and re-reads ``s[drafter_start:n)``
(for chains the target's token, plus the last accepted token when the whole draft was accepted;
for trees the accepted path and the target's token).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar, cast

import jax
import numpy as np
from flax import struct

from jaxcert.decoding.protocols import Cache

__all__ = ["DraftTree", "PolicyState", "Settings", "DecodeState", "NodeStats", "RoundStats"]


@struct.dataclass
class DraftTree:
    """One draft tree per row, topologically ordered (every parent before its children).

    Chains and static trees are level-major (node ``(d - 1) * M + r`` is branch ``r`` at depth
    ``d``); dynamic trees list their drafted nodes first, in expansion order. Verification
    position ``0`` is the root (the last committed token) and node ``i`` is position ``i + 1``.

    Attributes:
      tokens: ``[B, N]`` int32 drafted token ids.
      parent: ``[B, N]`` int32 node index of the parent, ``NO_PARENT`` for children of the root.
      depth: ``[B, N]`` int32, 1 for children of the root.
      rank: ``[B, N]`` int32 rank among its siblings in drafter order (0: the drafter's first
        choice, its argmax when drafting greedily).
      valid: ``[B, N]`` bool, drafted this round (``False``: padding, never accepted).
      q_index: ``[B, N]`` int32 row of ``q_logits`` that holds the parent's drafter logits.
      q_logits: ``[B, X, V]`` float32 drafter logits at the expanded nodes (row 0: the root).
    """

    NO_PARENT: ClassVar[int] = -1
    ROOT_POSITION: ClassVar[int] = 0

    tokens: jax.Array  # [B, N]
    parent: jax.Array  # [B, N]
    depth: jax.Array  # [B, N]
    rank: jax.Array  # [B, N]
    valid: jax.Array  # [B, N]
    q_index: jax.Array  # [B, N]
    q_logits: jax.Array  # [B, X, V]

    if TYPE_CHECKING:  # struct.dataclass adds it at run time, out of mypy's sight

        def replace(self, **updates: Any) -> DraftTree: ...

    @property
    def num_nodes(self) -> int:
        """N, node slots per row."""
        return self.tokens.shape[1]


@struct.dataclass
class PolicyState:
    """Per-row state of a draft-length policy, carried across rounds.

    Attributes:
      k: ``[B]`` int32 current draft length of the ``heuristic`` schedule.
      accepted: ``[B]`` float32 ``goodput``'s running (exponentially weighted) count of
        accepted drafted tokens; ``tested`` the same of drafted tokens the target tested
        (a rejected one included). Their ratio is the row's acceptance rate per token.
      predicted: ``[B]`` float32 the same sum of the tested tokens' certificate estimates
        ``(C_q / log 2) ** beta``; ``accepted / predicted`` calibrates the estimate.
      skipped: ``[B]`` int32 rounds in a row that ``goodput`` ran as plain target steps
        without the drafter (equal in every row: the choice is made for the batch);
        ``policies.UNMEASURED`` before the first drafting round.
      losses: ``[B]`` int32 measuring rounds in a row after which ``goodput`` skipped the
        drafter again (a drafting round followed by a skip; a drafting round followed by
        another one resets it), each counted by the rows it measured (row-rounds); at
        ``Goodput.patience`` it stops measuring.
      emitted: ``[B]`` float32 tokens emitted by the row's drafting rounds so far this
        decode (each round's accepted drafts and the target's token; a round that read
        the drafter and drafted nothing counts, at depth 0); ``rounds``
        ``[B, K + 1]`` float32 those rounds counted by the batch's depth, so that
        ``rounds @ RoundCosts.round_s`` is their cost in seconds. ``emitted`` over that
        cost is the row's measured rate of drafting, which ``goodput``'s skip decision
        weighs against a plain step.
      match_accepted, match_tested: ``[B, L]`` float32 ``goodput``'s running counts of a
        proposing drafter's accepted and tested tokens by the length of the match that
        proposed them (column ``l``: ``l + 1`` tokens, the last column that many or more;
        ``policies.MATCH_CLASSES`` columns); their ratio is its acceptance estimate of a
        proposal (:class:`~jaxcert.decoding.ngram.NgramDrafter`). Unused for a drafter
        with distributions.
    """

    k: jax.Array  # [B]
    accepted: jax.Array  # [B]
    tested: jax.Array  # [B]
    predicted: jax.Array  # [B]
    skipped: jax.Array  # [B]
    losses: jax.Array  # [B]
    emitted: jax.Array  # [B]
    rounds: jax.Array  # [B, K + 1]
    match_accepted: jax.Array  # [B, L]
    match_tested: jax.Array  # [B, L]

    if TYPE_CHECKING:  # struct.dataclass adds it at run time, out of mypy's sight

        def replace(self, **updates: Any) -> PolicyState: ...


@struct.dataclass
class Settings:
    """Decoding settings that are values, not shapes: traced, so one compiled program serves
    every budget, end-token set, temperature and top-p (a sweep compiles nothing new).

    Attributes:
      max_new_tokens: ``[]`` int32 output budget per row (at most the buffers' capacity).
      temperature: ``[]`` float32 sampling temperature (ignored by deterministic rules).
      top_p: ``[]`` float32 nucleus mass in ``(0, 1]`` (``1``: no truncation).
      eos_ids: ``[MAX_EOS]`` int32 end tokens, padded with ``-1`` (never a token id).
    """

    MAX_EOS: ClassVar[int] = 8

    max_new_tokens: jax.Array  # []
    temperature: jax.Array  # []
    top_p: jax.Array  # []
    eos_ids: jax.Array  # [MAX_EOS]

    if TYPE_CHECKING:  # struct.dataclass adds it at run time, out of mypy's sight

        def replace(self, **updates: Any) -> Settings: ...

    @classmethod
    def create(cls, max_new_tokens: int, temperature: float, top_p: float, eos_ids) -> Settings:
        """Host values to a ``Settings`` (``eos_ids``: at most ``MAX_EOS`` ids)."""
        eos = cls.check_eos_ids(eos_ids)
        padded = np.full((cls.MAX_EOS,), -1, np.int32)
        padded[: len(eos)] = eos
        # numpy host values (the fields' jax.Array is what a jitted program receives them as)
        return cls(
            max_new_tokens=cast(jax.Array, np.asarray(max_new_tokens, np.int32)),
            temperature=cast(jax.Array, np.asarray(temperature, np.float32)),
            top_p=cast(jax.Array, np.asarray(top_p, np.float32)),
            eos_ids=cast(jax.Array, padded),
        )

    @classmethod
    def check_eos_ids(cls, eos_ids) -> tuple[int, ...]:
        """``eos_ids`` as a tuple of ints.

        Raises:
          ValueError: more than ``MAX_EOS`` ids.
        """
        eos = tuple(int(i) for i in eos_ids)
        if len(eos) > cls.MAX_EOS:
            raise ValueError(f"at most {cls.MAX_EOS} end tokens, got {len(eos)}: {eos}")
        return eos

    def is_eos(self, tokens: jax.Array) -> jax.Array:
        """``[...]`` bool: which of ``tokens`` (``[...]`` int) are end tokens."""
        return (tokens[..., None] == self.eos_ids).any(-1)


@struct.dataclass
class DecodeState:
    """Everything the round loop carries; rows whose ``done`` is set are frozen.

    Attributes:
      tokens: ``[B, S]`` int32 prompt and output tokens, ``PAD`` beyond ``length``.
      length: ``[B]`` int32 tokens in the sequence ``n`` (prompt plus output).
      prompt_length: ``[B]`` int32 prompt tokens.
      done: ``[B]`` bool, the row reached ``max_new_tokens`` or emitted an end token.
      drafter_start: ``[B]`` int32 first sequence index the drafter re-reads next round.
      target_cache: the target's cache (``B`` rows, ``n - 1`` committed per row).
      drafter_cache: the drafter's cache (``B * M`` rows: one per tree branch);
        ``None`` in the target-only decoder.
      drafter_context: for a draft head, ``[B, width, Z]`` the target's states at the
        positions before the tokens it re-reads next round (``width``: the widest re-read,
        ``DecodeConfig.reread``; ``Z``: the head's input width);
        ``None`` otherwise.
      policy: the policy's per-row state; ``None`` in the target-only decoder.
      key: PRNG key (used by sampling only).
      rounds: ``[B]`` int32 rounds each row took part in.
      settings: the traced :class:`Settings` of the run.
    """

    PAD: ClassVar[int] = 0

    tokens: jax.Array  # [B, S]
    length: jax.Array  # [B]
    prompt_length: jax.Array  # [B]
    done: jax.Array  # [B]
    drafter_start: jax.Array  # [B]
    target_cache: Cache
    drafter_cache: Cache | None
    drafter_context: jax.Array | None
    policy: PolicyState | None
    key: jax.Array  # [] PRNG key
    rounds: jax.Array  # [B]
    settings: Settings

    if TYPE_CHECKING:  # struct.dataclass adds it at run time, out of mypy's sight

        def replace(self, **updates: Any) -> DecodeState: ...

    @property
    def generated(self) -> jax.Array:
        """``[B]`` int32 output tokens so far (may exceed the budget by the last round's extra)."""
        return self.length - self.prompt_length


@struct.dataclass
class NodeStats:
    """Statistics of every drafted node of one round; every field is ``[B, N]``.

    ``kl``, ``cert`` and ``entropy`` describe the node's *position* (its parent's context): the
    target ``p`` and drafter ``q`` there. ``cert`` is ``nan`` when certificates are not
    collected (or in sampling mode).

    Attributes:
      valid: drafted this round.
      depth: depth (1-based).
      rank: rank among siblings (0: the drafter's first choice).
      passes: the token is in the rule's accepted set ``U(p)`` at its position (sampling: it
        was accepted by the rejection test when it was reached, else ``False``).
      accepted: on the accepted root path.
      reached: its parent's context was verified (the parent is the root or was accepted).
      kl: ``KL(p || q)`` in nats at its position.
      cert: the certificate ``C_p`` of the rule (list size 1) at its position.
      cert_list: the tree certificate of the rule with ``m`` = the parent's number of drafted
        children (equals ``cert`` when ``m = 1``).
      covered: some sibling (or the node) passes; meaningful on rank-0 nodes.
      entropy: drafter entropy ``H(q)`` in nats at its position.
      q_top: drafter top probability at its position.
      q_cert: the drafter's own strict-greedy certificate ``C_q`` at its position.
    """

    valid: jax.Array  # [B, N]
    depth: jax.Array  # [B, N]
    rank: jax.Array  # [B, N]
    passes: jax.Array  # [B, N]
    accepted: jax.Array  # [B, N]
    reached: jax.Array  # [B, N]
    kl: jax.Array  # [B, N]
    cert: jax.Array  # [B, N]
    cert_list: jax.Array  # [B, N]
    covered: jax.Array  # [B, N]
    entropy: jax.Array  # [B, N]
    q_top: jax.Array  # [B, N]
    q_cert: jax.Array  # [B, N]

    if TYPE_CHECKING:  # struct.dataclass adds it at run time, out of mypy's sight

        def replace(self, **updates: Any) -> NodeStats: ...


@struct.dataclass
class RoundStats:
    """What one call of the round loop records, stacked over its ``R`` rounds.

    Attributes:
      active: ``[R, B]`` bool, the row took part in the round.
      drafted: ``[R, B]`` int32 drafted nodes.
      depth: ``[R, B]`` int32 drafted depth (the draft length ``K`` of a chain).
      accepted: ``[R, B]`` int32 accepted drafted tokens that were emitted: the accepted
        path, cut at the end token or the ``max_new_tokens`` budget (vLLM's "accepted"). A
        draft after an end token passes verification but is never emitted, so it does not
        count.
      emitted: ``[R, B]`` int32 tokens appended (the accepted path plus the target's token,
        truncated at the end token or the budget); ``accepted <= emitted <= accepted + 1``.
      nodes: a :class:`NodeStats` with ``[R, B, N]`` fields.
    """

    active: jax.Array  # [R, B]
    drafted: jax.Array  # [R, B]
    depth: jax.Array  # [R, B]
    accepted: jax.Array  # [R, B]
    emitted: jax.Array  # [R, B]
    nodes: NodeStats

    if TYPE_CHECKING:  # struct.dataclass adds it at run time, out of mypy's sight

        def replace(self, **updates: Any) -> RoundStats: ...
