"""Prompt-lookup drafting: the n-gram drafter, a :class:`DecoderModel` with no weights.

At every position the drafter looks for the latest earlier occurrence of the sequence's last
tokens in the sequence itself (prompt and output so far), longest match first (at most ``n``
tokens, at least ``min_n``), and proposes the token that followed it; with no match it
proposes nothing. This is prompt lookup as Hugging Face (``prompt_lookup_num_tokens``), vLLM
(``ngram``) and llama.cpp (lookup) have it, written as a per-token model so that every draft
shape and rule of the decoder drives it: a drafted token extends the match, so a chain copies
the continuation of the matched text token by token.

Its ``q`` is one-hot: a finite logit at the proposed token and ``-inf`` elsewhere (every
logit ``-inf`` when there is no match). The finite logit is the match's length in tokens
(read up to ``max(n, MATCH_REACH)`` tokens): any finite value gives the same one-hot ``q``,
and the value tells the decoder's ``goodput`` policy how long the match was, its estimate of
the proposal's acceptance (``docs/goodput.md``, "Prompt lookup: a drafter that costs
nothing"). The decoder treats such a drafter as proposing tokens, not distributions
(:attr:`NgramDrafter.proposes_tokens`): a node without a proposal is not drafted (a row with
none at all verifies nothing: a plain target step), greedy rules accept the proposal when
the target agrees, and speculative sampling accepts it with probability ``p(x)`` and
resamples from ``norm((p - q)+)`` on rejection, which for a one-hot ``q`` is exact.
``KL(p || q)`` is infinite and the certificate comparison ``KL < C_p`` has no meaning for such a
``q``: the decoder's per-node ``kl``, ``cert``, ``cert_list`` and drafter statistics are
``nan`` for it (``docs/design.md``, "N-gram drafting").

The drafter's cache is the token history, ``[B, S]`` int32 per row (:class:`TokenCache`).
Each lookup compares the last ``max(n, MATCH_REACH)`` tokens against every earlier slot:
``O(S * n)`` integer compares per drafted token, no matrix product.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
from flax import nnx, struct
from jax import lax
from jax.typing import ArrayLike

from jaxcert.base.validate import check_int
from jaxcert.models import cache as cache_lib

__all__ = [
    "NgramDrafter",
    "TokenCache",
    "NgramConfig",
    "match_length",
    "MATCH_REACH",
    "parse_ngram",
    "lookup_reference",
    "match_reference",
]

# How far a match's length is measured (tokens), whatever ``n``: the proposal comes from the
# longest match up to ``n``, and its length, read up to this, tells ``goodput`` how likely
# the proposal is to be accepted (a copy under way, or a chance match).
MATCH_REACH = 8
_EMPTY = -1  # a slot no token has been written to
_BEFORE = -2  # the "token" before position 0 (never equal to a slot)


@struct.dataclass
class TokenCache:
    """Token ids per slot and committed entries per row (the :class:`Cache` protocol).

    Attributes:
      tokens: ``[B, S]`` int32; slot ``i`` of a row holds the token at position ``i``.
      length: ``[B]`` int32 committed slots.
    """

    tokens: jax.Array
    length: jax.Array

    if TYPE_CHECKING:  # struct.dataclass adds it at run time, out of mypy's sight

        def replace(self, **updates: Any) -> TokenCache: ...

    @classmethod
    def create(cls, batch_size: int, max_length: int) -> TokenCache:
        """An empty cache: ``B = batch_size`` rows of ``S = max_length`` slots, lengths 0."""
        tokens = jnp.full((batch_size, max_length), _EMPTY, jnp.int32)
        return cls(tokens=tokens, length=jnp.zeros((batch_size,), jnp.int32))

    @property
    def batch_size(self) -> int:
        return self.tokens.shape[0]

    def _per_row(self, x: ArrayLike) -> jax.Array:
        return jnp.broadcast_to(jnp.asarray(x, jnp.int32), (self.batch_size,))

    def commit(self, num_tokens: ArrayLike) -> TokenCache:
        return self.replace(length=self.length + self._per_row(num_tokens))

    def rollback(self, length: ArrayLike) -> TokenCache:
        return self.replace(length=self._per_row(length))

    def select(self, offsets: ArrayLike, count: ArrayLike) -> TokenCache:
        offsets, count = jnp.asarray(offsets, jnp.int32), self._per_row(count)
        s = self.tokens.shape[1]
        i = jnp.arange(offsets.shape[1], dtype=jnp.int32)
        src = jnp.clip(self.length[:, None] + offsets, 0, s - 1)
        dst = jnp.where(i < count[:, None], self.length[:, None] + i, s)  # S: dropped
        rows = jnp.arange(self.batch_size)[:, None]
        moved = self.tokens.at[rows, dst].set(self.tokens[rows, src], mode="drop")
        return TokenCache(tokens=moved, length=self.length + count)

    def repeat(self, times: int) -> TokenCache:
        return jax.tree.map(lambda x: jnp.repeat(x, times, axis=0), self)

    def take_rows(self, rows: ArrayLike) -> TokenCache:
        rows = jnp.asarray(rows, jnp.int32)
        return jax.tree.map(lambda x: x[rows], self)

    def pin(self, pin_rows) -> TokenCache:
        """Every field through ``pin_rows`` (split over the batch axis on a mesh: the
        decoder's constraint for per-row state)."""
        return jax.tree.map(pin_rows, self)

    def put_rows(self, rows: TokenCache, at: ArrayLike) -> TokenCache:
        """Row ``i`` of ``rows`` replaces row ``at[i]`` (``[B']`` int32)."""
        return cache_lib.put_rows(self, rows, at)

    def copy_segments(self, src: ArrayLike, start: ArrayLike, width: int) -> TokenCache:
        src, start = jnp.asarray(src, jnp.int32), self._per_row(start)
        take = jax.vmap(lambda row, s: lax.dynamic_slice_in_dim(row, s, width))
        put = jax.vmap(lambda row, seg, s: lax.dynamic_update_slice_in_dim(row, seg, s, 0))
        return self.replace(tokens=put(self.tokens, take(self.tokens, start)[src], start))


@dataclasses.dataclass(frozen=True)
class NgramConfig:
    """The fields the decoder reads (:class:`~jaxcert.decoding.protocols.ModelConfigLike`).

    Attributes:
      vocab_size: the target's vocabulary size ``V``.
      max_position_embeddings: no limit of its own (the target's applies).
    """

    vocab_size: int
    max_position_embeddings: int = 2**31 - 1


def _lookup(history: jax.Array, end: jax.Array, n: int, min_n: int) -> jax.Array:
    """The proposal after position ``end`` of one row and its match length: ``[S]`` tokens,
    ``[]`` int -> ``[2]`` int32.

    The match of length ``k`` ending at slot ``e < end`` means ``history[e - j] ==
    history[end - j]`` for ``j < k``; the longest (capped at ``n``), then the latest, wins,
    and the proposal is ``history[e + 1]``. Its length is then read up to ``max(n,
    MATCH_REACH)`` tokens. ``(-1, 0)`` when no match reaches ``min_n``.
    """
    s = history.shape[0]
    slots = jnp.arange(s, dtype=jnp.int32)

    def at(i):  # history at positions i, _BEFORE before position 0
        return jnp.where(i >= 0, history[jnp.clip(i, 0, s - 1)], _BEFORE)

    run = jnp.ones((s,), bool)
    length = jnp.zeros((s,), jnp.int32)
    for j in range(max(n, MATCH_REACH)):  # static: both are small
        run = run & (at(slots - j) == at(end - j)) & (end - j >= 0)
        length = length + run.astype(jnp.int32)
    capped = jnp.minimum(length, n)
    ok = (slots < end) & (capped >= min_n)
    score = jnp.where(ok, capped * s + slots, -1)
    best = jnp.argmax(score)
    found = score[best] >= 0
    proposal = jnp.where(found, history[jnp.minimum(best + 1, s - 1)], -1)
    return jnp.stack([proposal, jnp.where(found, length[best], 0)])


class NgramDrafter(nnx.Module):
    """Prompt lookup as a drafter: proposes the continuation of the latest longest match.

    Use it as the ``drafter`` of :func:`jaxcert.decoding.speculative_decode`; built without
    a vocabulary size, it takes the target's there (:meth:`for_vocabulary`).

    Args:
      n: the longest suffix matched (tokens), ``>= 1`` (``ngram:N`` on the command line).
      min_n: the shortest match that counts, ``1 <= min_n <= n``.
      vocab_size: the target's vocabulary size ``V`` (``None``: set by the decoder).

    Raises:
      ValueError: ``n`` or ``min_n`` out of range.
    """

    proposes_tokens = True  # a one-hot q: the decoder's statistics treat it as such

    def __init__(self, n: int = 3, *, min_n: int = 1, vocab_size: int | None = None):
        check_int("n", n)
        check_int("min_n", min_n)
        if min_n > n:
            raise ValueError(f"min_n must be at most n={n}, got {min_n}")
        self.n, self.min_n = int(n), int(min_n)
        self.config = None if vocab_size is None else NgramConfig(int(vocab_size))

    @property
    def spec(self) -> str:
        """The command-line spelling, ``ngram:N`` (``ngram:N:MIN`` with ``min_n > 1``)."""
        return f"ngram:{self.n}" + (f":{self.min_n}" if self.min_n > 1 else "")

    def for_vocabulary(self, vocab_size: int) -> NgramDrafter:
        """This drafter for a target of ``vocab_size`` tokens."""
        return NgramDrafter(self.n, min_n=self.min_n, vocab_size=vocab_size)

    def init_cache(self, batch_size: int, max_length: int) -> TokenCache:
        return TokenCache.create(batch_size, max_length)

    def features(
        self, tokens: jax.Array, cache: TokenCache, **kwargs
    ) -> tuple[jax.Array, TokenCache]:
        """Writes ``[B, T]`` tokens at the next slots (a chain: the decoder's drafter calls
        are) and returns each position's proposal and its match length in tokens, ``[B, T,
        2]`` int32 (``(-1, 0)``: none)."""
        if kwargs.get("attention_mask") is not None:
            raise ValueError("NgramDrafter reads chains only (no attention_mask)")
        b, t = tokens.shape
        rows = jnp.arange(b)[:, None]
        slots = cache.length[:, None] + jnp.arange(t, dtype=jnp.int32)
        history = cache.tokens.at[rows, slots].set(tokens.astype(jnp.int32), mode="drop")
        look = jax.vmap(jax.vmap(_lookup, (None, 0, None, None)), (0, 0, None, None))
        return look(history, slots, self.n, self.min_n), cache.replace(tokens=history)

    def project(self, hidden: jax.Array) -> jax.Array:
        """``[..., 2]`` proposals and match lengths -> ``[..., V]`` float32 one-hot logits:
        the match length at the proposal, ``-inf`` elsewhere; all ``-inf`` for ``-1``
        (``softmax`` is one-hot whatever the finite value; :func:`match_length` reads it
        back).

        Raises:
          ValueError: the drafter has no vocabulary size yet.
        """
        if self.config is None:
            raise ValueError("NgramDrafter has no vocabulary size: use for_vocabulary(V)")
        ids = jnp.arange(self.config.vocab_size, dtype=jnp.int32)
        hidden = hidden.astype(jnp.int32)
        length = hidden[..., 1:].astype(jnp.float32)
        return jnp.where(ids == hidden[..., :1], length, -jnp.inf).astype(jnp.float32)

    def __call__(
        self, tokens: jax.Array, cache: TokenCache, **kwargs
    ) -> tuple[jax.Array, TokenCache]:
        hidden, cache = self.features(tokens, cache, **kwargs)
        return self.project(hidden), cache

    def propose(self, tokens: jax.Array, length: jax.Array) -> jax.Array:
        """The proposal for the token after each row's text, read from the text alone:
        ``[B, S]`` int tokens and ``[B]`` lengths ``n`` -> ``[B, 2]`` int32 (proposal, match
        length; ``(-1, 0)``: none), what :meth:`features` returns at position ``n - 1``
        once the drafter has read ``tokens[:n]``. It costs a few integer comparisons per
        slot, so ``goodput`` reads it before every round (``docs/goodput.md``, "Prompt
        lookup: looking before drafting")."""
        look = jax.vmap(_lookup, (0, 0, None, None))
        end = jnp.asarray(length, jnp.int32) - 1
        return look(tokens.astype(jnp.int32), end, self.n, self.min_n)

    def catch_up(self, cache: TokenCache, tokens: jax.Array, length: jax.Array) -> TokenCache:
        """The cache after reading ``tokens[:length]`` (``[B, S]``, ``[B]``) whatever it had
        read: its history is the text, so a drafter that skipped rounds catches up without
        a pass. The cache's ``B * M`` rows (tree branches) each get their row's text."""
        m = cache.batch_size // tokens.shape[0]
        s = cache.tokens.shape[1]
        text = jnp.repeat(tokens.astype(jnp.int32), m, axis=0)[:, :s]
        text = jnp.pad(text, ((0, 0), (0, s - text.shape[1])), constant_values=_EMPTY)
        return TokenCache(tokens=text, length=jnp.repeat(jnp.asarray(length, jnp.int32), m))


def match_length(q_logits: jax.Array) -> jax.Array:
    """The match length a proposing drafter's logits carry: ``[..., V]`` -> ``[...]`` int32,
    the finite logit of a one-hot ``q`` (:meth:`NgramDrafter.project`), 0 where nothing is
    proposed (every logit ``-inf``)."""
    top = jnp.max(q_logits, axis=-1)
    return jnp.where(jnp.isfinite(top), jnp.round(top), 0.0).astype(jnp.int32)


def parse_ngram(spec: str) -> NgramDrafter | None:
    """``ngram:N`` or ``ngram:N:MIN`` -> an :class:`NgramDrafter`; ``None`` for any other
    drafter spelling (a model name or path).

    Raises:
      ValueError: an ``ngram`` spelling with missing or invalid numbers.
    """
    text = spec.strip().lower()
    if text != "ngram" and not text.startswith("ngram:"):
        return None
    parts = text.split(":")[1:]
    try:
        numbers = [int(x) for x in parts]
        if not numbers or len(numbers) > 2:
            raise ValueError("expected ngram:N or ngram:N:MIN")
        return NgramDrafter(numbers[0], min_n=numbers[1] if len(numbers) == 2 else 1)
    except ValueError as err:
        raise ValueError(f"drafter {spec!r}: {err} (N, MIN: integers, 1 <= MIN <= N)") from None


def lookup_reference(sequence: list[int], n: int, min_n: int = 1) -> int:
    """The proposal after the last token of ``sequence``, in plain Python (tests' reference).

    Returns the token after the latest earlier occurrence of the longest suffix of length
    ``min_n..n`` (excluding the suffix itself), or ``-1``.
    """
    return match_reference(sequence, n, min_n)[0]


def match_reference(sequence: list[int], n: int, min_n: int = 1) -> tuple[int, int]:
    """:func:`lookup_reference` and the match's length in tokens, read up to ``max(n,
    MATCH_REACH)``: ``(-1, 0)`` for none."""
    end = len(sequence) - 1
    for k in range(min(n, len(sequence)), min_n - 1, -1):
        suffix = sequence[end - k + 1 :]
        for e in range(end - 1, k - 2, -1):
            if sequence[e - k + 1 : e + 1] == suffix:
                length = k
                while (
                    length < max(n, MATCH_REACH)
                    and e - length >= 0
                    and sequence[e - length] == sequence[end - length]
                ):
                    length += 1
                return sequence[e + 1], length
    return -1, 0
