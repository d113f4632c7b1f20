"""``jaxcert certify``: certificates of every rule at every greedy decoding position.

Data flow: prompts -> tokenizer + chat template -> a fixed set of ``B`` decoding slots
(continuous batching) -> per slot, a chunked prefill of its prompt -> a jitted greedy loop
(``lax.scan`` over ``chunk`` steps, one host round-trip per chunk) that, at every step,
computes the target's statistics and the exact certificate of every rule from the
full-vocabulary logits, then appends the greedy token -> one table per finished prompt.

**Prefill without waste.** A prompt is prefilled alone, in pieces of a few fixed widths
(:attr:`CertifyOptions.prefill_widths`, by default 256, 128, 64, 32 and 16 tokens: the
widest that the remaining tokens fill, the last piece padded up to the narrowest), into a
one-row cache that is then copied into its slot. Each width compiles once; the padding is
below the narrowest width per prompt, and the lm_head runs only on the last prompt token.

**Continuous batching.** When a slot's prompt ends (end of turn or ``steps``), the next
prompt is prefilled into that slot before the next chunk; every compiled shape stays the
same. A row's numbers depend only on its own prompt and the run's shapes (slots, cache
length), not on which prompts share the batch, so an interrupted run that resumes
(``skip``) computes the same rows as an uninterrupted one.

**A drafter beside the target.** With ``drafter`` (a language model of the target's
vocabulary, or a draft head of the target) every slot also holds the drafter's cache: it
prefills the same prompt and, at each step, reads the target's greedy token
(teacher-forced), in the same programs as the target. A draft head reads token ``x_t`` with
the target's states at ``t - 1``, which the target's prefill and steps then also return
(:func:`jaxcert.models.eagle.target_step`): its ``q`` at a position is the decoder's first
drafted token's after the target read the text so far. Each position then also records the
drafter's ``KL(p‖q)``, ``TV`` and, per rule, whether it is certified and accepted
(:mod:`jaxcert.pipeline.drafter`), computed on device from both logits; the target's
columns are those of a run without a drafter.

On a mesh (:mod:`jaxcert.models.mesh`) the slots are split over the ``data`` axis and the weights
over ``model``; the one-row prefill is replicated over ``data``. With ``part`` a process
certifies only its share of the prompts (with the shapes of the whole run, so the same
numbers) and :func:`merge_parts` joins the shares.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import time
from collections.abc import Callable, Collection, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pyarrow as pa
from flax import nnx
from jax import lax
from jax.sharding import PartitionSpec as P

from jaxcert import models
from jaxcert.base.programs import Programs
from jaxcert.base.prompts import Prompt, encode_prompts
from jaxcert.base.tables import counted
from jaxcert.base.validate import check_int, round_up
from jaxcert.core import stats as stats_lib
from jaxcert.core.solver import certificates
from jaxcert.decoding.protocols import reads_target
from jaxcert.models import eagle
from jaxcert.models import mesh as mesh_lib
from jaxcert.pipeline.drafter import DrafterTerms, drafter_columns, drafter_terms
from jaxcert.pipeline.report import rule_column

__all__ = [
    "CertifyOptions",
    "Certifier",
    "Progress",
    "certify_prompts",
    "check_drafter",
    "merge_parts",
    "prefill_pieces",
    "rule_column",
]


@dataclasses.dataclass(frozen=True, kw_only=True)
class CertifyOptions:
    """Options of a certification run.

    Attributes:
      steps: greedy continuation length per prompt, in tokens.
      batch_size: decoding slots ``B`` (prompts decoded together).
      min_prompt_tokens: prompts shorter than this (after the chat template) are skipped.
      max_prompt_tokens: prompts longer than this are skipped (``None``: none). Every slot's
        cache holds the longest prompt plus ``steps``, and each decoding step attends over
        it: one very long prompt slows every row (ShareGPT's longest is 5,699 tokens).
      stop_at_eos: stop recording a prompt after it emits an end-of-turn token.
      chunk: decoding steps per jitted call (a finished slot is refilled between calls).
      top: ``k`` of the recorded top-``k`` coverage.
      chat: apply the tokenizer's chat template.
      system_prompt: explicit system message (``None``: the template's default).
      prefill_widths: the prefill piece widths, in tokens (one compilation each).
    """

    steps: int = 128
    batch_size: int = 8
    min_prompt_tokens: int = 0
    max_prompt_tokens: int | None = None
    stop_at_eos: bool = True
    chunk: int = 16
    top: int = 10
    chat: bool = True
    system_prompt: str | None = None
    prefill_widths: tuple[int, ...] = (16, 32, 64, 128, 256)

    def __post_init__(self):
        for name in ("steps", "batch_size", "chunk", "top"):
            check_int(name, getattr(self, name))
        check_int("min_prompt_tokens", self.min_prompt_tokens, 0)
        if self.max_prompt_tokens is not None:
            check_int("max_prompt_tokens", self.max_prompt_tokens)
        widths = tuple(self.prefill_widths)
        if not widths:
            raise ValueError("prefill_widths must name at least one width")
        for w in widths:
            check_int("prefill width", w)
        object.__setattr__(self, "prefill_widths", tuple(sorted(set(widths))))


def prefill_pieces(length: int, widths: Sequence[int]) -> list[tuple[int, int]]:
    """How a prompt of ``length`` tokens is prefilled: ``[(width, real_tokens), ...]``.

    The widest piece that the remaining tokens fill, then the narrowest width for the rest
    (padded): the padding is below ``min(widths)`` tokens per prompt.

    >>> prefill_pieces(100, (16, 64, 256))
    [(64, 64), (16, 16), (16, 16), (16, 4)]
    """
    widths = sorted(widths)
    pieces, left = [], length
    while left > 0:
        fits = [w for w in widths if w <= left]
        width = fits[-1] if fits else widths[0]
        pieces.append((width, min(width, left)))
        left -= width
    return pieces


@dataclasses.dataclass(frozen=True)
class Progress:
    """A snapshot of a run, passed to the ``progress`` callback.

    Attributes:
      stage: ``"compile"`` (a program is about to compile), ``"prefill"`` or ``"decode"``.
      prompts_done: prompts finished (all their positions yielded).
      prompts_total: prompts this run certifies (without the skipped ones).
      positions: positions recorded so far.
    """

    stage: str
    prompts_done: int
    prompts_total: int
    positions: int


# ---------------------------------------------------------------------------------------------
# Jitted pieces, compiled ahead of time through a ``Programs`` (one program per shape: decode
# chunk, each prefill width, install).


@functools.partial(jax.jit, static_argnames=("graphdef", "taps"), donate_argnames=("row_cache",))
def _prefill_piece(params, tokens, count, row_cache, *, graphdef, taps=None):
    """Feeds ``tokens`` ``[1, T]`` (``count`` real) to a one-row cache and commits them.

    Returns ``(logits, row_cache, states)``: the logits ``[1, V]`` after the last real token
    (the lm_head runs on it only) and, for a draft head reading ``taps`` (``None``: no
    head), the states ``[1, T, Z]`` it reads (:func:`jaxcert.models.eagle.target_features`).
    """
    model = nnx.merge(graphdef, params)
    states = None
    if taps is None:
        hidden, row_cache = model.features(tokens, row_cache)
    else:
        hidden, row_cache, states = eagle.target_features(model, tokens, row_cache, taps)
    last = lax.dynamic_index_in_dim(hidden, count - 1, axis=1, keepdims=False)  # [1, E]
    return model.project(last), row_cache.commit(count), states


@functools.partial(jax.jit, static_argnames=("graphdef",), donate_argnames=("row_cache",))
def _prefill_head_piece(params, tokens, count, row_cache, context, states, *, graphdef):
    """A draft head reads a prefill piece ``tokens`` ``[1, T]`` (``count`` real): token
    ``t`` with the fused target states at ``t - 1`` (``context`` ``[1, E]`` before the
    first; zeros before a prompt's first token), as the decoder's prefill and the head's
    training read (:func:`jaxcert.decoding.protocols.context_before`).

    Returns ``(hidden [1, E], row_cache, context [1, E])``: the head's state after the last
    real token (what it projects), its committed cache, and the context of the next token
    (the fused target states at the last real token).
    """
    head = nnx.merge(graphdef, params)
    fused = head.fuse(states)  # [1, T, E]
    before = jnp.concatenate([context[:, None].astype(fused.dtype), fused[:, :-1]], axis=1)
    hidden, row_cache = head.features(tokens, row_cache, context=before)
    at = functools.partial(lax.dynamic_index_in_dim, index=count - 1, axis=1, keepdims=False)
    return at(hidden), row_cache.commit(count), at(fused)


@functools.partial(jax.jit, donate_argnames=("cache", "logits", "step", "active"))
def _install(cache, logits, step, active, row_cache, row_logits, slot):
    """Copies a prefilled one-row cache and its logits into ``slot``; the slot starts."""
    hit = jnp.arange(logits.shape[0]) == slot  # [B]
    cache = cache.put_rows(row_cache, slot)  # the Cache method: no reach inside
    logits = jnp.where(hit[:, None], row_logits.astype(logits.dtype), logits)
    return cache, logits, jnp.where(hit, 0, step), active | hit


@functools.partial(jax.jit, donate_argnames=("drafter",))
def _install_drafter(drafter, row_cache, rows, slot):
    """:func:`_install` of the drafter's prefilled row (the target's step and active rule):
    ``drafter`` is ``(cache, *arrays)`` (each ``[B, ...]``), ``rows`` the row's arrays
    (``[1, ...]`` each): a language model's logits, a head's hidden state and context."""
    cache, *arrays = drafter
    hit = jnp.arange(arrays[0].shape[0]) == slot  # [B]
    arrays = [
        jnp.where(hit.reshape((-1,) + (1,) * (a.ndim - 1)), r.astype(a.dtype), a)
        for a, r in zip(arrays, rows, strict=True)
    ]
    return (cache.put_rows(row_cache, slot), *arrays)


def _drafter_terms(d_graphdef, d_params, drafter, logits, rules, values, taps) -> DrafterTerms:
    """The drafter's terms against the target's ``logits`` ``[B, V]``. A language model's
    ``q`` is its logits; a head's (``taps`` not ``None``) is its projected state over the
    full vocabulary, tokens outside its draft vocabulary at its shared logit (a finite
    ``KL``), its proposals the tokens it drafts (``-inf`` outside for an EAGLE-3 head)."""
    certs = jnp.stack(values, axis=-1)  # [B, R]
    if taps is None:
        return drafter_terms(drafter[1], logits, rules, certs)
    head = nnx.merge(d_graphdef, d_params)
    hidden = drafter[1]  # [B, E]
    shown = None if head.outside == "oov" else head.project(hidden)
    q = head.project(hidden, outside="oov")
    return drafter_terms(q, logits, rules, certs, proposal_logits=shown)


def _drafter_step(d_graphdef, d_params, drafter, token, active, states, taps):
    """The drafter reads the target's greedy ``token`` ``[B]`` (committed on ``active``
    rows). A head (``taps`` not ``None``) reads it with the context of the position before
    it and keeps the fused target ``states`` ``[B, Z]`` after it as the next context."""
    if taps is None:
        d_logits, d_cache = models.decode_step(d_graphdef, d_params, token, drafter[0], active)
        return d_cache, d_logits
    head = nnx.merge(d_graphdef, d_params)
    d_cache, _, context = drafter
    hidden, d_cache = head.features(token[:, None], d_cache, context=context[:, None])
    context = head.fuse(states[:, None])[:, 0].astype(context.dtype)  # [B, E]
    return d_cache.commit(active.astype(jnp.int32)), hidden[:, 0], context


@functools.partial(
    jax.jit,
    static_argnames=("graphdef", "d_graphdef", "rules", "length", "top", "eos", "steps",
                     "taps"),
    donate_argnames=("cache", "logits", "step", "active", "drafter"),
)  # fmt: skip
def _decode_chunk(
    params, cache, logits, step, active, d_params, drafter,
    *, graphdef, d_graphdef, rules, length, top, eos, steps, taps=None,
):  # fmt: skip
    """``length`` greedy steps of every slot; records statistics and certificates.

    A slot records while ``active``; it stops after ``steps`` recorded positions or (with
    ``eos``) after emitting an end-of-turn token. Inactive slots compute but commit nothing.
    With a drafter (``drafter`` the state of the drafter ``d_graphdef``, ``d_params``;
    ``None``: none) the drafter reads the same greedy tokens (teacher-forced) and each step
    also records :func:`jaxcert.pipeline.drafter.drafter_terms` of its ``q`` against the
    target's. A language model's state is ``(cache, logits [B, V])``; a draft head's
    (``taps``: the target blocks it reads, ``None`` for no head) is ``(cache, hidden
    [B, E], context [B, E])``, and the target's step also returns the states it reads.
    """

    def body(carry, _):
        cache, logits, step, active, drafter = carry
        st = stats_lib.distribution_stats(logits, top=top)
        values = tuple(c.value for c in certificates(logits, rules))
        token = st.greedy_token
        terms = None
        if drafter is not None:
            terms = _drafter_terms(d_graphdef, d_params, drafter, logits, rules, values, taps)
        record = (st, values, active, step, terms)
        states = None
        if taps is None:
            new_logits, cache = models.decode_step(graphdef, params, token, cache, active)
        else:
            new_logits, cache, states = eagle.target_step(
                graphdef, params, token, cache, active, taps
            )
        if drafter is not None:
            drafter = _drafter_step(d_graphdef, d_params, drafter, token, active, states, taps)
        step = step + active.astype(jnp.int32)
        active = active & (step < steps)
        if eos:
            active = active & ~jnp.isin(token, jnp.asarray(eos, jnp.int32))
        return (cache, new_logits, step, active, drafter), record

    carry, records = lax.scan(body, (cache, logits, step, active, drafter), None, length=length)
    return (*carry, records)


# ---------------------------------------------------------------------------------------------
# The engine.


def _usable(encoded: Sequence, options: CertifyOptions) -> tuple[list[int], dict]:
    """The prompts within the options' token bounds, and the counts of the others.

    Raises:
      ValueError: no prompt is within them.
    """
    low, high = max(1, options.min_prompt_tokens), options.max_prompt_tokens
    lengths = [len(ids) for ids in encoded]
    keep = [i for i, n in enumerate(lengths) if n >= low and (high is None or n <= high)]
    if not keep:
        raise ValueError(
            f"no prompt has between {low} and {high or 'any number of'} tokens "
            f"(shortest: {sorted(lengths)[:5]}, longest: {sorted(lengths)[-5:]})"
        )
    counts = {
        "prompts_given": len(encoded),
        "prompts_used": len(keep),
        "prompts_skipped_short": sum(n < low for n in lengths),
        "prompts_skipped_long": sum(high is not None and n > high for n in lengths),
    }
    return keep, counts


def _share(encoded: Sequence, keep: list[int], skip, part) -> list[int]:
    """What is left (a resumed run skips what is done), then this part's share of it: the
    prompts sorted by length, dealt round-robin (whatever the process count was before).

    Raises:
      ValueError: a bad ``part``, or more parts than prompts.
    """
    skip = set(skip)
    order = [i for i in keep if i not in skip]
    if part is None:
        return order
    index, count = part
    check_int("part count", count)
    if not 0 <= index < count:
        raise ValueError(f"part index must be in [0, {count}), got {index}")
    if count > len(keep):
        raise ValueError(
            f"{count} processes for {counted(len(keep), 'prompt')}: each process needs a prompt"
        )
    return sorted(sorted(order, key=lambda i: (len(encoded[i]), i))[index::count])


@dataclasses.dataclass
class _Slots:
    """The decoding slots of a run: their device state and which prompt each holds."""

    cache: Any
    logits: Any
    step: Any
    active: Any
    row_cache: Any  # the one-row cache a prompt is prefilled into
    owner: list  # prompt index in each slot, or None
    records: list  # each slot's recorded chunks (column dicts)
    # The drafter's (cache, logits [B, V]), a head's (cache, hidden [B, E], context [B, E]),
    # or None without a drafter (_decode_chunk).
    drafter: Any = None
    drafter_row_cache: Any = None  # the drafter's one-row cache
    done: int = 0  # prompts finished
    positions: int = 0  # positions recorded


class Certifier:
    """A certification run over a prompt set: iterate to get one table per finished prompt.

    Example::

      run = Certifier(lm, prompt_set, rules, CertifyOptions(steps=64))
      for table in run:        # in order of completion (continuous batching)
          sink.write(table)
      print(run.info)          # counts, padding, timings

    Args:
      lm: a ``models.LoadedModel`` (the target).
      prompts: the prompts; a prompt's ``prompt_index`` column is its index here.
      rules: the verification rules (``jaxcert.core.rules``).
      options: a :class:`CertifyOptions`.
      drafter: a ``models.LoadedModel`` (or the module itself): a language model with the
        target's vocabulary, a draft head built for the target
        (:class:`jaxcert.models.EagleHead`, as ``jaxcert decode --drafter`` loads it), or
        ``None``. It reads each prompt and the target's greedy continuation
        (teacher-forced, in the same programs as the target), and every row also gets the
        columns of :func:`jaxcert.pipeline.drafter.drafter_columns`: ``kl``, ``tv``,
        ``drafter_token``, ``certified_<rule>`` and ``accepted_<rule>``. A head reads each
        token ``x_t`` with the target's states at ``t - 1`` (``docs/design.md``, "Draft
        heads"), so its ``q`` at position ``t`` is the one the decoder's first drafted token
        has after the target read ``x_<=t``; over the full vocabulary, tokens outside a
        reduced draft vocabulary at the head's shared logit. The target's columns are those
        of a run without a drafter.
      mesh: a ``("data", "model")`` mesh (:func:`jaxcert.models.mesh.make_mesh`): the slots are
        split over ``data`` (the batch size rounded up to a multiple of its size), the
        weights over ``model`` (``jaxcert.models.shard``; tensor parallelism). ``None``:
        JAX's default device.
      part: ``(index, count)``: certify only share ``index`` of ``count`` (the prompts not
        in ``skip``, sorted by length, dealt round-robin), with the shapes of the whole run.
      skip: prompt indices not to certify (already done: ``--resume``). The shapes are
        still those of the whole prompt set, so the other rows are unchanged.
      progress: called with a :class:`Progress` after every prefill and decoding chunk, and
        before a program compiles.
      programs: where the run's programs are compiled and kept
        (:class:`jaxcert.decoding.Programs`, the decoders' mechanism; default: a new one,
        this run's own, so that no other caller's compiler options apply to its numbers).
        Pass one to share compiled programs between runs of the same shapes. The time this
        run spends compiling is ``info["compile_s"]``.

    Raises:
      ValueError: no rules, no prompt long enough, prompts plus steps exceed the model's
        (or the drafter's) context length, mesh axes other than data/model, more parts
        than prompts, or a drafter of another vocabulary, a head built for another target,
        or a drafter without a distribution (prompt lookup).
    """

    def __init__(
        self,
        lm,
        prompts: Sequence[Prompt],
        rules: Sequence,
        options: CertifyOptions = CertifyOptions(),
        *,
        drafter=None,
        mesh: jax.sharding.Mesh | None = None,
        part: tuple[int, int] | None = None,
        skip: Collection[int] = (),
        progress: Callable[[Progress], None] | None = None,
        programs: Programs | None = None,
    ):
        self.rules = tuple(rules)
        if not self.rules:
            raise ValueError("no rules given")
        self._taps: tuple[int, ...] | None = None  # a draft head's taps; None: no head
        if drafter is not None:
            check_drafter(lm, drafter)
            module = _module(drafter)
            self._taps = tuple(module.taps) if reads_target(module) else None
        self.lm, self.drafter, self.prompts, self.options = lm, drafter, prompts, options
        self.mesh, self.progress = mesh, progress
        self.programs = Programs() if programs is None else programs
        self.encoded = encode_prompts(
            lm.tokenizer, prompts, chat=options.chat, system_prompt=options.system_prompt
        )
        keep, counts = _usable(self.encoded, options)
        # Shapes from every usable prompt (not only this part's, nor the ones left to do):
        # each row then has the same numbers in any part, resumed or not.
        longest = max(len(self.encoded[i]) for i in keep)
        data = 1 if mesh is None else mesh_lib.data_size(mesh)
        self.slots = round_up(min(round_up(options.batch_size, data), len(keep)), data)
        checked = {"target": lm} if drafter is None else {"target": lm, "drafter": drafter}
        models.check_context_length(checked, prompt_tokens=longest, new_tokens=options.steps)
        # Room for the padded last prefill piece and the slot's idle writes after its end.
        self.cache_length = round_up(longest, min(options.prefill_widths)) + options.steps + 1
        self.usable = frozenset(keep)
        self.order = _share(self.encoded, keep, skip, part)
        self.info = counts | {
            "prompts_this_run": len(self.order),
            "slots": self.slots,
            "cache_length": self.cache_length,
            "positions": 0,
            "prefill_tokens": 0,
            "prefill_padded_tokens": 0,
            "decode_slot_steps": 0,
            "decode_active_steps": 0,
            "prefill_s": 0.0,
            "decode_s": 0.0,
            "compile_s": 0.0,
        }
        if part is not None:
            self.info["part"] = {"index": part[0], "count": part[1], "prompts": len(self.order)}
        if mesh is not None:
            self.info["mesh"] = dict(mesh.shape)

    # -- host side ------------------------------------------------------------------------

    def _place(self, tree):  # host arrays onto the device(s): slots split over "data"
        if self.mesh is None:
            return jax.tree.map(jnp.asarray, tree)
        return mesh_lib.place(tree, self.mesh, P("data"))

    def _replicated(self, tree):
        if self.mesh is None:
            return jax.tree.map(jnp.asarray, tree)
        return mesh_lib.place(tree, self.mesh, P())

    def _report(self, stage: str, slots: _Slots) -> None:
        if self.progress is not None:
            self.progress(Progress(stage, slots.done, len(self.order), slots.positions))

    def _program(self, fn, args: tuple, static: dict, slots: _Slots):
        """``fn`` compiled for ``args`` through :attr:`programs` (the time it takes is
        counted in ``info["compile_s"]``; the progress callback hears of it first)."""
        before, t0 = self.programs.compiled, time.perf_counter()
        program = self.programs.compile(fn, args, static, lambda _: self._report("compile", slots))
        if self.programs.compiled != before:
            self.info["compile_s"] += time.perf_counter() - t0
        return program

    def __iter__(self) -> Iterator[pa.Table]:
        try:
            yield from self._run()
        finally:
            for key in ("prefill_s", "decode_s", "compile_s"):
                self.info[key] = round(self.info[key], 3)

    def _run(self) -> Iterator[pa.Table]:
        if not self.order:
            return
        self._graphdef, self._state = nnx.split(mesh_lib.shard_model(self.lm.model, self.mesh))
        self._d_graphdef = self._d_state = None
        if self.drafter is not None:
            drafter = mesh_lib.shard_model(_module(self.drafter), self.mesh)
            self._d_graphdef, self._d_state = nnx.split(drafter)
        self._eos = tuple(self.lm.eos_ids) if self.options.stop_at_eos else ()
        slots = self._empty_slots()
        queue = collections.deque(self.order)
        for slot in range(self.slots):
            if queue:
                self._prefill(slots, slot, queue.popleft())
        while any(o is not None for o in slots.owner):
            finished = self._record(slots, *self._decode(slots))
            for slot in finished:
                yield self._finish(slots, slot)
            self._report("decode", slots)
            for slot in finished:
                if queue:
                    self._prefill(slots, slot, queue.popleft())

    def _empty_slots(self) -> _Slots:
        lm, rows = self.lm, self.slots

        def cache(model, rows):
            module = _module(model)
            return models.KVCache.create(
                module.config, rows, self.cache_length, dtype=module.dtype, mesh=self.mesh
            )

        def logits():
            return self._place(np.zeros((rows, lm.config.vocab_size), np.float32))

        def states():  # a head's hidden state or context, [B, E]
            head = _module(self.drafter)
            return self._place(np.zeros((rows, head.config.hidden_size), head.dtype))

        slots = _Slots(
            cache=cache(lm, rows),
            logits=logits(),
            step=self._place(np.zeros(rows, np.int32)),
            active=self._place(np.zeros(rows, bool)),
            row_cache=cache(lm, 1),
            owner=[None] * rows,
            records=[[] for _ in range(rows)],
        )
        if self.drafter is not None:
            rest = (logits(),) if self._taps is None else (states(), states())
            slots.drafter = (cache(self.drafter, rows), *rest)
            slots.drafter_row_cache = cache(self.drafter, 1)
        return slots

    def _prefill(self, slots: _Slots, slot: int, index: int) -> None:
        """Prefills prompt ``index`` piece by piece into the one-row cache, then installs it
        in ``slot``, which starts decoding at the next chunk."""
        info = self.info
        ids = np.asarray(self.encoded[index], np.int32)
        slots.row_cache = slots.row_cache.rollback(self._replicated(np.zeros(1, np.int32)))
        if slots.drafter is not None:  # its own lengths: each row cache is donated
            zero = self._replicated(np.zeros(1, np.int32))
            slots.drafter_row_cache = slots.drafter_row_cache.rollback(zero)
        start, t0 = 0, time.perf_counter()
        d_rows = self._drafter_rows()
        for width, count in prefill_pieces(len(ids), self.options.prefill_widths):
            piece = np.zeros((1, width), np.int32)
            piece[0, :count] = ids[start : start + count]
            start += count
            tokens = self._replicated((piece, np.int32(count)))
            args = (self._state, *tokens, slots.row_cache)
            static = {"graphdef": self._graphdef, "taps": self._taps}
            program = self._program(_prefill_piece, args, static, slots)
            row_logits, slots.row_cache, states = program(*args)
            if slots.drafter is not None:  # the drafter reads the same prompt
                d_rows = self._prefill_drafter(slots, tokens, states, d_rows)
            info["prefill_tokens"] += count
            info["prefill_padded_tokens"] += width
        at = self._replicated(np.int32(slot))
        args = (slots.cache, slots.logits, slots.step, slots.active, slots.row_cache, row_logits,
                at)  # fmt: skip
        slots.cache, slots.logits, slots.step, slots.active = self._program(
            _install, args, {}, slots
        )(*args)
        if slots.drafter is not None:
            args = (slots.drafter, slots.drafter_row_cache, d_rows, at)
            slots.drafter = self._program(_install_drafter, args, {}, slots)(*args)
        jax.block_until_ready(slots.logits)
        info["prefill_s"] += time.perf_counter() - t0
        slots.owner[slot], slots.records[slot] = index, []
        self._report("prefill", slots)

    def _drafter_rows(self) -> tuple:
        """The drafter's row arrays before a prompt: a head's zero context ``[1, E]`` (no
        position before the first token), nothing for a language model."""
        if self._taps is None:
            return ()
        head = _module(self.drafter)
        return (self._replicated(np.zeros((1, head.config.hidden_size), head.dtype)),)

    def _prefill_drafter(self, slots: _Slots, tokens, states, rows: tuple) -> tuple:
        """The drafter reads a prefill piece after the target (``states``: the target's
        states a head reads, ``[1, T, Z]``); returns its row arrays after it: a language
        model's ``(logits [1, V],)``, a head's ``(hidden [1, E], context [1, E])`` (``rows``:
        those before the piece)."""
        if self._taps is None:
            args = (self._d_state, *tokens, slots.drafter_row_cache)
            program = self._program(_prefill_piece, args, {"graphdef": self._d_graphdef}, slots)
            d_logits, slots.drafter_row_cache, _ = program(*args)
            return (d_logits,)
        args = (self._d_state, *tokens, slots.drafter_row_cache, rows[-1], states)
        static = {"graphdef": self._d_graphdef}
        program = self._program(_prefill_head_piece, args, static, slots)
        hidden, slots.drafter_row_cache, context = program(*args)
        return hidden, context

    def _decode(self, slots: _Slots):
        """One chunk of greedy steps of every slot: the recorded statistics and
        certificates, and which slots are still active (host arrays)."""
        options = self.options
        static = {"graphdef": self._graphdef, "d_graphdef": self._d_graphdef,
                  "rules": self.rules, "length": options.chunk, "top": options.top,
                  "eos": self._eos, "steps": options.steps, "taps": self._taps}  # fmt: skip
        t0 = time.perf_counter()
        args = (self._state, slots.cache, slots.logits, slots.step, slots.active, self._d_state,
                slots.drafter)  # fmt: skip
        program = self._program(_decode_chunk, args, static, slots)
        slots.cache, slots.logits, slots.step, slots.active, slots.drafter, out = program(*args)
        out, still = jax.device_get((out, slots.active))
        self.info["decode_s"] += time.perf_counter() - t0
        return out, still

    def _record(self, slots: _Slots, out, still) -> list[int]:
        """Keeps each slot's recorded positions of a chunk; returns the slots that finished."""
        st, values, was_active, at, terms = out
        self.info["decode_slot_steps"] += self.options.chunk * self.slots
        self.info["decode_active_steps"] += int(was_active.sum())
        for slot in range(self.slots):
            if slots.owner[slot] is None:
                continue
            keep = was_active[:, slot]
            if keep.any():
                columns = _columns(st, values, terms, at, slot, keep, self.rules, self.options)
                slots.records[slot].append(columns)
                slots.positions += int(keep.sum())
        return [s for s in range(self.slots) if slots.owner[s] is not None and not still[s]]

    def _finish(self, slots: _Slots, slot: int) -> pa.Table:
        """The table of the prompt that finished in ``slot``, which is then free."""
        table = self._table(slots.owner[slot], slots.records[slot])
        slots.owner[slot], slots.records[slot] = None, []
        slots.done += 1
        self.info["positions"] += table.num_rows
        return table

    def _table(self, index: int, parts: list[dict]) -> pa.Table:
        """A finished prompt's positions (a slot records its first step: never empty)."""
        prompt = self.prompts[index]
        columns = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
        n = len(columns["position"])
        out = {
            "prompt_index": np.full(n, index, np.int64),
            # Explicit types: every table has the same schema whatever its prompt holds.
            "prompt_id": pa.array([str(prompt.id)] * n, pa.string()),
            "category": pa.array([_text(prompt.category)] * n, pa.string()),
            "prompt_tokens": np.full(n, len(self.encoded[index]), np.int32),
            **columns,
        }
        return pa.table(out)


def _columns(st, values, terms: DrafterTerms | None, at, slot, keep, rules, options) -> dict:
    """One slot's recorded positions of a chunk, as column arrays (the drafter's last)."""
    out = {
        "position": at[keep, slot].astype(np.int32),
        "token": st.greedy_token[keep, slot].astype(np.int32),
        "top1": st.top1[keep, slot],
        f"top{options.top}_coverage": st.top_coverage[keep, slot],
        "margin": st.margin[keep, slot],
        "entropy": st.entropy[keep, slot],
    }
    for rule, v in zip(rules, values, strict=True):
        out[rule_column(rule)] = v[keep, slot]
    if terms is not None:
        out |= drafter_columns(jax.tree.map(lambda a: a[keep, slot], terms), rules)
    return out


def check_drafter(lm, drafter) -> None:
    """Refuses a drafter that ``jaxcert certify`` cannot run beside the target ``lm``.

    Args:
      lm: the target, a ``models.LoadedModel``.
      drafter: the drafter, a ``models.LoadedModel`` (or a module): a language model, or a
        draft head (:class:`jaxcert.models.EagleHead`) of the target.

    Raises:
      ValueError: a draft head built for another target (vocabulary, width or blocks), a
        drafter that proposes tokens without a distribution (prompt lookup) or is no
        language model, or a language model whose vocabulary or tokenizer differs from the
        target's.
    """
    module = _module(drafter)
    if reads_target(module):  # a draft head reading the target's states
        if not isinstance(module, eagle.EagleHead):
            raise ValueError(
                f"the draft head must be a jaxcert.models.EagleHead, got {type(module).__name__}"
            )
        eagle.check_head_fits(module, _module(lm).config)
        return
    if getattr(module, "proposes_tokens", False) or not isinstance(module, models.Transformer):
        raise ValueError(
            f"the drafter must be a language model (a jaxcert.models.Transformer), got "
            f"{type(module).__name__}"
        )
    models.check_same_vocabulary(lm, drafter)


def _module(model):
    """The module of a ``models.LoadedModel``, or ``model`` itself."""
    return getattr(model, "model", model)


def _text(value) -> str | None:
    return None if value is None else str(value)


def certify_prompts(
    lm,
    prompts: Sequence[Prompt],
    rules: Sequence,
    options: CertifyOptions = CertifyOptions(),
    *,
    drafter=None,
    mesh: jax.sharding.Mesh | None = None,
    part: tuple[int, int] | None = None,
    progress: Callable[[Progress], None] | None = None,
) -> tuple[pa.Table, dict]:
    """Greedy-decodes every prompt and certifies every position under every rule.

    The in-memory form of :class:`Certifier` (same arguments): all positions in one table.

    Returns:
      ``(table, info)``: one row per recorded position, in prompt order then position order,
      with columns ``prompt_index``, ``prompt_id``, ``category``, ``prompt_tokens``,
      ``position``, ``token``, ``top1``, ``top{k}_coverage``, ``margin``, ``entropy`` and
      one ``cert_<rule>`` column per rule (nats, ``inf`` where rejection is impossible),
      with a ``drafter`` then ``kl``, ``tv``, ``drafter_token``, ``certified_<rule>`` and
      ``accepted_<rule>``; ``info`` has counts, padding and timings (seconds).

    Raises:
      ValueError: as :class:`Certifier`.
    """
    run = Certifier(
        lm, prompts, rules, options, drafter=drafter, mesh=mesh, part=part, progress=progress
    )
    tables = list(run)
    return merge_parts(tables), run.info


def _sorted(table: pa.Table) -> pa.Table:
    return table.sort_by([("prompt_index", "ascending"), ("position", "ascending")])


def merge_parts(tables: Sequence[pa.Table]) -> pa.Table:
    """Joins per-prompt or per-part tables into the table of one run over all prompts:
    rows in prompt order, then position order."""
    return _sorted(pa.concat_tables(tables))
