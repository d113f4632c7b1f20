"""The steps of ``jaxcert train-drafter``: features from the two models, the comparison of
objectives on held-out prompts, the decoder's acceptance, and the written results.

The command line reads the options and calls these in order::

  prepared = prepare(loaders, prompt_set, ...)            # features and both lm_heads
  split = split_heldout(prepared.features, heldout, seed=seed)
  comparison = compare(prepared, split, comparison_objectives(weight, margin), settings)
  write_results(out, comparison, ...); plot_histories(comparison.histories, ...)
  decode_heldout(loaders, prompt_set, split.held, comparison.heads, ...)

Models come from :class:`Loaders` (callables), so that one model at a time is in memory
where the recipe allows it: the 1.5B target alone is 7 GB in float32.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import pathlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from jaxcert import models
from jaxcert.base import prompts
from jaxcert.base.tables import counted
from jaxcert.core import rules as rules_lib
from jaxcert.training.evaluation import decoder_acceptance, evaluate
from jaxcert.training.features import (
    FeatureSet,
    feature_set,
    greedy_continuations,
    target_logits,
    teacher_forced_states,
)
from jaxcert.training.heads import DraftHead, HeadedDrafter, Projection
from jaxcert.training.train import Objective, train_head

if TYPE_CHECKING:
    from jaxcert.models import LoadedModel

__all__ = [
    "Bars",
    "Comparison",
    "Loaders",
    "Prepared",
    "RULES",
    "Split",
    "TrainSettings",
    "compare",
    "comparison_objectives",
    "context_needs",
    "decode_heldout",
    "no_bars",
    "plot_histories",
    "prepare",
    "split_heldout",
    "write_results",
]

Progress = Callable[[int, int], None]
"""``progress(done, total)``."""

Bars = Callable[[str], contextlib.AbstractContextManager[Progress]]
"""``bars(description)``: a context that yields the ``progress`` of one phase (e.g. a bar)."""

RULES: tuple[rules_lib.Rule, ...] = (rules_lib.StrictGreedy(), rules_lib.TreeCoverage(4))
"""The rules of the held-out certified fractions."""


@contextlib.contextmanager
def _no_bar(desc: str) -> Iterator[Progress]:
    yield lambda done, total: None


no_bars: Bars = _no_bar
"""Bars that show nothing."""


@dataclasses.dataclass(frozen=True)
class Loaders:
    """Where the recipe's models come from.

    Attributes:
      target: loads the target.
      drafter: loads a separate drafter (the target's vocabulary), or ``None``: the
        drafter is the target's first ``exit_layer`` layers (self-speculative early exit).
      exit_layer: layers of the early-exit drafter (ignored with ``drafter``).
    """

    target: Callable[[], LoadedModel]
    drafter: Callable[[], LoadedModel] | None = None
    exit_layer: int = 6


@dataclasses.dataclass(frozen=True)
class Prepared:
    """What training needs of the two models: the features and both lm_heads."""

    features: FeatureSet
    target_head: Projection
    drafter_head: Projection


@dataclasses.dataclass(frozen=True)
class Split:
    """Training and held-out positions, split by prompt; ``held``: the held-out prompts."""

    train: FeatureSet
    test: FeatureSet
    held: np.ndarray

    def summary(self) -> str:
        """``"<n> train / <n> held-out positions (<n> / <n> prompts)"``."""
        return (
            f"{len(self.train)} train / {len(self.test)} held-out positions "
            f"({len(np.unique(self.train.prompt))} / {len(self.held)} prompts)"
        )


@dataclasses.dataclass(frozen=True)
class TrainSettings:
    """The optimisation settings of :func:`~jaxcert.training.train_head`, every objective."""

    steps: int = 150
    batch_size: int = 64
    learning_rate: float = 1e-3
    width: int = 1024
    seed: int = 0


@dataclasses.dataclass(frozen=True)
class Comparison:
    """Held-out results, one per drafter (the untrained one first), and the training runs.

    Attributes:
      results: one dict per drafter: ``drafter`` (its name) and the metrics of
        :func:`~jaxcert.training.evaluate`.
      histories: objective name -> the per-step history of its training.
      heads: the trained heads, in the order of ``results`` (``None``: the plain drafter).
    """

    results: list[dict[str, Any]]
    histories: dict[str, list[dict[str, float]]]
    heads: list[DraftHead | None]


def context_needs(
    target: LoadedModel,
    prompt_set: Sequence[prompts.Prompt],
    *,
    continuation: int,
    decode_tokens: int,
    draft_length: int,
) -> list[dict[str, int]]:
    """The context both phases need (``models.check_context_length`` keywords each).

    The continuations, and the decoder phase when ``decode_tokens > 0``: checked before
    anything compiles, so training is not lost to a decode phase that cannot run.
    """
    longest = max(len(ids) for ids in prompts.encode_prompts(target.tokenizer, prompt_set))
    needs = [dict(prompt_tokens=longest, new_tokens=continuation)]
    if decode_tokens > 0:
        needs.append(
            dict(prompt_tokens=longest, new_tokens=decode_tokens, draft_positions=draft_length)
        )
    return needs


def _early_exit(target: LoadedModel, num_layers: int) -> LoadedModel:
    """The target's first ``num_layers`` layers as a model of its own (weights shared)."""
    trunk = models.truncate(target.model, num_layers)
    return dataclasses.replace(target, model=trunk, config=trunk.config)


def prepare(
    loaders: Loaders,
    prompt_set: Sequence[prompts.Prompt],
    *,
    continuation: int,
    decode_tokens: int,
    draft_length: int,
    load_saved: Callable[[], FeatureSet] | None = None,
    save_to: pathlib.Path | None = None,
    bars: Bars = no_bars,
) -> Prepared:
    """Features of the target and the drafter on ``prompt_set``, and their lm_heads.

    The target greedy-decodes ``continuation`` tokens per prompt, then both models read
    prompt + continuation (:func:`~jaxcert.training.feature_set`); with ``load_saved``
    the features it returns are used instead (the models still give their lm_heads and
    their context lengths are still checked). Computed features are saved to
    ``save_to`` (:meth:`FeatureSet.save`). One model is in memory at a time: the trunks
    are only needed for the features, training needs the two lm_heads.

    Raises:
      ValueError: a model's context is too short for the continuations or for the
        decoder phase (:func:`context_needs`), or the vocabularies differ.
    """
    target = loaders.target()
    target_config = target.config
    needs = context_needs(
        target,
        prompt_set,
        continuation=continuation,
        decode_tokens=decode_tokens,
        draft_length=draft_length,
    )
    for need in needs:
        models.check_context_length({"target": target}, **need)
    features = None if load_saved is None else load_saved()
    if features is None:
        with bars("target continuations") as progress:
            conts = greedy_continuations(target, prompt_set, steps=continuation, progress=progress)
        target_hidden = teacher_forced_states(target, conts)
    target_head = Projection(target.model)
    if loaders.drafter is None:  # early exit of the target itself (weights shared)
        drafter = _early_exit(target, loaders.exit_layer)
        del target
    else:
        del target
        gc.collect()
        drafter = loaders.drafter()
    models.check_same_vocabulary(target_config, drafter.config)
    for need in needs:
        models.check_context_length({"drafter": drafter}, **need)
    if features is None:
        features = feature_set(conts, target_hidden, teacher_forced_states(drafter, conts))
        if save_to is not None:
            features.save(save_to)
    drafter_head = Projection(drafter.model)
    del drafter
    gc.collect()
    return Prepared(features, target_head, drafter_head)


def split_heldout(features: FeatureSet, fraction: float, *, seed: int = 0) -> Split:
    """Holds out ``round(fraction * prompts)`` prompts (at least one), drawn with ``seed``.

    Raises:
      ValueError: fewer than 2 prompts have positions (nothing left to train on or to
        hold out).
    """
    rng = np.random.default_rng(seed)
    prompt_ids = np.unique(features.prompt)
    held = rng.choice(prompt_ids, max(1, round(fraction * len(prompt_ids))), replace=False)
    is_held = np.isin(features.prompt, held)
    train, test = features.select(~is_held), features.select(is_held)
    if len(train) == 0 or len(test) == 0:
        raise ValueError(
            f"{counted(len(prompt_ids), 'prompt')} with positions: need at least 2 to hold some "
            "out (raise --max-prompts)"
        )
    return Split(train, test, held)


def comparison_objectives(weight: float = 1.0, margin: float = 0.0) -> tuple[Objective, ...]:
    """The compared objectives: (a) KL, (b) KL + strict-greedy and (c) KL + tree:4
    violation, the violation terms with ``weight`` and ``margin``."""
    return (
        Objective("(a) KL"),
        Objective(
            "(b) KL + greedy violation", rules_lib.StrictGreedy(), weight=weight, margin=margin
        ),
        Objective(
            "(c) KL + tree:4 violation", rules_lib.TreeCoverage(4), weight=weight, margin=margin
        ),
    )


def compare(
    prepared: Prepared,
    split: Split,
    objectives: Sequence[Objective],
    settings: TrainSettings = TrainSettings(),
    *,
    draft_length: int = 5,
    bars: Bars = no_bars,
    log: Callable[[str], None] = lambda message: None,
) -> Comparison:
    """The plain drafter, then a head trained with each objective, on held-out positions.

    Every objective trains at the same ``settings`` (same seed: same initial head, same
    batches); the target's logits of the training positions are computed once. ``log``
    gets one line per trained head with its results.
    """
    target_head, drafter_head = prepared.target_head, prepared.drafter_head
    kw: dict[str, Any] = dict(rules=RULES, draft_length=draft_length)
    results = [
        {
            "drafter": "untrained (plain drafter)",
            **evaluate(None, split.test, target_head, drafter_head, **kw),
        }
    ]
    train_logits = target_logits(split.train, target_head)  # once, for every objective
    histories: dict[str, list[dict[str, float]]] = {}
    heads: list[DraftHead | None] = [None]
    for objective in objectives:
        with bars(objective.name) as progress:
            head, history = train_head(
                objective,
                split.train,
                train_logits,
                drafter_head,
                **dataclasses.asdict(settings),
                progress=progress,
            )
        histories[objective.name] = history
        heads.append(head)
        result = evaluate(head, split.test, target_head, drafter_head, **kw)
        results.append({"drafter": objective.name, **result})
        log(f"{objective.name}: {result}")
    return Comparison(results, histories, heads)


def decode_heldout(
    loaders: Loaders,
    prompt_set: Sequence[prompts.Prompt],
    held: np.ndarray,
    heads: Sequence[DraftHead | None],
    *,
    draft_length: int = 5,
    max_new_tokens: int = 64,
    bars: Bars = no_bars,
) -> list[float]:
    """The speculative decoder's acceptance length with each head on the held-out prompts.

    Greedy chain, constant ``draft_length``, in the order of ``heads`` (``None``: the
    plain drafter); both models are loaded again (from ``loaders``).
    """
    target = loaders.target()
    if loaders.drafter is None:
        base = models.truncate(target.model, loaders.exit_layer)
    else:
        base = loaders.drafter().model
    encoded = prompts.encode_prompts(target.tokenizer, [prompt_set[i] for i in sorted(held)])
    lengths = []
    with bars("decoder acceptance") as progress:
        for i, head in enumerate(heads):
            drafter = base if head is None else HeadedDrafter(base, head)
            measured = decoder_acceptance(
                target,
                drafter,
                encoded,
                draft_length=draft_length,
                max_new_tokens=max_new_tokens,
                eos_ids=target.eos_ids,
            )
            lengths.append(measured["decoder_acceptance_length"])
            progress(i + 1, len(heads))
    return lengths


def write_results(
    out: pathlib.Path,
    comparison: Comparison,
    *,
    command: str,
    args: Mapping[str, Any],
    seconds: float,
) -> str:
    """Writes ``results.json`` (command, args, results, histories, seconds) and
    ``results.md`` (the results table) to ``out``; returns the table."""
    from jaxcert.pipeline import report

    table = report.markdown_table(comparison.results, digits=4)
    meta = {
        "command": command,
        "args": dict(args),
        "results": comparison.results,
        "histories": comparison.histories,
        "seconds": round(seconds, 1),
    }
    (out / "results.json").write_text(json.dumps(meta, indent=2, default=str))
    (out / "results.md").write_text(table + "\n")
    return table


def plot_histories(
    histories: Mapping[str, Sequence[Mapping[str, float]]], path: pathlib.Path
) -> None:
    """Loss, KL and violation per step (10-step means) of every training run, to ``path``."""
    from matplotlib.figure import Figure  # no pyplot: no global backend or figure state

    fig = Figure(figsize=(13, 3.8))
    axes = fig.subplots(1, 3)
    for name, history in histories.items():
        for ax, key in zip(axes, ("loss", "kl", "violation"), strict=True):
            values = np.array([h[key] for h in history])
            smooth = np.convolve(values, np.ones(10) / 10, mode="valid")
            ax.plot(np.arange(len(smooth)) + 9, smooth, label=name)
            ax.set_title(f"{key} (train batch, 10-step mean)")
            ax.set_xlabel("step")
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
