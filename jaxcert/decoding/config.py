"""Settings of the decoders: :class:`DecodeConfig` and the buffer :class:`Sizes`.

A config holds two kinds of settings. Its *shape* (draft tree, rule, ``max_draft``,
verification buckets, statistics, rounds per call) is static: one compilation per distinct
shape. Its *values* (``max_new_tokens``, ``eos_ids``, ``temperature``, ``top_p``) travel as a
traced :class:`~jaxcert.decoding.state.Settings`, so a sweep over them reuses one program;
only the buffers' capacity depends on the budget, and it is bucketed (:func:`bucket`), so a
sweep of budgets compiles a few programs, not one per value.
"""

from __future__ import annotations

import dataclasses

from jaxcert.base.validate import check_float, check_int, check_probability, round_up
from jaxcert.decoding import policies as policies_lib
from jaxcert.decoding import tree as tree_lib
from jaxcert.decoding.state import Settings
from jaxcert.decoding.verify import Verification, parse_verify

__all__ = ["DecodeConfig", "Sizes", "bucket", "check_sampling"]

# Verification widths in tree levels (chain: drafted tokens). Each width is one more copy of
# the target's forward in the rounds program (~5 s of compilation for the 1.5B on 2 CPU cores),
# and padding a pass to its bucket costs little where the forward is memory-bound: the 1.5B's
# 1..40-token passes on 2 cores took 405, 515, 619, 745, 824, 750, 880 (8), 994 (10),
# 1047 (16), 1268 (20), 1357 (24), 1561 (32) and 1786 ms (40) (scripts/bench_pass_width.py;
# docs/benchmarks.md, "Compile time"). Doubling to 16, then steps of 8 up to 24 and 16
# beyond, keeps the padding cost under ~20% of a pass with 7 programs for a 40-deep chain
# instead of 14.
_LEVEL_BUCKETS = (1, 2, 4, 8, 16, 24, 40, 56, 64)


def bucket(n: int, minimum: int = 16) -> int:
    """``n`` rounded up to a compile bucket: a multiple of 16 up to 128, then of an eighth of
    the next power of two below ``n`` (at most 25% above ``n``; four buckets per octave).

    >>> [bucket(n) for n in (1, 16, 17, 100, 129, 700)]
    [16, 16, 32, 112, 160, 768]
    """
    check_int("n", n)
    return round_up(n, max(minimum, 2 ** (n.bit_length() - 3)))


PROMPT_ROOM = 512


def prompt_room(n: int) -> int:
    """The default prompt width for prompts of up to ``n`` tokens: a multiple of
    :data:`PROMPT_ROOM`, so prompts of different lengths (up to 512 tokens, then each 512
    more) share one compiled program; the prefill reads only the 64-token chunks the
    prompts fill (:func:`jaxcert.decoding.loop.prefill_chunk`), so the room costs the
    prefill nothing, and a decode step's attention over the wider cache little.

    >>> [prompt_room(n) for n in (1, 512, 513)]
    [512, 512, 1024]
    """
    check_int("n", n)
    return round_up(n, PROMPT_ROOM)


def check_sampling(temperature: float, top_p: float) -> None:
    """Raises ``ValueError`` unless ``temperature`` is finite, ``>= 0``, and ``top_p`` in (0, 1]."""
    check_float("temperature", temperature)
    check_probability("top_p", top_p)


@dataclasses.dataclass(frozen=True, kw_only=True)
class DecodeConfig:
    """Settings of a decoder: its shape (static) and its values (traced).

    Configs that differ only in ``max_new_tokens`` (within a :func:`bucket`), ``eos_ids``,
    ``temperature`` or ``top_p`` share one compiled program.

    Attributes:
      verification: draft shape and rule (``rule=None``: speculative sampling), or its
        spelling for :func:`~jaxcert.decoding.verify.parse_verify`.
      max_new_tokens: output budget per row (traced; the buffers hold its bucket).
      max_draft: deepest chain (``K_max``); trees use their own depth.
      temperature: ``0`` for deterministic rules, ``> 0`` for sampling (traced).
      top_p: nucleus truncation for sampling (``1.0``: none; traced).
      eos_ids: tokens that end a row (kept in its output; at most ``Settings.MAX_EOS``, 8;
        traced).
      collect_stats: compute certificates for every drafted node (KL and entropies are always
        computed).
      buckets: verification widths in drafted nodes (sorted; the last must be the node
        count); ``None`` picks a default.
      rounds_per_call: rounds per jitted call (the host sees progress between calls).
      head_taps: ``None`` for a language-model drafter; for a draft head that reads the
        target's states (:class:`~jaxcert.decoding.protocols.FeatureDrafter`), its ``taps``
        (``()``: the target's final-norm hidden states). :func:`speculative_decode` sets it
        from the drafter.
      proposes_tokens: the drafter proposes tokens with a one-hot ``q``
        (:class:`~jaxcert.decoding.ngram.NgramDrafter`): its per-node KL and certificates
        are ``nan``, and the verification widths include 0 (no row drafted anything: a
        plain target step). :func:`speculative_decode` sets it from the drafter.
      max_skip: the most rounds in a row the ``goodput`` policy may run as plain target
        steps without the drafter (the drafter then catches up in one wider re-read);
        ``None``: 8 with ``goodput``, else 0 (set by :func:`speculative_decode`). With
        ``max_skip > 0`` the verification widths include 0.
    """

    verification: Verification = Verification()
    max_new_tokens: int = 128
    max_draft: int = policies_lib.DEFAULT_K_MAX
    temperature: float = 0.0
    top_p: float = 1.0
    eos_ids: tuple[int, ...] = ()
    collect_stats: bool = True
    buckets: tuple[int, ...] | None = None
    rounds_per_call: int = 8
    head_taps: tuple[int, ...] | None = None
    proposes_tokens: bool = False
    max_skip: int | None = None

    def __post_init__(self):
        if isinstance(self.verification, str):  # e.g. "tree:2x4+greedy"
            object.__setattr__(self, "verification", parse_verify(self.verification))
        if not isinstance(self.verification, Verification):
            raise ValueError(f"verification must be a Verification, got {self.verification!r}")
        object.__setattr__(self, "eos_ids", Settings.check_eos_ids(self.eos_ids))
        for name in ("max_new_tokens", "max_draft", "rounds_per_call"):
            check_int(name, getattr(self, name))
        if self.max_skip is not None:
            check_int("max_skip", self.max_skip, low=0)
        check_sampling(self.temperature, self.top_p)
        if self.verification.sampling != (self.temperature > 0):
            raise ValueError(
                f"temperature {self.temperature} does not fit verification "
                f"{self.verification.spec!r}: speculative sampling ('sample', "
                "'tree:MxD+sample') needs temperature > 0; deterministic rules need 0"
            )
        if self.buckets is not None:
            b = tuple(self.buckets)
            if not b or list(b) != sorted(set(b)) or b[0] < 0 or b[-1] != self.num_nodes:
                raise ValueError(
                    f"buckets must increase from >= 0 to the node count {self.num_nodes}, got {b}"
                )

    def shape_only(self) -> DecodeConfig:
        """This config with its traced values set to canonical ones: the static part, the
        key of the compiled programs."""
        return dataclasses.replace(
            self,
            max_new_tokens=1,
            temperature=1.0 if self.verification.sampling else 0.0,
            top_p=1.0,
            eos_ids=(),
        )

    @property
    def tree(self) -> tree_lib.TreeShape:
        return self.verification.tree

    @property
    def branching(self) -> int:
        """``M``: drafter rows per batch row."""
        return 1 if isinstance(self.tree, tree_lib.Chain) else self.tree.m

    @property
    def depth(self) -> int:
        """``K``: the deepest drafted node."""
        return self.max_draft if isinstance(self.tree, tree_lib.Chain) else self.tree.depth

    @property
    def num_nodes(self) -> int:
        """``N``: node slots per round."""
        if isinstance(self.tree, tree_lib.DynamicTree):
            return self.tree.nodes
        return self.branching * self.depth

    @property
    def skips(self) -> int:
        """``max_skip`` resolved (``None`` counts as 0)."""
        return self.max_skip or 0

    @property
    def reread_base(self) -> int:
        """Tokens the drafter re-reads after a round that drafted: the accepted path and the
        target's token (a chain's language-model drafter has read all but the last two)."""
        chain_lm = isinstance(self.tree, tree_lib.Chain) and self.head_taps is None
        return 2 if chain_lm else self.depth + 1

    @property
    def reread(self) -> int:
        """The widest re-read: :attr:`reread_base` plus a token per skipped round."""
        return self.reread_base + self.skips

    def reread_widths(self) -> tuple[int, ...]:
        """The static widths of the drafter's re-read pass; a round takes the narrowest that
        holds every row's new tokens: 1 (after a rejection), :attr:`reread_base` (after a
        round that drafted), :attr:`reread` (after skipped rounds), and for a draft head
        every level bucket below :attr:`reread` too. A head's re-read is one block, cheap
        to compile at each width, and a wide one is dear: re-reading 2 tokens took 16 ms
        with a 2-wide pass and 35 ms with the 41-wide one of ``max_draft=40`` (the 1.5B's
        EAGLE-3 head, 2 CPU cores; a target step 210 ms)."""
        widths = {1, self.reread_base, self.reread}
        if self.head_taps is not None:
            widths |= {x for x in _LEVEL_BUCKETS if x < self.reread}
        return tuple(sorted(widths))

    def verify_buckets(self) -> tuple[int, ...]:
        """The verification widths in drafted nodes (the pass reads one more, the root);
        ``0`` is a plain target step, a default only for a drafter that may propose nothing
        (``proposes_tokens``) or a policy that may draft nothing (``max_skip > 0``)."""
        if self.buckets is not None:
            return tuple(self.buckets)
        zero = (0,) if self.proposes_tokens or self.skips else ()
        if isinstance(self.tree, tree_lib.DynamicTree):
            n = self.num_nodes
            return zero + tuple(sorted({max(1, n // 4), max(1, n // 2), n}))
        levels = [x for x in _LEVEL_BUCKETS if x < self.depth] + [self.depth]
        return zero + tuple(self.branching * x for x in levels)


@dataclasses.dataclass(frozen=True)
class Sizes:
    """Static buffer sizes: sequence slots, target cache slots, drafter cache slots."""

    sequence: int
    target: int
    drafter: int

    @classmethod
    def for_prompts(cls, prompt_width: int, config: DecodeConfig | None, max_new: int) -> Sizes:
        """Sizes for prompts of width ``prompt_width`` and a budget of ``max_new`` tokens
        (pass the budget's :func:`bucket` to share programs across budgets)."""
        d = config.depth if config else 0
        n = config.num_nodes if config else 1
        w = config.reread if config else 1
        base = prompt_width + max_new + d + 2
        return cls(
            sequence=round_up(base + w, 16),
            target=round_up(base + n, 16),
            drafter=round_up(base + w + d, 16),
        )
