"""The steps of ``jaxcert finetune-drafter``: a drafter model's top blocks fine-tuned toward
its target with each objective and seed, compared on held-out text and in the decoder.

The command line calls these in order (``docs/training.md``, "Fine-tuning a drafter at the
boundary")::

  store, heldout = write_records(target, prompt_set, settings, out)      # the target, once
  states, held_states = write_states(drafter, name, store, heldout, settings, out)
  data = Data.load(store, heldout, states, held_states)
  sweep = sweep_blocks(drafter, data, (1, 2, 4), settings, out)          # optional
  runs = train_runs(drafter, data, objectives, settings, out)            # + held-out curves
  decoded = decode_runs(target, drafters, prompt_ids, out)               # tokens per round
  speed = speed_runs(target, drafters, prompt_ids, out)                  # batch 1, tokens/s
  summary = summarize(runs, decoded, speed); write learning_curves.png, results.md

Every phase resumes: the two record stores and the drafter's states skip their complete
shards, each run continues from its last checkpoint (a finished one is read back), and
held-out evaluations and decodes are cached per run in its folder, keyed by what they
measured.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from jaxcert.base.folders import atomic_write, check_options, refuse_other_options
from jaxcert.training import drafter_states, finetune, head_data
from jaxcert.training.head_recipe import bootstrap_mean, interval

if TYPE_CHECKING:
    from flax import nnx

    from jaxcert.base import prompts
    from jaxcert.models import LoadedModel, Transformer

__all__ = [
    "Data",
    "RecipeSettings",
    "heldout_figures",
    "decode_runs",
    "plot_curves",
    "results_table",
    "relative_speed",
    "speed_runs",
    "summarize",
    "sweep_blocks",
    "train_runs",
    "record_options",
    "write_records",
    "write_states",
]

Log = Callable[[str], None]

DECODE_CONFIGS: tuple[tuple[str, float, str], ...] = (
    ("T0 cert:0.55", 0.0, "cert:0.55"),
    ("T0 constant:5", 0.0, "constant:5"),
    ("T1 cert:0.55", 1.0, "cert:0.55"),
    ("T1 constant:5", 1.0, "constant:5"),
)
"""The decoder configurations every drafter is measured in: ``(name, temperature,
policy)``."""


@dataclasses.dataclass(frozen=True)
class RecipeSettings:
    """The data and schedule of a comparison.

    Attributes:
      positions: trained positions recorded from the target (ShareGPT replies).
      heldout: held-out sequences (the prompt set's last; never trained on).
      length: tokens per sequence (prompt + reply).
      top_k: the target's window per training position; ``heldout_top_k`` per held-out one.
      states_after: ``s``, the drafter blocks below the stored states (the most blocks a
        run can train is ``L - s``).
      finetune: the optimisation of every run.
      seeds: one run per seed and objective.
      curve_sequences: the first held-out sequences the learning curve is evaluated on
        (every checkpoint; the final figures use them all).
    """

    positions: int = 200_000
    heldout: int = 48
    length: int = 256
    top_k: int = 64
    heldout_top_k: int = 1024
    states_after: int = 20
    finetune: finetune.FinetuneSettings = finetune.FinetuneSettings()
    seeds: tuple[int, ...] = (0, 1)
    curve_sequences: int = 16


def _spec(target: LoadedModel, settings: RecipeSettings, top_k: int) -> head_data.StoreSpec:
    return head_data.StoreSpec(
        target=str(target.path),
        taps=(),
        length=settings.length,
        top_k=min(top_k, target.config.vocab_size),
        states=False,
    )


def _read_json(path: pathlib.Path) -> dict:
    """A cache file's JSON object; ``{}`` when it is missing or unreadable (the figures are
    then measured again and the file replaced)."""
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


FINGERPRINTS = ("target_sha256", "drafter_sha256")
"""The options of a fine-tuning folder that name the models' weights by content
(:func:`jaxcert.pipeline.store.fingerprint_path`): the same path holding other weights is
another folder's data."""

OPTIONS_ADVICE = "use another --out (the records and states are the runs' data)"


def record_options(
    out: pathlib.Path,
    options: Mapping[str, Any],
    *,
    record: bool = True,
    log: Log = lambda message: None,
) -> None:
    """Records ``options`` in ``out / 'options.json'``, or checks them against the record
    there (:func:`jaxcert.base.folders.check_options`). A record without
    :data:`FINGERPRINTS` (written before them) that agrees on the rest gets them; with
    ``record=False`` nothing is written and the fingerprints are not compared (a check
    before the models are loaded).

    Raises:
      ValueError: the folder records other options (each named, with both values).
    """
    path = out / "options.json"
    saved = _read_json(path) if path.is_file() else {}
    if saved and (not record or not any(k in saved for k in FINGERPRINTS)):

        def rest(d: Mapping[str, Any]) -> dict:
            kept = {k: v for k, v in d.items() if k not in FINGERPRINTS}
            return json.loads(json.dumps(kept, default=str))

        refuse_other_options(out, rest(saved), rest(options), advice=OPTIONS_ADVICE)
        if record:
            atomic_write(path, json.dumps(dict(options), indent=1, default=str) + "\n")
            log(f"{path}: recorded the models' fingerprints (a record written before them)")
        return
    check_options(out, options, advice=OPTIONS_ADVICE, record=record)


def write_records(
    target: LoadedModel,
    prompt_set: Sequence[prompts.Prompt],
    settings: RecipeSettings,
    out: pathlib.Path,
    *,
    options: Mapping[str, Any] | None = None,
    log: Log = lambda message: None,
) -> tuple[head_data.Store, head_data.Store]:
    """The target's records of ShareGPT-style replies: the held-out store (``out /
    'heldout'``, the last ``settings.heldout`` sequences, the wide window) first, then the
    training store (``out / 'store'``, up to ``settings.positions``); both resume.

    ``options`` (what the folder's data comes from, the models' fingerprints among them)
    are recorded in ``out / 'options.json'`` once the sequences are known to suffice and
    before anything is written: a folder recording other options is refused, one whose
    record predates the fingerprints (:data:`FINGERPRINTS`) gets them.

    Raises:
      ValueError: as :func:`jaxcert.training.head_recipe.sequences` and
        :func:`head_data.write_store`; ``out`` records other options.
    """
    from jaxcert.training import head_recipe

    head_settings = head_recipe.HeadSettings(
        positions=settings.positions, heldout=settings.heldout, length=settings.length
    )
    seqs = head_recipe.sequences(target, prompt_set, head_settings)
    train, held = head_recipe.split_sequences(seqs, settings.heldout)
    if options is not None:
        record_options(out, options, log=log)
    t0 = time.perf_counter()

    def progress(done: int, goal: int) -> None:
        of = f" / {goal:,}" if goal > 0 else " held-out"
        log(f"records: {done:,}{of} positions ({time.perf_counter() - t0:.0f} s)")

    heldout = head_data.write_store(
        target.model,
        held,
        out / "heldout",
        _spec(target, settings, settings.heldout_top_k),
        progress=progress,
    )
    store = head_data.write_store(
        target.model,
        train,
        out / "store",
        _spec(target, settings, settings.top_k),
        max_positions=settings.positions,
        progress=progress,
    )
    log(f"records: {store.positions:,} training positions, {heldout.positions:,} held out")
    return store, heldout


def write_states(
    drafter: Transformer,
    name: str,
    store: head_data.Store,
    heldout: head_data.Store,
    settings: RecipeSettings,
    out: pathlib.Path,
    *,
    log: Log = lambda message: None,
) -> tuple[drafter_states.DrafterStates, drafter_states.DrafterStates]:
    """The drafter's states after ``settings.states_after`` blocks on both stores
    (``out / 'drafter-states'``, ``out / 'heldout-drafter-states'``); both resume."""

    def progress(done: int, total: int) -> None:
        if done % 50 == 0 or done == total:
            log(f"drafter states: {done} / {total} shards")

    held = drafter_states.write_drafter_states(
        drafter,
        heldout,
        out / "heldout-drafter-states",
        blocks=settings.states_after,
        name=name,
        progress=progress,
    )
    states = drafter_states.write_drafter_states(
        drafter,
        store,
        out / "drafter-states",
        blocks=settings.states_after,
        name=name,
        progress=progress,
    )
    return states, held


@dataclasses.dataclass(frozen=True)
class Data:
    """Both stores and their drafter states, in memory."""

    store: head_data.Store
    heldout: head_data.Store
    states_manifest: drafter_states.DrafterStates
    records: head_data.HeadRecords
    states: np.ndarray
    held: head_data.HeadRecords
    held_states: np.ndarray
    rule_names: tuple[str, ...]
    first: int

    @classmethod
    def load(
        cls,
        store: head_data.Store,
        heldout: head_data.Store,
        states: drafter_states.DrafterStates,
        held_states: drafter_states.DrafterStates,
    ) -> Data:
        """Reads the four folders (``[N, T, E]`` float32 states: ~0.9 MB a sequence for
        the 0.5B at ``T = 256``).

        Raises:
          ValueError: states written for other shards than the stores'.
        """
        for s, h in ((store, states), (heldout, held_states)):
            if [x["digest"] for x in s.shards] != [x["digest"] for x in h.shards]:
                raise ValueError(f"{h.folder} does not hold the states of {s.folder}'s shards")
        return cls(
            store,
            heldout,
            states,
            store.load(),
            states.load(),
            heldout.load(),
            held_states.load(),
            tuple(store.spec.rules),
            states.blocks,
        )


def _curve_point(
    drafter: Transformer, data: Data, trained_blocks: int, sequences: int
) -> Callable[[nnx.State], dict[str, float]]:
    """The learning curve's evaluation: means over the first ``sequences`` held-out
    sequences."""
    n = min(sequences, data.held.tokens.shape[0])
    fields = dataclasses.fields(data.held)
    held = head_data.HeadRecords(**{f.name: getattr(data.held, f.name)[:n] for f in fields})

    def evaluate(trainable: nnx.State) -> dict[str, float]:
        per = finetune.evaluate_drafter(
            drafter,
            trainable,
            held,
            data.held_states[:n],
            rule_names=data.rule_names,
            first=data.first,
            trained_blocks=trained_blocks,
        )
        return {k: float(np.mean(v)) for k, v in per.items() if k != "positions"}

    return evaluate


HELDOUT_FIGURES = 2
"""The version of :func:`finetune.evaluate_drafter`'s figures a cached ``heldout.json``
holds (2: with ``near:<rule>``); another is recomputed."""


def heldout_figures(
    drafter: Transformer, trainable, data: Data, trained_blocks: int, path: pathlib.Path
) -> dict[str, np.ndarray]:
    """Per held-out sequence (:func:`finetune.evaluate_drafter`), cached in ``path`` (keyed
    by the held-out shards and :data:`HELDOUT_FIGURES`; the run's folder is keyed by its
    training)."""
    key = {"shards": [s["digest"] for s in data.heldout.shards], "figures": HELDOUT_FIGURES}
    saved = _read_json(path)
    if saved.get("key") == key and isinstance(saved.get("per_sequence"), dict):
        return {k: np.asarray(v) for k, v in saved["per_sequence"].items()}
    per = finetune.evaluate_drafter(
        drafter,
        trainable,
        data.held,
        data.held_states,
        rule_names=data.rule_names,
        first=data.first,
        trained_blocks=trained_blocks,
    )
    record = {"key": key, "per_sequence": {k: v.tolist() for k, v in per.items()}}
    atomic_write(path, json.dumps(record))
    return per


def _run(
    drafter: Transformer,
    data: Data,
    objective: finetune.FinetuneObjective,
    seed: int,
    ft: finetune.FinetuneSettings,
    folder: pathlib.Path,
    key: Mapping[str, Any],
    **kwargs: Any,
) -> tuple[nnx.State, dict]:
    """One resumable run in ``folder``, keyed by its data, objective, seed and schedule
    (``key``, :func:`finetune.run_key`)."""
    return finetune.finetune_drafter(
        drafter, data.records, data.states, objective, rule_names=data.rule_names,
        first=data.first, settings=ft, seed=seed, folder=folder, key=key, **kwargs,
    )  # fmt: skip


def sweep_blocks(
    drafter: Transformer,
    data: Data,
    candidates: Sequence[int],
    settings: RecipeSettings,
    steps: int,
    out: pathlib.Path,
    *,
    log: Log = lambda message: None,
) -> list[dict[str, Any]]:
    """The short sweep of ``N``: ``kl``, seed 0, ``steps`` steps per candidate, each in
    ``out / 'sweep' / 'N<n>'`` (resumable).

    Per candidate: ``fresh_kl_change``, the mean over the second half of the steps of each
    batch's KL before its update minus the untrained drafter's KL on the same batch (every
    batch is new text in the first pass: a paired measure of what the run has learnt, far
    less noisy than a held-out difference after a few steps); the held-out means after the
    last step; and the median seconds a step (the comparison's forward excluded).
    """
    rows = []
    for n in candidates:
        ft = dataclasses.replace(settings.finetune, trained_blocks=n, steps=steps, every=steps)
        folder = out / "sweep" / f"N{n}"
        objective = finetune.OBJECTIVES["kl"]
        key = finetune.run_key(data.store, data.states_manifest, objective, 0, ft)
        trainable, progress = _run(
            drafter, data, objective, 0, ft, folder, key, compare_initial=True
        )
        per = heldout_figures(drafter, trainable, data, n, folder / "heldout.json")
        history = progress["history"]
        seconds = [h["seconds"] for h in history[1:]]
        late = history[len(history) // 2 :]
        row: dict[str, Any] = {"trained_blocks": n, "steps": steps}
        row["fresh_kl_change"] = float(np.mean([h["kl"] - h["kl_initial"] for h in late]))
        row |= {k: float(np.mean(v)) for k, v in per.items() if k != "positions"}
        row["seconds_per_step"] = float(np.median(seconds)) if seconds else float("nan")
        rows.append(row)
        log(f"sweep N={n}: {row}")
    return rows


def train_runs(
    drafter: Transformer,
    data: Data,
    objectives: Sequence[finetune.FinetuneObjective],
    settings: RecipeSettings,
    out: pathlib.Path,
    *,
    mesh=None,
    log: Log = lambda message: None,
) -> list[dict[str, Any]]:
    """One run per seed and objective (every objective at the first seed before any at the
    second), each in ``out / '<objective>-seed<seed>'``, then its held-out evaluation.
    Every run's folder is checked against what it was trained for before any run trains.

    Returns:
      Per run: ``objective``, ``seed``, ``folder``, ``trainable`` (the parameters),
      ``curve`` (the learning curve), ``history`` and ``per_sequence`` (held-out).

    Raises:
      ValueError: a run's folder trained for another key (:func:`finetune.run_key`).
    """
    ft = settings.finetune
    keys = {
        (seed, objective.name): finetune.run_key(
            data.store, data.states_manifest, objective, seed, ft
        )
        for seed in settings.seeds
        for objective in objectives
    }
    for (seed, name), key in keys.items():  # every run's folder checked before any trains
        check_options(
            out / f"{name}-seed{seed}", key, name="run.json", advice="use another folder",
            record=False,
        )  # fmt: skip
    rows = []
    for seed in settings.seeds:
        for objective in objectives:
            folder = out / f"{objective.name}-seed{seed}"

            def step_log(step: int, entry: dict, name: str = folder.name) -> None:
                if step % 10 == 0 or step == ft.steps:
                    shown = {k: round(v, 4) for k, v in entry.items() if k != "step"}
                    log(f"{name} step {step}/{ft.steps}: {shown}")

            trainable, progress = _run(
                drafter,
                data,
                objective,
                seed,
                ft,
                folder,
                keys[seed, objective.name],
                evaluate=_curve_point(drafter, data, ft.trained_blocks, settings.curve_sequences),
                mesh=mesh,
                log=step_log,
            )
            per = heldout_figures(
                drafter, trainable, data, ft.trained_blocks, folder / "heldout.json"
            )
            log(
                f"{folder.name}: held-out KL {per['kl'].mean():.4f}, certified greedy "
                f"{per['certified:greedy'].mean():.4f}"
            )
            rows.append(
                {
                    "objective": objective.name,
                    "seed": seed,
                    "folder": str(folder),
                    "trainable": trainable,
                    "curve": progress["curve"],
                    "history": progress["history"],
                    "per_sequence": per,
                }
            )
    return rows


def _decode_config(temperature: float, target: LoadedModel, tokens: int):
    from jaxcert import decoding

    return decoding.DecodeConfig(
        verification=decoding.parse_verify("sample" if temperature > 0 else "greedy"),
        temperature=temperature,
        max_new_tokens=tokens,
        max_draft=8,
        eos_ids=target.eos_ids,
    )


def decode_runs(
    target: LoadedModel,
    drafters: Mapping[str, Transformer],
    prompt_ids: Sequence[Sequence[int]],
    folder_of: Mapping[str, pathlib.Path],
    *,
    tokens: int = 64,
    log: Log = lambda message: None,
) -> dict[str, dict[str, list[float]]]:
    """Tokens per round (emitted tokens / rounds, per prompt) of each drafter in each of
    :data:`DECODE_CONFIGS`, all prompts in one batch; cached in each drafter's folder
    (``decode.json``, keyed by the prompts and ``tokens``).

    Returns:
      ``{drafter: {config: [P] tokens per round}}``.
    """
    import jax

    from jaxcert import decoding

    out: dict[str, dict[str, list[float]]] = {}
    key = {"prompts": [list(map(int, p)) for p in prompt_ids], "tokens": tokens}
    width = max(len(p) for p in prompt_ids)
    for name, drafter in drafters.items():
        path = folder_of[name] / "decode.json"
        saved = _read_json(path)
        if saved.get("key") != key or not isinstance(saved.get("runs"), dict):
            saved = {"key": key, "runs": {}}
        for config_name, temperature, policy in DECODE_CONFIGS:
            if config_name in saved["runs"]:
                continue
            result = decoding.speculative_decode(
                target.model,
                drafter,
                [list(p) for p in prompt_ids],
                policy=decoding.parse_policy(policy),
                config=_decode_config(temperature, target, tokens),
                prompt_width=width,
                key=jax.random.key(0),
            )
            per = [
                len(t) / max(int(r), 1) for t, r in zip(result.tokens, result.rounds, strict=True)
            ]
            saved["runs"][config_name] = per
            path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write(path, json.dumps(saved))
            log(f"decode {name} {config_name}: {np.mean(per):.3f} tokens per round")
        out[name] = saved["runs"]
    return out


def speed_runs(
    target: LoadedModel,
    drafters: Mapping[str, Transformer],
    prompt_ids: Sequence[Sequence[int]],
    path: pathlib.Path,
    *,
    tokens: int = 64,
    policy: str = "cert:0.55",
    log: Log = lambda message: None,
) -> dict[str, dict[str, Any]]:
    """Batch 1, T = 0: each prompt decoded alone, target-only and with each drafter
    (``policy``); per method its tokens per second over the prompts (prefill and decode
    time, compiles excluded: each method decodes the first prompt once before timing) and
    its outputs' equality to target-only's. The methods are interleaved: each prompt is
    decoded by every method in turn (the order rotated from prompt to prompt), so a drift
    of the machine's speed during the run reaches every method alike. Cached in ``path``
    after each prompt: a rerun goes on from the next prompt, and a method added later is
    timed on its own (against the cached ones, interleaving no longer holds for it).

    Returns:
      ``{method: {"tokens_per_s", "speedup", "speedup_ci95", "tokens", "seconds",
      "per_prompt_tokens", "per_prompt_seconds", "same_as_target"}}``, target-only under
      ``"target-only"``; ``speedup`` is the ratio of tokens/s to target-only's, with a 95%
      bootstrap interval over the prompts (:func:`relative_speed`; ``None`` with one prompt).
    """
    from jaxcert import decoding

    key = {
        "prompts": [list(map(int, p)) for p in prompt_ids],
        "tokens": tokens,
        "policy": policy,
        "interleaved": True,
    }
    saved = _read_json(path)
    if saved.get("key") != key or not isinstance(saved.get("methods"), dict):
        saved = {"key": key, "methods": {}}
    config = _decode_config(0.0, target, tokens)
    decoders: dict[str, Callable] = {
        "target-only": lambda p: decoding.target_decode(
            target.model, p, max_new_tokens=tokens, eos_ids=target.eos_ids
        )
    }
    for name, drafter in drafters.items():
        decoders[name] = lambda p, d=drafter: decoding.speculative_decode(
            target.model, d, p, policy=decoding.parse_policy(policy), config=config
        )
    for name in decoders:  # per method its per-prompt lists, cached or partly cached
        saved["methods"].setdefault(
            name, {"per_prompt_tokens": [], "per_prompt_seconds": [], "outputs": []}
        )
    timed = saved["methods"]
    todo = [m for m in decoders if "tokens_per_s" not in timed[m]]
    for name in todo:
        if len(timed[name]["per_prompt_seconds"]) < len(prompt_ids):
            decoders[name]([list(prompt_ids[0])])  # compiles
    for i, prompt in enumerate(prompt_ids):
        turn = [m for m in todo if len(timed[m]["per_prompt_seconds"]) == i]
        if not turn:
            continue
        shift = i % len(turn)
        for name in turn[shift:] + turn[:shift]:
            result = decoders[name]([list(prompt)])
            timed[name]["per_prompt_tokens"].append(int(result.num_tokens))
            timed[name]["per_prompt_seconds"].append(round(result.prefill_s + result.decode_s, 4))
            timed[name]["outputs"].append([int(x) for x in result.tokens[0]])
        atomic_write(path, json.dumps(saved))
    for name in todo:
        entry = timed[name]
        total, seconds = sum(entry["per_prompt_tokens"]), sum(entry["per_prompt_seconds"])
        entry |= {"tokens": total, "seconds": round(seconds, 3)}
        entry["tokens_per_s"] = round(total / seconds, 4)
        log(f"speed {name}: {total / seconds:.3f} tokens/s")
    if todo:
        atomic_write(path, json.dumps(saved))
    base = saved["methods"]["target-only"]
    speed = {
        m: {
            "tokens_per_s": r["tokens_per_s"],
            "tokens": r["tokens"],
            "seconds": r["seconds"],
            "per_prompt_tokens": r["per_prompt_tokens"],
            "per_prompt_seconds": r["per_prompt_seconds"],
            "same_as_target": sum(
                a == b for a, b in zip(r["outputs"], base["outputs"], strict=True)
            ),
        }
        for m, r in saved["methods"].items()
        if "tokens_per_s" in r  # not one left half-timed by a run of other methods
    }
    for r in speed.values():
        ratio = relative_speed(r, speed["target-only"])
        r["speedup"] = round(ratio[0], 4)  # no interval (None) from a single prompt
        r["speedup_ci95"] = None if np.isnan(ratio[1]) else [round(x, 4) for x in ratio[1:]]
    return speed


def relative_speed(
    method: Mapping[str, Any], base: Mapping[str, Any]
) -> tuple[float, float, float]:
    """``(ratio, low, high)``: ``method``'s tokens/s over ``base``'s (two entries of
    :func:`speed_runs`' result, timed on the same prompts), with a 95% bootstrap interval
    over the prompts (each resample recomputes the ratio of total throughputs)."""
    from jaxcert.decoding.run_report import bootstrap_speedup

    return bootstrap_speedup(
        base["per_prompt_tokens"],
        base["per_prompt_seconds"],
        method["per_prompt_tokens"],
        method["per_prompt_seconds"],
    )


def summarize(
    runs: Sequence[Mapping[str, Any]],
    untrained: Mapping[str, np.ndarray],
    decoded: Mapping[str, Mapping[str, Sequence[float]]],
) -> dict[str, Any]:
    """Per objective (seeds pooled by averaging per held-out sequence and per decoded
    prompt): each metric's mean with a 95% bootstrap interval, and its paired differences
    from the untrained drafter (``vs_untrained:``) and from ``kl`` (``vs_kl:``).

    Args:
      runs: :func:`train_runs`' rows.
      untrained: the untrained drafter's per-sequence held-out figures.
      decoded: :func:`decode_runs`' result, with the untrained drafter as ``"untrained"``
        and each run under its folder's name.
    """
    by: dict[str, list[Mapping[str, Any]]] = {}
    for r in runs:
        by.setdefault(r["objective"], []).append(r)

    def pooled_decode(names: Sequence[str]) -> dict[str, np.ndarray]:
        present = [decoded[n] for n in names if n in decoded]
        if not present:
            return {}
        return {c: np.mean([np.asarray(d[c]) for d in present], axis=0) for c in present[0]}

    table: dict[str, dict[str, np.ndarray]] = {
        "untrained": {
            **{k: np.asarray(v) for k, v in untrained.items() if k != "positions"},
            **pooled_decode(["untrained"]),
        },
    }
    for name, group in by.items():
        per = {
            k: np.mean([g["per_sequence"][k] for g in group], axis=0)
            for k in group[0]["per_sequence"]
            if k != "positions"
        }
        per |= pooled_decode([pathlib.Path(g["folder"]).name for g in group])
        table[name] = per
    summary: dict[str, Any] = {"objectives": {}}
    for name, metrics in table.items():
        entry: dict[str, Any] = {k: bootstrap_mean(v) for k, v in metrics.items()}
        for base in ("untrained", "kl"):
            if base in table and name != base:
                entry |= {
                    f"vs_{base}:{k}": bootstrap_mean(v - table[base][k])
                    for k, v in metrics.items()
                    if k in table[base]
                }
        entry["seeds"] = [g["seed"] for g in by.get(name, [])]
        summary["objectives"][name] = entry
    return summary


def results_table(summary: Mapping[str, Any], metrics: Sequence[str], against: str) -> str:
    """Markdown: one row per objective, ``mean [low, high]`` of each of ``metrics``, and the
    paired difference from ``against`` (``"kl"`` or ``"untrained"``; ``*``: the interval
    excludes 0)."""
    from jaxcert.base.tables import markdown_table

    rows = []
    for name, e in summary["objectives"].items():
        row = {"drafter": name, "seeds": ",".join(map(str, e["seeds"])) or "-"}
        for k in metrics:
            if k in e:
                row[k] = interval(e[k], 4)
        for k in metrics:
            d = e.get(f"vs_{against}:{k}")
            row[f"Δ {k}"] = interval(d, 4, signed=True) if d is not None else "-"
        rows.append(row)
    return markdown_table(rows)


def plot_curves(runs: Sequence[Mapping[str, Any]], path: pathlib.Path, *, smooth: int = 10) -> None:
    """Held-out greedy-certified fraction and KL against step, per objective (seeds
    averaged), and the fraction of each step's positions where the objective's extra term
    is active (its training history, a running mean over ``smooth`` steps; objectives with
    no term are left out), to ``path``."""
    from matplotlib.figure import Figure

    by: dict[str, list[Mapping[str, Any]]] = {}
    for r in runs:
        by.setdefault(r["objective"], []).append(r)
    fig = Figure(figsize=(15, 4))
    axes = fig.subplots(1, 3)
    for name, group in by.items():
        curves = [g["curve"] for g in group]
        steps = [p["step"] for p in curves[0]]
        for ax, key in zip(axes[:2], ("certified:greedy", "kl"), strict=True):
            values = np.mean([[p[key] for p in c[: len(steps)]] for c in curves], axis=0)
            ax.plot(steps, values, marker="o", label=name)
        width = min(len(g["history"]) for g in group)
        active = np.mean([[h["active"] for h in g["history"][:width]] for g in group], axis=0)
        if width and active.any():
            k = min(smooth, width)
            axes[2].plot(np.arange(k, width + 1), np.convolve(active, np.ones(k) / k, "valid"),
                         label=name)  # fmt: skip
        else:
            axes[2].plot([], [])  # keeps each objective's colour across the panels
    axes[0].set_title("held-out greedy-certified fraction")
    axes[1].set_title("held-out KL(p||q) (nats)")
    axes[2].set_title(f"positions where the term is active (mean of {smooth} steps)")
    for ax in axes:
        ax.set_xlabel("step")
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
