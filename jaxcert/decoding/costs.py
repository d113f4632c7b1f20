"""What a pass costs on this machine: the cost model of the ``goodput`` policy.

A speculative round that drafts ``d`` tokens costs the drafter's re-read, ``d - 1`` more
drafter steps and one target pass over the root and the drafted nodes, at the verification
width the decoder uses (the node count's bucket, :meth:`DecodeConfig.verify_buckets`). A
plain target step costs a one-token target pass. :class:`PassCosts` holds measured seconds
of those passes at one batch size; :func:`measure` times them (compiled, warmed up, the
median of a few runs), :func:`cache_path` names the file a calibration keeps them in
(``costs/`` under :func:`jaxcert.base.paths.cache_dir`, keyed by machine, model pair,
dtype, batch rows and widths; :class:`~jaxcert.decoding.goodput.GoodputController` reads
and writes it), and :meth:`PassCosts.round_costs` lowers it to the traced
:class:`~jaxcert.decoding.policies.RoundCosts` a decoder reads. ``scripts/bench_pass_width.py``
prints the same measurements. A calibration times the passes alone; a decoder's round also
pays for acceptance, cache rollback, statistics and the host's calls, so
:class:`CostTracker` corrects the calibrated costs from the decoder's own timed calls as it
runs (``docs/goodput.md``, "Costs that correct themselves"). What a decoder learnt (those
overheads, and what its drafting rounds produced: :class:`PastDrafting`) is kept by the
controller the caller holds, so the next decode starts from it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pathlib
import platform
import re
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxcert.base.paths import cache_dir
from jaxcert.decoding import drafters
from jaxcert.decoding import tree as tree_lib
from jaxcert.decoding.config import DecodeConfig
from jaxcert.decoding.policies import RoundCosts

__all__ = [
    "PassCosts",
    "PastDrafting",
    "CostTracker",
    "measure",
    "cache_path",
    "nodes_at_depth",
    "FORMAT",
]

FORMAT = 1  # version of the cached JSON

# What one decode's drafting weighs in the next (docs/goodput.md, "What earlier decodes
# measured"): the kept evidence halves with every decode, whatever that decode measured,
# and never exceeds one round of the batch (one row-round per row).
PAST_DECAY = 0.5


def sampling_mode(temperature: float) -> str:
    """``"greedy"`` at temperature 0, else ``"sampling"``: past drafting is kept apart by
    this, since acceptance differs between the two."""
    return "greedy" if temperature == 0 else "sampling"


@dataclasses.dataclass(frozen=True)
class PastDrafting:
    """What ``goodput``'s drafting rounds produced in earlier decodes (one pass-costs file:
    one machine, model pair, batch size; one sampling mode), as evidence for the next.

    Attributes:
      emitted: tokens those rounds emitted, summed over rows (row-rounds), decayed.
      rounds: ``K + 1`` row-rounds by the depth the batch drafted, decayed; their sum is
        the evidence's weight ``n``.
    """

    emitted: float
    rounds: tuple[float, ...]

    @property
    def weight(self) -> float:
        """Row-rounds of evidence."""
        return float(sum(self.rounds))

    def then(self, emitted: float, rounds, *, rows: int, decay: float = PAST_DECAY):
        """The evidence after a decode of ``rows`` rows whose drafting rounds emitted
        ``emitted`` tokens in ``rounds`` (``[K + 1]`` row-rounds by depth; zeros: it never
        drafted): ``decay`` times this plus that, scaled down to at most ``rows``
        row-rounds. A decode that did not draft therefore halves the weight, and one with
        little weight left drafts again to measure (``docs/goodput.md``).

        Raises:
          ValueError: ``rounds`` of another length than this evidence's.
        """
        rounds = np.asarray(rounds, np.float64)
        if rounds.shape != (len(self.rounds),):
            raise ValueError(f"rounds of shape {rounds.shape}, expected ({len(self.rounds)},)")
        new_rounds = decay * np.asarray(self.rounds) + rounds
        new_emitted = decay * self.emitted + float(emitted)
        scale = min(1.0, rows / max(float(new_rounds.sum()), 1e-12))
        return PastDrafting(new_emitted * scale, tuple(float(r * scale) for r in new_rounds))

    def per_row(self, rows: int) -> tuple[float, np.ndarray]:
        """``(emitted, rounds [K + 1])`` per row for a batch of ``rows`` rows, the prior
        each row starts with (at most one row-round each)."""
        scale = 1.0 / rows / max(1.0, self.weight / rows)
        return self.emitted * scale, np.asarray(self.rounds) * scale


@dataclasses.dataclass(frozen=True)
class PassCosts:
    """Seconds of one pass, by the number of positions it reads, at ``rows`` batch rows.

    Attributes:
      rows: batch rows ``B``.
      target_s: ``{width: seconds}`` of a target pass reading ``width`` positions per row.
      drafter_s: seconds of one drafter step (one token for each of ``B * M`` rows); ``0``
        for a drafter without a forward pass of its own worth timing.
      round_overhead_s, step_overhead_s: seconds a decoder's speculative round (plain
        target step) took beyond its passes, as :class:`CostTracker` learnt them in
        earlier runs (0: not learnt; may be negative).
      round_scale: the factor on a round's passes that :class:`CostTracker` learnt with
        ``round_overhead_s`` (a round costs ``round_scale * passes + round_overhead_s``;
        1: not learnt).
      drafting: ``{mode: PastDrafting}`` what ``goodput``'s drafting produced in earlier
        decodes, by :func:`sampling_mode` (empty: nothing kept).
    """

    rows: int
    target_s: dict[int, float]
    drafter_s: float
    round_overhead_s: float = 0.0
    step_overhead_s: float = 0.0
    round_scale: float = 1.0
    drafting: dict[str, PastDrafting] = dataclasses.field(default_factory=dict)

    def target(self, width: int) -> float:
        """Seconds of a target pass of ``width`` positions (linear between measured widths).

        A pass reads a prefix of any wider pass's positions, so it cannot cost more: a
        measured width dearer than a wider one was slowed by something else on the machine
        (timing noise only ever adds). Each width is therefore priced at the least seconds
        measured at it or any wider width (the suffix minimum), which keeps the prices
        non-decreasing in width (``docs/goodput.md``, "The cost model").

        Raises:
          ValueError: nothing measured.
        """
        if not self.target_s:
            raise ValueError("PassCosts has no target measurement")
        widths = sorted(self.target_s)
        seconds = np.minimum.accumulate([self.target_s[w] for w in widths][::-1])[::-1]
        return float(np.interp(width, widths, seconds))

    def round_costs(self, config: DecodeConfig, *, overhead: bool = True) -> RoundCosts:
        """The ``[K + 1]`` seconds of a round by drafted depth, and of a plain step.

        Entry ``d``: the re-read and ``d - 1`` drafter steps (``d`` steps' worth, the re-read
        usually reads one token), plus the verification pass at the bucket that holds
        :func:`nodes_at_depth` nodes. Entry 0 drafts nothing: re-read plus the narrowest
        verification width. With ``overhead`` the learnt correction is applied (a round:
        ``round_scale * passes + round_overhead_s``; a plain step: ``+ step_overhead_s``;
        never below half of the passes' seconds, as :class:`CostTracker` bounds them).
        """
        buckets = config.verify_buckets()
        rounds = []
        for d, nodes in enumerate(nodes_at_depth(config)):
            nb = next(b for b in buckets if b >= nodes) if nodes <= buckets[-1] else buckets[-1]
            rounds.append(max(d, 1) * self.drafter_s + self.target(nb + 1))
        learnt = (self.round_overhead_s, self.step_overhead_s) if overhead else (0.0, 0.0)
        scale = self.round_scale if overhead else 1.0
        return _corrected(np.asarray(rounds), self.target(1), *learnt, floor=0.5, scale=scale)

    def to_json(self) -> dict:
        return {
            "format": FORMAT,
            "rows": self.rows,
            "target_s": {str(k): v for k, v in sorted(self.target_s.items())},
            "drafter_s": self.drafter_s,
            "round_overhead_s": self.round_overhead_s,
            "step_overhead_s": self.step_overhead_s,
            "round_scale": self.round_scale,
            "drafting": {
                mode: {"emitted": past.emitted, "rounds": list(past.rounds)}
                for mode, past in sorted(self.drafting.items())
            },
        }

    @classmethod
    def from_json(cls, data: dict) -> PassCosts:
        """The costs :meth:`to_json` wrote.

        Raises:
          ValueError: another format version, a missing field, or a number that is not
            finite, or not positive where it must be (rows, a target pass's width and
            seconds, ``round_scale``; ``drafter_s`` may be 0).
        """
        found = data.get("format") if isinstance(data, dict) else type(data).__name__
        if type(found) is not int or found != FORMAT:
            raise ValueError(f"pass costs of format {found!r}, expected {FORMAT}")
        try:
            if not isinstance(data["target_s"], dict) or not data["target_s"]:
                raise ValueError(f"target_s must map widths to seconds, got {data['target_s']!r}")
            target = {
                _width("a width of target_s", k): _number(f"target_s[{k}]", v)
                for k, v in data["target_s"].items()
            }
            if not isinstance(data.get("drafting", {}), dict):
                raise ValueError(f"drafting must map modes to counts, got {data['drafting']!r}")
            rows = data["rows"]
            if type(rows) is not int or rows < 1:
                raise ValueError(f"rows must be a positive integer, got {rows!r}")
            costs = cls(
                rows=rows,
                target_s=target,
                drafter_s=_number("drafter_s", data["drafter_s"], ">= 0"),
                round_overhead_s=_number(
                    "round_overhead_s", data.get("round_overhead_s", 0), "any"
                ),
                step_overhead_s=_number("step_overhead_s", data.get("step_overhead_s", 0), "any"),
                round_scale=_number("round_scale", data.get("round_scale", 1.0), "> 0", 1e3),
                drafting={
                    str(mode): _past(mode, past) for mode, past in data.get("drafting", {}).items()
                },
            )
        except (KeyError, TypeError, AttributeError) as err:
            raise ValueError(f"malformed pass costs: missing or wrong field {err}") from None
        return costs


def _width(name: str, key) -> int:
    """A width written as a JSON key: decimal digits, no sign, space or leading zero."""
    if not isinstance(key, str) or not re.fullmatch(r"[1-9][0-9]{0,5}", key):
        raise ValueError(f"{name} must be a positive integer, got {key!r}")
    return int(key)


def _overhead(data: dict, kind: str) -> float:
    """``round_overhead_s`` or ``step_overhead_s`` (0 when absent): finite, any sign."""
    return _number(f"{kind}_overhead_s", data.get(f"{kind}_overhead_s", 0.0), "any")


# No pass, overhead or count of a cost file is this large in magnitude (seconds: ~11
# days), and float32, which the decoder weighs in, holds every value below it.
LARGEST = 1e6


def _number(name: str, value, need: str = "> 0", largest: float = LARGEST) -> float:
    """``value`` as a float that meets ``need`` (``"> 0"``: at least ``1e-9``, a second's
    billionth, which float32 still holds; ``">= 0"``; ``"any"``) and of magnitude at most
    ``largest``. Counts that halve with every decode may be any tiny positive number."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {value!r}")
    try:
        x = float(value)
    except OverflowError:
        x = float("inf")
    ok = {"> 0": x >= 1e-9, ">= 0": x >= 0, "any": True}[need]
    if not (np.isfinite(x) and abs(x) <= largest and ok):
        what = "finite" if need == "any" else f"finite and {need}"
        shown = f"{value!r}" if len(repr(value)) < 40 else repr(value)[:37] + "..."
        raise ValueError(f"{name} must be {what}, at most {largest:g} in size, got {shown}")
    return x


def _past(mode, data) -> PastDrafting:
    """A :class:`PastDrafting` from its JSON form; ``ValueError`` unless it is an object
    with ``emitted`` and a list ``rounds`` of numbers ``>= 0``."""
    if not isinstance(data, dict) or not isinstance(data.get("rounds"), list):
        raise ValueError(f"drafting[{mode!r}] must hold emitted and a list of rounds, got {data!r}")
    emitted = _number(f"drafting[{mode!r}].emitted", data.get("emitted"), ">= 0", 1e12)
    rounds = [_number(f"drafting[{mode!r}].rounds", r, ">= 0", 1e12) for r in data["rounds"]]
    return PastDrafting(emitted, tuple(rounds))


def _corrected(
    round_s, skip_s: float, round_o: float, step_o: float, *, floor: float, scale: float = 1.0
):
    """:class:`RoundCosts` of passes (rounds' times ``scale``) plus overheads, never below
    ``floor`` of the passes."""
    rounds = np.maximum(scale * round_s + round_o, floor * round_s)
    skip = max(skip_s + step_o, floor * skip_s)
    return RoundCosts(
        round_s=jnp.asarray(rounds, jnp.float32), skip_s=jnp.asarray(skip, jnp.float32)
    )


class CostTracker:
    """Calibrated round costs, corrected by what the decoder's calls really took.

    Every round of a call is modelled as its calibrated passes times a factor ``k`` plus
    one overhead ``o`` shared by all depths (``k * round_s[d] + o``), and every plain step
    as ``skip_s + o_step``. Inside the decoder a round has a larger fixed part and a smaller
    cost per drafted token than passes timed alone (``docs/goodput.md``, "Costs that correct
    themselves"), so both are fitted. ``k`` is the slope of a least squares fit of
    ``s_c = o R_c + k P_c`` over the calls so far (call ``c`` of ``R_c`` rounds, calibrated
    seconds ``P_c``, wall time ``s_c``, weighted ``memory^(n-c) / R_c``: a call's noise
    grows with its rounds), with a ridge that holds ``k`` at ``scale`` as ``ridge`` rounds
    at depth 1 would; then ``o`` is the ratio estimate ``sum (s_c - k P_c) / sum R_c``
    (same weights, with the prior). Calls of one depth mix say nothing about the slope, so
    ``k`` stays where it was and ``o`` takes all the excess. ``o_step`` is the ratio
    estimate over the calls of plain steps. A corrected cost is never below ``floor``
    times its calibrated value (a calibration that overestimates is corrected too, but a
    noisy call cannot make a pass free), and ``k`` stays in ``[floor, 1 / floor]``. The
    corrections travel into the compiled decoder as traced values (no recompilation).

    Overheads learnt by an earlier run (``prior``, seconds per round and per step) count as
    ``prior_weight`` rounds (steps) of evidence for ``o`` (``o_step``), fading with
    ``memory`` per call like the calls, so a run starts where the last one ended and its
    own calls soon outweigh them. The plain step's prior is dropped at this tracker's first
    timed steps: the skip decision hinges on that cost, and a decode measures it
    first-hand early on (``speculative_decode`` probes it), where a prior learnt in another
    decode (another temperature, a first execution) can be far off (``docs/goodput.md``,
    "Measuring the plain step too").

    ``observed`` counts the calls this tracker timed, by kind (``"round"``, ``"step"``;
    the prior not included).

    Args:
      base: the calibrated :class:`~jaxcert.decoding.policies.RoundCosts` (passes only).
      memory: weight of the past per call, in ``[0, 1)``.
      floor: lowest corrected cost as a fraction of the calibrated one, in ``(0, 1]``.
      prior: ``(round, step)`` overheads in seconds from earlier runs (``None``: none;
        the round overhead is then fitted from this run's calls alone).
      prior_weight: how many rounds (steps) of evidence ``prior`` counts for, ``>= 0``.
      scale: the factor ``k`` learnt by earlier runs (1: none), ``> 0``.
      ridge: rounds at depth 1 whose evidence holds ``k`` at ``scale``, ``> 0``.

    Raises:
      ValueError: ``memory``, ``floor``, ``prior_weight``, ``scale`` or ``ridge`` out of
        range.
    """

    def __init__(
        self,
        base: RoundCosts,
        *,
        memory: float = 0.7,
        floor: float = 0.5,
        prior: tuple[float, float] | None = None,
        prior_weight: float = 4.0,
        scale: float = 1.0,
        ridge: float = 1.0,
    ):
        if not 0.0 <= memory < 1.0:
            raise ValueError(f"CostTracker memory must be in [0, 1), got {memory!r}")
        if not 0.0 < floor <= 1.0:
            raise ValueError(f"CostTracker floor must be in (0, 1], got {floor!r}")
        if not prior_weight >= 0.0:
            raise ValueError(f"CostTracker prior_weight must be >= 0, got {prior_weight!r}")
        if not (np.isfinite(scale) and scale > 0.0):
            raise ValueError(f"CostTracker scale must be > 0, got {scale!r}")
        if not (np.isfinite(ridge) and ridge > 0.0):
            raise ValueError(f"CostTracker ridge must be > 0, got {ridge!r}")
        self.round_s = np.asarray(jax.device_get(base.round_s), np.float64)  # [K + 1]
        self.skip_s = float(jax.device_get(base.skip_s))
        self.memory, self.floor = memory, floor
        self.prior_scale = float(np.clip(scale, floor, 1.0 / floor))
        depth_one = float(self.round_s[1]) if self.round_s.size > 1 else float(self.round_s[0])
        self._ridge = ridge * max(depth_one, 1e-9) ** 2
        # Rounds: weighted sums of R, P, y, P^2 / R and P y / R over the calls (weights
        # memory^(n-c)); the prior overhead as `weight` rounds of evidence for o alone.
        self._sums = np.zeros(5)
        weight = 0.0 if prior is None else float(prior_weight)
        prior = (0.0, 0.0) if prior is None else prior
        self._prior = np.asarray([weight, weight * prior[0]])  # rounds, seconds
        self._excess = {"step": prior[1] * weight}
        self._count = {"step": weight}
        self.observed = {"round": 0, "step": 0}  # calls timed by this tracker (no prior)

    def _observe(self, kind: str, seconds: float, predicted: float, count: int) -> None:
        if count <= 0 or not np.isfinite(seconds):
            return
        if kind == "step" and not self.observed["step"]:  # first-hand evidence replaces
            self._excess["step"] = self._count["step"] = 0.0  # the prior (see the class doc)
        self.observed[kind] += 1
        if kind == "round":
            r, p, y = float(count), predicted, seconds
            self._sums = self.memory * self._sums + np.asarray([r, p, y, p * p / r, p * y / r])
            self._prior *= self.memory
        else:
            self._count[kind] = self.memory * self._count[kind] + count
            self._excess[kind] = self.memory * self._excess[kind] + (seconds - predicted)

    def observe_rounds(self, seconds: float, depths) -> None:
        """A call of the round loop took ``seconds`` for rounds of these depths.

        Args:
          seconds: wall time of the call, host synchronisation included.
          depths: ``[R]`` int, each round's drafted depth (the deepest row's: the round's
            verification width is the batch's), ``R >= 0``.
        """
        depths = np.clip(np.asarray(depths, np.int64), 0, self.round_s.shape[0] - 1)
        self._observe("round", seconds, float(self.round_s[depths].sum()), int(depths.size))

    def observe_steps(self, seconds: float, steps: int) -> None:
        """``steps`` plain target steps (one call) took ``seconds``."""
        self._observe("step", seconds, steps * self.skip_s, int(steps))

    def _fit(self) -> tuple[float, float]:
        """``(o, k)`` of the rounds (see the class doc)."""
        rounds, passes, seconds, pp, py = self._sums
        k = self.prior_scale
        if rounds > 0:  # the ridge-held slope of the centred sums
            spread = pp - passes * passes / rounds
            covary = py - passes * seconds / rounds
            k = (covary + self._ridge * k) / (spread + self._ridge)
            k = float(np.clip(k, self.floor, 1.0 / self.floor))
        weight = rounds + self._prior[0]
        o = (seconds - k * passes + self._prior[1]) / weight if weight > 0 else 0.0
        return float(o), float(k)

    def scale(self) -> float:
        """The factor ``k`` on a round's calibrated passes fitted so far."""
        return self._fit()[1]

    def overhead_s(self, kind: str) -> float:
        """Seconds added to each ``"round"`` (beyond ``scale()`` times its passes) or
        ``"step"`` by the correction so far."""
        if kind == "round":
            return self._fit()[0]
        count = self._count[kind]
        return self._excess[kind] / count if count > 0 else 0.0

    def round_costs(self) -> RoundCosts:
        """The corrected :class:`~jaxcert.decoding.policies.RoundCosts` (float32)."""
        (o, k), step = self._fit(), self.overhead_s("step")
        return _corrected(self.round_s, self.skip_s, o, step, floor=self.floor, scale=k)


def nodes_at_depth(config: DecodeConfig) -> list[int]:
    """Drafted nodes of a round that drafts to depth ``d``, for ``d = 0..K``: ``d`` (chain),
    ``M d`` (static tree), ``min(N, M + (d - 1) M^2)`` (dynamic tree: every frontier node's
    top-``M`` children compete for ``N`` slots)."""
    shape, k = config.tree, config.depth
    if isinstance(shape, tree_lib.Chain):
        return list(range(k + 1))
    m = shape.m
    if isinstance(shape, tree_lib.DynamicTree):
        return [0] + [min(shape.nodes, m + (d - 1) * m * m) for d in range(1, k + 1)]
    return [m * d for d in range(k + 1)]


def _median_s(fn, *args, repeats: int) -> float:
    jax.block_until_ready(fn(*args))  # compile and warm up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def _module(model):
    return getattr(model, "model", model)


def measure(
    target,
    drafter=None,
    *,
    rows: int,
    config: DecodeConfig,
    context: int = 256,
    repeats: int = 3,
    widths: list[int] | None = None,
    log=None,
) -> PassCosts:
    """Times the passes of a round on this machine.

    The target reads each verification width (buckets + 1, and 1) on a cache holding
    ``context`` tokens per row; the drafter reads one token on ``rows * M`` rows.

    Args:
      target, drafter: ``models.LoadedModel`` or modules (as for ``speculative_decode``);
        ``drafter=None`` measures the target only (``drafter_s`` is 0).
      rows: batch rows ``B``.
      config: the decoder's config (its buckets and branching).
      context: tokens already in the caches.
      repeats: timed runs per pass (the median is kept).
      widths: target widths to time instead of the config's.
      log: called with a line per measured pass (e.g. ``print``).
    """
    t_model = _module(target)
    d_model = None if drafter is None else _module(drafter)
    if widths is None:
        widths = sorted({1} | {b + 1 for b in config.verify_buckets()})
    slots = context + max(config.num_nodes, max(widths)) + 2
    t_graph, t_params = nnx.split(t_model)

    @jax.jit
    def t_pass(params, tokens, cache):
        return nnx.merge(t_graph, params)(tokens, cache)[0]

    target_s = {}
    for width in widths:
        cache = t_model.init_cache(rows, slots).commit(context)
        tokens = jnp.ones((rows, width), jnp.int32)
        target_s[width] = _median_s(t_pass, t_params, tokens, cache, repeats=repeats)
        if log is not None:
            log(f"target, {rows} rows x {width:3d} positions: {1000 * target_s[width]:8.1f} ms")
    d_rows = rows * config.branching
    if d_model is None or getattr(d_model, "proposes_tokens", False):
        drafter_s = 0.0  # a lookup: integer compares, no weights (measured as negligible)
    else:
        d_graph, d_params = nnx.split(d_model)
        step = drafters.for_model(d_graph, d_model).step  # what a round's draft steps run
        cache = d_model.init_cache(d_rows, slots).commit(context)
        tokens = jnp.ones((d_rows,), jnp.int32)
        parent = jnp.zeros((d_rows, d_model.config.hidden_size), jnp.float32)

        @jax.jit
        def d_pass(params, tokens, cache):
            return step(params, tokens, cache, parent)[0]

        drafter_s = _median_s(d_pass, d_params, tokens, cache, repeats=repeats)
        if log is not None:
            log(f"drafter, {d_rows} rows x 1 position: {1000 * drafter_s:8.1f} ms")
    return PassCosts(rows=rows, target_s=target_s, drafter_s=drafter_s)


def _describe(model) -> dict:
    """What identifies a model's cost: its kind, config and parameter dtypes."""
    module = _module(model)
    config = getattr(module, "config", None)
    fields: object = repr(config)
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        fields = dataclasses.asdict(config)
    dtypes = sorted({str(x.dtype) for x in jax.tree.leaves(nnx.state(module))})
    return {"kind": type(module).__name__, "config": fields, "dtypes": dtypes}


def _key(target, drafter, rows: int, config: DecodeConfig, context: int) -> str:
    device = jax.devices()[0]
    fields = {
        "format": FORMAT,
        "machine": [platform.node(), platform.machine(), os.cpu_count()],
        "device": [device.platform, device.device_kind, jax.device_count()],
        "target": _describe(target),
        "drafter": _describe(drafter),
        "rows": rows,
        "branching": config.branching,
        "widths": sorted({1} | {b + 1 for b in config.verify_buckets()}),
        "context": context,
    }
    text = json.dumps(fields, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:20]


def cache_path(
    target, drafter, *, rows: int, config: DecodeConfig, context: int = 256, folder=None
) -> pathlib.Path:
    """Where :meth:`~jaxcert.decoding.goodput.GoodputController.calibrate` keeps the costs
    of this machine, pair, rows and widths: under ``folder``, else ``$JAXCERT_COSTS``, else
    ``costs/`` under :func:`jaxcert.base.paths.cache_dir`."""
    if folder is None:
        folder = os.environ.get("JAXCERT_COSTS") or cache_dir() / "costs"
    root = pathlib.Path(folder)
    return root / f"{_key(target, drafter, rows, config, context)}.json"
