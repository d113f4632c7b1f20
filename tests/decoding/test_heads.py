"""Draft heads that read the target's states (`FeatureDrafter`): exactness and the context.

`ContextHead` is the smallest such head: ``hidden = tanh(A[x_t] + context_t)``, no attention,
and a cache that holds nothing but lengths. Its distribution depends on the context alone
(besides the token), so the statistics pin down which target states the decoder handed it:
the root's KL must equal an offline recomputation from a teacher-forced target pass.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx, struct

from jaxcert import decoding
from jaxcert.decoding.protocols import FeatureDrafter, context_before, reads_target
from jaxcert.models import EagleHead
from jaxcert.models.cache import put_rows
from tests.helpers.tiny_decoding import CONFIG, MAX_NEW, PROMPTS, random_model

V, E = CONFIG.vocab_size, CONFIG.hidden_size


@struct.dataclass
class LengthCache:
    """A cache with nothing in it but the committed length per row."""

    length: jax.Array

    def commit(self, num_tokens):
        return LengthCache(self.length + jnp.asarray(num_tokens, jnp.int32))

    def rollback(self, length):
        return LengthCache(jnp.broadcast_to(jnp.asarray(length, jnp.int32), self.length.shape))

    def select(self, offsets, count):
        return LengthCache(self.length + count)

    def repeat(self, times):
        return LengthCache(jnp.repeat(self.length, times))

    def take_rows(self, rows):
        return LengthCache(self.length[rows])

    def put_rows(self, rows, at):
        return put_rows(self, rows, at)

    def copy_segments(self, src, start, width):
        return self


@dataclasses.dataclass(frozen=True)
class Config:
    vocab_size: int = V
    max_position_embeddings: int = CONFIG.max_position_embeddings


class ContextHead(nnx.Module):
    def __init__(self, taps: tuple[int, ...], seed: int = 0):
        k = jax.random.split(jax.random.key(seed), 3)
        width = len(taps) * E if taps else E
        self.taps = taps
        self.a = nnx.Param(jax.random.normal(k[0], (V, E)))
        self.w_fuse = nnx.Param(jax.random.normal(k[1], (width, E)) * width**-0.5 * 2)
        self.w_out = nnx.Param(jax.random.normal(k[2], (E, V)) * 2)
        self.config = Config()

    def init_cache(self, batch_size, max_length):
        return LengthCache(jnp.zeros((batch_size,), jnp.int32))

    def fuse(self, target_states):
        return target_states @ self.w_fuse[...]

    def features(self, tokens, cache, *, context, positions=None, attention_mask=None):
        return jnp.tanh(self.a[...][tokens] + context), cache

    def project(self, hidden):
        return (hidden @ self.w_out[...]).astype(jnp.float32)

    def __call__(self, tokens, cache, *, context, **kwargs):
        hidden, cache = self.features(tokens, cache, context=context)
        return self.project(hidden), cache


@pytest.fixture(scope="module")
def target():
    return random_model(CONFIG, seed=5)


def _config(verify, **kw):
    return decoding.DecodeConfig(
        verification=decoding.parse_verify(verify), max_new_tokens=MAX_NEW, max_draft=5, **kw
    )


@pytest.fixture(scope="module")
def want(target):
    return decoding.target_decode(target, PROMPTS, max_new_tokens=MAX_NEW).tokens


def test_context_head_is_a_feature_drafter():
    head = ContextHead(taps=(0,))
    assert isinstance(head, FeatureDrafter) and reads_target(head)
    assert not reads_target(random_model(CONFIG, seed=1))


def test_a_head_rereads_with_the_narrowest_width_that_holds_its_tokens():
    """A head's re-read pass has a width per level bucket up to the widest; a chain's
    language-model drafter keeps its three (one token, the usual two, the widest)."""
    head = decoding.DecodeConfig(max_draft=40, max_skip=8, head_taps=(2, 14, 25))
    assert head.reread_widths() == (1, 2, 4, 8, 16, 24, 40, 41, 49)
    assert dataclasses.replace(head, max_skip=None).reread_widths() == (1, 2, 4, 8, 16, 24, 40, 41)
    assert decoding.DecodeConfig(max_draft=4, head_taps=()).reread_widths() == (1, 2, 4, 5)
    lm = decoding.DecodeConfig(max_draft=40, max_skip=8)
    assert lm.reread_widths() == (1, 2, 10)
    tree = decoding.DecodeConfig(verification="tree:2x3+greedy")
    assert tree.reread_widths() == (1, 4)


_SLOW = pytest.mark.slow  # the same program as a default case, another shape or head


@pytest.mark.parametrize(
    "verify, taps, policy",
    [
        ("dyntree:3x3x6", (0, 1), "constant:4"),
        *(("greedy", (0, 1), p) for p in ("constant:4", "heuristic", "confidence:0.5")),
        *(("greedy", (0, 1), p) for p in ("svip:0.3", "cert")),
        pytest.param("greedy", (), "constant:4", marks=_SLOW),
        pytest.param("tree:2x3", (), "svip:0.3", marks=_SLOW),
        pytest.param("tree:2x3", (0, 1), "constant:4", marks=_SLOW),
        pytest.param("dyntree:3x3x6", (), "cert", marks=_SLOW),
    ],
    ids=lambda x: (
        (("taps" + "-".join(map(str, x))) if x else "final-hidden") if isinstance(x, tuple) else x
    ),
)
def test_speculative_greedy_with_a_head_equals_target_only(target, want, verify, taps, policy):
    """Every policy (one compiled program: policies are traced parameters) and every shape."""
    out = decoding.speculative_decode(
        target, ContextHead(taps), PROMPTS, config=_config(verify),
        policy=decoding.parse_policy(policy),
    )  # fmt: skip
    for got, w in zip(out.tokens, want, strict=True):
        np.testing.assert_array_equal(got, w)


@pytest.mark.parametrize(
    "verify, kw",
    [
        ("greedy", dict()),
        *(
            (v, dict(taps=(0, 1), draft_vocab=range(0, V, 2), num_layers=2))
            for v in ("greedy", "tree:2x3", "dyntree:3x3x6")
        ),
        pytest.param("tree:2x3", dict(), marks=_SLOW),
        pytest.param("dyntree:3x3x6", dict(), marks=_SLOW),
    ],  # fmt: skip
    ids=lambda x: ("eagle1" if not x else "eagle3-2layers-halfvocab") if isinstance(x, dict) else x,
)
def test_speculative_greedy_with_an_eagle_head_equals_target_only(target, want, verify, kw):
    head = EagleHead.from_target(target, rngs=nnx.Rngs(1), **kw)
    out = decoding.speculative_decode(
        target, head, PROMPTS, config=_config(verify), policy=decoding.Constant(k=4)
    )
    for got, w in zip(out.tokens, want, strict=True):
        np.testing.assert_array_equal(got, w)
    ns = out.stats.nodes
    assert np.all(np.isfinite(ns.kl[ns.valid])) and np.all(np.isfinite(ns.cert[ns.valid]))


def _teacher_forced(target, seq, taps):
    """Target logits ``[T, V]`` and the head's input states ``[T, C]`` over one sequence."""
    tokens = jnp.asarray(seq, jnp.int32)[None]
    hidden, _, tapped = target.tapped_features(tokens, target.init_cache(1, len(seq)), taps)
    states = tapped if taps else hidden
    return np.asarray(target.project(hidden)[0], np.float64), states[0]


def _target_logits(target, seq, width=64):
    """Target logits ``[len(seq), V]`` (padded to one width: one compiled program)."""
    tokens = jnp.zeros((1, width), jnp.int32).at[0, : len(seq)].set(jnp.asarray(seq))
    return np.asarray(_jit_logits(target, tokens)[0, : len(seq)], np.float64)


@nnx.jit
def _jit_logits(target, tokens):
    return target(tokens, target.init_cache(1, tokens.shape[1]))[0]


def _kl(p_logits, q_logits):
    lp = p_logits - np.logaddexp.reduce(p_logits)
    lq = q_logits - np.logaddexp.reduce(q_logits)
    return float(np.sum(np.exp(lp) * (lp - lq)))


# goodput with costs that make it skip the drafter (plain target steps), then draft: the
# head catches up in one wide re-read, each skipped token with the state the target handed
# over in its step.
_SKIPPING = (
    decoding.Goodput(beta=0.01, patience=0),  # measures again after every skip
    decoding.PassCosts(rows=3, target_s={1: 1.0, 2: 1.2, 8: 2.0}, drafter_s=0.5),
)


@pytest.mark.parametrize(
    "taps, skipping",
    [pytest.param((), False, marks=_SLOW), ((1,), False), ((1,), True)],
    ids=["final-hidden", "tap1", "tap1-after-skipped-rounds"],
)
def test_the_head_reads_the_targets_states_before_each_token(target, want, taps, skipping):
    """Round r's first drafted position is ``n - 1 -> n`` (``n`` tokens so far): the head
    read ``x_{n-1}`` with the target's states at ``n - 2``; its second read the first draft
    with its own hidden output at the root. The recorded KLs (``KL(p || q)``) equal the
    offline ones."""
    head = ContextHead(taps, seed=3)
    policy, costs = _SKIPPING if skipping else (decoding.Constant(k=3), None)
    config = _config("greedy", max_skip=2 if skipping else None)
    out = decoding.speculative_decode(
        target, head, PROMPTS, config=config, policy=policy, costs=costs
    )
    for got, w in zip(out.tokens, want, strict=True):
        np.testing.assert_array_equal(got, w)
    if skipping:  # rounds without the drafter, and drafting rounds after them
        drafted = out.stats.drafted[out.stats.active]
        assert np.any(drafted == 0) and np.any(drafted > 0)
    s = out.stats
    a, w_fuse, w_out = (np.asarray(x[...], np.float64) for x in (head.a, head.w_fuse, head.w_out))
    checked = after_skip = 0
    for b, prompt in enumerate(PROMPTS):
        seq = list(prompt) + list(out.tokens[b])
        p_logits, states = _teacher_forced(target, seq, taps)
        states = np.asarray(states, np.float64)
        n = len(prompt)
        for r in range(s.active.shape[0]):
            if not s.active[r, b]:
                continue
            if not s.nodes.valid[r, b, 0]:  # nothing drafted (a plain target step)
                n += int(s.emitted[r, b])
                continue
            after_skip += bool(r > 0 and s.drafted[r - 1, b] == 0)
            h_root = np.tanh(a[seq[n - 1]] + states[n - 2] @ w_fuse)
            np.testing.assert_allclose(
                s.nodes.kl[r, b, 0], _kl(p_logits[n - 1], h_root @ w_out), rtol=1e-4, atol=1e-4
            )
            if s.nodes.valid[r, b, 1]:  # the second draft read the first with h_root
                d1 = int(np.argmax(h_root @ w_out))
                p_d1 = _target_logits(target, seq[:n] + [d1])[n]
                h_1 = np.tanh(a[d1] + h_root)
                np.testing.assert_allclose(
                    s.nodes.kl[r, b, 1], _kl(p_d1, h_1 @ w_out), rtol=1e-4, atol=1e-4
                )
                checked += 1
            n += int(s.emitted[r, b])
    assert after_skip > 0 if skipping else checked > 0


def test_a_head_fusing_a_block_the_target_lacks_is_named(target):
    with pytest.raises(ValueError, match=r"fuses target blocks \(0, 7\), but the target has 2"):
        decoding.speculative_decode(
            target, ContextHead((0, 7)), PROMPTS, config=_config("greedy"),
            policy=decoding.Constant(k=2),
        )  # fmt: skip


def test_an_eagle_heads_drafts_after_skipped_steps_equal_teacher_forcing(target, want):
    """``goodput``'s plain steps run in the target-only program, which records the target's
    tapped states for the head: when it drafts again, the head re-reads every skipped token
    with the state before it, so its cache (attention over all earlier tokens) is the
    teacher-forced one. Every root draft's recorded ``KL(p || q)`` equals the KL of a head
    run teacher-forced over the final text."""
    taps = (0, 1)
    head = EagleHead.from_target(target, rngs=nnx.Rngs(4), taps=taps)
    policy, costs = _SKIPPING
    out = decoding.speculative_decode(
        target, head, PROMPTS, config=_config("greedy", max_skip=2), policy=policy, costs=costs
    )
    for got, w in zip(out.tokens, want, strict=True):
        np.testing.assert_array_equal(got, w)
    s = out.stats
    after_skip = 0
    for b, prompt in enumerate(PROMPTS):
        seq = list(prompt) + list(out.tokens[b])
        p_logits, states = _teacher_forced(target, seq, taps)
        tokens = jnp.asarray(seq, jnp.int32)[None]
        hidden, _ = head.features(
            tokens, head.init_cache(1, len(seq)), context=context_before(head, states[None])
        )
        q_logits = np.asarray(head.project(hidden)[0], np.float64)
        n = len(prompt)
        for r in range(s.active.shape[0]):
            if not s.active[r, b]:
                continue
            if s.nodes.valid[r, b, 0]:
                after_skip += bool(r > 0 and s.drafted[r - 1, b] == 0)
                np.testing.assert_allclose(
                    s.nodes.kl[r, b, 0], _kl(p_logits[n - 1], q_logits[n - 1]), rtol=1e-4,
                    atol=1e-4,
                )  # fmt: skip
            n += int(s.emitted[r, b])
    assert after_skip > 0
