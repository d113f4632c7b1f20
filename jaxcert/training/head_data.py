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
``states``      ``[B, T, C]``    the target states the head fuses, after reading ``x_t``
                f32              (``C = len(taps) * E``; ``E``, the final-norm state, for
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
assistant turns) or :func:`greedy_sequences` (the target's greedy continuations).
"""

from __future__ import annotations

import dataclasses
import hashlib
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
from jaxcert.base.validate import check_int
from jaxcert.core import rules as rules_lib
from jaxcert.core import solver

if TYPE_CHECKING:
    from jaxcert.models import LoadedModel, Transformer

__all__ = [
    "HeadRecords",
    "Store",
    "StoreSpec",
    "TrainingSequence",
    "greedy_sequences",
    "read_store",
    "reply_sequences",
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
    """

    target: str
    taps: tuple[int, ...]
    length: int = 256
    top_k: int = 64
    rules: tuple[str, ...] = ("greedy", "tree:4")
    batch_size: int = 4

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


def greedy_sequences(
    target_lm: LoadedModel,
    prompt_set: Sequence[prompts.Prompt],
    *,
    length: int,
    batch_size: int = 8,
    progress: Callable[[int, int], None] | None = None,
) -> list[TrainingSequence]:
    """Prompt (chat template) + the target's greedy continuation, up to ``length`` tokens.

    Prompts whose templated form takes more than half of ``length`` are left out.
    """
    from jaxcert.training.features import greedy_continuations

    check_int("length", length, 2)
    encoded = prompts.encode_prompts(target_lm.tokenizer, prompt_set)
    index = [i for i, ids in enumerate(encoded) if len(ids) <= length // 2]
    kept = [prompt_set[i] for i in index]
    steps = length - min(len(encoded[i]) for i in index) if index else 1
    conts = greedy_continuations(
        target_lm, kept, steps=steps, batch_size=batch_size, progress=progress
    )
    out = []
    for j, generated in conts.generated.items():
        ids = conts.prompt_ids[j]
        tokens = (list(ids) + list(generated))[:length]
        if len(tokens) > len(ids):
            out.append(TrainingSequence(kept[j].id, tuple(tokens), len(ids)))
    return out


def _digest(sequences: Sequence[TrainingSequence]) -> str:
    h = hashlib.sha256()
    for s in sequences:
        h.update(json.dumps([s.id, s.start, list(s.tokens)]).encode())
    return h.hexdigest()[:16]


def _manifest_path(folder: pathlib.Path) -> pathlib.Path:
    return folder / "manifest.json"


def read_store(folder: str | os.PathLike) -> Store:
    """The store in ``folder`` (its complete shards).

    Raises:
      FileNotFoundError: no ``manifest.json`` there.
      ValueError: a manifest of another version.
    """
    folder = pathlib.Path(folder)
    path = _manifest_path(folder)
    if not path.is_file():
        raise FileNotFoundError(f"{folder}: no head-record store (manifest.json) there")
    record = json.loads(path.read_text())
    if record.get("version") != STORE_VERSION:
        raise ValueError(f"{path}: store version {record.get('version')}, expected {STORE_VERSION}")
    return Store(folder, StoreSpec.from_json(record["spec"]), tuple(record["shards"]))


def _write_manifest(store: Store) -> None:
    record = {"version": STORE_VERSION, "spec": store.spec.to_json(), "shards": list(store.shards)}
    tmp = _manifest_path(store.folder).with_suffix(".json.tmp")
    tmp.write_text(json.dumps(record, indent=1))
    os.replace(tmp, _manifest_path(store.folder))


@jax.jit(static_argnames=("graphdef", "taps", "top_k", "rules"))
def _records(graphdef, params, tokens, *, taps, top_k, rules):
    model = nnx.merge(graphdef, params)
    cache = model.init_cache(tokens.shape[0], tokens.shape[1])
    hidden, _, states = model.tapped_features(tokens, cache, taps)
    logits = model.project(hidden).astype(jnp.float32)  # [B, T, V]
    logp = jax.nn.log_softmax(logits, axis=-1)
    top_logp, top_ids = jax.lax.top_k(logp, top_k)
    prob = jnp.exp(logp)
    entropy = -jnp.sum(jnp.where(prob > 0, prob * logp, 0.0), axis=-1)
    certs = solver.certificates(logp, rules)
    certificate = jnp.stack([c.value for c in certs], axis=-1)
    return (hidden if not taps else states), top_logp, top_ids, entropy, certificate


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
    if _manifest_path(folder).is_file():
        store = read_store(folder)
        if store.spec != spec:
            raise ValueError(
                f"{folder}: the store was written with {store.spec}, not {spec}; use another folder"
            )
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
            graphdef, params, jnp.asarray(tokens), taps=spec.taps, top_k=spec.top_k, rules=rules
        )
        arrays = dict(
            zip(("states", "top_logp", "top_ids", "entropy", "certificate"), out, strict=True)
        )
        rows = len(batch)
        record = {k: np.asarray(v)[:rows] for k, v in arrays.items()}
        record.update(tokens=tokens[:rows], length=length[:rows], start=start[:rows])
        name = f"shard-{i:05d}.safetensors"
        save_file({k: np.ascontiguousarray(v) for k, v in record.items()}, folder / (name + ".tmp"))
        os.replace(folder / (name + ".tmp"), folder / name)
        positions = int(np.sum(np.maximum(length[:rows] - np.maximum(start[:rows], 1), 0)))
        shards.append(
            {"file": name, "rows": rows, "positions": positions, "digest": _digest(batch)}
        )
        store = Store(folder, spec, tuple(shards))
        _write_manifest(store)
        if progress is not None:
            progress(store.positions, goal or -1)
    return store
