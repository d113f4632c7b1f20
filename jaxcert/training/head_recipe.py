"""The steps of ``jaxcert train-drafter --head``: EAGLE draft heads for a target, at scale.

The command line calls these in order (``docs/training.md``, "Training a draft head at
scale")::

  seqs = sequences(target, prompt_set, settings, cache=out / "greedy.jsonl")
  train, held = split_sequences(seqs, settings.heldout)
  store = head_data.write_store(target.model, train, out / "store", spec, max_positions=...)
  heldout = head_data.write_store(target.model, held, out / "heldout", heldout_spec)
  vocab = draft_vocabulary(store.load(), settings.draft_vocab)
  for objective in objectives(...), seed in settings.seeds:
      head = train_one(target.model, records, objective, seed, settings, vocab, out / name)
      rows.append(evaluate_head(head, heldout_records, ...))

Every phase resumes: greedy continuations (``--data greedy``) are read back from
``greedy.jsonl``, the two stores skip their complete shards, each training run continues
from its last checkpoint, and finished heads (``head/`` with ``done.json``) are evaluated
without retraining.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import pathlib
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from jaxcert.base import prompts
from jaxcert.base.folders import refuse_other_options
from jaxcert.base.tables import counted
from jaxcert.base.validate import check_int
from jaxcert.core import rules as rules_lib
from jaxcert.training import head_data
from jaxcert.training.evaluation import decoder_acceptance_by_prompt
from jaxcert.training.train import Objective

if TYPE_CHECKING:
    from jaxcert.models import EagleHead, LoadedModel, Transformer

__all__ = [
    "HeadSettings",
    "default_taps",
    "draft_vocabulary",
    "evaluate_head",
    "evaluate_heads",
    "heads_table",
    "head_objectives",
    "interval",
    "sequences",
    "split_sequences",
    "train_one",
]


def default_taps(num_layers: int) -> tuple[int, ...]:
    """EAGLE-3's low / mid / high taps: blocks ``2``, ``L // 2`` and ``L - 3``
    (``(0, L // 2, L - 1)`` below 6 blocks)."""
    if num_layers < 6:
        return tuple(sorted({0, num_layers // 2, num_layers - 1}))
    return (2, num_layers // 2, num_layers - 3)


@dataclasses.dataclass(frozen=True)
class HeadSettings:
    """Options of a head-training run.

    Attributes:
      data: ``'replies'`` (the prompt set's own replies, e.g. ShareGPT's assistant turns)
        or ``'greedy'`` (the target's greedy continuations).
      arch: the head's `EagleHead` arch: ``'jaxcert'`` or ``'eagle3'`` (the published
        layer the engines serve; one layer, three taps).
      taps: target blocks the head fuses (``()``: EAGLE-1, the final-norm state).
      num_layers: the head's decoder blocks.
      ttt_depth: drafted tokens a round the loss covers ("training-time test",
        `eagle.window_loss`; ``1``: teacher forcing only).
      draft_vocab: size of the reduced draft vocabulary (``0``: the full vocabulary).
      length: tokens per training sequence (prompt + reply).
      top_k: target log-probabilities stored per training position.
      heldout_top_k: the same for held-out positions (a wider window: the held-out KL's
        lower bound is then tight).
      positions: trained positions to record.
      heldout: held-out sequences (the last ones of the prompt set; never trained on).
      steps, batch_size, learning_rate: optimisation (``batch_size`` sequences per step).
      seeds: one trained head per seed and objective.
    """

    data: str = "replies"
    arch: str = "jaxcert"
    taps: tuple[int, ...] = ()
    num_layers: int = 1
    ttt_depth: int = 1
    draft_vocab: int = 32_768
    length: int = 256
    top_k: int = 64
    heldout_top_k: int = 1024
    positions: int = 100_000
    heldout: int = 48
    steps: int = 1000
    batch_size: int = 4
    learning_rate: float = 3e-4
    seeds: tuple[int, ...] = (0, 1)

    def __post_init__(self) -> None:
        if self.data not in ("replies", "greedy"):
            raise ValueError(f"data must be 'replies' or 'greedy', got {self.data!r}")
        from jaxcert.models.eagle import ARCHS

        if self.arch not in ARCHS:
            raise ValueError(f"arch must be one of {ARCHS}, got {self.arch!r}")
        check_int("ttt_depth", self.ttt_depth)


def head_objectives(weight: float = 1.0, margin: float = 0.0) -> tuple[Objective, ...]:
    """The compared objectives: KL, KL + greedy violation, KL + tree:4 violation, and the
    acceptance-aware KL + TV (``tv_weight = 1``: the chance of a rejection at T = 1)."""
    return (
        Objective("kl"),
        Objective("kl+greedy", rules_lib.StrictGreedy(), weight=weight, margin=margin),
        Objective("kl+tree4", rules_lib.TreeCoverage(4), weight=weight, margin=margin),
        Objective("kl+tv", tv_weight=1.0),
    )


def sequences(
    target: LoadedModel,
    prompt_set: Sequence[prompts.Prompt],
    settings: HeadSettings,
    *,
    cache: pathlib.Path | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> list[head_data.TrainingSequence]:
    """Training sequences of ``prompt_set`` for ``settings.data`` (chat template, default
    system prompt; cut at ``settings.length``), the ``settings.heldout`` held-out ones last
    (:func:`split_sequences` parts them).

    With ``'greedy'`` (:func:`head_data.greedy_sequences`) the held-out sequences are the
    continuations of the last ``settings.heldout`` prompts that fit
    (:func:`head_data.fitting_prompts`), generated first; the training ones are those of
    the fitting prompts before them, in order, until ``settings.positions`` trained
    positions. ``cache`` (the continuations' file) and ``progress`` are ``greedy_sequences``'
    (``'greedy'`` only).

    Raises:
      ValueError: ``'replies'`` with a prompt set that has no replies; ``'greedy'`` with no
        more than ``settings.heldout`` fitting prompts; as ``greedy_sequences``.
    """
    if settings.data == "replies":
        if not any(p.response is not None for p in prompt_set):
            raise ValueError("--data replies needs a prompt set with replies (ShareGPT)")
        end = target.config.eos_token_ids[0] if target.config.eos_token_ids else 0
        return head_data.reply_sequences(
            target.tokenizer, prompt_set, length=settings.length, end_id=end
        )
    keyed = head_data.unique_ids(prompt_set)  # one key per prompt across both calls
    fit = head_data.fitting_prompts(target.tokenizer, keyed, length=settings.length)
    n_train = len(fit) - settings.heldout
    if n_train < 1:
        raise ValueError(
            f"{counted(len(fit), 'prompt')} fit{'s' if len(fit) == 1 else ''} "
            f"{settings.length} tokens: too few to hold out "
            f"{settings.heldout} (more prompts: --prompts, --max-prompts; or lower "
            "--heldout-sequences)"
        )
    kw: dict[str, Any] = {"length": settings.length, "cache": cache, "progress": progress}
    held = head_data.greedy_sequences(target, fit[n_train:], **kw)
    if len(held) != settings.heldout:  # a prompt without a continuation
        raise ValueError(f"{settings.heldout - len(held)} held-out prompts have no continuation")
    train = head_data.greedy_sequences(
        target, fit[:n_train], max_positions=settings.positions, **kw
    )
    return train + held


def split_sequences(
    seqs: Sequence[head_data.TrainingSequence], heldout: int
) -> tuple[list[head_data.TrainingSequence], list[head_data.TrainingSequence]]:
    """``(train, held)``: the last ``heldout`` sequences are held out.

    Raises:
      ValueError: fewer than ``heldout + 1`` sequences.
    """
    if len(seqs) <= heldout:
        raise ValueError(
            f"{counted(len(seqs), 'sequence')} cannot hold out {heldout} (more prompts: "
            "--prompts, --max-prompts)"
        )
    return list(seqs[: len(seqs) - heldout]), list(seqs[len(seqs) - heldout :])


def draft_vocabulary(records: head_data.HeadRecords, size: int) -> np.ndarray | None:
    """The ``size`` tokens with the most target probability over the trained positions
    (from the stored windows), sorted; ``None`` for ``size == 0`` (the full vocabulary)."""
    from jaxcert.models.eagle import draft_vocab_from_counts

    if size == 0:
        return None
    mask = records.mask
    ids = records.top_ids[mask].ravel()
    mass = np.exp(records.top_logp[mask].astype(np.float64)).ravel()
    vocab = int(ids.max()) + 1
    counts = np.bincount(ids, weights=mass, minlength=vocab)
    return draft_vocab_from_counts(counts, size)


def train_one(
    target: Transformer,
    records: head_data.HeadRecords,
    objective: Objective,
    seed: int,
    settings: HeadSettings,
    vocab: np.ndarray | None,
    folder: pathlib.Path,
    *,
    rule_names: tuple[str, ...],
    log: Callable[[int, dict[str, float]], None] | None = None,
) -> EagleHead:
    """One head (``EagleHead.from_target``, seed ``seed``) trained on ``records``; resumes
    from ``folder``'s checkpoint, and returns the finished head of ``folder / 'head'`` when
    ``folder / 'done.json'`` says it is complete."""
    from flax import nnx

    from jaxcert.models import EagleHead
    from jaxcert.models.eagle import load_head
    from jaxcert.training.eagle import train_head_on_records

    key = run_key(records, objective, seed, settings, vocab)
    _check_run_key(folder, key)
    if (folder / "done.json").is_file():
        return load_head(folder / "head")
    for stale in ("heldout.json", "decode.json"):  # figures of an earlier head in this folder
        (folder / stale).unlink(missing_ok=True)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "run.json").write_text(json.dumps(key, indent=1))
    head = EagleHead.from_target(
        target,
        rngs=nnx.Rngs(seed),
        num_layers=settings.num_layers,
        taps=settings.taps,
        draft_vocab=vocab,
        arch=settings.arch,
    )
    head, history = train_head_on_records(
        head,
        records,
        objective,
        rule_names=rule_names,
        steps=settings.steps,
        batch_size=settings.batch_size,
        learning_rate=settings.learning_rate,
        seed=seed,
        checkpoint=folder,
        log=log,
        depth=settings.ttt_depth,
    )
    (folder / "done.json").write_text(json.dumps({"steps": len(history), "last": history[-1]}))
    return head


def run_key(
    records: head_data.HeadRecords,
    objective: Objective,
    seed: int,
    settings: HeadSettings,
    vocab: np.ndarray | None,
) -> dict[str, Any]:
    """What a head folder's training depends on: the trained sequences (a digest of their
    tokens), the objective, the seed, the head's shape and the optimisation settings
    (``ttt_depth`` only when it is not 1 and ``arch`` only when it is not ``'jaxcert'``, so
    that earlier folders keep their keys)."""
    import hashlib

    digest = hashlib.sha256(np.ascontiguousarray(records.tokens).tobytes()).hexdigest()[:16]
    vocab_digest = None
    if vocab is not None:
        vocab_digest = hashlib.sha256(np.asarray(vocab, np.int64).tobytes()).hexdigest()[:16]
    return (
        {
            "records": digest,
            "sequences": int(records.tokens.shape[0]),
            "objective": dataclasses.asdict(objective) | {"rule": str(objective.rule)},
            "seed": seed,
            "taps": list(settings.taps),
            "num_layers": settings.num_layers,
            "draft_vocab": vocab_digest,
            "steps": settings.steps,
            "batch_size": settings.batch_size,
            "learning_rate": settings.learning_rate,
        }
        | ({"ttt_depth": settings.ttt_depth} if settings.ttt_depth != 1 else {})
        | ({"arch": settings.arch} if settings.arch != "jaxcert" else {})
    )


def _check_run_key(folder: pathlib.Path, key: dict[str, Any]) -> None:
    """Refuses to resume or reuse a head folder trained for another run (a grown store,
    other settings): its head and checkpoint are kept, and the error says what differs.

    Raises:
      ValueError: ``folder / 'run.json'`` (or, from before run keys, a checkpoint without
        one) belongs to another run.
    """
    path = folder / "run.json"
    if path.is_file():
        advice = "it holds a head trained for another run: move it away or choose another --out"
        refuse_other_options(folder, json.loads(path.read_text()), key, advice=advice)
    elif (folder / "progress.json").is_file() or (folder / "done.json").is_file():
        raise ValueError(
            f"{folder} holds a head without a run key (an earlier version's); move it away or "
            "choose another --out"
        )


@functools.cache
def _jitted_window_terms(depth: int) -> Callable:
    """`eagle.unrolled_window_terms` at ``depth`` under one ``nnx.jit``, made once: heads of
    one shape then share its compiled program (a fresh wrapper per call compiled it again
    for every head)."""
    from flax import nnx

    from jaxcert.training.eagle import unrolled_window_terms

    return nnx.jit(functools.partial(unrolled_window_terms, depth=depth))


def evaluate_head(
    head: EagleHead,
    records: head_data.HeadRecords,
    rule_names: tuple[str, ...],
    *,
    depth: int = 1,
) -> dict[str, np.ndarray]:
    """Per held-out sequence: mean window KL (nats), mean TV, greedy agreement and the
    certified fraction per rule (``KL < C_p``), over its trained positions.

    With ``depth = D > 1``, also the head's later drafted tokens
    (`eagle.unrolled_window_terms`, ``docs/training.md``, "Training-time test"): for
    ``k = 2 .. D``, ``kl@k`` and ``agreement@k`` of the ``k``-th token of a round given
    that the ``k - 1`` before it were the text's (accepted), over the positions where
    such a round fits; and ``accepted@D``, the mean over rounds starting at each trained
    position (with ``D - 1`` trained positions after it) of how many of ``D`` greedily
    drafted tokens the target's greedy choice accepts. On the target's own greedy text
    ``accepted@D`` is the acceptance of a ``D``-token chain in greedy decoding (up to float
    rounding); on other text the chain is drafted after the text's tokens, not the
    target's.

    Returns:
      ``{"kl", "tv", "agreement", "certified:<rule>"..., ["kl@k", "agreement@k"...,
      "accepted@D"]}``, each ``[N]`` float64 (one value per sequence: the unit of the
      bootstrap; NaN for a sequence too short for a round of ``D``).

    Raises:
      ValueError: ``depth`` below 1.
    """
    check_int("depth", depth)
    terms = _jitted_window_terms(depth)
    out: dict[str, list[float]] = {"kl": [], "tv": [], "agreement": []}
    for r in rule_names:
        out[f"certified:{r}"] = []
    for k in range(2, depth + 1):
        out[f"kl@{k}"], out[f"agreement@{k}"] = [], []
    if depth > 1:
        out[f"accepted@{depth}"] = []
    mask = records.mask
    nan = float("nan")
    for i in range(records.tokens.shape[0]):
        batch = records.batch(slice(i, i + 1))
        kl, tv, cert, top = terms(head, batch)
        kl, tv, top = (np.asarray(x)[:, 0] for x in (kl, tv, top))  # [D, T]
        cert = np.asarray(cert)[0]  # [T, R]
        m = mask[i]
        greedy = records.top_ids[i, :, 0]
        hit = top == greedy[None, :]  # [D, T]
        out["kl"].append(float(kl[0][m].mean()))
        out["tv"].append(float(tv[0][m].mean()))
        out["agreement"].append(float(hit[0][m].mean()))
        for j, r in enumerate(rule_names):
            out[f"certified:{r}"].append(float((kl[0][m] < cert[m, j]).mean()))
        t = np.arange(m.size)
        for k in range(1, depth):
            mk = m & (t >= k)  # pass k at t: the round's last accepted token is x_{t-k}
            out[f"kl@{k + 1}"].append(float(kl[k][mk].mean()) if mk.any() else nan)
            out[f"agreement@{k + 1}"].append(float(hit[k][mk].mean()) if mk.any() else nan)
        if depth > 1:
            starts = np.flatnonzero(m[: m.size - depth + 1] & m[depth - 1 :])
            run = np.ones(starts.size, bool)
            accepted = np.zeros(starts.size)
            for k in range(depth):
                run &= hit[k][starts + k]
                accepted += run
            out[f"accepted@{depth}"].append(float(accepted.mean()) if starts.size else nan)
    return {k: np.asarray(v) for k, v in out.items()}


def _pool_seeds(runs: Sequence[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """Per-sequence metrics of one head per seed, averaged per sequence (seeds pooled)."""
    return {k: np.mean([r[k] for r in runs], axis=0) for k in runs[0]}


def interval(v: Sequence[float], digits: int, *, signed: bool = False) -> str:
    """``mean [low, high]``; ``signed`` (a paired difference) adds signs and a ``*`` when
    the interval excludes 0."""
    fmt = f"{{:{'+' if signed else ''}.{digits}f}}"
    m, lo, hi = v
    text = f"{fmt.format(m)} [{fmt.format(lo)}, {fmt.format(hi)}]"
    return text + ("*" if signed and (lo > 0 or hi < 0) else "")


def evaluate_heads(
    heads: Mapping[str, EagleHead | Sequence[EagleHead]],
    stores: Mapping[str, head_data.Store],
    *,
    samples: int = 4000,
    depth: int = 1,
) -> dict:
    """Every head on every held-out store: heads trained on different data (ShareGPT's
    replies, the target's greedy continuations) compared on each other's held-out text
    (``docs/training.md``, "Replies or greedy continuations").

    On a store of the target's greedy continuations, a head's greedy agreement is its
    first drafted token's acceptance rate in greedy decoding of those prompts, up to float
    rounding (the decoder's context is then the target's greedy text, and the head reads
    the target's states of it).

    Args:
      heads: name -> head, or name -> the heads of several seeds (their per-sequence
        metrics averaged, as the objectives table pools seeds); the first name is the
        baseline of the paired differences.
      stores: name -> held-out store (:func:`head_data.read_store`), each of the heads'
        taps.
      samples: bootstrap resamples.
      depth: drafted tokens a round for the later-token metrics of :func:`evaluate_head`
        (``1``: the first drafted token only).

    Returns:
      ``{"stores": {store: {"sequences", "positions", "heads": {head: {metric: [mean, low,
      high]}}, "diff": {head: {metric: [mean, low, high]}}}}}``: the metrics of
      :func:`evaluate_head`, means over the store's sequences with 95% bootstrap intervals;
      ``diff`` holds each later head minus the first, paired by sequence (an interval that
      excludes 0 is a significant difference).

    Raises:
      ValueError: ``depth`` below 1; no head or no store; a head whose taps are not the
        store's (its features would be other blocks' states).
    """
    check_int("depth", depth)
    groups = {name: list(h) if isinstance(h, Sequence) else [h] for name, h in heads.items()}
    if not groups or not stores or not all(groups.values()):
        raise ValueError("evaluate_heads needs at least one head and one held-out store")
    for store_name, store in stores.items():
        for head_name, group in groups.items():
            head = next((h for h in group if tuple(h.taps) != tuple(store.spec.taps)), None)
            if head is not None:
                raise ValueError(
                    f"head {head_name!r} reads target blocks {tuple(head.taps)}, store "
                    f"{store_name!r} ({store.folder}) holds blocks {tuple(store.spec.taps)}"
                )
    out: dict[str, dict] = {}
    for store_name, store in stores.items():
        records = store.load()
        per = {}
        for name, group in groups.items():
            per[name] = _pool_seeds(
                [evaluate_head(h, records, store.spec.rules, depth=depth) for h in group]
            )
        first = next(iter(per))
        out[store_name] = {
            "folder": str(store.folder),
            "sequences": int(records.tokens.shape[0]),
            "positions": int(records.mask.sum()),
            "seeds": {name: len(group) for name, group in groups.items()},
            "heads": {
                name: {k: list(bootstrap_mean(v, samples=samples)) for k, v in m.items()}
                for name, m in per.items()
            },
            "diff": {
                name: {
                    k: list(bootstrap_mean(v - per[first][k], samples=samples))
                    for k, v in m.items()
                }
                for name, m in per.items()
                if name != first
            },
        }
    return {"stores": out}


def heads_table(result: dict) -> str:
    """Markdown of :func:`evaluate_heads`: a row per held-out store and head, ``mean [low,
    high]`` per metric, and the paired difference from the first head in KL and agreement
    (``*``: the interval excludes 0)."""
    from jaxcert.base.tables import markdown_table

    def diff(entry: dict | None, k: str) -> str:
        return "-" if entry is None else interval(entry[k], 3, signed=True)

    rows = []
    for store_name, store in result["stores"].items():
        for name, metrics in store["heads"].items():
            entry = store["diff"].get(name)
            rows.append(
                {"held-out": f"{store_name} ({store['sequences']} seq.)", "head": name}
                | {k: interval(v, 3) for k, v in metrics.items()}
                | {"Δ kl": diff(entry, "kl"), "Δ agreement": diff(entry, "agreement")}
            )
    return markdown_table(rows)


def _store_spec(target: LoadedModel, settings: HeadSettings, top_k: int) -> head_data.StoreSpec:
    return head_data.StoreSpec(
        target=str(target.path),
        taps=settings.taps,
        length=settings.length,
        top_k=min(top_k, target.config.vocab_size),  # a window no wider than the vocabulary
    )


def write_stores(
    target: LoadedModel,
    train: Sequence[head_data.TrainingSequence],
    held: Sequence[head_data.TrainingSequence],
    settings: HeadSettings,
    out: pathlib.Path,
    *,
    log: Callable[[str], None] = lambda message: None,
) -> tuple[head_data.Store, head_data.Store]:
    """The training store (``out / 'store'``, up to ``settings.positions`` trained positions)
    and the held-out one (``out / 'heldout'``, every held-out sequence, the wider
    ``heldout_top_k`` window); both resume."""
    import time

    def reporter() -> Callable[[int, int], None]:
        """A store's progress log; its rate counts only the positions this run wrote."""
        first: list[tuple[int, float]] = []

        def progress(done: int, goal: int) -> None:
            of = f" / {goal:,}" if goal > 0 else " held-out"
            if not first:  # before the first new shard: what earlier runs wrote
                first.append((done, time.perf_counter()))
                if done:
                    log(f"records: {done:,}{of} positions already written, resuming")
                return
            base, t0 = first[0]
            rate = (done - base) / max(time.perf_counter() - t0, 1e-9)
            log(f"records: {done:,}{of} positions ({rate:.0f} positions/s this run)")

        return progress

    store = head_data.write_store(
        target.model,
        train,
        out / "store",
        _store_spec(target, settings, settings.top_k),
        max_positions=settings.positions,
        progress=reporter(),
    )
    heldout = head_data.write_store(
        target.model,
        held,
        out / "heldout",
        _store_spec(target, settings, settings.heldout_top_k),
        progress=reporter(),
    )
    log(f"records: {store.positions:,} training positions, {heldout.positions:,} held out")
    return store, heldout


def compare_heads(
    target: Transformer,
    store: head_data.Store,
    heldout: head_data.Store,
    objectives: Sequence[Objective],
    settings: HeadSettings,
    out: pathlib.Path,
    *,
    decode_prompts: Sequence[Sequence[int]] = (),
    decode_seeds: int | None = None,
    decode_tokens: int = 64,
    draft_length: int = 5,
    eos_ids: Sequence[int] = (),
    log: Callable[[str], None] = lambda message: None,
) -> list[dict]:
    """Trains (or resumes, or reloads) one head per objective and seed, evaluates each on
    the held-out records, and decodes ``decode_prompts`` with it at T = 0 and T = 1
    (:func:`decode_heads`; kept in the head's ``decode.json``): one row per head, with its
    per-sequence arrays (``per_sequence``) and per-prompt decoder figures (``decode``,
    empty for the seeds after the first ``decode_seeds``; ``None``: every seed)."""
    records = store.load()
    held = heldout.load()
    vocab = draft_vocabulary(records, settings.draft_vocab)
    rows = []
    for n_seed, seed in enumerate(settings.seeds):  # every objective at a seed, then the next
        decoded_seed = decode_seeds is None or n_seed < decode_seeds
        for objective in objectives:
            name = f"{objective.name}-seed{seed}"

            def step_log(i: int, entry: dict[str, float], name: str = name) -> None:
                if (i + 1) % 25 == 0:
                    log(f"{name}: step {i + 1}/{settings.steps} kl {entry['kl']:.3f} "
                        f"violation {entry['violation']:.3f} tv {entry['tv']:.3f} "
                        f"({entry['seconds']:.2f} s/step)")  # fmt: skip

            head = train_one(
                target, records, objective, seed, settings, vocab, out / name,
                rule_names=store.spec.rules, log=step_log,
            )  # fmt: skip
            metrics = _evaluate_cached(head, held, heldout, out / name / "heldout.json")
            head_folder = str(out / name / "head")
            decoded = _decode_cached(
                target, head, out / name / "decode.json", decode_prompts if decoded_seed else (),
                draft_length=draft_length, max_new_tokens=decode_tokens, eos_ids=eos_ids,
            )  # fmt: skip
            rows.append({"objective": objective.name, "seed": seed, "head": head_folder,
                         "per_sequence": metrics, "decode": decoded})  # fmt: skip
            log(f"{name}: held-out KL {metrics['kl'].mean():.3f} nats, agreement "
                f"{metrics['agreement'].mean():.3f}")  # fmt: skip
    return rows


def _evaluate_cached(head, held, heldout: head_data.Store, path: pathlib.Path):
    key = {"shards": [s["digest"] for s in heldout.shards], "spec": heldout.spec.to_json()}
    if path.is_file():
        saved = json.loads(path.read_text())
        if saved["key"] == key:
            return {k: np.asarray(v) for k, v in saved["metrics"].items()}
    metrics = evaluate_head(head, held, heldout.spec.rules)
    path.write_text(
        json.dumps({"key": key, "metrics": {k: v.tolist() for k, v in metrics.items()}})
    )
    return metrics


def _decode_cached(target, head, path, prompt_ids, **kw) -> dict[str, dict[str, np.ndarray]]:
    if not prompt_ids:
        return {}
    key = {
        "prompts": [list(map(int, p)) for p in prompt_ids],
        **{k: list(v) if isinstance(v, (list, tuple)) else v for k, v in kw.items()},
    }
    if path.is_file():
        saved = json.loads(path.read_text())
        if saved["key"] == key:
            return {t: {k: np.asarray(v) for k, v in r.items()} for t, r in saved["runs"].items()}
    runs = {}
    for name, temperature in (("T0", 0.0), ("T1", 1.0)):
        runs[name] = decode_heads(target, [head], prompt_ids, temperature=temperature, **kw)[0]
    record = {t: {k: v.tolist() for k, v in r.items()} for t, r in runs.items()}
    path.write_text(json.dumps({"key": key, "runs": record}))
    return runs


def bootstrap_mean(
    values: np.ndarray, *, samples: int = 4000, seed: int = 0
) -> tuple[float, float, float]:
    """``(mean, low, high)``: the mean of ``[N]`` values with a 95% bootstrap interval over
    them (``nan`` bounds for ``N < 2``)."""
    x = np.asarray(values, np.float64)
    if x.size < 2:
        return float(x.mean()) if x.size else float("nan"), float("nan"), float("nan")
    idx = np.random.default_rng(seed).integers(0, x.size, (samples, x.size))
    low, high = np.percentile(x[idx].mean(1), [2.5, 97.5])
    return float(x.mean()), float(low), float(high)


def summarize(rows: Sequence[dict], store: head_data.Store, settings: HeadSettings) -> dict:
    """Per objective (seeds pooled by averaging per held-out sequence): each metric's mean
    with a 95% bootstrap interval over held-out sequences, and the paired difference of
    every objective against the first (``kl``) with its interval; an interval that excludes
    0 is a significant difference."""
    by_objective: dict[str, list[dict]] = {}
    for row in rows:
        by_objective.setdefault(row["objective"], []).append(row)
    pooled: dict[str, dict[str, np.ndarray]] = {}
    for name, group in by_objective.items():
        metrics = _pool_seeds([r["per_sequence"] for r in group])
        decoded = [r for r in group if r.get("decode")]  # the seeds decoded
        for t in decoded[0]["decode"] if decoded else ():
            runs = [r["decode"][t]["tokens_per_round"] for r in decoded]
            metrics[f"{t}_tokens_per_round"] = np.mean(runs, axis=0)
        pooled[name] = metrics
    base = next(iter(pooled))
    objectives = {}
    for name, metrics in pooled.items():
        entry: dict[str, Any] = {k: bootstrap_mean(v) for k, v in metrics.items()}
        if name != base:
            entry |= {f"diff:{k}": bootstrap_mean(v - pooled[base][k]) for k, v in metrics.items()}
        entry["seeds"] = [r["seed"] for r in by_objective[name]]
        entry["decoded_seeds"] = [r["seed"] for r in by_objective[name] if r.get("decode")]
        entry["per_seed_kl"] = [float(r["per_sequence"]["kl"].mean()) for r in by_objective[name]]
        objectives[name] = entry
    return {
        "settings": dataclasses.asdict(settings),
        "training_positions": store.positions,
        "training_sequences": store.sequences,
        "heldout_sequences": int(len(next(iter(pooled.values()))["kl"])),
        "objectives": objectives,
        "heads": [r["head"] for r in rows],
    }


def results_table(summary: dict) -> str:
    """Markdown: one row per objective, ``mean [low, high]`` per metric, and the paired
    differences against the first objective (``*``: the interval excludes 0)."""
    from jaxcert.base.tables import markdown_table

    objectives = summary["objectives"]
    metrics = [
        k for k in next(iter(objectives.values())) if ":" not in k or k.startswith("certified")
    ]
    metrics = [k for k in metrics if k not in ("seeds", "decoded_seeds", "per_seed_kl")]
    diffs = ("kl", "agreement", "T0_tokens_per_round", "T1_tokens_per_round")

    def diff(entry: dict, k: str) -> str:
        if f"diff:{k}" not in entry:
            return "—"
        return interval(entry[f"diff:{k}"], 4, signed=True)

    rows = [
        {"objective": name, "seeds": ",".join(map(str, e["seeds"]))}
        | {k: interval(e[k], 4) for k in metrics}
        | {f"Δ {k}": diff(e, k) for k in diffs if k in e}
        for name, e in objectives.items()
    ]
    return markdown_table(rows)


def decode_prompt_ids(target: LoadedModel, source: str, count: int) -> list[list[int]]:
    """Token ids of ``count`` first turns of ``source`` (``prompts.load_prompts``; chat
    template): the first prompt of each category, then the second of each, and so on.
    MT-Bench, the default, is never part of a training set drawn from ShareGPT."""
    if count == 0:
        return []
    questions = prompts.load_prompts(source)
    by_category: dict[str | None, list[prompts.Prompt]] = {}
    for q in questions:
        by_category.setdefault(q.category, []).append(q)
    order = [
        g[i]
        for i in range(max(map(len, by_category.values())))
        for g in by_category.values()
        if i < len(g)
    ]
    return prompts.encode_prompts(target.tokenizer, order[:count])


def decode_heads(
    target: Transformer,
    heads: Sequence[EagleHead],
    prompt_ids: Sequence[Sequence[int]],
    *,
    draft_length: int = 5,
    max_new_tokens: int = 64,
    temperature: float = 0.0,
    eos_ids: Sequence[int] = (),
    seed: int = 0,
) -> list[dict[str, np.ndarray]]:
    """Each head drafting for ``target`` in the speculative decoder: greedy chain
    verification at ``temperature == 0``, speculative sampling otherwise, ``constant:K``.

    All prompts are one batch (one compilation per head shape).

    Returns:
      Per head ``{"tokens", "rounds", "tokens_per_round"}``, each ``[P]`` (per prompt:
      emitted tokens, rounds, their ratio: the acceptance length, accepted drafts plus the
      target's token).
    """
    out = []
    for head in heads:
        per = decoder_acceptance_by_prompt(
            target, head, prompt_ids, draft_length=draft_length,
            max_new_tokens=max_new_tokens, temperature=temperature, eos_ids=eos_ids,
            batch_size=len(prompt_ids), seed=seed,
        )  # fmt: skip
        tokens, rounds = per["tokens"], per["rounds"]
        out.append({"tokens": tokens, "rounds": rounds, "tokens_per_round": tokens / rounds})
    return out
