"""The jitted decoders: prefill, the speculative round loop and the target-only loop.

A round: the drafter re-reads the new tokens and drafts a chain or tree under the policy
(:mod:`~jaxcert.decoding.draft`); the target scores the root and every drafted node in ONE
forward pass (tree attention mask, positions ``length + depth``); the rule (or rejection
sampling) accepts a root path; the target cache keeps that path (``commit`` for chains,
``select`` for trees) and the target's own token is appended. Each call of :func:`run_rounds`
runs up to ``rounds_per_call`` rounds in a ``lax.while_loop`` on device; the host sees only
finished calls (for the progress bar).

The verification pass has a static width, but the drafted depth varies: the pass is a
``lax.switch`` over a few widths ("buckets", each compiled once), taking the smallest that
holds every row's drafted nodes, so a 3-token draft is not scored at ``K_max + 1`` positions;
width 0 (no row drafted anything) is a plain target step. With ``DecodeConfig.max_skip > 0``
a round may also skip the drafter altogether (``goodput``'s choice): the target steps alone
and the drafter catches up in its next, wider re-read. The loop stops before such a round and
the host runs the steps in the target-only program (:func:`hands_off`,
:func:`run_target_steps`), which for a draft head also records the target's states it will
read.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

from jaxcert.decoding import node_stats as stats_lib
from jaxcert.decoding import policies as policies_lib
from jaxcert.decoding import tree as tree_lib
from jaxcert.decoding.config import DecodeConfig, Sizes
from jaxcert.decoding.draft import draft
from jaxcert.decoding.drafters.base import Drafter, read_chunks
from jaxcert.decoding.state import DecodeState, RoundStats, Settings
from jaxcert.decoding.verify import in_accepted_set, sample_tree, sampling_log_probs
from jaxcert.models.eagle import target_features
from jaxcert.models.sharding import constrain
from jaxcert.models.transformer import decode_step
from jaxcert.models.transformer import forward as _forward

__all__ = [
    "prefill",
    "run_rounds",
    "hands_off",
    "skip_next",
    "prefill_target",
    "run_target_steps",
]


def prefill_chunk(width: int) -> int:
    """The static chunk a prefill reads the prompts in: 64 tokens, or the whole width when
    it is not a multiple of 64 (a prompt width the caller chose)."""
    return PREFILL_CHUNK if width % PREFILL_CHUNK == 0 else width


PREFILL_CHUNK = 64


def _read_prompt(graphdef, params, prompt, lengths, slots, taps=None):
    """The target's cache after reading the ``[B, T]`` prompt in chunks of
    :func:`prefill_chunk` tokens, only as many as the longest prompt needs (so a wide
    prompt room costs no more than the prompts themselves), nothing committed past
    ``lengths - 1``; with ``taps`` also the ``[B, T, Z]`` states a draft head reads."""
    model = nnx.merge(graphdef, params)
    b, w = prompt.shape
    chunk = prefill_chunk(w)
    cache = model.init_cache(b, slots)
    if taps is None:
        read = lambda window, _, cache: model.features(window, cache)[1]  # noqa: E731
        return read_chunks(prompt, lengths, chunk, read, cache).rollback(lengths - 1), None
    # The states' width and dtype, traced without running (one copy of the pass: the loop's).
    first = jax.eval_shape(lambda: target_features(model, prompt[:, :chunk], cache, taps)[2])
    states = jnp.zeros((b, w, first.shape[-1]), first.dtype)
    count = -(-jnp.max(lengths) // chunk)

    def body(carry):
        i, cache, states = carry
        window = lax.dynamic_slice_in_dim(prompt, i * chunk, chunk, axis=1)
        _, cache, got = target_features(model, window, cache, taps)
        states = lax.dynamic_update_slice_in_dim(states, got, i * chunk, axis=1)
        return i + 1, cache.commit(chunk), states

    init = (jnp.asarray(0, jnp.int32), cache, states)
    _, cache, states = lax.while_loop(lambda c: c[0] < count, body, init)
    return cache.rollback(lengths - 1), states


def _target_pass(graphdef, params, tokens, cache, taps, **kwargs):
    """The target's ``[B, T, V]`` logits and cache, and for a drafter that reads its states
    (``taps`` not ``None``) those states, ``[B, T, Z]`` (the final-norm hidden states for
    ``()``)."""
    if taps is None:
        logits, cache = _forward(graphdef, params, tokens, cache, **kwargs)
        return logits, cache, None
    model = nnx.merge(graphdef, params)
    hidden, cache, states = target_features(model, tokens, cache, taps, **kwargs)
    return model.project(hidden), cache, states


_PER_ROW = ("tokens", "length", "prompt_length", "done", "drafter_start", "drafter_context")


def _pin(state: DecodeState, layout) -> DecodeState:
    """Keeps the per-row fields of ``state`` split over the batch axis on a mesh (``layout``
    of the target; ``None``: one device, nothing to do).

    The compiled round loop takes the prefill's output shardings as its input shardings;
    without a constraint XLA may choose other shardings for the loop's outputs (it did for a
    draft head's state and for the n-gram drafter's token cache), and the next call would
    refuse them. A drafter cache with a ``pin`` method (``TokenCache``) is pinned too.
    """
    if layout is None:
        return state

    def pin(x):
        return constrain(layout, x, ("batch",) + (None,) * (x.ndim - 1))

    fields = {
        name: pin(getattr(state, name)) for name in _PER_ROW if getattr(state, name) is not None
    }
    policy = None if state.policy is None else jax.tree.map(pin, state.policy)
    cache = state.drafter_cache
    if cache is not None and hasattr(cache, "pin"):  # a cache without a layout of its own
        fields["drafter_cache"] = cache.pin(pin)
    return state.replace(rounds=pin(state.rounds), policy=policy, **fields)


def _layout(graphdef, params):
    """The target's mesh layout (``None`` on one device or for a model without one)."""
    return getattr(nnx.merge(graphdef, params), "layout", None)


def _initial_state(
    prompt, lengths, key, settings, sizes, target_cache, drafter, policy, drafter_start=None
):
    """The :class:`DecodeState` after prefill (the target's cache holds all but the last
    token); ``drafter`` is ``(cache, context)`` or ``None``."""
    b, t = prompt.shape
    tokens = jnp.full((b, sizes.sequence), DecodeState.PAD, jnp.int32).at[:, :t].set(prompt)
    d_cache, d_context = (None, None) if drafter is None else drafter
    return DecodeState(
        tokens=tokens,
        length=lengths,
        prompt_length=lengths,
        done=jnp.zeros((b,), bool),
        drafter_start=lengths - 2 if drafter_start is None else drafter_start,
        target_cache=target_cache,
        drafter_cache=d_cache,
        drafter_context=d_context,
        policy=policy,
        key=key,
        rounds=jnp.zeros((b,), jnp.int32),
        settings=settings,
    )


@functools.partial(jax.jit, static_argnames=("t_graphdef", "drafter", "config", "sizes"))
def prefill(
    t_params: nnx.State,
    d_params: nnx.State,
    prompt: jax.Array,
    lengths: jax.Array,
    policy: policies_lib.PolicyParams,
    key: jax.Array,
    settings: Settings,
    *,
    t_graphdef: nnx.GraphDef,
    drafter: Drafter,
    config: DecodeConfig,
    sizes: Sizes,
) -> DecodeState:
    """Reads the prompts into both caches, in chunks of :func:`prefill_chunk` tokens.

    Args:
      t_params, d_params: target and drafter parameters (``nnx.split``).
      prompt: ``[B, T]`` int32 right-padded prompts; ``lengths`` ``[B]`` their lengths (>= 2).
      policy: :class:`~jaxcert.decoding.policies.PolicyParams`.
      key: PRNG key.
      settings: the traced :class:`~jaxcert.decoding.state.Settings` (budget, end tokens,
        temperature, top-p); ``config``'s own values of these are not read.
      t_graphdef: the target's graph definition; drafter: the
        :class:`~jaxcert.decoding.drafters.base.Drafter` (both static).
      config: :class:`~jaxcert.decoding.config.DecodeConfig` (its shapes and rule); sizes:
        :class:`~jaxcert.decoding.config.Sizes`.

    Returns:
      The initial :class:`DecodeState`.
    """
    t_cache, states = _read_prompt(
        t_graphdef, t_params, prompt, lengths, sizes.target, drafter.taps
    )
    d_cache, context, start = drafter.prefill(
        d_params, prompt, lengths, states, slots=sizes.drafter,
        chunk=prefill_chunk(prompt.shape[1]), copies=config.branching, width=config.reread,
    )  # fmt: skip
    policy_state = policies_lib.init_policy_state(policy, prompt.shape[0])
    state = _initial_state(
        prompt, lengths, key, settings, sizes, t_cache, (d_cache, context), policy_state, start
    )
    return _pin(state, _layout(t_graphdef, t_params))


def _children(sub: dict, positions: int, m: int):
    """``[B, T, M]`` children of each position by rank and ``[B, T]`` their ``q_index``."""
    b, n = sub["parent"].shape
    rows = jnp.arange(b)[:, None]
    at = jnp.where(sub["valid"], sub["parent"] + 1, positions)  # invalid nodes are dropped
    nodes = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), (b, n))
    children = jnp.full((b, positions, m), -1, jnp.int32)
    children = children.at[rows, at, sub["rank"]].set(nodes, mode="drop")
    expanded = jnp.zeros((b, positions), jnp.int32).at[rows, at].set(sub["q_index"], mode="drop")
    return children, expanded


def _verify(nb, operands, *, t_graphdef, config, taps):
    """Target pass over the root and the first ``nb`` nodes, acceptance and node statistics."""
    t_params, cache, tree, tokens, length, key, settings = operands
    v = config.verification
    b, big_n = tree.tokens.shape
    rows = jnp.arange(b)
    fields = ("tokens", "parent", "depth", "rank", "valid", "q_index")
    sub = {name: getattr(tree, name)[:, :nb] for name in fields}
    root = tokens[rows, length - 1]
    toks = jnp.concatenate([root[:, None], sub["tokens"]], axis=1)  # [B, T]
    positions = (length - 1)[:, None] + jnp.concatenate(
        [jnp.zeros((b, 1), jnp.int32), sub["depth"]], axis=1
    )
    shape = config.tree
    if isinstance(shape, tree_lib.DynamicTree):
        mask = tree_lib.ancestor_mask(sub["parent"], config.depth)
    else:
        st = tree_lib.static_structure(config.branching, config.depth)
        mask = jnp.broadcast_to(jnp.asarray(st.mask[: nb + 1, : nb + 1]), (b, nb + 1, nb + 1))
    fwd_mask = None if isinstance(shape, tree_lib.Chain) or nb == 0 else mask
    logits, cache, states = _target_pass(
        t_graphdef, t_params, toks, cache, taps, positions=positions, attention_mask=fwd_mask,
    )  # fmt: skip
    if nb == 0:  # nothing drafted in any row: a plain target step
        passes = on_path = jnp.zeros((b, 0), bool)
        last = jnp.zeros((b,), jnp.int32)
        if v.sampling:
            lp = sampling_log_probs(logits[:, 0], settings.temperature, settings.top_p)
            token = jax.random.categorical(key, lp, axis=-1).astype(jnp.int32)
        else:
            token = jnp.argmax(logits[:, 0], axis=-1).astype(jnp.int32)
    elif v.sampling:
        children, expanded = _children(sub, nb + 1, config.branching)
        passes, last, token = sample_tree(
            key,
            logits,
            sub["tokens"],
            children,
            expanded,
            tree.q_logits,
            max_depth=config.depth,
            temperature=settings.temperature,
            top_p=settings.top_p,
        )
        on_path = jnp.take_along_axis(mask, last[:, None, None], axis=1)[:, 0, 1:]
    else:
        if isinstance(shape, tree_lib.Chain):
            p_parent = logits[:, :nb]
        else:
            p_parent = jnp.take_along_axis(logits, (sub["parent"] + 1)[..., None], axis=1)
        passes = in_accepted_set(p_parent, sub["tokens"], v.rule) & sub["valid"]
        on_path, last, _ = tree_lib.accept_longest_path(passes, sub["depth"], mask)
        token = jnp.argmax(logits[rows, last], axis=-1).astype(jnp.int32)
    accepted = jnp.sum(on_path, axis=-1, dtype=jnp.int32)
    if nb == 0:
        offsets = jnp.zeros((b, config.depth + 1), jnp.int32)
    else:
        offsets = tree_lib.path_offsets(on_path, sub["depth"], config.depth)
    # A drafter that reads the target's states re-reads the accepted path and the target's
    # token with those at the root and the path's nodes (the positions before them).
    path_states = None if states is None else jnp.take_along_axis(states, offsets[..., None], 1)
    path_tokens = jnp.take_along_axis(toks, offsets[:, 1:], axis=1)
    new = jnp.concatenate([path_tokens, jnp.zeros((b, 1), jnp.int32)], axis=1)
    new = new.at[rows, accepted].set(token)
    if nb == 0:  # nothing drafted: no node statistics
        return cache, accepted, new, offsets, path_states, stats_lib.no_nodes((b, big_n))
    ns = stats_lib.node_stats(
        logits,
        tree.q_logits,
        tokens_valid=sub["valid"],
        parent=sub["parent"],
        depth=sub["depth"],
        rank=sub["rank"],
        q_index=sub["q_index"],
        passes=passes,
        on_path=on_path,
        rule=v.rule,
        max_children=config.branching,
        certify=config.collect_stats,
        one_hot=config.proposes_tokens,
    )
    return cache, accepted, new, offsets, path_states, stats_lib.pad_nodes(ns, big_n)


def hands_off(config: DecodeConfig) -> bool:
    """Whether ``goodput``'s plain target steps run in the target-only program
    (:func:`run_target_steps`, between calls of :func:`run_rounds`): whenever the policy may
    skip (``max_skip > 0``). A plain round inside the speculative loop cost about 7% more
    than a target-only step (1.5B target, 2 CPU cores); the hand-off makes a skipped step
    cost what target-only decoding pays. A draft head's context, the target's state at each
    skipped token, is recorded by the target-only program (its ``taps``)."""
    return config.skips > 0


def _skip_next(policy, state: DecodeState, config, drafter=None, d_params=None) -> jax.Array:
    """``[]`` bool: the next round would skip the drafter (``goodput``). A drafter that
    proposes tokens (give it and its ``d_params``) is read first: the round is skipped when
    no row's proposal is worth one."""
    assert state.policy is not None
    proposal = None
    if drafter is not None and drafter.proposes_tokens and config.skips:
        read = drafter.propose(d_params, state.tokens, state.length)
        proposal = policies_lib.proposal_features(read)
    return policies_lib.should_skip(
        policy, state.policy, ~state.done, config.skips, _need(state), proposal
    )


def _need(state: DecodeState) -> jax.Array:
    """``[B]`` float32 tokens each row still has to write (0 once done): ``goodput`` weighs
    the batch's finishing time with it (``docs/goodput.md``)."""
    remaining = state.settings.max_new_tokens - state.generated
    return jnp.where(state.done, 0, jnp.maximum(remaining, 1)).astype(jnp.float32)


@functools.partial(jax.jit, static_argnames=("config", "drafter"))
def skip_next(
    policy: policies_lib.PolicyParams,
    state: DecodeState,
    d_params: nnx.State,
    *,
    config: DecodeConfig,
    drafter: Drafter,
):
    """Whether the next round would skip the drafter (``[]`` bool, for the host loop of
    :func:`hands_off` configurations); a drafter that proposes tokens is read first."""
    return _skip_next(policy, state, config, drafter, d_params)


def _speculative_round(t_graphdef, t_params, drafter, d_params, policy, state, config):
    key, k_draft, k_verify = jax.random.split(state.key, 3)
    active = ~state.done
    settings = state.settings
    remaining = settings.max_new_tokens - state.generated
    assert state.drafter_cache is not None and state.policy is not None  # a speculative state
    tree, d_cache = draft(
        drafter,
        d_params,
        state.drafter_cache,
        tokens=state.tokens,
        length=state.length,
        start=state.drafter_start,
        limit=jnp.maximum(remaining - 1, 1),
        need=_need(state),
        policy=policy,
        policy_state=state.policy,
        key=k_draft,
        shape=config.tree,
        max_depth=config.depth,
        widths=config.reread_widths(),
        sampling=config.verification.sampling,
        temperature=settings.temperature,
        top_p=settings.top_p,
        context=state.drafter_context,
    )
    used = tree.valid & active[:, None]
    n_eff = jnp.max(jnp.where(used, jnp.arange(1, tree.num_nodes + 1), 0))
    buckets = config.verify_buckets()
    index = jnp.minimum(jnp.searchsorted(jnp.asarray(buckets), n_eff), len(buckets) - 1)
    branches = [
        functools.partial(_verify, nb, t_graphdef=t_graphdef, config=config, taps=drafter.taps)
        for nb in buckets
    ]
    operands = (t_params, state.target_cache, tree, state.tokens, state.length, k_verify, settings)
    verified = lax.switch(index, branches, operands)
    return _commit(state, config, drafter, policy, key, tree, d_cache, verified)


def _commit(state, config, drafter, policy, key, tree, d_cache, verified):
    """Appends the accepted path and the target token; rolls caches to the kept path.

    ``verified`` is what :func:`_verify` returns: the target cache, accepted counts, new
    tokens, accepted-path offsets and node statistics.
    """
    t_cache, accepted, new, offsets, path_states, ns = verified
    active = ~state.done
    settings = state.settings
    remaining = settings.max_new_tokens - state.generated
    b = state.length.shape[0]
    rows = jnp.arange(b)
    keep = jnp.where(active, accepted + 1, 0)
    if isinstance(config.tree, tree_lib.Chain):
        t_cache = t_cache.commit(keep)
    else:
        t_cache = t_cache.select(offsets, keep)
    j = jnp.arange(new.shape[1])
    is_eos = settings.is_eos(new) & (j <= accepted[:, None])
    has_eos = jnp.any(is_eos, axis=-1)
    count = jnp.where(has_eos, jnp.argmax(is_eos, axis=-1) + 1, accepted + 1)
    count = jnp.where(active, jnp.minimum(count, remaining), 0).astype(jnp.int32)
    slots = jnp.where(j < count[:, None], state.length[:, None] + j, state.tokens.shape[1])
    tokens = state.tokens.at[rows[:, None], slots].set(new, mode="drop")
    length = state.length + count
    finished = has_eos | (length - state.prompt_length >= settings.max_new_tokens)
    depth = jnp.max(jnp.where(tree.valid, tree.depth, 0), axis=-1)
    if isinstance(config.tree, tree_lib.Chain) and drafter.keeps_drafts:
        # After a rejection the drafter already read every kept token but the target's.
        start = jnp.where(accepted < depth, length - 1, length - 2)
    else:
        start = state.length  # re-read the accepted path and the target's token
    start = jnp.where(active, start, state.drafter_start)
    context = drafter.after_round(state.drafter_context, path_states, active)
    tested = ns.valid & ns.reached & (ns.rank == 0)  # first choices the target tested
    match = None
    if config.proposes_tokens:  # each proposal's logit is its match length
        match = policies_lib.tree_match_counts(tree, tested, ns.accepted)
    policy_state = policies_lib.update_policy_state(
        policy, state.policy, drafted=depth, accepted=accepted, active=active,
        predicted=policies_lib.tested_estimate(policy, ns.q_cert, tested), match=match,
        emitted=count,
    )  # fmt: skip
    new_state = state.replace(
        tokens=tokens,
        length=length,
        done=state.done | (active & finished),
        drafter_start=start,
        target_cache=t_cache,
        drafter_cache=d_cache,
        drafter_context=context,
        policy=policy_state,
        key=key,
        rounds=state.rounds + active.astype(jnp.int32),
    )
    mask = lambda x: jnp.where(active[:, None], x, jnp.zeros((), x.dtype))  # noqa: E731
    # Statistics count emitted tokens (vLLM's drafted / accepted / emitted): drafts after an
    # end token or past the budget pass verification but are never emitted, so they are not
    # "accepted". The emitted tokens are the first `count` of the accepted path plus the
    # target's token, so min(accepted, count) of them are drafts.
    emitted_drafts = jnp.minimum(accepted, count)
    round_stats = RoundStats(
        active=active,
        drafted=jnp.sum(tree.valid & active[:, None], axis=-1, dtype=jnp.int32),
        depth=jnp.where(active, depth, 0),
        accepted=emitted_drafts,
        emitted=count,
        nodes=ns.replace(
            valid=mask(ns.valid),
            accepted=mask(ns.accepted & (ns.depth <= emitted_drafts[:, None])),
        ),
    )
    return new_state, round_stats


@functools.partial(
    jax.jit, static_argnames=("t_graphdef", "drafter", "config"), donate_argnames=("state",)
)
def run_rounds(
    t_params: nnx.State,
    d_params: nnx.State,
    state: DecodeState,
    policy: policies_lib.PolicyParams,
    *,
    t_graphdef: nnx.GraphDef,
    drafter: Drafter,
    config: DecodeConfig,
) -> tuple[DecodeState, RoundStats]:
    """Up to ``config.rounds_per_call`` rounds (fewer once every row is done, or, with
    :func:`hands_off`, before a round that would skip the drafter).

    Returns:
      ``(state, stats)``: the new :class:`DecodeState` and a :class:`RoundStats` of
      ``[rounds_per_call, B, ...]`` (rounds not run have ``active`` all ``False``).
    """
    r_max = config.rounds_per_call
    b = state.length.shape[0]
    buffers = stats_lib.empty_round_stats(r_max, b, config.num_nodes)

    layout = _layout(t_graphdef, t_params)

    def cond(carry):
        r, state, _ = carry
        go = (r < r_max) & ~jnp.all(state.done)
        if hands_off(config):
            go = go & ~_skip_next(policy, state, config, drafter, d_params)
        return go

    def body(carry):
        r, state, buffers = carry
        state, rs = _speculative_round(
            t_graphdef, t_params, drafter, d_params, policy, state, config
        )
        buffers = jax.tree.map(lambda buf, x: buf.at[r].set(x), buffers, rs)
        return r + 1, _pin(state, layout), buffers

    _, state, buffers = lax.while_loop(cond, body, (jnp.asarray(0, jnp.int32), state, buffers))
    return state, buffers


@functools.partial(jax.jit, static_argnames=("graphdef", "sizes"))
def prefill_target(
    params: nnx.State,
    prompt: jax.Array,
    lengths: jax.Array,
    key: jax.Array,
    settings: Settings,
    *,
    graphdef: nnx.GraphDef,
    sizes: Sizes,
) -> DecodeState:
    """Target-only prefill (in chunks, as :func:`prefill`); the state's drafter fields are
    ``None``."""
    cache, _ = _read_prompt(graphdef, params, prompt, lengths, sizes.target)
    return _initial_state(prompt, lengths, key, settings, sizes, cache, None, None)


@functools.partial(
    jax.jit,
    static_argnames=("graphdef", "steps", "sampling", "drafter", "config"),
    donate_argnames=("state",),
)
def run_target_steps(
    params: nnx.State,
    state: DecodeState,
    d_params: nnx.State | None = None,
    policy: policies_lib.PolicyParams | None = None,
    *,
    graphdef: nnx.GraphDef,
    steps: int,
    sampling: bool,
    drafter: Drafter | None = None,
    config: DecodeConfig | None = None,
) -> DecodeState:
    """Up to ``steps`` target-only decoding steps: greedy, or sampled with ``sampling`` at
    the state's (traced) temperature and top-p; budget and end tokens from its settings.

    With a ``drafter`` (``goodput``'s skipped rounds; its ``d_params``, the ``policy`` and
    the speculative ``config``), the drafter stays in step with the text:

    - one that reads the target's states (:attr:`Drafter.taps`) gets, at each step, the
      states at the token the target reads in its context (``state.drafter_context``, slot
      ``length - drafter_start``: the state before the new token), so its next re-read reads
      every skipped token with the state before it, as a teacher-forced head does; a slot
      past the context's width (a batch that skipped more than ``max_skip`` steps in a row,
      and so never drafts again) is dropped;
    - one that proposes tokens is read before each step after the first: the steps stop
      before one where a row's proposal is worth a round, and the drafter then catches up
      with the text without a pass (its re-read starts at the last token): ``goodput``
      reads prompt lookup at every token, at the price of a few integer comparisons."""
    b = state.length.shape[0]
    rows = jnp.arange(b)
    settings = state.settings
    taps = None if drafter is None else drafter.taps
    looks = drafter is not None and drafter.proposes_tokens

    def cond(carry):
        r, state = carry
        go = (r < steps) & ~jnp.all(state.done)
        if looks:
            go = go & ((r == 0) | _skip_next(policy, state, config, drafter, d_params))
        return go

    def body(carry):
        r, state = carry
        active = ~state.done
        key, sub = jax.random.split(state.key)
        last = state.tokens[rows, state.length - 1]
        step = active.astype(jnp.int32)
        context = state.drafter_context
        if taps is None:
            logits, cache = decode_step(graphdef, params, last, state.target_cache, active)
        else:
            assert drafter is not None
            logits, cache, states = _target_pass(
                graphdef, params, last[:, None], state.target_cache, taps
            )
            logits, cache = logits[:, 0], cache.commit(step)
            at = jnp.where(active, state.length - state.drafter_start, context.shape[1])
            context = drafter.after_step(context, states, at)
        if sampling:
            lp = sampling_log_probs(logits, settings.temperature, settings.top_p)
            token = jax.random.categorical(sub, lp, axis=-1).astype(jnp.int32)
        else:
            token = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        slot = jnp.where(active, state.length, state.tokens.shape[1])
        tokens = state.tokens.at[rows, slot].set(token, mode="drop")
        length = state.length + step
        finished = settings.is_eos(token) | (
            length - state.prompt_length >= settings.max_new_tokens
        )
        state = state.replace(
            tokens=tokens,
            length=length,
            done=state.done | (active & finished),
            target_cache=cache,
            drafter_context=context,
            key=key,
            rounds=state.rounds + step,
        )
        return r + 1, state

    _, state = lax.while_loop(cond, body, (jnp.asarray(0, jnp.int32), state))
    if looks:
        assert drafter is not None and d_params is not None and state.drafter_cache is not None
        state = state.replace(
            drafter_cache=drafter.catch_up(
                d_params, state.drafter_cache, state.tokens, state.length
            ),
            drafter_start=state.length - 1,
        )
    return state
