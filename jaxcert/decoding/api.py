"""Host-side entry points: batches of token prompts in, tokens, statistics and timings out.

Both decoders compile ahead of time (timed as ``compile_s``, cached per configuration and
shape), then run in calls of a few rounds (or steps) so a progress callback can follow;
``decode_s`` is the wall time of those calls alone, ``prefill_s`` that of the prompt pass.

On a mesh (a target placed with :func:`jaxcert.models.shard` or loaded with ``mesh=``, or a
``mesh=`` argument) both models run on it: the prompts are split over the batch axis (the
logical ``batch`` axis, ``data`` by default; the batch is padded with copies of the last prompt
to a multiple of its size, and the copies are dropped from the output), a model not yet on the
mesh is placed there with :func:`jaxcert.models.shard` (once per call: shard it yourself to
avoid the transfer), and the caches and logits stay split as the models' layouts say.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxcert import models
from jaxcert.base.prompts import pad_prompts
from jaxcert.base.validate import check_int
from jaxcert.decoding import costs as costs_lib
from jaxcert.decoding import loop
from jaxcert.decoding import node_stats as stats_lib
from jaxcert.decoding import policies as policies_lib
from jaxcert.decoding.config import DecodeConfig, Sizes, bucket, check_sampling
from jaxcert.decoding.costs import PassCosts
from jaxcert.decoding.ngram import NgramDrafter
from jaxcert.decoding.programs import Programs, default_programs
from jaxcert.decoding.protocols import DecoderModel, reads_target
from jaxcert.decoding.state import RoundStats, Settings
from jaxcert.models import sharding as sharding_lib

__all__ = [
    "DecodeCall",
    "DecodeOutput",
    "check_pair",
    "resolved_config",
    "speculative_decode",
    "split_model",
    "target_decode",
]


@dataclasses.dataclass(frozen=True)
class DecodeCall:
    """One call of a decode's host loop: a compiled program run until it hands back.

    Attributes:
      program: ``"steps"`` (target-only steps: all of :func:`target_decode`, and the steps
        ``goodput`` runs instead of rounds) or ``"rounds"`` (the speculative round loop).
      seconds: its wall time, the host's wait for the result included.
      tokens: the tokens it added, summed over the batch's rows.
    """

    program: str
    seconds: float
    tokens: int


@dataclasses.dataclass
class DecodeOutput:
    """Result of decoding one batch.

    Attributes:
      tokens: per row, the output token ids (prompt excluded, end token included).
      stats: per-round statistics, numpy ``[R, B, ...]`` (``None`` for target-only).
      rounds: ``[B]`` rounds (speculative) or steps (target-only) per row.
      prefill_s, decode_s, compile_s: wall times in seconds.
      compiled: programs this call compiled (0: every one was cached in the process).
      round_costs: ``goodput`` only: the :class:`~jaxcert.decoding.policies.RoundCosts` it
        weighed last (seconds; calibrated, then corrected by the timed calls), else ``None``.
      calls: the host loop's calls in order (:class:`DecodeCall`); their seconds add up to
        ``decode_s``. Where a decode loses time, they say in which program
        (``scripts/bench_decode_calls.py``; docs/benchmarks.md).
    """

    tokens: list[np.ndarray]
    stats: RoundStats | None
    rounds: np.ndarray
    prefill_s: float
    decode_s: float
    compile_s: float
    compiled: int = 0
    round_costs: policies_lib.RoundCosts | None = None
    calls: tuple[DecodeCall, ...] = ()

    @property
    def num_tokens(self) -> int:
        return int(sum(len(t) for t in self.tokens))


def split_model(model) -> tuple[nnx.GraphDef, nnx.State]:
    """``(graphdef, params)`` of a ``models.LoadedModel``, an ``nnx.Module`` or such a pair."""
    if isinstance(model, tuple) and len(model) == 2:
        return model
    module = getattr(model, "model", model)
    if not isinstance(module, nnx.Module):
        raise ValueError(f"expected a models.LoadedModel or an nnx.Module, got {type(model)}")
    if not isinstance(module, DecoderModel):
        surface = ("config", "init_cache", "features", "project", "__call__")
        missing = [a for a in surface if not hasattr(module, a)]
        raise ValueError(
            f"{type(module).__name__} lacks {', '.join(missing)}: a target or drafter needs the "
            "jaxcert.decoding.protocols.DecoderModel surface"
        )
    return nnx.split(module)


def _padded(prompts, width, minimum, vocab_size, placement=None):
    """``(tokens [B', W], lengths [B'])`` on the device(s); ``B' = B`` unless on a mesh.

    With ``placement = (mesh, rules)`` the batch is padded with copies of the last prompt to
    a multiple of the size of the mesh axes of ``batch``, then split over them.
    """
    if placement is not None and len(prompts) and not isinstance(prompts[0], (int, np.integer)):
        mesh, rules = placement
        n = sharding_lib.axis_size("batch", mesh, rules)
        prompts = list(prompts) + [prompts[-1]] * (-len(prompts) % n)
    tokens, lengths = pad_prompts(prompts, width=width, minimum=minimum, vocab_size=vocab_size)
    if placement is None:
        return jnp.asarray(tokens), jnp.asarray(lengths)
    layout = sharding_lib.Layout.create(*placement)
    tokens = jax.device_put(tokens, layout.sharding(("batch", None), tokens.shape))
    return tokens, jax.device_put(lengths, layout.sharding(("batch",), lengths.shape))


def _model_mesh(model):
    """The mesh a model (``LoadedModel``, module or ``(graphdef, params)``) lives on, or None."""
    if isinstance(model, tuple) and len(model) == 2:
        return sharding_lib.mesh_of(model[1])
    layout = sharding_lib.layout_of(model)
    if layout is not None:
        return layout.mesh
    module = getattr(model, "model", model)
    return sharding_lib.mesh_of(nnx.state(module)) if isinstance(module, nnx.Module) else None


def _on_mesh(models_, mesh):
    """Puts every model on one mesh: ``(models, (mesh, rules) or None)``.

    The mesh is ``mesh`` if given, else the one the models live on (``None``: nothing to do,
    the single-device path). A model elsewhere is placed with ``models.shard`` (the rules of
    the first sharded model, else the default rules).

    Raises:
      ValueError: the models live on different meshes (and no ``mesh`` was given), or an
        ``Explicit`` mesh.
    """
    found = [_model_mesh(m) for m in models_]
    if mesh is None:
        meshes = {m for m in found if m is not None}
        if len(meshes) > 1:
            raise ValueError(
                "the target and the drafter live on different meshes; place them on one "
                "(jaxcert.models.shard) or pass mesh="
            )
        if not meshes:
            return models_, None
        mesh = meshes.pop()
    sharding_lib.check_mesh(mesh)
    layouts = [sharding_lib.layout_of(m) for m in models_ if not isinstance(m, tuple)]
    rules = next((x.rules for x in layouts if x is not None), sharding_lib.LOGICAL_RULES)
    placed = []
    for model, where in zip(models_, found, strict=True):
        if where != mesh:
            if isinstance(model, tuple) and len(model) == 2:
                model = nnx.split(models.shard(nnx.merge(*model), mesh, rules))
            else:
                model = models.shard(getattr(model, "model", model), mesh, rules)
        placed.append(model)
    return placed, (mesh, rules)


def _replicated(tree, placement):
    """``tree`` replicated on the mesh (``tree`` itself without one)."""
    if placement is None:
        return tree
    return jax.device_put(
        tree, jax.sharding.NamedSharding(placement[0], jax.sharding.PartitionSpec())
    )


def _vocab_size(model) -> int | None:
    config = models.config_of(model)  # None for a (graphdef, params) pair: ids >= 0 only
    return None if config is None else int(config.vocab_size)


check_pair = models.check_same_vocabulary
"""Raises ``ValueError`` unless target and drafter share one vocabulary (and tokenizer)."""


def _with_head(config: DecodeConfig, target, drafter) -> DecodeConfig:
    """``config`` with ``head_taps`` set when ``drafter`` is a draft head.

    Raises:
      ValueError: the head fuses a block the target does not have, or the target cannot
        hand over its intermediate states (no ``tapped_features``).
    """
    head = getattr(drafter, "model", drafter)
    if isinstance(head, tuple) or not reads_target(head):
        return dataclasses.replace(config, head_taps=None)
    taps = tuple(int(i) for i in head.taps)
    t_model = getattr(target, "model", target)
    if taps and not hasattr(t_model, "tapped_features"):
        raise ValueError(
            f"the draft head fuses target blocks {taps}, but the target "
            f"({type(t_model).__name__}) has no tapped_features to hand them over"
        )
    layers = getattr(getattr(t_model, "config", None), "num_layers", None)
    if layers is not None and any(not 0 <= i < layers for i in taps):
        raise ValueError(
            f"the draft head fuses target blocks {taps}, but the target has {layers} blocks"
        )
    return dataclasses.replace(config, head_taps=taps)


def resolved_config(
    config: DecodeConfig, target, drafter, policy: policies_lib.Policy
) -> DecodeConfig:
    """``config`` as :func:`speculative_decode` runs it with this pair and policy: the draft
    head's taps, whether the drafter proposes one-hot tokens, and ``max_skip`` (``None``:
    8 with :class:`~jaxcert.decoding.policies.Goodput`, else 0). Its verification widths
    are the ones :func:`~jaxcert.decoding.costs.calibrate` should measure.

    Raises:
      ValueError: as :func:`speculative_decode` for a head the target cannot feed.
    """
    config = _with_head(config, target, drafter)
    proposes = bool(getattr(getattr(drafter, "model", drafter), "proposes_tokens", False))
    goodput = isinstance(policy, policies_lib.Goodput)
    skips = config.max_skip if config.max_skip is not None else (8 if goodput else 0)
    return dataclasses.replace(config, proposes_tokens=proposes, max_skip=skips)


def _bound(drafter, target):
    """An :class:`~jaxcert.decoding.ngram.NgramDrafter` built without a vocabulary size
    takes the target's; any other drafter is returned as it is."""
    if isinstance(drafter, NgramDrafter) and drafter.config is None:
        vocab_size = _vocab_size(target)
        if vocab_size is None:
            raise ValueError(
                "NgramDrafter needs the target's vocabulary size: pass a target with a "
                "config, or build it with NgramDrafter(n, vocab_size=V)"
            )
        return drafter.for_vocabulary(vocab_size)
    return drafter


def _prepare_prompts(prompts, prompt_width, minimum, vocab_size, models_, new_tokens, draft):
    """Validates the prompts and the context length; returns the (bucketed) prompt width.

    Without ``prompt_width`` the width is the longest prompt's :func:`bucket`, so batches of
    similar prompts share one program.
    """
    _, lengths = pad_prompts(prompts, width=prompt_width, minimum=minimum, vocab_size=vocab_size)
    longest = int(lengths.max())
    models.check_context_length(
        models_, prompt_tokens=longest, new_tokens=new_tokens, draft_positions=draft
    )
    return prompt_width if prompt_width is not None else bucket(longest)


def _outputs(state, rows: int) -> tuple[list[np.ndarray], np.ndarray]:
    """Per row, the output tokens, and ``[B]`` rounds, of the first ``rows`` rows."""
    tokens, length, prompt = jax.device_get((state.tokens, state.length, state.prompt_length))
    rounds = np.asarray(jax.device_get(state.rounds))[:rows]
    return [tokens[b, prompt[b] : length[b]].copy() for b in range(rows)], rounds


def _generated(state, rows: int):
    """Output tokens so far in the first ``rows`` rows (the others pad the batch)."""
    new = state.length - state.prompt_length
    return jnp.sum(new if new.shape[0] == rows else new[:rows])


def _drive(pre, pre_args, call, rows: int, progress) -> tuple:
    """The host loop of both decoders: the timed prefill, then ``call(state)`` until every
    row is done. Returns ``(state, prefill_s, decode_s, calls)``, ``calls`` a list of
    ``(seconds, tokens)`` per call."""
    t0 = time.perf_counter()
    state = pre(*pre_args)
    jax.block_until_ready(state)
    prefill_s = time.perf_counter() - t0
    decode_s, done, before, calls = 0.0, False, 0, []
    while not done:
        t0 = time.perf_counter()
        state = call(state)
        done, generated = jax.device_get((jnp.all(state.done), _generated(state, rows)))
        seconds = time.perf_counter() - t0
        decode_s += seconds
        calls.append((seconds, int(generated) - before))
        before = int(generated)
        if progress is not None:
            progress(int(generated))
    return state, prefill_s, decode_s, calls


def _plain_steps(plain, t_params, state, config: DecodeConfig, chunks: list, losing=True):
    """``goodput``'s skipped rounds: up to ``config.skips`` target-only steps (``plain``, a
    compiled :func:`loop.run_target_steps`) on the speculative state. The drafter's cache
    and re-read start stay (it catches up in its next re-read); the skip count grows by the
    steps run; each step is recorded as a round that drafted nothing and emitted one token.
    ``losing=False`` (a probe of the plain step's cost, not a skip the policy chose): the
    drafting round before it does not count as a losing measurement.
    Returns ``(state, steps run)``."""
    before = np.asarray(jax.device_get(state.rounds))  # read before `plain` donates it
    state = plain(t_params, state)
    steps = np.asarray(jax.device_get(state.rounds)) - before  # [B] steps per row
    assert state.policy is not None
    ran = int(steps.max(initial=0))
    rows = int(np.sum(steps > 0))  # rows still decoding: those the last measurement weighed
    weighed = rows if losing else 0
    state = state.replace(policy=policies_lib.skipped_round(state.policy, ran, weighed))
    chunks.append(_plain_round_stats(steps, config.skips, config.num_nodes))
    return state, ran


def _plain_round_stats(steps: np.ndarray, rounds: int, nodes: int) -> RoundStats:
    """Host statistics ``[rounds, B]`` of plain target steps, ``steps[b]`` in row ``b``:
    each a round that drafted nothing and emitted one token."""
    active = np.arange(rounds)[:, None] < steps[None, :]  # [rounds, B]
    empty = jax.device_get(stats_lib.empty_round_stats(rounds, active.shape[1], nodes))
    return empty.replace(active=active, emitted=active.astype(np.int32))


def _never_drafts(params: policies_lib.PolicyParams, config: DecodeConfig, batch: int) -> bool:
    """Whether ``goodput`` will run every round of a ``batch``-row decode as a plain step:
    its first round skips on the prior from earlier decodes, and that skip, a losing
    measurement of ``batch`` row-rounds, reaches ``patience``, so it never measures again
    (``docs/goodput.md``, "What earlier decodes measured")."""
    patience = int(jax.device_get(params.patience))
    if config.skips == 0 or patience <= 0 or batch < patience or config.proposes_tokens:
        return False  # a proposing drafter is read before every round, whatever the past
    state = policies_lib.init_policy_state(params, batch)
    active = jnp.ones((batch,), bool)  # every row, padding rows included, starts active
    need = jnp.ones((batch,), jnp.float32)  # equal budgets: only their ratios matter
    skip = policies_lib.should_skip(params, state, active, config.skips, need)
    return bool(skip)


def _without_drafter(
    target, prompts, config, static, *, key, prompt_width, progress, mesh, on_compile,
    programs, costs, policy_params, calibrated, mode,
) -> DecodeOutput:  # fmt: skip
    """A ``goodput`` decode that will not draft (:func:`_never_drafts`), run as
    :func:`target_decode`: every step is recorded as a round that drafted nothing and
    emitted one token, and the past is kept with nothing drafted (so its weight halves).
    The decision is made once, before the prefill, with the costs as they stand."""
    out = target_decode(
        target, prompts, max_new_tokens=config.max_new_tokens, temperature=config.temperature,
        top_p=config.top_p, eos_ids=config.eos_ids, key=key, prompt_width=prompt_width,
        progress=progress, mesh=mesh, on_compile=on_compile, programs=programs,
    )  # fmt: skip
    steps = np.asarray(out.rounds)  # [B] steps per row
    stats = _plain_round_stats(steps, int(steps.max(initial=0)), static.num_nodes)
    if calibrated is not None:
        # No tracker: the overheads stay as they were, since target-only steps are not the
        # speculative decoder's plain steps (other calls, another state).
        depths = policy_params.costs.round_s.shape[0]
        costs_lib.remember(calibrated, None, (mode, 0.0, np.zeros(depths)))
    weighed = jax.device_get(policy_params.costs)
    return dataclasses.replace(out, stats=stats, round_costs=weighed)


def speculative_decode(
    target,
    drafter,
    prompts: Sequence[Sequence[int]],
    *,
    policy: policies_lib.Policy,
    config: DecodeConfig,
    key: jax.Array | None = None,
    prompt_width: int | None = None,
    progress: Callable[[int], None] | None = None,
    mesh: jax.sharding.Mesh | None = None,
    on_compile: Callable[[str], None] | None = None,
    programs: Programs | None = None,
    costs: PassCosts | None = None,
    correct_costs: bool | None = None,
) -> DecodeOutput:
    """Speculative decoding of one batch of token prompts.

    Args:
      target, drafter: ``models.LoadedModel`` or ``nnx.Module`` (same vocabulary), or
        ``(graphdef, params)`` pairs; on one device or on a mesh (see the module docstring).
        The drafter may be a draft head (:class:`jaxcert.models.EagleHead`) or an
        :class:`~jaxcert.decoding.ngram.NgramDrafter` (one-hot proposals; it takes the
        target's vocabulary size).
      prompts: ``B`` token-id sequences, each of length >= 2.
      policy: the draft-length policy (:func:`~jaxcert.decoding.policies.parse_policy`).
      config: a :class:`~jaxcert.decoding.config.DecodeConfig`.
      key: PRNG key (sampling); default ``jax.random.key(0)``.
      prompt_width: pad prompts to this width (share one compilation across batches).
      progress: called with the number of new output tokens after every call.
      mesh: run on this ``jax.sharding.Mesh`` (``Auto`` axes); default: the mesh the models
        live on, if any.
      on_compile: called with the program's name before each compilation (a program
        ``programs`` does not hold yet), e.g. to show it in a progress display.
      programs: where compiled programs are kept and counted
        (:class:`~jaxcert.decoding.programs.Programs`; default: the process's,
        :func:`~jaxcert.decoding.programs.default_programs`).
      costs: the pass costs the ``goodput`` policy weighs
        (:class:`~jaxcert.decoding.costs.PassCosts` at this batch size); default: measured
        on this machine once and cached (:func:`~jaxcert.decoding.costs.calibrate`).
        Other policies ignore it.
      correct_costs: ``goodput`` only: correct those costs as the decoder runs, from the
        wall time of its own calls (:class:`~jaxcert.decoding.costs.CostTracker`; a
        calibration times the passes alone, a round also pays for acceptance, statistics
        and the host's calls). Default (``None``): correct costs calibrated here, keep
        ``costs`` given by the caller as they are. Never across processes (each would
        time its own calls, and the costs are one replicated value). A decode that
        corrects its costs and has drafted but not yet skipped runs one call of plain steps
        (up to ``max_skip``) to time them, so that a calibration that overstates a plain
        step is corrected too. What a decode's drafting produced is kept with costs calibrated
        here, and the next decode at this batch size and sampling mode starts from it
        (``docs/goodput.md``, "What earlier decodes measured"); when it says the decode
        will not draft at all, the decode runs as :func:`target_decode` (the drafter does
        not read the prompts) and its statistics record plain rounds.

    Returns:
      A :class:`DecodeOutput`.

    Raises:
      ValueError: mismatched vocabularies, short prompts or an invalid config; prompts plus
        ``max_new_tokens`` plus the draft depth longer than a model's context
        (``max_position_embeddings``); models on different meshes or an ``Explicit`` mesh.
    """
    drafter = _bound(drafter, target)
    check_pair(target, drafter)
    config = resolved_config(config, target, drafter, policy)
    goodput = isinstance(policy, policies_lib.Goodput)
    vocab_size = _vocab_size(target)
    rows = len(prompts)
    width = _prepare_prompts(
        prompts, prompt_width, 2, vocab_size, {"target": target, "drafter": drafter},
        config.max_new_tokens, config.depth,
    )  # fmt: skip
    (target, drafter), placement = _on_mesh((target, drafter), mesh)
    t_graphdef, t_params = split_model(target)
    d_graphdef, d_params = split_model(drafter)
    prompt, lengths = _padded(prompts, width, 2, vocab_size, placement)
    key = jax.random.key(0) if key is None else key
    static = config.shape_only()  # budget, end tokens, temperature and top-p are traced
    sizes = Sizes.for_prompts(width, static, bucket(config.max_new_tokens))
    settings = Settings.create(
        config.max_new_tokens, config.temperature, config.top_p, config.eos_ids
    )
    round_costs = policies_lib.RoundCosts.unknown(static.depth)  # zeros: not read
    if correct_costs is None:
        correct_costs = costs is None
    # Each process times its own calls; the policy's costs must be one replicated value.
    correct_costs = correct_costs and jax.process_count() == 1
    calibrated = None  # where calibrated costs are kept (their learnt overheads too)
    if goodput:
        if costs is None:
            padded_rows = int(prompt.shape[0])
            calibrated = costs_lib.cache_path(target, drafter, rows=padded_rows, config=static)
            costs = costs_lib.calibrate(
                target, drafter, rows=padded_rows, config=static, path=calibrated
            )
        round_costs = costs.round_costs(static)
    policy_params = policies_lib.PolicyParams.from_policy(policy, round_costs)
    mode = costs_lib.sampling_mode(config.temperature)
    past = costs.drafting.get(mode) if goodput and costs is not None else None
    if past is not None and len(past.rounds) != round_costs.round_s.shape[0]:
        past = None  # kept for another draft depth: not this decode's evidence
    # Per row, the prior each row starts with (zeros: none), kept on the host in the
    # decoder's float32 to subtract exactly from what the decode counted when it ends.
    past_row = (np.float32(0.0), np.zeros(round_costs.round_s.shape, np.float32))
    if past is not None:
        # What earlier decodes' drafting produced: the first round's skip decision weighs
        # it (docs/goodput.md, "What earlier decodes measured").
        emitted, rounds = past.per_row(int(prompt.shape[0]))
        past_row = (np.float32(emitted), rounds.astype(np.float32))
        policy_params = policy_params.with_past(*past_row)
    if isinstance(config.tree, loop.tree_lib.Chain) and policy.k_max > config.max_draft:
        policy_params = policy_params.replace(k_max=jnp.asarray(config.max_draft, jnp.int32))
    policy_params, key, settings = _replicated((policy_params, key, settings), placement)
    hand_off = loop.hands_off(static)
    if hand_off and past is not None and _never_drafts(policy_params, static, prompt.shape[0]):
        # What earlier decodes measured says this decode will not draft at all: it runs as
        # target-only decoding, and the drafter does not even read the prompts.
        return _without_drafter(
            target, prompts, config, static, key=key, prompt_width=width, progress=progress,
            mesh=mesh, on_compile=on_compile, programs=programs, costs=costs,
            policy_params=policy_params, calibrated=calibrated if correct_costs else None,
            mode=mode,
        )  # fmt: skip
    programs = default_programs() if programs is None else programs
    t0, before = time.perf_counter(), programs.compiled
    graphdefs = {"t_graphdef": t_graphdef, "d_graphdef": d_graphdef}
    pre_args = (t_params, d_params, prompt, lengths, policy_params, key, settings)
    pre = programs.compile(
        loop.prefill, pre_args, graphdefs | {"config": static, "sizes": sizes}, on_compile
    )
    run_args = (t_params, d_params, pre.out_info, policy_params)
    run = programs.compile(loop.run_rounds, run_args, graphdefs | {"config": static}, on_compile)
    if hand_off:  # goodput's plain steps run in the target-only program
        # A proposing drafter is read before every round and after every plain step.
        looks = static.proposes_tokens
        look_args = (d_params,) if looks else ()
        look_kw = {"d_graphdef": d_graphdef} if looks else {}
        plan_program = programs.compile(
            loop.skip_next, (policy_params, pre.out_info, *look_args),
            {"config": static} | look_kw, on_compile,
        )  # fmt: skip
        steps_kw = {
            "graphdef": t_graphdef,
            "steps": static.skips,
            "sampling": static.verification.sampling,
            "taps": static.head_taps,  # a draft head's context gains each step's states
        }
        if looks:
            steps_kw |= look_kw | {"config": static}
            look_args += (policy_params,)
        steps_program = programs.compile(
            loop.run_target_steps, (t_params, pre.out_info, *look_args), steps_kw, on_compile
        )

        def plan(policy_params, state):
            return plan_program(policy_params, state, *((d_params,) if looks else ()))

        def plain(t_params, state):
            extra = (d_params, policy_params) if looks else ()
            return steps_program(t_params, state, *extra)

    compile_s, compiled = time.perf_counter() - t0, programs.compiled - before
    chunks: list = []
    tracker = None
    if goodput and hand_off and correct_costs:
        assert costs is not None
        learnt = (costs.round_overhead_s, costs.step_overhead_s)
        tracker = costs_lib.CostTracker(
            costs.round_costs(static, overhead=False),
            prior=learnt if any(learnt) else None,
            scale=costs.round_scale,
        )

    programs_run: list[str] = []  # per call: "steps" or "rounds" (DecodeOutput.calls)

    def call(state):
        nonlocal policy_params
        t0 = time.perf_counter()
        skip = hand_off and bool(plan(policy_params, state))
        # The plain step's cost is measured too, once a decode has drafted: a calibration
        # that overstates it would otherwise keep the policy drafting, unchecked
        # (docs/goodput.md, "Measuring the plain step too").
        probe = hand_off and tracker is not None and bool(chunks) and not tracker.observed["step"]
        # A program's first execution is slower than the rest: its call is not a cost the
        # decode will pay again, so the tracker leaves it out (docs/goodput.md, "Costs
        # that correct themselves").
        programs_run.append("steps" if skip or probe else "rounds")
        if skip or probe:
            first = programs.first_execution(plan_program, steps_program)
            state, ran = _plain_steps(plain, t_params, state, static, chunks, losing=skip)
            if tracker is not None and not first:
                tracker.observe_steps(time.perf_counter() - t0, ran)
        else:
            first = programs.first_execution(run, *((plan_program,) if hand_off else ()))
            state, stats = run(t_params, d_params, state, policy_params)
            chunks.append(jax.device_get(stats))
            if tracker is not None and not first:
                active = chunks[-1].active
                depths = np.where(active, chunks[-1].depth, 0).max(axis=1)[active.any(axis=1)]
                tracker.observe_rounds(time.perf_counter() - t0, depths)
        if tracker is not None:
            costs_now = _replicated(tracker.round_costs(), placement)
            policy_params = policy_params.replace(costs=costs_now)
        return state

    state, prefill_s, decode_s, timed = _drive(pre, pre_args, call, rows, progress)
    calls = tuple(DecodeCall(k, s, n) for k, (s, n) in zip(programs_run, timed, strict=True))
    stats = jax.tree.map(lambda *xs: np.concatenate(xs, axis=0)[:, :rows], *chunks)
    keep = np.any(stats.active, axis=1)
    stats = jax.tree.map(lambda x: x[keep], stats)
    tokens, rounds = _outputs(state, rows)
    if tracker is not None and calibrated is not None:
        # The next run starts from what this one saw: the overheads, and what drafting
        # produced this decode (the rows' counts less the prior they started with).
        assert state.policy is not None
        emitted, counted = jax.device_get((state.policy.emitted, state.policy.rounds))
        drafted = (
            mode,
            float(np.sum(emitted[:rows] - past_row[0])),
            np.maximum(np.sum(counted[:rows] - past_row[1], axis=0), 0.0),
        )
        costs_lib.remember(calibrated, tracker, drafted)
    weighed = jax.device_get(policy_params.costs) if goodput else None
    return DecodeOutput(
        tokens,
        stats,
        rounds,
        prefill_s,
        decode_s,
        compile_s,
        compiled,
        round_costs=weighed,
        calls=calls,
    )


def target_decode(
    target,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    eos_ids: tuple[int, ...] = (),
    key: jax.Array | None = None,
    prompt_width: int | None = None,
    rounds_per_call: int = 16,
    progress: Callable[[int], None] | None = None,
    mesh: jax.sharding.Mesh | None = None,
    on_compile: Callable[[str], None] | None = None,
    programs: Programs | None = None,
) -> DecodeOutput:
    """Target-only decoding (greedy at temperature 0, else sampled), the speed baseline.

    Arguments as in :func:`speculative_decode` (``mesh`` included); prompts need at least 1
    token.

    Raises:
      ValueError: invalid sampling settings, ``max_new_tokens < 1``, short prompts, or
        prompts plus ``max_new_tokens`` longer than the target's context
        (``max_position_embeddings``).
    """
    check_sampling(temperature, top_p)
    check_int("max_new_tokens", max_new_tokens)
    vocab_size = _vocab_size(target)
    rows = len(prompts)
    width = _prepare_prompts(
        prompts, prompt_width, 1, vocab_size, {"target": target}, max_new_tokens, 0
    )
    settings = Settings.create(max_new_tokens, temperature, top_p, eos_ids)
    (target,), placement = _on_mesh((target,), mesh)
    graphdef, params = split_model(target)
    prompt, lengths = _padded(prompts, width, 1, vocab_size, placement)
    key = jax.random.key(0) if key is None else key
    key, settings = _replicated((key, settings), placement)
    sizes = Sizes.for_prompts(width, None, bucket(max_new_tokens))
    programs = default_programs() if programs is None else programs
    t0, before = time.perf_counter(), programs.compiled
    pre_args = (params, prompt, lengths, key, settings)
    pre = programs.compile(
        loop.prefill_target, pre_args, {"graphdef": graphdef, "sizes": sizes}, on_compile
    )
    kw = dict(graphdef=graphdef, steps=rounds_per_call, sampling=temperature > 0)
    run = programs.compile(loop.run_target_steps, (params, pre.out_info), kw, on_compile)
    compile_s, compiled = time.perf_counter() - t0, programs.compiled - before
    state, prefill_s, decode_s, timed = _drive(
        pre, pre_args, lambda st: run(params, st), rows, progress
    )
    tokens, rounds = _outputs(state, rows)
    calls = tuple(DecodeCall("steps", s, n) for s, n in timed)
    return DecodeOutput(tokens, None, rounds, prefill_s, decode_s, compile_s, compiled, calls=calls)
