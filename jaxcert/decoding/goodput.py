"""``goodput``'s host half: the pass costs a decode weighs, held by the caller.

The ``goodput`` policy weighs what a round costs against a plain target step
(``docs/goodput.md``). Its traced half (the decision) lives in
:class:`~jaxcert.decoding.policies.PolicyParams`, so one compiled program serves every
policy; its host half is a :class:`GoodputController` the caller creates once, from a cost
table or a calibration of this machine, and passes to every
:func:`~jaxcert.decoding.speculative_decode` call. Between a decode's calls it says which
program runs next (rounds, or a probe of plain steps), is told each call's wall time, and
corrects the costs (:class:`~jaxcert.decoding.costs.CostTracker`); at the decode's end it
keeps what the decode's drafting rounds emitted, so the next decode starts from it. Nothing
touches the disk until :meth:`GoodputController.save`.

Example::

  controller = decoding.GoodputController.calibrate(target, drafter, config=config, rows=1)
  for prompt in prompts:
      decoding.speculative_decode(target, drafter, [prompt], policy=decoding.Goodput(),
                                  config=config, costs=controller)
  controller.save()   # the next process starts from what these decodes learnt
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import warnings
from collections.abc import Iterable, Mapping

import jax
import numpy as np

from jaxcert.base.folders import atomic_write
from jaxcert.base.validate import check_int
from jaxcert.decoding import costs as costs_lib
from jaxcert.decoding.config import DecodeConfig
from jaxcert.decoding.costs import CostTracker, PassCosts, PastDrafting
from jaxcert.decoding.pairing import resolved_config
from jaxcert.decoding.policies import Goodput, RoundCosts

__all__ = ["GoodputController", "GoodputRun", "read_costs"]


def _widths(config: DecodeConfig) -> set[int]:
    """The target widths a decoder with ``config`` verifies at (its buckets + 1, and 1)."""
    return {1} | {b + 1 for b in config.verify_buckets()}


def read_costs(
    path: str | os.PathLike, config: DecodeConfig | None = None, rows: int | None = None
) -> PassCosts:
    """The :class:`~jaxcert.decoding.costs.PassCosts` kept in the JSON file at ``path``.

    Args:
      path: a file :meth:`GoodputController.save` (or ``scripts/bench_pass_width.py``) wrote.
      config: when given, every target width a decoder with this config verifies at must
        be in the file.
      rows: when given, the batch rows the costs must be for.

    Raises:
      ValueError: an unreadable or malformed file, a number that is not finite (or not
        positive where it must be), or a width the config needs missing; the message names
        the file.
    """
    path = pathlib.Path(path)
    try:
        costs = PassCosts.from_json(json.loads(path.read_text()))
    except (OSError, ValueError) as err:  # json.JSONDecodeError is a ValueError
        raise ValueError(f"pass costs {path}: {err}") from None
    if rows is not None and costs.rows != rows:
        raise ValueError(f"pass costs {path}: for {costs.rows} rows, expected {rows}")
    if config is not None:
        missing = sorted(_widths(config) - set(costs.target_s))
        if missing:
            raise ValueError(f"pass costs {path}: no target pass of widths {missing} measured")
    return costs


def _write(path: pathlib.Path, body: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, json.dumps(body, indent=1))


def _as_table(costs) -> dict[int, PassCosts]:
    if not isinstance(costs, (PassCosts, list, tuple, dict)) and not hasattr(costs, "__iter__"):
        raise ValueError(f"GoodputController needs PassCosts, got {costs!r}")
    items = [costs] if isinstance(costs, PassCosts) else list(costs)
    if not all(isinstance(c, PassCosts) for c in items):
        raise ValueError(f"GoodputController needs PassCosts, got {costs!r}")
    return {c.rows: c for c in items}


class GoodputController:
    """The pass costs ``goodput`` weighs, by batch rows, and what decodes learnt of them.

    Args:
      costs: a :class:`~jaxcert.decoding.costs.PassCosts` or several (one per batch size,
        keyed by their ``rows``; none: :meth:`calibrate` fills the table).
      correct: correct the costs from the decoder's own timed calls as it runs
        (:class:`~jaxcert.decoding.costs.CostTracker`, ``docs/goodput.md``, "Costs that
        correct themselves"), and keep what its drafting rounds emitted for the next
        decode; ``False``: weigh the costs exactly as given.
      files: ``{rows: path}`` where :meth:`save` writes each batch size's costs (a
        calibration's cache files; ``None``: :meth:`save` needs a path).

    Attributes:
      table: ``{rows: PassCosts}`` the costs as they stand (updated after each decode).
      correct: as above.

    Raises:
      ValueError: something other than ``PassCosts`` given.
    """

    def __init__(
        self,
        costs: PassCosts | Iterable[PassCosts],
        *,
        correct: bool = True,
        files: Mapping[int, str | os.PathLike] | None = None,
    ):
        self.table = _as_table(costs)
        self.correct = bool(correct)
        self._files = {int(r): pathlib.Path(p) for r, p in (files or {}).items()}
        self._source: dict | None = None  # how calibrate() measures a batch size it lacks

    @classmethod
    def calibrate(
        cls,
        target,
        drafter,
        *,
        config: DecodeConfig,
        rows: int | Iterable[int] = (),
        folder: str | os.PathLike | None = None,
        context: int = 256,
        repeats: int = 3,
        correct: bool = True,
        log=None,
    ) -> GoodputController:
        """The costs of this machine, model pair and config by batch size: read from
        ``folder`` (default ``cache_dir() / "costs"``, one file per machine, models, dtypes,
        rows and widths) where measured before, else measured
        (:func:`~jaxcert.decoding.costs.measure`) and written there; the sizes in ``rows``
        now, any other when a decode first needs it. A damaged file (not JSON, a number not
        finite or out of range, a width missing) is measured again and replaced, with a
        warning that names it. :meth:`save` writes back to these files.

        Args:
          target, drafter: as for :func:`~jaxcert.decoding.speculative_decode`.
          config: the decoder's config (its verification widths and branching, as the
            decoder resolves them for ``goodput`` and this pair).
          rows: batch size(s) ``B`` to calibrate now (after padding to a mesh).
          folder, context, repeats: where the files go; tokens in the caches and timed
            runs per pass of a measurement.
          correct: as for the constructor.
          log: called with one line per batch size measured (e.g. ``print``).
        """
        # Resolved as speculative_decode resolves it for goodput (skips: a width-0 pass).
        config = resolved_config(config, target, drafter, Goodput()).shape_only()
        source = dict(
            target=target, drafter=drafter, config=config, folder=folder, context=context,
            repeats=repeats, log=log,
        )  # fmt: skip
        controller = cls((), correct=correct)
        controller._source = source
        sizes = [rows] if isinstance(rows, int) else list(rows)
        for size in sorted({check_int("GoodputController.calibrate rows", r) for r in sizes}):
            controller._calibrate(size)
        return controller

    def _calibrate(self, rows: int) -> PassCosts:
        """The calibration at ``rows`` rows, read or measured (see :meth:`calibrate`)."""
        src = self._source
        assert src is not None  # made by calibrate()
        path = costs_lib.cache_path(
            src["target"], src["drafter"], rows=rows, config=src["config"],
            context=src["context"], folder=src["folder"],
        )  # fmt: skip
        costs = None
        if (
            path.exists()
            and not path.is_file()
            or path.parent.exists()
            and not path.parent.is_dir()
        ):
            raise ValueError(f"pass costs {path}: not a file (the calibration is kept there)")
        if path.is_file():
            try:
                costs = read_costs(path, src["config"], rows)
            except ValueError as err:
                warnings.warn(f"{err}; measuring again", stacklevel=3)
        if costs is None:
            if src["log"] is not None:
                src["log"](f"measuring pass costs ({rows} rows); kept in {path}")
            costs = costs_lib.measure(
                src["target"], src["drafter"], rows=rows, config=src["config"],
                context=src["context"], repeats=src["repeats"],
            )  # fmt: skip
            _write(path, costs.to_json())
        self.table[rows], self._files[rows] = costs, path
        return costs

    @classmethod
    def load(cls, path: str | os.PathLike, *, correct: bool = True) -> GoodputController:
        """A cost table from one JSON file, ``{rows: PassCosts JSON}``, as
        ``scripts/bench_pass_width.py --json`` and :meth:`save` with a path write it.

        Raises:
          ValueError: an unreadable or malformed file, naming it.
        """
        path = pathlib.Path(path)
        try:
            data = json.loads(path.read_text())
            if not isinstance(data, dict) or not data:
                raise ValueError("expected an object mapping batch rows to pass costs")
            table = [PassCosts.from_json(body) for body in data.values()]
            for key, costs in zip(data, table, strict=True):
                if str(costs.rows) != str(key).strip():
                    raise ValueError(f"the costs under {key!r} are for {costs.rows} rows")
        except (OSError, ValueError) as err:
            raise ValueError(f"pass costs {path}: {err}") from None
        return cls(table, correct=correct)

    def save(self, path: str | os.PathLike | None = None) -> None:
        """Writes the costs as they stand (each write replaces its file whole).

        Args:
          path: one JSON file for the whole table (read back by :meth:`load`); ``None``:
            each batch size's calibration file (:meth:`calibrate`).

        Raises:
          ValueError: ``path`` is ``None`` and a batch size has no calibration file.
        """
        if path is not None:
            if pathlib.Path(path).is_dir():
                raise ValueError(f"GoodputController.save: {path} is a folder, not a file")
            body = {str(r): c.to_json() for r, c in sorted(self.table.items())}
            _write(pathlib.Path(path), body)
            return
        unfiled = sorted(set(self.table) - set(self._files))
        if unfiled:
            raise ValueError(f"no calibration file for batches of {unfiled} rows: pass a path")
        for rows, costs in self.table.items():
            _write(self._files[rows], costs.to_json())

    def costs(self, rows: int) -> PassCosts:
        """The costs at ``rows`` batch rows (a calibration measures or reads them now).

        Raises:
          ValueError: none for that batch size.
        """
        if rows not in self.table and self._source is not None:
            return self._calibrate(rows)
        if rows not in self.table:
            raise ValueError(
                f"goodput has no pass costs for batches of {rows} rows "
                f"(it has {sorted(self.table)})"
            )
        return self.table[rows]

    def begin(self, rows: int, config: DecodeConfig, temperature: float) -> GoodputRun:
        """A decode of ``rows`` rows with the (resolved) ``config`` starts: its
        :class:`GoodputRun`. Costs are corrected only in a single process (each process
        would time its own calls, and the costs must be one replicated value).

        A width between measured ones is priced by interpolation
        (:meth:`~jaxcert.decoding.costs.PassCosts.target`).

        Raises:
          ValueError: no costs for ``rows``.
        """
        costs = self.costs(rows)
        correct = self.correct and jax.process_count() == 1
        return GoodputRun(self, costs, config, costs_lib.sampling_mode(temperature), correct)


class GoodputRun:
    """One decode's side of a :class:`GoodputController` (made by
    :meth:`GoodputController.begin`; the decoder calls it between its calls).

    Attributes:
      round_costs: the :class:`~jaxcert.decoding.policies.RoundCosts` the policy weighs now.
      prior: ``(emitted [], rounds [K + 1])`` float32 per row, what earlier decodes'
        drafting produced (``None``: nothing kept for this depth and sampling mode).
    """

    def __init__(self, owner, costs: PassCosts, config: DecodeConfig, mode: str, correct):
        self._owner, self._costs, self._mode = owner, costs, mode
        self.round_costs: RoundCosts = costs.round_costs(config)
        depths = int(self.round_costs.round_s.shape[0])
        past = costs.drafting.get(mode)
        self.prior: tuple[np.float32, np.ndarray] | None = None
        if past is not None and len(past.rounds) == depths:
            emitted, rounds = past.per_row(costs.rows)
            self.prior = (np.float32(emitted), rounds.astype(np.float32))
        self._tracker = None
        if correct:
            learnt = (costs.round_overhead_s, costs.step_overhead_s)
            self._tracker = CostTracker(
                costs.round_costs(config, overhead=False),
                prior=learnt if any(learnt) else None,
                scale=costs.round_scale,
            )
        self._drafted = False

    def program(self, skip: bool) -> str:
        """``"steps"`` or ``"rounds"``: the program the decoder runs next. Plain steps when
        the policy skips (``skip``), and once, after the decode has drafted, to time them
        when the costs are corrected: a calibration that overstates a plain step would
        otherwise keep the policy drafting, unchecked (``docs/goodput.md``, "Measuring the
        plain step too")."""
        probe = self._tracker is not None and self._drafted and not self._tracker.observed["step"]
        return "steps" if skip or probe else "rounds"

    def observe(self, program: str, seconds: float, ran, *, first: bool) -> RoundCosts:
        """A call ran: ``program`` (``"rounds"``: ``ran`` is ``[R]`` each round's drafted
        depth; ``"steps"``: ``ran`` is the plain steps run) for ``seconds`` of wall time.
        A program's ``first`` execution is slower than the rest and is not timed.

        Returns the :class:`~jaxcert.decoding.policies.RoundCosts` to weigh from now on.
        """
        if program == "rounds":
            self._drafted = True
        if self._tracker is None:
            return self.round_costs
        if not first:
            if program == "rounds":
                self._tracker.observe_rounds(seconds, ran)
            else:
                self._tracker.observe_steps(seconds, int(ran))
        self.round_costs = self._tracker.round_costs()
        return self.round_costs

    def finish(self, emitted: float, rounds) -> None:
        """The decode ended; its drafting rounds emitted ``emitted`` tokens (summed over the
        batch's real rows, the prior excluded) in ``rounds`` ``[K + 1]`` row-rounds by
        depth (zeros: it never drafted). With corrected costs the controller keeps them,
        and the overheads the decode learnt, for the next decode at this batch size."""
        if self._tracker is None:
            return
        rounds = np.maximum(np.asarray(rounds, np.float64), 0.0)
        past = self._costs.drafting.get(self._mode)
        if past is None or len(past.rounds) != rounds.shape[0]:
            past = PastDrafting(0.0, (0.0,) * rounds.shape[0])
        drafting = dict(self._costs.drafting)
        drafting[self._mode] = past.then(max(float(emitted), 0.0), rounds, rows=self._costs.rows)
        tracker = self._tracker
        costs = dataclasses.replace(self._costs, drafting=drafting)
        if tracker.observed["round"] or tracker.observed["step"]:
            costs = dataclasses.replace(
                costs,
                round_overhead_s=tracker.overhead_s("round"),
                step_overhead_s=tracker.overhead_s("step"),
                round_scale=tracker.scale(),
            )
        self._owner.table[self._costs.rows] = costs
