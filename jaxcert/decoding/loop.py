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
from jaxcert.decoding.protocols import Cache, context_before
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


def _read_prompt(graphdef, params, prompt, slots) -> Cache:
    """The model's own cache with the ``[B, T]`` prompt read into it (nothing committed)."""
    cache = nnx.merge(graphdef, params).init_cache(prompt.shape[0], slots)
    return _forward(graphdef, params, prompt, cache)[1]


def _target_pass(graphdef, params, tokens, cache, taps, **kwargs):
    """The target's ``[B, T, V]`` logits and cache, and for a draft head (``taps`` not
    ``None``) the states it reads, ``[B, T, C]`` (the final-norm hidden states for ``()``)."""
    if taps is None:
        logits, cache = _forward(graphdef, params, tokens, cache, **kwargs)
        return logits, cache, None
    model = nnx.merge(graphdef, params)
    hidden, cache, states = target_features(model, tokens, cache, taps, **kwargs)
    return model.project(hidden), cache, states


def _prefill_head(d_graphdef, d_params, prompt, lengths, states, slots, width):
    """A draft head reads the prompt, token ``t`` with the target's states at ``t - 1``, and
    keeps all but the last token (re-read in the first round with ``states[n - 2]``).

    Returns its cache (``lengths - 1`` committed) and the ``[B, width, C]`` context.
    """
    head = nnx.merge(d_graphdef, d_params)
    before = context_before(head, states)  # [B, T, E]
    _, cache = head.features(prompt, head.init_cache(prompt.shape[0], slots), context=before)
    rows = jnp.arange(prompt.shape[0])
    context = jnp.zeros((prompt.shape[0], width, states.shape[-1]), states.dtype)
    context = context.at[:, 0].set(states[rows, lengths - 2])
    return cache.commit(lengths - 1), context


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
    """The :class:`DecodeState` after prefill (the target has read all but the last token);
    ``drafter`` is ``(cache, context)`` or ``None``."""
    b, t = prompt.shape
    tokens = jnp.full((b, sizes.sequence), DecodeState.PAD, jnp.int32).at[:, :t].set(prompt)
    d_cache, d_context = (None, None) if drafter is None else drafter
    return DecodeState(
        tokens=tokens,
        length=lengths,
        prompt_length=lengths,
        done=jnp.zeros((b,), bool),
        drafter_start=lengths - 2 if drafter_start is None else drafter_start,
        target_cache=target_cache.commit(lengths - 1),
        drafter_cache=d_cache,
        drafter_context=d_context,
        policy=policy,
        key=key,
        rounds=jnp.zeros((b,), jnp.int32),
        settings=settings,
    )


@functools.partial(jax.jit, static_argnames=("t_graphdef", "d_graphdef", "config", "sizes"))
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
    d_graphdef: nnx.GraphDef,
    config: DecodeConfig,
    sizes: Sizes,
) -> DecodeState:
    """Reads the prompts into both caches.

    Args:
      t_params, d_params: target and drafter parameters (``nnx.split``).
      prompt: ``[B, T]`` int32 right-padded prompts; ``lengths`` ``[B]`` their lengths (>= 2).
      policy: :class:`~jaxcert.decoding.policies.PolicyParams`.
      key: PRNG key.
      settings: the traced :class:`~jaxcert.decoding.state.Settings` (budget, end tokens,
        temperature, top-p); ``config``'s own values of these are not read.
      t_graphdef, d_graphdef: their graph definitions (static).
      config: :class:`~jaxcert.decoding.config.DecodeConfig` (its shapes and rule); sizes:
        :class:`~jaxcert.decoding.config.Sizes`.

    Returns:
      The initial :class:`DecodeState`.
    """
    taps = config.head_taps
    policy_state = policies_lib.init_policy_state(policy, prompt.shape[0])
    m = config.branching
    t_cache = nnx.merge(t_graphdef, t_params).init_cache(prompt.shape[0], sizes.target)
    _, t_cache, states = _target_pass(t_graphdef, t_params, prompt, t_cache, taps)
    if taps is None:
        d_cache = _read_prompt(d_graphdef, d_params, prompt, sizes.drafter)
        drafter = (d_cache.commit(lengths - 2).repeat(m), None)
        start = lengths - 2
    else:
        d_cache, context = _prefill_head(
            d_graphdef, d_params, prompt, lengths, states, sizes.drafter, config.reread
        )
        drafter, start = (d_cache.repeat(m), context), lengths - 1
    state = _initial_state(
        prompt, lengths, key, settings, sizes, t_cache, drafter, policy_state, start
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


def _verify(nb, operands, *, t_graphdef, config):
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
        t_graphdef, t_params, toks, cache, config.head_taps,
        positions=positions, attention_mask=fwd_mask,
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
    # A head re-reads the accepted path and the target's token with the target's states at
    # the root and the path's nodes (the positions before them).
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


def _proposal(d_graphdef, d_params, state: DecodeState) -> policies_lib.DrafterFeatures:
    """A proposing drafter's next proposal for every row, read from the text (no pass)."""
    drafter = nnx.merge(d_graphdef, d_params)
    return policies_lib.proposal_features(drafter.propose(state.tokens, state.length))


def _skip_next(policy, state: DecodeState, config, d_graphdef=None, d_params=None) -> jax.Array:
    """``[]`` bool: the next round would skip the drafter (``goodput``). A proposing
    drafter (``config.proposes_tokens``; give its ``d_graphdef`` and ``d_params``) is read
    first: the round is skipped when no row's proposal is worth one."""
    assert state.policy is not None
    proposal = None
    if config.proposes_tokens and config.skips:
        proposal = _proposal(d_graphdef, d_params, state)
    return policies_lib.should_skip(
        policy, state.policy, ~state.done, config.skips, _need(state), proposal
    )


def _need(state: DecodeState) -> jax.Array:
    """``[B]`` float32 tokens each row still has to write (0 once done): ``goodput`` weighs
    the batch's finishing time with it (``docs/goodput.md``)."""
    remaining = state.settings.max_new_tokens - state.generated
    return jnp.where(state.done, 0, jnp.maximum(remaining, 1)).astype(jnp.float32)


@functools.partial(jax.jit, static_argnames=("config", "d_graphdef"))
def skip_next(
    policy: policies_lib.PolicyParams,
    state: DecodeState,
    d_params: nnx.State | None = None,
    *,
    config: DecodeConfig,
    d_graphdef: nnx.GraphDef | None = None,
):
    """Whether the next round would skip the drafter (``[]`` bool, for the host loop of
    :func:`hands_off` configurations); a proposing drafter's ``d_graphdef`` and
    ``d_params`` are needed to read its proposal."""
    return _skip_next(policy, state, config, d_graphdef, d_params)


def _speculative_round(
    t_graphdef, t_params, d_graphdef, d_params, policy, state: DecodeState, config
):
    key, k_draft, k_verify = jax.random.split(state.key, 3)
    active = ~state.done
    settings = state.settings
    remaining = settings.max_new_tokens - state.generated
    assert state.drafter_cache is not None and state.policy is not None  # a speculative state
    tree, d_cache = draft(
        d_graphdef,
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
        proposes=config.proposes_tokens,
    )
    used = tree.valid & active[:, None]
    n_eff = jnp.max(jnp.where(used, jnp.arange(1, tree.num_nodes + 1), 0))
    buckets = config.verify_buckets()
    index = jnp.minimum(jnp.searchsorted(jnp.asarray(buckets), n_eff), len(buckets) - 1)
    branches = [
        functools.partial(_verify, nb, t_graphdef=t_graphdef, config=config) for nb in buckets
    ]
    operands = (t_params, state.target_cache, tree, state.tokens, state.length, k_verify, settings)
    verified = lax.switch(index, branches, operands)
    return _commit(state, config, policy, key, tree, d_cache, verified)


def _commit(state, config, policy, key, tree, d_cache, verified):
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
    if isinstance(config.tree, tree_lib.Chain) and config.head_taps is None:
        # After a rejection the drafter already read every kept token but the target's.
        start = jnp.where(accepted < depth, length - 1, length - 2)
    else:
        start = state.length  # re-read the accepted path and the target's token
    start = jnp.where(active, start, state.drafter_start)
    context = state.drafter_context
    if path_states is not None:
        pad = context.shape[1] - path_states.shape[1]  # room for skipped steps' states
        path_states = jnp.pad(path_states, ((0, 0), (0, pad), (0, 0)))
        context = jnp.where(active[:, None, None], path_states, context)
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
    jax.jit, static_argnames=("t_graphdef", "d_graphdef", "config"), donate_argnames=("state",)
)
def run_rounds(
    t_params: nnx.State,
    d_params: nnx.State,
    state: DecodeState,
    policy: policies_lib.PolicyParams,
    *,
    t_graphdef: nnx.GraphDef,
    d_graphdef: nnx.GraphDef,
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
            go = go & ~_skip_next(policy, state, config, d_graphdef, d_params)
        return go

    def body(carry):
        r, state, buffers = carry
        state, rs = _speculative_round(
            t_graphdef, t_params, d_graphdef, d_params, policy, state, config
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
    """Target-only prefill; the state's drafter fields are ``None``."""
    cache = _read_prompt(graphdef, params, prompt, sizes.target)
    return _initial_state(prompt, lengths, key, settings, sizes, cache, None, None)


@functools.partial(
    jax.jit,
    static_argnames=("graphdef", "steps", "sampling", "d_graphdef", "config", "taps"),
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
    d_graphdef: nnx.GraphDef | None = None,
    config: DecodeConfig | None = None,
    taps: tuple[int, ...] | None = None,
) -> DecodeState:
    """Up to ``steps`` target-only decoding steps: greedy, or sampled with ``sampling`` at
    the state's (traced) temperature and top-p; budget and end tokens from its settings.

    With a draft head's ``taps`` (``DecodeConfig.head_taps``, static) each step also
    records the target's states at the token it reads into the head's context
    (``state.drafter_context``, slot ``length - drafter_start``: the state before the new
    token), so the head's next re-read reads every skipped token with the state before it,
    as a teacher-forced head does. A slot past the context's width (a batch that skipped
    more than ``max_skip`` steps in a row, and so never drafts again) is dropped.

    With a proposing drafter (``d_graphdef``, ``d_params``, the ``goodput`` ``policy`` and
    the speculative ``config``), the steps stop before one where a row's proposal is worth
    a round (after the first step), and the drafter catches up with the text (its re-read
    then starts at the last token): ``goodput`` reads prompt lookup at every token, at the
    price of a few integer comparisons, and a skipped drafter is never stale."""
    b = state.length.shape[0]
    rows = jnp.arange(b)
    settings = state.settings
    looks = d_graphdef is not None

    def cond(carry):
        r, state = carry
        go = (r < steps) & ~jnp.all(state.done)
        if looks:
            go = go & ((r == 0) | _skip_next(policy, state, config, d_graphdef, d_params))
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
            assert context is not None  # a draft head's state
            logits, cache, states = _target_pass(
                graphdef, params, last[:, None], state.target_cache, taps
            )
            logits, cache = logits[:, 0], cache.commit(step)
            at = jnp.where(active, state.length - state.drafter_start, context.shape[1])
            context = context.at[rows, at].set(states[:, 0].astype(context.dtype), mode="drop")
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
    if d_graphdef is not None:
        drafter = nnx.merge(d_graphdef, d_params)
        state = state.replace(
            drafter_cache=drafter.catch_up(state.drafter_cache, state.tokens, state.length),
            drafter_start=state.length - 1,
        )
    return state
