"""The decoders' entry points: batches of token prompts in, tokens, statistics and timings out.

Both decoders compile ahead of time (timed as ``compile_s``, cached per configuration and
shape in a :class:`~jaxcert.base.programs.Programs`), then run in calls of a few rounds
(or steps) so a progress callback can follow; ``decode_s`` is the wall time of those calls
alone, ``prefill_s`` that of the prompt pass. On a mesh (a target placed with
:func:`jaxcert.models.shard` or loaded with ``mesh=``, or a ``mesh=`` argument) both models
run on it, the prompts split over its batch axis (:mod:`~jaxcert.decoding.pairing`).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxcert.base.programs import Programs, default_programs
from jaxcert.base.validate import check_int
from jaxcert.decoding import host, loop
from jaxcert.decoding import policies as policies_lib
from jaxcert.decoding.config import DecodeConfig, check_sampling
from jaxcert.decoding.costs import PassCosts
from jaxcert.decoding.goodput import GoodputController
from jaxcert.decoding.pairing import on_mesh, pair, replicated, split_model, vocab_size
from jaxcert.decoding.state import RoundStats

__all__ = ["DecodeCall", "DecodeOutput", "speculative_decode", "target_decode"]


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
    costs: GoodputController | PassCosts | None = None,
) -> DecodeOutput:
    """Speculative decoding of one batch of token prompts.

    Args:
      target, drafter: ``models.LoadedModel`` or ``nnx.Module`` (same vocabulary), or
        ``(graphdef, policy_params)`` pairs; on one device or on a mesh (see the module docstring).
        The drafter may be a draft head (:class:`jaxcert.models.EagleHead`) or an
        :class:`~jaxcert.decoding.ngram.NgramDrafter` (one-hot proposals; it takes the
        target's vocabulary size).
      prompts: ``B`` token-id sequences, each of length >= 2.
      policy: the draft-length policy (:func:`~jaxcert.decoding.policies.parse_policy`).
      config: a :class:`~jaxcert.decoding.config.DecodeConfig`.
      key: PRNG key (sampling); default ``jax.random.key(0)``.
      prompt_width: the prompts' room in the caches, ``>=`` the longest prompt (default:
        :func:`~jaxcert.decoding.config.prompt_room`, a multiple of 512: prompts up to 512
        tokens share every program); the prefill reads the prompts in 64-token chunks
        when it is a multiple of 64, else in one pass of this width.
      progress: called with the number of new output tokens after every call.
      mesh: run on this ``jax.sharding.Mesh`` (``Auto`` axes); default: the mesh the models
        live on, if any.
      on_compile: called with the program's name before each compilation (a program
        ``programs`` does not hold yet), e.g. to show it in a progress display.
      programs: where compiled programs are kept and counted
        (:class:`~jaxcert.base.programs.Programs`; default: the process's,
        :func:`~jaxcert.base.programs.default_programs`).
      costs: ``goodput`` only (other policies ignore it): the
        :class:`~jaxcert.decoding.goodput.GoodputController` whose pass costs the policy
        weighs, corrected by this decode's timed calls and told what its drafting emitted
        (hold one across decodes, and :meth:`~GoodputController.save` it, to keep what they
        learn); a :class:`~jaxcert.decoding.costs.PassCosts`: weighed exactly as given;
        default: this machine's calibration (:meth:`GoodputController.calibrate`, read
        from or written to the cache), corrected during this decode only. When what earlier
        decodes measured says this decode will not draft at all, it runs as
        :func:`target_decode` and its statistics record plain rounds.

    Returns:
      A :class:`DecodeOutput`.

    Raises:
      ValueError: mismatched vocabularies, short prompts or an invalid config; prompts plus
        ``max_new_tokens`` plus the draft depth longer than a model's context
        (``max_position_embeddings``); models on different meshes or an ``Explicit`` mesh;
        ``goodput`` costs without this batch size (a width between measured ones is
        interpolated, one past the widest priced as the widest).
    """
    p = pair(target, drafter, config=config, policy=policy, mesh=mesh)
    c = p.config
    batch = host.Batch.create(
        prompts, models_=p.models, vocab_size=p.vocab_size, placement=p.placement, config=c,
        max_new_tokens=c.max_new_tokens, temperature=c.temperature, top_p=c.top_p,
        eos_ids=c.eos_ids, key=key, prompt_width=prompt_width,
    )  # fmt: skip
    goodput = _goodput(policy, costs, p, batch)
    policy_params = _policy_params(policy, c, goodput, p.placement)
    if (
        goodput is not None
        and goodput.prior is not None
        and host.never_drafts(policy_params, c.shape_only(), int(batch.prompt.shape[0]))
    ):
        return _without_drafter(
            p.models["target"], prompts, c, goodput, policy_params, key=key,
            prompt_width=batch.width, progress=progress, mesh=mesh, on_compile=on_compile,
            programs=programs,
        )  # fmt: skip
    programs = default_programs() if programs is None else programs
    compiled = host.compile_speculative(p, batch, policy_params, programs, on_compile)
    calls = host.SpeculativeCalls(compiled, policy_params, c.shape_only(), goodput, p.placement)
    state, prefill_s, decode_s, timed = host.drive(compiled.prefill, calls, batch.rows, progress)
    if goodput is not None and compiled.steps is not None:
        goodput.finish(*host.drafted(state, batch.rows, goodput.prior))
    tokens, rounds = host.outputs(state, batch.rows)
    return DecodeOutput(
        tokens, calls.stats(batch.rows), rounds, prefill_s, decode_s, compiled.compile_s,
        compiled.compiled,
        round_costs=jax.device_get(calls.policy_params.costs) if goodput is not None else None,
        calls=tuple(
            DecodeCall(k, s, n) for k, (s, n) in zip(calls.programs_run, timed, strict=True)
        ),
    )  # fmt: skip


def _goodput(policy, costs, p, batch) -> host.GoodputRun | None:
    """``goodput``'s :class:`~jaxcert.decoding.goodput.GoodputRun` for this decode (``None``
    for the other policies)."""
    if not isinstance(policy, policies_lib.Goodput):
        return None
    rows = int(batch.prompt.shape[0])
    if costs is None:
        targets = (p.models["target"], p.models["drafter"])
        costs = GoodputController.calibrate(*targets, config=p.config.shape_only(), rows=rows)
    elif isinstance(costs, PassCosts):
        costs = GoodputController(costs, correct=False)
    return costs.begin(rows, p.config.shape_only(), p.config.temperature)


def _policy_params(policy, config: DecodeConfig, goodput, placement):
    """The policy lowered to traced scalars, with ``goodput``'s costs and prior, replicated
    on the mesh."""
    depth = config.shape_only().depth
    costs = policies_lib.RoundCosts.unknown(depth) if goodput is None else goodput.round_costs
    policy_params = policies_lib.PolicyParams.from_policy(policy, costs)
    if goodput is not None and goodput.prior is not None:
        # What earlier decodes' drafting produced: the first round's skip decision weighs
        # it (docs/goodput.md, "What earlier decodes measured").
        policy_params = policy_params.with_past(*goodput.prior)
    if isinstance(config.tree, loop.tree_lib.Chain) and policy.k_max > config.max_draft:
        policy_params = policy_params.replace(k_max=jnp.asarray(config.max_draft, jnp.int32))
    return replicated(policy_params, placement)


def _without_drafter(target, prompts, config, goodput, policy_params, **kw) -> DecodeOutput:
    """A ``goodput`` decode that will not draft (:func:`~jaxcert.decoding.host.never_drafts`),
    run as :func:`target_decode`: every step is recorded as a round that drafted nothing
    and emitted one token, and the past is kept with nothing drafted (so its weight halves;
    the overheads stay: target-only steps are not the speculative decoder's plain steps)."""
    out = target_decode(
        target, prompts, max_new_tokens=config.max_new_tokens, temperature=config.temperature,
        top_p=config.top_p, eos_ids=config.eos_ids, **kw,
    )  # fmt: skip
    steps = np.asarray(out.rounds)  # [B] steps per row
    nodes = config.shape_only().num_nodes
    stats = host.plain_round_stats(steps, int(steps.max(initial=0)), nodes)
    goodput.finish(0.0, np.zeros(policy_params.costs.round_s.shape))
    return dataclasses.replace(out, stats=stats, round_costs=jax.device_get(policy_params.costs))


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
    (placed,), placement = on_mesh((target,), mesh)
    batch = host.Batch.create(
        prompts, models_={"target": target}, vocab_size=vocab_size(target), placement=placement,
        config=None, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
        eos_ids=eos_ids, key=key, prompt_width=prompt_width,
    )  # fmt: skip
    graphdef, params = split_model(placed)
    programs = default_programs() if programs is None else programs
    t0, before = time.perf_counter(), programs.compiled
    pre_args = (params, batch.prompt, batch.lengths, batch.key, batch.settings)
    pre = programs.compile(
        loop.prefill_target, pre_args, {"graphdef": graphdef, "sizes": batch.sizes}, on_compile
    )
    kw = dict(graphdef=graphdef, steps=rounds_per_call, sampling=temperature > 0)
    run = programs.compile(loop.run_target_steps, (params, pre.out_info), kw, on_compile)
    compile_s, compiled = time.perf_counter() - t0, programs.compiled - before
    state, prefill_s, decode_s, timed = host.drive(
        lambda: pre(*pre_args), lambda st: run(params, st), batch.rows, progress
    )
    tokens, rounds = host.outputs(state, batch.rows)
    calls = tuple(DecodeCall("steps", s, n) for s, n in timed)
    return DecodeOutput(tokens, None, rounds, prefill_s, decode_s, compile_s, compiled, calls=calls)
