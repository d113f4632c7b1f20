"""The decoders' host side: prompts placed, programs compiled, calls driven, outputs read.

A decode compiles its programs ahead of time (:class:`Compiled`), runs the prefill, then
calls a compiled loop until every row is done (:func:`drive`); between calls the speculative
decoder's :class:`SpeculativeCalls` asks ``goodput``'s
:class:`~jaxcert.decoding.goodput.GoodputRun` (when there is one) which program runs next
and tells it what each call took.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxcert import models
from jaxcert.base.programs import Programs
from jaxcert.base.prompts import pad_prompts
from jaxcert.base.validate import check_int
from jaxcert.decoding import loop
from jaxcert.decoding import node_stats as stats_lib
from jaxcert.decoding import policies as policies_lib
from jaxcert.decoding.config import DecodeConfig, Sizes, bucket, prompt_room
from jaxcert.decoding.goodput import GoodputRun
from jaxcert.decoding.pairing import Pair, place_prompts, replicated
from jaxcert.decoding.state import RoundStats, Settings

__all__ = ["Batch", "Compiled", "SpeculativeCalls", "compile_speculative", "drive", "outputs"]


@dataclasses.dataclass(frozen=True)
class Batch:
    """Prompts on the device(s), ``B'`` rows (``B`` real ones, the rest pad a mesh).

    Attributes:
      prompt: ``[B', T]`` int32 right-padded prompts; lengths: ``[B']`` int32.
      rows: the real rows ``B``; width: ``T``.
      key: PRNG key; settings: the traced :class:`~jaxcert.decoding.state.Settings`.
      sizes: the static buffer sizes (:class:`~jaxcert.decoding.config.Sizes`).
    """

    prompt: jax.Array
    lengths: jax.Array
    rows: int
    width: int
    key: jax.Array
    settings: Settings
    sizes: Sizes

    @classmethod
    def create(
        cls, prompts, *, models_: dict, vocab_size, placement, config: DecodeConfig | None,
        max_new_tokens: int, temperature: float, top_p: float, eos_ids, key=None,
        prompt_width: int | None = None,
    ) -> Batch:  # fmt: skip
        """Validates the prompts (at least 2 tokens each with a drafter, 1 without) and the
        context length of ``models_`` and places them; without ``prompt_width`` the width
        is :func:`~jaxcert.decoding.config.prompt_room` of the longest prompt, so prompts
        of any length up to 512 tokens share one program."""
        minimum = 1 if config is None else 2
        if prompt_width is not None:
            check_int("prompt_width", prompt_width)
        _, lengths = pad_prompts(
            prompts, width=prompt_width, minimum=minimum, vocab_size=vocab_size
        )
        longest = int(lengths.max())
        models.check_context_length(
            models_, prompt_tokens=longest, new_tokens=max_new_tokens,
            draft_positions=0 if config is None else config.depth,
        )  # fmt: skip
        width = prompt_width if prompt_width is not None else prompt_room(longest)
        prompt, lengths = place_prompts(prompts, width, minimum, vocab_size, placement)
        settings = Settings.create(max_new_tokens, temperature, top_p, eos_ids)
        key = jax.random.key(0) if key is None else key
        key, settings = replicated((key, settings), placement)
        static = None if config is None else config.shape_only()
        sizes = Sizes.for_prompts(width, static, bucket(max_new_tokens))
        return cls(prompt, lengths, len(prompts), width, key, settings, sizes)


@dataclasses.dataclass
class Compiled:
    """The speculative decoder's programs, compiled for one pair, config and batch shape.

    Attributes:
      prefill: ``() -> DecodeState``; rounds: ``(policy_params, state) -> (state, stats)``.
      plan: ``(policy_params, state) -> []`` bool, the next round would skip the drafter;
        steps: ``(policy_params, state) -> state``, ``goodput``'s plain target steps (both
        ``None`` unless ``goodput`` may skip, :func:`~jaxcert.decoding.loop.hands_off`).
      compile_s: seconds spent compiling; compiled: programs compiled (0: all cached).
    """

    prefill: Callable
    rounds: Callable
    plan: Callable | None
    steps: Callable | None
    compile_s: float
    compiled: int
    _programs: Programs
    _handles: dict

    def first_execution(self, program: str) -> bool:
        """Whether ``program`` (``"rounds"`` or ``"steps"``) runs for the first time now."""
        return self._programs.first_execution(*self._handles[program])


def compile_speculative(
    pair: Pair, batch: Batch, policy_params, programs: Programs, on_compile=None
) -> Compiled:
    """Compiles (or finds in ``programs``) the prefill, the round loop and, when
    ``goodput`` may skip, its plan and plain-step programs."""
    static = pair.config.shape_only()  # budget, end tokens, temperature and top-p are traced
    t0, before = time.perf_counter(), programs.compiled
    t, d, drafter = pair.t_params, pair.d_params, pair.drafter
    kinds = {"t_graphdef": pair.t_graphdef, "drafter": drafter, "config": static}
    pre_args = (t, d, batch.prompt, batch.lengths, policy_params, batch.key, batch.settings)
    pre = programs.compile(loop.prefill, pre_args, kinds | {"sizes": batch.sizes}, on_compile)
    run = programs.compile(loop.run_rounds, (t, d, pre.out_info, policy_params), kinds, on_compile)
    plan = steps = None
    handles: dict = {"rounds": (run,), "steps": ()}
    if loop.hands_off(static):  # goodput's plain steps run in the target-only program
        plan_program = programs.compile(
            loop.skip_next, (policy_params, pre.out_info, d),
            {"config": static, "drafter": drafter}, on_compile,
        )  # fmt: skip
        steps_kw = {
            "graphdef": pair.t_graphdef, "steps": static.skips,
            "sampling": static.verification.sampling, "drafter": drafter, "config": static,
        }  # fmt: skip
        steps_program = programs.compile(
            loop.run_target_steps, (t, pre.out_info, d, policy_params), steps_kw, on_compile
        )

        def plan(policy_params, state):
            return plan_program(policy_params, state, d)

        def steps(policy_params, state):
            return steps_program(t, state, d, policy_params)

        handles = {"rounds": (run, plan_program), "steps": (plan_program, steps_program)}
    return Compiled(
        prefill=lambda: pre(*pre_args),
        rounds=lambda policy_params, state: run(t, d, state, policy_params),
        plan=plan,
        steps=steps,
        compile_s=time.perf_counter() - t0,
        compiled=programs.compiled - before,
        _programs=programs,
        _handles=handles,
    )


class SpeculativeCalls:
    """The speculative decoder's host loop body: one call of a compiled program per
    :meth:`__call__`, the round loop or (``goodput``) plain target steps.

    Attributes:
      policy_params: the :class:`~jaxcert.decoding.policies.PolicyParams` (costs corrected
        as the decode runs). chunks: per call, the ``[R, B, ...]`` host :class:`RoundStats`.
      programs_run: per call, ``"rounds"`` or ``"steps"``.
    """

    def __init__(self, compiled: Compiled, policy_params, static: DecodeConfig, goodput, placement):
        self.compiled, self.policy_params, self.static = compiled, policy_params, static
        self.goodput: GoodputRun | None = goodput
        self.placement = placement
        self.chunks: list = []
        self.programs_run: list[str] = []

    def __call__(self, state):
        t0 = time.perf_counter()
        c = self.compiled
        skip = c.plan is not None and bool(c.plan(self.policy_params, state))
        if self.goodput is not None and c.steps is not None:
            program = self.goodput.program(skip)
        else:
            program = "steps" if skip else "rounds"
        first = c.first_execution(program)
        if program == "steps":
            assert c.steps is not None
            state, ran = plain_steps(
                c.steps, self.policy_params, state, self.static, self.chunks, losing=skip
            )
        else:
            state, stats = c.rounds(self.policy_params, state)
            self.chunks.append(jax.device_get(stats))
            active = self.chunks[-1].active
            depths = np.where(active, self.chunks[-1].depth, 0).max(axis=1)
            ran = depths[active.any(axis=1)]
        self.programs_run.append(program)
        if self.goodput is not None and c.steps is not None:
            costs = self.goodput.observe(program, time.perf_counter() - t0, ran, first=first)
            if costs is not self.policy_params.costs:
                placed = replicated(costs, self.placement)
                self.policy_params = self.policy_params.replace(costs=placed)
        return state

    def stats(self, rows: int) -> RoundStats:
        """``[R, B]`` statistics of the rounds run (the batch's real rows)."""
        stats = jax.tree.map(lambda *xs: np.concatenate(xs, axis=0)[:, :rows], *self.chunks)
        keep = np.any(stats.active, axis=1)
        return jax.tree.map(lambda x: x[keep], stats)


def drive(prefill: Callable, call: Callable, rows: int, progress) -> tuple:
    """The host loop of both decoders: the timed ``prefill()``, then ``call(state)`` until
    every row is done. Returns ``(state, prefill_s, decode_s, calls)``, ``calls`` a list of
    ``(seconds, tokens)`` per call."""
    t0 = time.perf_counter()
    state = prefill()
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


def _generated(state, rows: int):
    """Output tokens so far in the first ``rows`` rows (the others pad the batch)."""
    new = state.length - state.prompt_length
    return jnp.sum(new if new.shape[0] == rows else new[:rows])


def outputs(state, rows: int) -> tuple[list[np.ndarray], np.ndarray]:
    """Per row, the output tokens, and ``[B]`` rounds, of the first ``rows`` rows."""
    tokens, length, prompt = jax.device_get((state.tokens, state.length, state.prompt_length))
    rounds = np.asarray(jax.device_get(state.rounds))[:rows]
    return [tokens[b, prompt[b] : length[b]].copy() for b in range(rows)], rounds


def drafted(state, rows: int, prior) -> tuple[float, np.ndarray]:
    """What a ``goodput`` decode's drafting rounds emitted, summed over the first ``rows``
    rows, less the ``prior`` ``(emitted, rounds [K + 1])`` each row started with: tokens,
    and row-rounds by depth."""
    emitted, counted = jax.device_get((state.policy.emitted, state.policy.rounds))
    start = (np.float32(0.0), np.zeros(counted.shape[1:], np.float32)) if prior is None else prior
    return (
        float(np.sum(emitted[:rows] - start[0])),
        np.maximum(np.sum(counted[:rows] - start[1], axis=0), 0.0),
    )


def plain_steps(steps, policy_params, state, config: DecodeConfig, chunks: list, losing=True):
    """``goodput``'s skipped rounds: up to ``config.skips`` target-only steps (``steps``, a
    compiled :func:`~jaxcert.decoding.loop.run_target_steps`) on the speculative state. The
    drafter's cache and re-read start stay (it catches up in its next re-read); the skip
    count grows by the steps run; each step is recorded as a round that drafted nothing and
    emitted one token. ``losing=False`` (a probe of the plain step's cost, not a skip the
    policy chose): the drafting round before it does not count as a losing measurement.
    Returns ``(state, steps run)``."""
    before = np.asarray(jax.device_get(state.rounds))  # read before `steps` donates it
    state = steps(policy_params, state)
    ran_per_row = np.asarray(jax.device_get(state.rounds)) - before  # [B] steps per row
    assert state.policy is not None
    ran = int(ran_per_row.max(initial=0))
    rows = int(np.sum(ran_per_row > 0))  # rows still decoding: those the last round weighed
    weighed = rows if losing else 0
    state = state.replace(policy=policies_lib.skipped_round(state.policy, ran, weighed))
    chunks.append(plain_round_stats(ran_per_row, config.skips, config.num_nodes))
    return state, ran


def plain_round_stats(steps: np.ndarray, rounds: int, nodes: int) -> RoundStats:
    """Host statistics ``[rounds, B]`` of plain target steps, ``steps[b]`` in row ``b``:
    each a round that drafted nothing and emitted one token."""
    active = np.arange(rounds)[:, None] < steps[None, :]  # [rounds, B]
    empty = jax.device_get(stats_lib.empty_round_stats(rounds, active.shape[1], nodes))
    return empty.replace(active=active, emitted=active.astype(np.int32))


def never_drafts(
    policy_params: policies_lib.PolicyParams, config: DecodeConfig, batch: int
) -> bool:
    """Whether ``goodput`` will run every round of a ``batch``-row decode as a plain step:
    its first round skips on the prior from earlier decodes, and that skip, a losing
    measurement of ``batch`` row-rounds, reaches ``patience``, so it never measures again
    (``docs/goodput.md``, "What earlier decodes measured")."""
    patience = int(jax.device_get(policy_params.patience))
    if config.skips == 0 or patience <= 0 or batch < patience or config.proposes_tokens:
        return False  # a proposing drafter is read before every round, whatever the past
    state = policies_lib.init_policy_state(policy_params, batch)
    active = jnp.ones((batch,), bool)  # every row, padding rows included, starts active
    need = jnp.ones((batch,), jnp.float32)  # equal budgets: only their ratios matter
    return bool(policies_lib.should_skip(policy_params, state, active, config.skips, need))
