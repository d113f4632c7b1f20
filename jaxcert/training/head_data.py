"""Training records of a draft head, computed once from the target and streamed to disk.

A draft head (`jaxcert.models.EagleHead`) trains on the target's teacher-forced pass over
token sequences (``docs/training.md``, "Training a draft head at scale"). That pass is the
expensive part (the 1.5B target costs ~20 ms a position on 2 CPU cores), so it runs once and
its records go to a folder, one shard per batch of sequences, which later runs read back:

==============  ===============  ==========================================================
array           shape, dtype     meaning
==============  ===============  ==========================================================
``tokens``      ``[B, T]`` i32   the sequence ``x_0 .. x_{T-1}``, right-padded with 0
``length``      ``[B]`` i32      valid tokens per row
``start``       ``[B]`` i32      first position of the reply (the trained part)
``states``      ``[B, T, Z]``    the target states the head fuses, after reading ``x_t``
                f32              (``Z = len(taps) * E``; ``E``, the final-norm state, for
                                 ``taps == ()``)
``top_logp``    ``[B, T, K]``    the target's ``K`` largest log-probabilities of
                f32              ``x_{t+1}``, descending (``p`` normalised over all V)
``top_ids``     ``[B, T, K]``    their token ids
                i32
``entropy``     ``[B, T]`` f32   ``H(p_t)`` in nats, over the full vocabulary
``certificate`` ``[B, T, R]``    exact ``C_p`` of each rule of the store (full vocabulary)
                f32
==============  ===============  ==========================================================

The trained positions of a row are ``start - 1 <= t < length - 1``: those whose next token
is part of the reply. The folder holds ``manifest.json`` (the :class:`StoreSpec`, and per
shard its file, rows, trained positions and a digest of its token ids) and
``shard-NNNNN.safetensors``. Shards are written to a temporary name and renamed, and the
manifest is rewritten after each one, so a run stopped at any point resumes after the last
complete shard (:func:`write_store` on the same folder, sequences and spec); a different
spec or a changed sequence list is refused, not mixed in.

Sequences come from :func:`reply_sequences` (a prompt set's own replies, e.g. ShareGPT's
assistant turns) or :func:`greedy_sequences` (the target's greedy continuations, generated
in chunks and streamed to a JSON-lines cache that a later run resumes from).
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import os
import pathlib
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxcert.base import prompts
from jaxcert.base.folders import (
    atomic_file,
    atomic_write,
    manifest_path,
    read_manifest,
    refuse_other_options,
)
from jaxcert.base.validate import check_int
from jaxcert.core import rules as rules_lib
from jaxcert.core import solver
from jaxcert.models.eagle import target_features

if TYPE_CHECKING:
    from jaxcert.models import LoadedModel, Transformer

__all__ = [
    "HeadRecords",
    "batch_rows",
    "Store",
    "StoreSpec",
    "TrainingSequence",
    "fitting_prompts",
    "greedy_sequences",
    "read_store",
    "reply_sequences",
    "unique_ids",
    "write_store",
]

STORE_VERSION = 1
_ARRAYS = ("tokens", "length", "start", "states", "top_logp", "top_ids", "entropy", "certificate")


@dataclasses.dataclass(frozen=True)
class TrainingSequence:
    """One training sequence: ``tokens`` (prompt then reply), the reply from ``start``."""

    id: str
    tokens: tuple[int, ...]
    start: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "tokens", tuple(int(x) for x in self.tokens))
        object.__setattr__(self, "start", int(self.start))


@dataclasses.dataclass(frozen=True)
class StoreSpec:
    """What a store holds; two runs append to one store only if their specs are equal.

    Attributes:
      target: a name for the target (asset name or checkpoint path).
      taps: the head's taps (``()``: the target's final-norm hidden states).
      length: ``T``, the padded sequence length (longer sequences are cut).
      top_k: ``K``, target log-probabilities kept per position.
      rules: rule specs (`jaxcert.core.rules.parse_rule`) whose certificates are stored.
      batch_size: sequences per shard (and per target pass).
      states: whether the target's states are stored (``False``: ``states`` is
        ``[B, T, 0]``; a language-model drafter trains on the target's side only).
    """

    target: str
    taps: tuple[int, ...]
    length: int = 256
    top_k: int = 64
    rules: tuple[str, ...] = ("greedy", "tree:4")
    batch_size: int = 4
    states: bool = True

    def __post_init__(self) -> None:
        check_int("length", self.length, 2)
        check_int("top_k", self.top_k)
        check_int("batch_size", self.batch_size)
        rules_lib.parse_rules(",".join(self.rules))  # raises on a bad spec

    def to_json(self) -> dict:
        return {**dataclasses.asdict(self), "taps": list(self.taps), "rules": list(self.rules)}

    @classmethod
    def from_json(cls, record: dict) -> StoreSpec:
        return cls(**{**record, "taps": tuple(record["taps"]), "rules": tuple(record["rules"])})


@dataclasses.dataclass(frozen=True)
class HeadRecords:
    """All shards of a store in memory (numpy; shapes as in the module docstring, ``N``
    sequences)."""

    tokens: np.ndarray
    length: np.ndarray
    start: np.ndarray
    states: np.ndarray
    top_logp: np.ndarray
    top_ids: np.ndarray
    entropy: np.ndarray
    certificate: np.ndarray

    @property
    def mask(self) -> np.ndarray:
        """``[N, T]`` bool: the trained positions (``start - 1 <= t < length - 1``)."""
        t = np.arange(self.tokens.shape[1])[None, :]
        return (t >= self.start[:, None] - 1) & (t < self.length[:, None] - 1)

    BATCH_FIELDS = ("tokens", "states", "top_logp", "top_ids", "certificate")

    def batch(self, rows) -> dict:
        """The training fields of sequences ``rows`` (indices or a slice) as device arrays:
        ``tokens``, ``states``, ``top_logp``, ``top_ids``, ``certificate`` and ``mask``, each
        ``[b, T, ...]`` (what :func:`jaxcert.training.eagle.window_loss` reads)."""
        import jax.numpy as jnp

        out = {k: jnp.asarray(getattr(self, k)[rows]) for k in self.BATCH_FIELDS}
        return out | {"mask": jnp.asarray(self.mask[rows])}


@dataclasses.dataclass(frozen=True)
class Store:
    """A store's manifest: its spec and complete shards (``shards``: file, rows, positions,
    digest)."""

    folder: pathlib.Path
    spec: StoreSpec
    shards: tuple[dict, ...]

    @property
    def positions(self) -> int:
        """Trained positions in the complete shards."""
        return sum(int(s["positions"]) for s in self.shards)

    @property
    def sequences(self) -> int:
        return sum(int(s["rows"]) for s in self.shards)

    def load(self) -> HeadRecords:
        """Reads every shard into memory.

        Raises:
          FileNotFoundError: a shard of the manifest is missing.
        """
        from safetensors.numpy import load_file

        parts: dict[str, list[np.ndarray]] = {k: [] for k in _ARRAYS}
        for shard in self.shards:
            arrays = load_file(self.folder / shard["file"])
            for k in _ARRAYS:
                parts[k].append(arrays[k])
        if not self.shards:
            raise ValueError(f"{self.folder}: the store has no complete shard yet")
        return HeadRecords(**{k: np.concatenate(v) for k, v in parts.items()})


def batch_rows(n: int, batch_size: int, seed: int, step: int) -> np.ndarray:
    """The sorted rows (of ``n`` stored sequences) of training step ``step``: epoch ``e``
    walks a permutation drawn from ``(seed, e)``, so the batch of a step depends only on the
    seed and the step, and a resumed run draws the same batches."""
    per_epoch = max(n // batch_size, 1)
    epoch, i = divmod(step, per_epoch)
    perm = np.random.default_rng([seed, epoch]).permutation(n)
    return np.sort(perm[i * batch_size : (i + 1) * batch_size])


def reply_sequences(
    tokenizer,
    prompt_set: Sequence[prompts.Prompt],
    *,
    length: int,
    end_id: int,
    system_prompt: str | None = None,
) -> list[TrainingSequence]:
    """Prompt (chat template) + the prompt set's own reply + ``end_id``, cut at ``length``.

    Prompts without a reply (``Prompt.response is None``), and prompts whose templated form
    takes more than half of ``length`` tokens, are left out (the reply is the trained part).
    """
    check_int("length", length, 2)
    kept = [p for p in prompt_set if p.response is not None]
    encoded = prompts.encode_prompts(tokenizer, kept, system_prompt=system_prompt)
    out = []
    for prompt, ids in zip(kept, encoded, strict=True):
        if len(ids) > length // 2:
            continue
        reply = tokenizer(prompt.response, add_special_tokens=False)["input_ids"]
        tokens = (list(ids) + [int(i) for i in reply] + [int(end_id)])[:length]
        out.append(TrainingSequence(prompt.id, tuple(tokens), len(ids)))
    return out


def unique_ids(prompt_set: Sequence[prompts.Prompt]) -> list[prompts.Prompt]:
    """The prompts in order, a repeated id made unique as ``id#k`` (its ``k``-th repeat).

    The ids key :func:`greedy_sequences`' cache; a prompt set whose ids are unique is
    returned unchanged.
    """
    used: set[str] = set()
    out = []
    for prompt in prompt_set:
        key, k = prompt.id, 0
        while key in used:
            k += 1
            key = f"{prompt.id}#{k}"
        used.add(key)
        out.append(prompt if key == prompt.id else dataclasses.replace(prompt, id=key))
    return out


def _fitting(
    tokenizer, prompt_set: Sequence[prompts.Prompt], length: int
) -> list[tuple[prompts.Prompt, list[int]]]:
    check_int("length", length, 2)
    encoded = prompts.encode_prompts(tokenizer, prompt_set)
    return [
        (p, [int(x) for x in ids])
        for p, ids in zip(prompt_set, encoded, strict=True)
        if len(ids) <= length // 2
    ]


def fitting_prompts(
    tokenizer, prompt_set: Sequence[prompts.Prompt], *, length: int
) -> list[prompts.Prompt]:
    """The prompts, in order, whose chat-templated form (default system prompt) takes at
    most half of ``length`` tokens: the rest of the sequence is left for the reply."""
    return [p for p, _ in _fitting(tokenizer, prompt_set, length)]


def greedy_sequences(
    target_lm: LoadedModel,
    prompt_set: Sequence[prompts.Prompt],
    *,
    length: int,
    batch_size: int = 8,
    max_positions: int | None = None,
    cache: str | os.PathLike | None = None,
    chunk: int | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> list[TrainingSequence]:
    """Prompt (chat template) + the target's greedy continuation, up to ``length`` tokens.

    Only :func:`fitting_prompts` are used, in prompt order, a repeated id keyed ``id#k``
    (:func:`unique_ids`; also the sequence's id). Continuations are generated ``chunk``
    prompts at a time, and generation stops once the sequences hold ``max_positions``
    trained positions (the reply's tokens); cached continuations are always used, so the
    sequences are those of every prompt up to the first uncached one past the goal.

    With ``cache``, a JSON-lines file, each chunk is appended to it (flushed and synced to
    disk) as soon as it is generated: a header line ``{"target": ..., "length": ...}``, then
    one line per prompt, ``{"key": id, "prompt": [template token ids], "generated": [ids]}``.
    A later call reuses what the file holds and generates from the first uncached prompt on.
    A torn last line (a crash in the middle of a write) is dropped from the file.

    Args:
      target_lm: the target.
      prompt_set: the prompts, in order.
      length: tokens per sequence (prompt + continuation).
      batch_size: prompts per generation batch.
      max_positions: stop generating after this many trained positions (``None``: every
        prompt).
      cache: the continuations' file (created if missing).
      chunk: prompts generated between two writes of the cache (default ``4 * batch_size``).
      progress: called as ``progress(positions_done, positions_goal)`` once before the first
        generated chunk (the positions of the cached continuations before it) and after each
        (``positions_goal`` is ``-1`` without ``max_positions``).

    Raises:
      ValueError: a cache of another target or length; a cached prompt whose template
        tokens differ from its tokens now; a line of the cache that is not a cached
        continuation (other than a torn last line).
    """
    check_int("batch_size", batch_size)
    chunk = 4 * batch_size if chunk is None else chunk
    check_int("chunk", chunk)
    kept = _fitting(target_lm.tokenizer, unique_ids(prompt_set), length)
    target = str(target_lm.path)
    path = None if cache is None else pathlib.Path(cache)
    cached = {} if path is None else _read_greedy_cache(path, target, length)
    for prompt, ids in kept:
        if prompt.id in cached and cached[prompt.id][0] != ids:
            raise ValueError(
                f"{path}: prompt {prompt.id!r} was cached with other template tokens (another "
                "tokenizer or chat template); move the file away or choose another folder"
            )
    goal = -1 if max_positions is None else max_positions
    out: list[TrainingSequence] = []
    positions = 0
    started = False
    for i, (prompt, ids) in enumerate(kept):
        if prompt.id not in cached:
            if max_positions is not None and positions >= max_positions:
                break
            if progress is not None and not started:
                progress(positions, goal)
            started = True
            uncached = ((p, p_ids) for p, p_ids in kept[i:] if p.id not in cached)
            todo = list(itertools.islice(uncached, chunk))
            new = _generate(target_lm, todo, length, batch_size)
            if path is not None:
                _append_greedy_cache(path, target, length, new)
            cached.update(new)
            if progress is not None:
                positions_new = sum(len(g) for _, g in new.values())
                progress(positions + positions_new, goal)
        generated = cached[prompt.id][1]
        tokens = (ids + generated)[:length]
        if len(tokens) > len(ids):
            out.append(TrainingSequence(prompt.id, tuple(tokens), len(ids)))
            positions += len(tokens) - len(ids)
    return out


def _generate(
    target_lm: LoadedModel,
    todo: Sequence[tuple[prompts.Prompt, list[int]]],
    length: int,
    batch_size: int,
) -> dict[str, tuple[list[int], list[int]]]:
    """``{id: (template token ids, continuation cut at length)}`` of the prompts ``todo``."""
    from jaxcert.training import features

    steps = length - min(len(ids) for _, ids in todo)
    conts = features.greedy_continuations(
        target_lm, [p for p, _ in todo], steps=steps, batch_size=batch_size
    )
    return {
        p.id: (ids, [int(x) for x in conts.generated.get(j, [])][: length - len(ids)])
        for j, (p, ids) in enumerate(todo)
    }


def _cache_entry(line: bytes) -> tuple[str, list[int], list[int]] | None:
    """``(key, prompt ids, generated ids)`` of a cache line; ``None`` if it is not one."""
    try:
        record = json.loads(line)
    except ValueError:  # JSONDecodeError, UnicodeDecodeError
        return None
    if not isinstance(record, dict) or not isinstance(record.get("key"), str):
        return None
    ids, generated = record.get("prompt"), record.get("generated")
    if not isinstance(ids, list) or not isinstance(generated, list):
        return None
    if not all(type(x) is int for x in ids + generated):
        return None
    return record["key"], ids, generated


def _read_greedy_cache(
    path: pathlib.Path, target: str, length: int
) -> dict[str, tuple[list[int], list[int]]]:
    """The continuations of a :func:`greedy_sequences` cache, ``{key: (prompt ids,
    generated ids)}`` (``{}`` without the file). A torn last line (no final newline: an
    interrupted write) is cut from the file, once every other line has been read.

    Raises:
      ValueError: a header of another target or length; a line that is not a header
        (line 1) or a cached continuation.
    """
    if not path.is_file():
        return {}
    data = path.read_bytes()
    *lines, torn = data.split(b"\n")  # ``torn``: what follows the last newline
    out: dict[str, tuple[list[int], list[int]]] = {}
    if lines:
        try:
            header = json.loads(lines[0])
        except ValueError:
            header = None
        if not isinstance(header, dict) or not {"target", "length"} <= header.keys():
            raise ValueError(f"{path}: line 1 is not a cached continuation header")
        if (header["target"], header["length"]) != (target, length):
            raise ValueError(
                f"{path} holds greedy continuations of another run (target "
                f"{header['target']}, length {header['length']}), not of target {target}, "
                f"length {length}; move it away or choose another folder"
            )
    for n, line in enumerate(lines[1:], start=2):
        entry = _cache_entry(line)
        if entry is None:
            raise ValueError(f"{path}: line {n} is not a cached continuation")
        out[entry[0]] = (entry[1], entry[2])
    if torn:
        with open(path, "r+b") as f:
            f.truncate(len(data) - len(torn))
            os.fsync(f.fileno())
    return out


def _append_greedy_cache(
    path: pathlib.Path,
    target: str,
    length: int,
    entries: dict[str, tuple[list[int], list[int]]],
) -> None:
    """Appends ``entries`` to a :func:`greedy_sequences` cache (the header first, if the
    file is new or empty), then flushes and syncs it to disk."""
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = []
    if not path.is_file() or path.stat().st_size == 0:
        lines.append(json.dumps({"target": target, "length": length}))
    for key, (ids, generated) in entries.items():
        lines.append(json.dumps({"key": key, "prompt": ids, "generated": generated}))
    with open(path, "a", encoding="utf-8") as f:
        f.write("".join(line + "\n" for line in lines))
        f.flush()
        os.fsync(f.fileno())


def _digest(sequences: Sequence[TrainingSequence]) -> str:
    h = hashlib.sha256()
    for s in sequences:
        h.update(json.dumps([s.id, s.start, list(s.tokens)]).encode())
    return h.hexdigest()[:16]


def read_store(folder: str | os.PathLike) -> Store:
    """The store in ``folder`` (its complete shards).

    Raises:
      FileNotFoundError: no ``manifest.json`` there.
      ValueError: a damaged manifest or one of another version.
    """
    folder = pathlib.Path(folder)
    record = read_manifest(
        folder, version=STORE_VERSION, keys=("spec", "shards"), what="head-record store"
    )
    spec, shards = record["spec"], tuple(record["shards"])
    return Store(folder, StoreSpec.from_json(spec), shards)


def _write_manifest(store: Store) -> None:
    record = {"version": STORE_VERSION, "spec": store.spec.to_json(), "shards": list(store.shards)}
    atomic_write(manifest_path(store.folder), json.dumps(record, indent=1))


@jax.jit(static_argnames=("graphdef", "taps", "top_k", "rules", "keep_states"))
def _records(graphdef, params, tokens, *, taps, top_k, rules, keep_states=True):
    model = nnx.merge(graphdef, params)
    cache = model.init_cache(tokens.shape[0], tokens.shape[1])
    hidden, _, states = target_features(model, tokens, cache, taps)
    if not keep_states:
        states = jnp.zeros((*tokens.shape, 0), jnp.float32)
    logits = model.project(hidden).astype(jnp.float32)  # [B, T, V]
    logp = jax.nn.log_softmax(logits, axis=-1)
    top_logp, top_ids = jax.lax.top_k(logp, top_k)
    prob = jnp.exp(logp)
    entropy = -jnp.sum(jnp.where(prob > 0, prob * logp, 0.0), axis=-1)
    certs = solver.certificates(logp, rules)
    certificate = jnp.stack([c.value for c in certs], axis=-1)
    return states, top_logp, top_ids, entropy, certificate


def write_store(
    target: Transformer,
    sequences: Sequence[TrainingSequence],
    folder: str | os.PathLike,
    spec: StoreSpec,
    *,
    max_positions: int | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> Store:
    """Writes (or resumes) the head records of ``sequences`` in ``folder``.

    Shard ``i`` holds sequences ``[i * B, (i + 1) * B)`` (``B = spec.batch_size``; the last
    shard may hold fewer). Writing stops once the store has ``max_positions`` trained
    positions, or after the last sequence; calling again with a larger ``max_positions``
    (or more sequences appended at the end) continues from there.

    Args:
      target: the target model.
      sequences: the training sequences, in a fixed order.
      folder: the store (created if missing).
      spec: what to record; must equal the spec of an existing store.
      max_positions: stop after this many trained positions (``None``: all sequences).
      progress: called as ``progress(positions_done, positions_goal)`` once before the
        first new shard (the positions earlier runs wrote) and after each shard.

    Returns:
      The store's manifest.

    Raises:
      ValueError: a store in ``folder`` with another spec, or whose written shards do not
        hold the first of ``sequences``; a tap outside the target's blocks; a token id
        outside the target's vocabulary.
    """
    from safetensors.numpy import save_file

    folder = pathlib.Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    if manifest_path(folder).is_file():
        store = read_store(folder)
        refuse_other_options(
            folder, store.spec.to_json(), spec.to_json(), advice="use another folder"
        )
        for leftover in folder.glob(".*.tmp"):  # a shard cut short by a crash
            leftover.unlink()
    else:
        store = Store(folder, spec, ())
        _write_manifest(store)
    b, t = spec.batch_size, spec.length
    for i, shard in enumerate(store.shards):
        if shard["digest"] != _digest(sequences[i * b : (i + 1) * b]):
            raise ValueError(
                f"{folder}: shard {i} was written from other sequences than the ones given "
                "(same prompts, order, length and template are needed to resume)"
            )
    vocab = target.config.vocab_size
    if any(x < 0 or x >= vocab for s in sequences for x in s.tokens):
        raise ValueError(f"a token id outside the target's vocabulary [0, {vocab})")
    if any(not 0 <= tap < target.config.num_layers for tap in spec.taps):
        raise ValueError(f"taps {spec.taps} outside the target's {target.config.num_layers} blocks")
    rules = rules_lib.parse_rules(",".join(spec.rules))
    graphdef, params = nnx.split(target)
    goal = max_positions if max_positions is not None else None
    shards = list(store.shards)
    if progress is not None:  # what earlier runs wrote: the baseline of this run's rate
        progress(store.positions, goal or -1)
    for i in range(len(shards), -(-len(sequences) // b)):
        if goal is not None and store.positions >= goal:
            break
        batch = list(sequences[i * b : (i + 1) * b])
        tokens = np.zeros((b, t), np.int32)
        length = np.zeros(b, np.int32)
        start = np.zeros(b, np.int32)
        for r, s in enumerate(batch):
            row = s.tokens[:t]
            tokens[r, : len(row)] = row
            length[r], start[r] = len(row), min(s.start, len(row))
        out = _records(
            graphdef,
            params,
            jnp.asarray(tokens),
            taps=spec.taps,
            top_k=spec.top_k,
            rules=rules,
            keep_states=spec.states,
        )
        arrays = dict(
            zip(("states", "top_logp", "top_ids", "entropy", "certificate"), out, strict=True)
        )
        rows = len(batch)
        record = {k: np.asarray(v)[:rows] for k, v in arrays.items()}
        record.update(tokens=tokens[:rows], length=length[:rows], start=start[:rows])
        name = f"shard-{i:05d}.safetensors"
        with atomic_file(folder / name) as tmp:
            save_file({k: np.ascontiguousarray(v) for k, v in record.items()}, tmp)
        positions = int(np.sum(np.maximum(length[:rows] - np.maximum(start[:rows], 1), 0)))
        shards.append(
            {"file": name, "rows": rows, "positions": positions, "digest": _digest(batch)}
        )
        store = Store(folder, spec, tuple(shards))
        _write_manifest(store)
        if progress is not None:
            progress(store.positions, goal or -1)
    return store
