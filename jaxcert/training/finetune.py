"""Fine-tuning a language-model drafter toward its target: the top blocks, at the boundary.

A drafter model ``q`` (e.g. the 0.5B for the 1.5B) is already close to its target: about
half of its positions are certified (``KL(p||q) < C_p``). That is where the certificate
losses can act (``docs/training.md``, "Fine-tuning a drafter at the boundary"). This module
trains the drafter's top ``N`` blocks and its final norm, the rest frozen, on the target's
records (a head-record store written with ``states=False``,
:mod:`jaxcert.training.head_data`: per position the target's top-``K`` log-probabilities and
ids, and the exact certificates of its rules) and the drafter's states after its first ``s``
blocks (:mod:`jaxcert.training.drafter_states`).

With ``train_lm_head`` the lm_head is trained too (a tied drafter's is first untied,
:func:`jaxcert.models.transformer.untied`: its embedding, which made the stored states,
stays as it was).

A step runs the drafter's blocks ``s .. L-1`` on the stored states of ``b`` sequences (the
first ``L - N - s`` of them frozen), its final norm and lm_head at the trained positions
only (gathered, so padding and prompt positions cost no lm_head), and the objective on the
target's window (:func:`window_terms`). The batch is split over a ``"data"`` mesh axis
(rows and their gathered positions stay on their device; the parameters are replicated),
and a run resumes from its last checkpoint, drawing the same batches.

Objectives (:data:`OBJECTIVES`, per position on the window; ``m`` the margin):

=============  =====================================================  =========================
name           loss per position                                      full vocabulary
=============  =====================================================  =========================
``kl``         ``KL``                                                 ``kl_divergence``
``kl+greedy``  ``KL + relu(KL - C_p^greedy + m)``                     ``certificate_violation``
``kl+tree4``   ``KL + relu(KL - C_p^tree:4 + m)``                     ``certificate_violation``
``kl+tv``      ``KL + TV`` (the expected rejection at T = 1)          ``rejection_rate``
``kl+miss``    ``KL + sigmoid((KL - C_p^greedy + m) / temperature)``  ``certificate_miss``
=============  =====================================================  =========================

(the full-vocabulary forms are :mod:`jaxcert.losses`').
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pathlib
import shutil
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jaxcert.base.folders import (
    atomic_write,
    check_options,
)
from jaxcert.base.validate import check_int
from jaxcert.training import head_data
from jaxcert.training.drafter_states import DrafterStates

if TYPE_CHECKING:
    from jax.sharding import Mesh

    from jaxcert.models import Transformer

__all__ = [
    "OBJECTIVES",
    "FinetuneObjective",
    "FinetuneSettings",
    "evaluate_drafter",
    "finetune_drafter",
    "merged_drafter",
    "run_key",
    "trainable_filter",
    "window_terms",
]


# --------------------------------------------------------------------------- objectives


@dataclasses.dataclass(frozen=True)
class FinetuneObjective:
    """A per-position loss of the window terms ``(KL, TV, C_p)``.

    Attributes:
      name: label in tables and folders.
      kind: ``"kl"``, ``"hinge"`` (``KL + weight * relu(KL - C_p + margin)``), ``"tv"``
        (``KL + weight * TV``) or ``"miss"`` (``KL + weight * sigmoid((KL - C_p + margin) /
        temperature)``).
      rule: the store rule spec whose ``C_p`` the term reads (``"greedy"``, ``"tree:4"``);
        ``None`` for ``kl`` and ``tv``.
      weight: the term's weight.
      margin: nats of slack asked below the certificate.
      temperature: nats, the width of the ``miss`` term's step.
    """

    name: str
    kind: str = "kl"
    rule: str | None = None
    weight: float = 1.0
    margin: float = 0.0
    temperature: float = 0.1

    def __post_init__(self) -> None:
        if self.kind not in ("kl", "hinge", "tv", "miss"):
            raise ValueError(f"objective kind must be kl, hinge, tv or miss, got {self.kind!r}")
        if (self.rule is None) != (self.kind in ("kl", "tv")):
            raise ValueError(f"objective {self.name!r}: a {self.kind} term needs a rule iff it "
                             "reads a certificate")  # fmt: skip
        if self.temperature <= 0:
            raise ValueError(f"temperature must be > 0 nats, got {self.temperature}")

    def term(self, kl: jax.Array, tv: jax.Array, c: jax.Array | None) -> jax.Array:
        """The added term per position (0 for ``kl``); ``c``: this objective's ``C_p``."""
        if self.kind == "kl":
            return jnp.zeros_like(kl)
        if self.kind == "tv":
            return tv
        assert c is not None
        excess = kl - c + self.margin
        possible = c != jnp.inf  # C_p = +inf: no drafter is rejected
        safe = jnp.where(possible, excess, 0.0)
        if self.kind == "hinge":
            return jnp.where(possible, jax.nn.relu(safe), 0.0)
        return jnp.where(possible, jax.nn.sigmoid(safe / self.temperature), 0.0)

    def loss(self, kl: jax.Array, tv: jax.Array, c: jax.Array | None) -> jax.Array:
        """``KL + weight * term`` per position (nats)."""
        return kl + self.weight * self.term(kl, tv, c)

    def active(self, kl: jax.Array, c: jax.Array | None) -> jax.Array:
        """Where the term's gradient is not negligible (bool): the hinge where it is
        positive; the miss within ``3 * temperature`` of the boundary (``sigmoid' > 0.045
        / temperature``); never for ``kl``; everywhere for ``tv``."""
        if self.kind == "kl":
            return jnp.zeros(kl.shape, bool)
        if self.kind == "tv":
            return jnp.ones(kl.shape, bool)
        assert c is not None
        excess = kl - c + self.margin
        if self.kind == "hinge":
            return (excess > 0) & (c != jnp.inf)
        return (jnp.abs(excess) < 3 * self.temperature) & (c != jnp.inf)


OBJECTIVES: dict[str, FinetuneObjective] = {
    o.name: o
    for o in (
        FinetuneObjective("kl"),
        FinetuneObjective("kl+greedy", "hinge", "greedy"),
        FinetuneObjective("kl+tree4", "hinge", "tree:4"),
        FinetuneObjective("kl+tv", "tv"),
        FinetuneObjective("kl+miss", "miss", "greedy"),
    )
}
"""The compared objectives, by name (module docstring)."""


def window_terms(
    logits: jax.Array, top_ids: jax.Array, top_logp: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``(KL, TV, argmax)`` of a drafter against a stored target window.

    Both distributions are coarsened to the target's top-``K`` ids plus one bucket for the
    rest (as :func:`jaxcert.training.eagle.window_terms`): ``KL(p'||q') <= KL(p||q)`` and
    ``TV(p', q') <= TV(p, q)``, equal when ``p`` has no mass outside its window.

    Args:
      logits: ``[..., V]`` drafter logits (float32).
      top_ids: ``[..., K]`` int32, the target's window ids.
      top_logp: ``[..., K]`` float32, the target's log-probabilities there (normalised over
        the full vocabulary).

    Returns:
      ``kl`` ``[...]`` nats, ``tv`` ``[...]`` and ``argmax`` ``[...]`` int32 (the drafter's
      greedy token).
    """
    from jaxcert.training.eagle import coarse_terms

    log_q = jnp.take_along_axis(jax.nn.log_softmax(logits, axis=-1), top_ids, axis=-1)
    kl, tv = coarse_terms(top_logp, log_q)
    return kl, tv, jnp.argmax(logits, axis=-1).astype(jnp.int32)


def _holds(path: pathlib.Path, record: dict) -> bool:
    """Whether ``path`` is a JSON file holding ``record`` (then it is not rewritten)."""
    try:
        return bool(json.loads(path.read_text()) == record)
    except (OSError, ValueError):
        return False


# --------------------------------------------------------------------------- the model


def _layer_index(path: tuple) -> int | None:
    for a, b in zip(path, path[1:], strict=False):
        if str(a) == "layers":
            return int(b)
    return None


def trainable_filter(
    num_layers: int, trained: int, *, lm_head: bool = False
) -> Callable[[tuple, Any], bool]:
    """An nnx filter: the last ``trained`` blocks' parameters and the final norm's (and the
    untied lm_head's with ``lm_head``)."""
    names = ("norm", "lm_head") if lm_head else ("norm",)

    def keep(path: tuple, value: Any) -> bool:
        if not isinstance(value, nnx.Param):
            return False
        layer = _layer_index(path)
        if layer is not None:
            return layer >= num_layers - trained
        return bool(path) and str(path[0]) in names

    return keep


def _top_hidden(model: Transformer, states: jax.Array, first: int) -> jax.Array:
    """Blocks ``first .. L-1`` and the final norm on residual states ``[B, T, E]`` (position
    ``t`` at RoPE position ``t``, causal): ``[B, T, E]``."""
    from jaxcert.models.transformer import rope_angles, slot_mask

    b, t, _ = states.shape
    cache = model.init_cache(b, t)
    mask = slot_mask(cache.length, t, t, None)
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    cos, sin = rope_angles(positions, model.config.head_dim, model.config.rope_theta)
    x = states.astype(model.dtype)
    for i in range(first, model.config.num_layers):
        x, _, _ = model.layers[i](x, cos, sin, cache.keys[i], cache.values[i], cache.length, mask)
    return model.norm(x)


# --------------------------------------------------------------------------- training


@dataclasses.dataclass(frozen=True)
class FinetuneSettings:
    """How a drafter is fine-tuned (every objective and seed of a comparison alike).

    Attributes:
      trained_blocks: ``N``, the drafter's top blocks trained (with the final norm).
      steps: optimiser steps.
      batch_size: sequences per step (a multiple of the ``data`` devices).
      learning_rate: peak Adam rate (warm-up over 5% of the steps, cosine decay, gradient
        norm clipped at 1).
      every: steps between checkpoints (and held-out evaluations of the learning curve).
      train_lm_head: train the lm_head too (untied from the embedding when tied: the
        fine-tuned drafter then has an lm_head of its own, ``tie_word_embeddings`` false in
        its export).
    """

    trained_blocks: int = 4
    steps: int = 150
    batch_size: int = 8
    learning_rate: float = 1e-5
    every: int = 25
    train_lm_head: bool = False

    def __post_init__(self) -> None:
        for k in ("trained_blocks", "steps", "batch_size", "every"):
            check_int(k, getattr(self, k))
        if not self.learning_rate > 0:
            raise ValueError(f"learning_rate must be > 0, got {self.learning_rate}")


def _gather_plan(mask: np.ndarray, devices: int, width: int) -> tuple[np.ndarray, np.ndarray]:
    """``(index [d, width], weight [d, width])``: each device's trained positions as flat
    indices into its own rows (``[rows / d * T]``), padded with index 0, weight 0."""
    b, t = mask.shape
    per = b // devices
    index = np.zeros((devices, width), np.int32)
    weight = np.zeros((devices, width), np.float32)
    for d in range(devices):
        flat = np.flatnonzero(mask[d * per : (d + 1) * per].ravel())
        if len(flat) > width:
            raise ValueError(f"{len(flat)} trained positions exceed the gather width {width}")
        index[d, : len(flat)] = flat
        weight[d, : len(flat)] = 1.0
    return index, weight


def _gather_width(mask: np.ndarray, rows: Sequence[np.ndarray], devices: int) -> int:
    """The most trained positions any device holds in any of the batches ``rows``, rounded
    up to a multiple of 64 (one static shape for the run)."""
    most = 1
    for r in rows:
        m = mask[r]
        per = len(r) // devices
        most = max(most, *(int(m[d * per : (d + 1) * per].sum()) for d in range(devices)))
    return -(-most // 64) * 64


def _pick(x: np.ndarray, rows: np.ndarray, index: np.ndarray, devices: int) -> np.ndarray:
    """``x[rows]`` (``[b, T, ...]``) at the gathered positions: ``[d, width, ...]``."""
    b, t = len(rows), x.shape[1]
    per = b // devices
    local = x[rows].reshape(devices, per * t, *x.shape[2:])
    return np.take_along_axis(local, index.reshape(*index.shape, *([1] * (x.ndim - 2))), axis=1)


def _gathered_logits(model, states, index, first):
    """The drafter's float32 logits ``[d, width, V]`` at the gathered positions ``index``
    (``[d, width]``, flat into each device's rows) of the stored states ``[d, r, T, E]``."""
    hidden = _top_hidden(model, states.reshape(-1, *states.shape[2:]), first)  # [d*r, T, E]
    hidden = hidden.reshape(index.shape[0], -1, hidden.shape[-1])  # [d, r*T, E]
    picked = jnp.take_along_axis(hidden, index[..., None], axis=1)  # [d, w, E]
    return model.project(picked).astype(jnp.float32)


def _model_terms(model, states, index, top_ids, top_logp, first):
    """Window terms at the gathered positions: ``kl``, ``tv``, ``argmax`` ``[d, width]``."""
    return window_terms(_gathered_logits(model, states, index, first), top_ids, top_logp)


def _loss(trainable, frozen, graphdef, batch, objective, rule_index, first):
    model = nnx.merge(graphdef, trainable, frozen)
    kl, tv, top = _model_terms(
        model, batch["states"], batch["index"], batch["top_ids"], batch["top_logp"], first
    )
    valid = batch["weight"] > 0
    count = jnp.maximum(jnp.sum(valid), 1)

    def mean(x):
        return jnp.sum(jnp.where(valid, x, 0.0)) / count

    c = None if rule_index is None else batch["certificate"][..., rule_index]
    loss = mean(objective.loss(kl, tv, c))
    certified = kl[..., None] < batch["certificate"]  # [d, w, R]
    aux = {
        "kl": mean(kl),
        "tv": mean(tv),
        "term": mean(objective.term(kl, tv, c)),
        "active": mean(objective.active(kl, c).astype(jnp.float32)),
        "agreement": mean((top == batch["top_ids"][..., 0]).astype(jnp.float32)),
        "certified": jnp.sum(valid[..., None] & certified, axis=(0, 1)) / count,
    }
    return loss, aux


@dataclasses.dataclass(frozen=True)
class _Program:
    graphdef: Any
    objective: FinetuneObjective
    rule_index: int | None
    first: int
    tx: Any

    def step(self, trainable, opt_state, frozen, batch):
        grad_fn = jax.value_and_grad(_loss, has_aux=True)
        (loss, aux), grads = grad_fn(
            trainable, frozen, self.graphdef, batch, self.objective, self.rule_index, self.first
        )
        updates, opt_state = self.tx.update(grads, opt_state, trainable)
        trainable = optax.apply_updates(trainable, updates)
        return trainable, opt_state, {"loss": loss, **aux}

    def initial_kl(self, initial, frozen, batch):
        """The batch's mean window KL under the initial parameters (forward only)."""
        _, aux = _loss(initial, frozen, self.graphdef, batch, self.objective, self.rule_index,
                       self.first)  # fmt: skip
        return aux["kl"]


def _split(model: Transformer, trained: int, lm_head: bool = False):
    if lm_head:
        from jaxcert.models.transformer import untied

        model = untied(model)
    keep = trainable_filter(model.config.num_layers, trained, lm_head=lm_head)
    graphdef, trainable, frozen = nnx.split(model, keep, ...)  # type: ignore[misc]
    return graphdef, trainable, frozen


def _trains_lm_head(trainable: nnx.State | None) -> bool:
    return trainable is not None and "lm_head" in trainable


def merged_drafter(
    drafter: Transformer, trainable: nnx.State, *, trained_blocks: int
) -> Transformer:
    """``drafter`` with its top ``trained_blocks`` blocks and final norm (and lm_head, when
    ``trainable`` holds one: the drafter untied) from ``trainable`` (a fine-tuned drafter as
    a model the decoder and the exporter take)."""
    graphdef, _, frozen = _split(drafter, trained_blocks, _trains_lm_head(trainable))
    return nnx.merge(graphdef, trainable, frozen)


def _digest_of(store: head_data.Store) -> str:
    h = hashlib.sha256()
    for s in store.shards:
        h.update(s["digest"].encode())
    return h.hexdigest()[:16]


def run_key(
    store: head_data.Store,
    states: DrafterStates,
    objective: FinetuneObjective,
    seed: int,
    settings: FinetuneSettings,
) -> dict[str, Any]:
    """What a run's folder was trained for (``run.json``): a resumed run must match it
    (``train_lm_head`` only when set: the keys of runs without it stay what they were)."""
    trained = dataclasses.asdict(settings)
    if not trained["train_lm_head"]:
        del trained["train_lm_head"]
    return {
        "records": _digest_of(store),
        "drafter": states.drafter,
        "frozen_states_after": states.blocks,
        "objective": dataclasses.asdict(objective),
        "seed": seed,
        "settings": trained,
    }


def _save_checkpoint(folder: pathlib.Path, trainable, opt_state, progress: dict) -> None:
    """Parameters, optimiser state and progress, replaced together: written to a new
    folder and renamed over ``folder / 'checkpoint'``."""
    from safetensors.numpy import save_file

    final = folder / "checkpoint"
    tmp = folder / ".checkpoint.tmp"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    for name, tree in (("params", trainable), ("optimizer", opt_state)):
        leaves = jax.tree.leaves(tree)
        save_file(
            {f"{i:05d}": np.asarray(x) for i, x in enumerate(leaves)}, tmp / f"{name}.safetensors"
        )
    (tmp / "progress.json").write_text(json.dumps(progress))
    old = folder / ".checkpoint.old"
    if final.exists():
        if old.exists():
            shutil.rmtree(old)
        final.rename(old)
    tmp.rename(final)
    if old.exists():
        shutil.rmtree(old)


def _load_checkpoint(folder: pathlib.Path, trainable, opt_state):
    from safetensors.numpy import load_file

    path = folder / "checkpoint"
    if not path.is_dir() and (folder / ".checkpoint.old").is_dir():
        path = folder / ".checkpoint.old"  # a crash between the two renames
    if not (path / "progress.json").is_file():
        return None
    out = []
    try:
        for name, tree in (("params", trainable), ("optimizer", opt_state)):
            saved = load_file(path / f"{name}.safetensors")
            leaves, treedef = jax.tree.flatten(tree)
            arrays = [saved[f"{i:05d}"] for i in range(len(leaves))]
            if any(a.shape != x.shape for a, x in zip(arrays, leaves, strict=True)):
                raise ValueError(f"{name}.safetensors holds arrays of other shapes")
            out.append(
                jax.tree.unflatten(
                    treedef, [jnp.asarray(a, x.dtype) for a, x in zip(arrays, leaves, strict=True)]
                )
            )
        progress = json.loads((path / "progress.json").read_text())
        if not isinstance(progress, dict) or not isinstance(progress.get("step"), int):
            raise ValueError("progress.json holds no step")
    except Exception as err:  # safetensors' own error type, OSError, KeyError, ValueError
        raise ValueError(
            f"{path}: a damaged checkpoint ({str(err).splitlines()[0][:120]}); move it away to "
            "train this run from the start"
        ) from None
    return out[0], out[1], progress


def _device_batch(data, rows, width, devices) -> dict[str, np.ndarray]:
    records, states = data
    mask = records.mask
    index, weight = _gather_plan(mask[rows], devices, width)
    per = len(rows) // devices
    return {
        "states": states[rows].reshape(devices, per, *states.shape[1:]),
        "index": index,
        "weight": weight,
        "top_ids": _pick(records.top_ids, rows, index, devices),
        "top_logp": _pick(records.top_logp, rows, index, devices),
        "certificate": _pick(records.certificate, rows, index, devices),
    }


def _placer(mesh: Mesh | None) -> Callable[[dict], dict]:
    if mesh is None:
        return lambda batch: jax.tree.map(jnp.asarray, batch)
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    sharding = NamedSharding(mesh, P("data"))
    return lambda batch: jax.tree.map(lambda x: jax.device_put(x, sharding), batch)


def _devices(mesh: Mesh | None, batch_size: int) -> int:
    if mesh is None:
        return 1
    if "data" not in mesh.axis_names:
        raise ValueError(f"the mesh has no 'data' axis (axes {mesh.axis_names})")
    d = int(mesh.shape["data"])
    if batch_size % d:
        raise ValueError(f"batch_size {batch_size} is not a multiple of the {d} data devices")
    return d


def finetune_drafter(
    drafter: Transformer,
    records: head_data.HeadRecords,
    states: np.ndarray,
    objective: FinetuneObjective,
    *,
    rule_names: Sequence[str],
    first: int,
    settings: FinetuneSettings,
    seed: int,
    folder: str | os.PathLike | None = None,
    key: Mapping[str, Any] | None = None,
    evaluate: Callable[[nnx.State], dict[str, float]] | None = None,
    mesh: Mesh | None = None,
    log: Callable[[int, dict[str, float]], None] | None = None,
    compare_initial: bool = False,
) -> tuple[nnx.State, dict]:
    """Trains the drafter's top ``settings.trained_blocks`` blocks and final norm.

    Args:
      drafter: the drafter model (not modified).
      records: the target's records (:meth:`head_data.Store.load`) of the training
        sequences.
      states: ``[N, T, E]`` float32, the drafter's residual stream after its first
        ``first`` blocks at the same sequences
        (:meth:`jaxcert.training.drafter_states.DrafterStates.load`).
      objective: the loss (its rule among ``rule_names``).
      rule_names: the store's rule specs, in the order of ``records.certificate``.
      first: ``s``, the blocks the states come after (``s <= L - N``).
      settings: the schedule.
      seed: the batch order (the initial drafter is the same for every seed).
      folder: the run's folder: ``run.json`` (``key``), a checkpoint every
        ``settings.every`` steps and at the end, and ``done.json``; a run finding a
        checkpoint continues from it and ends where an uninterrupted one would.
      key: what the folder is for (:func:`run_key`); a folder with another key is refused.
      evaluate: called with the trained parameters at step 0 and at every checkpoint; its
        results go into the progress's ``curve`` (the learning curve).
      mesh: a mesh with a ``"data"`` axis to split each batch over (``None``: one device).
      log: called as ``log(step, entry)`` after each step.
      compare_initial: also log ``kl_initial``, the step's batch KL under the initial
        parameters (one more forward a step): ``kl - kl_initial`` on batches not yet trained
        on is the change a run has made on fresh text (progressive validation; the sweep's
        measure).

    Returns:
      ``(trainable, progress)``: the trained parameters (:func:`merged_drafter` makes the
      model) and ``{"step", "history": [per step], "curve": [per evaluation]}``.

    Raises:
      ValueError: ``first`` above ``L - N``; a rule not in ``rule_names``; states that do
        not match the records; a batch size the data devices do not divide; a folder
        trained for another key.
    """
    layers = drafter.config.num_layers
    n_trained = settings.trained_blocks
    if not 1 <= first <= layers - n_trained:
        raise ValueError(
            f"the states come after {first} blocks: {n_trained} trained blocks need them "
            f"after at most {layers - n_trained} of the drafter's {layers}"
        )
    rule_index = None
    if objective.rule is not None:
        if objective.rule not in rule_names:
            raise ValueError(f"rule {objective.rule} is not among the store's rules {rule_names}")
        rule_index = list(rule_names).index(objective.rule)
    if states.shape[:2] != records.tokens.shape:
        raise ValueError(
            f"drafter states {states.shape[:2]} do not match the records' sequences "
            f"{records.tokens.shape}"
        )
    devices = _devices(mesh, settings.batch_size)
    n = records.tokens.shape[0]
    size = min(settings.batch_size, n) // devices * devices
    if size == 0:
        raise ValueError(f"{n} sequences cannot fill a batch over {devices} data devices")
    plan = [head_data.batch_rows(n, size, seed, i) for i in range(settings.steps)]
    width = _gather_width(records.mask, plan, devices)

    graphdef, untrained, frozen = _split(drafter, n_trained, settings.train_lm_head)
    trainable = jax.tree.map(jnp.array, untrained)  # a copy: the step donates it
    warmup = max(settings.steps // 20, 1)
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, settings.learning_rate, warmup, max(settings.steps, warmup + 1)
    )
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(schedule))
    opt_state = tx.init(trainable)
    progress: dict[str, Any] = {"step": 0, "history": [], "curve": []}
    out = None if folder is None else pathlib.Path(folder)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        if key is not None:
            check_options(out, key, name="run.json", advice="use another folder")
        resumed = _load_checkpoint(out, trainable, opt_state)
        if resumed is not None:
            trainable, opt_state, progress = resumed
    place = _placer(mesh)
    if mesh is not None:
        from jax.sharding import NamedSharding
        from jax.sharding import PartitionSpec as P

        replicated = NamedSharding(mesh, P())
        trainable, opt_state, frozen = jax.device_put((trainable, opt_state, frozen), replicated)
    program = _Program(graphdef, objective, rule_index, first, tx)
    step_fn = jax.jit(program.step, donate_argnums=(0, 1))
    initial = jax.tree.map(jnp.array, untrained) if compare_initial else None
    if initial is not None and mesh is not None:
        initial = jax.device_put(initial, replicated)
    initial_fn = jax.jit(program.initial_kl)
    if evaluate is not None and not progress["curve"]:
        progress["curve"].append({"step": 0, **evaluate(trainable)})
    for i in range(progress["step"], settings.steps):
        batch = place(_device_batch((records, states), plan[i], width, devices))
        t0 = time.perf_counter()
        trainable, opt_state, metrics = step_fn(trainable, opt_state, frozen, batch)
        entry: dict[str, Any] = {"step": i + 1}
        for k, v in metrics.items():
            v = np.asarray(v)
            if v.ndim:
                entry.update({f"{k}:{r}": float(x) for r, x in zip(rule_names, v, strict=True)})
            else:
                entry[k] = float(v)
        entry["seconds"] = round(time.perf_counter() - t0, 3)
        if initial is not None:  # after the timing: the step's own seconds stay comparable
            entry["kl_initial"] = float(initial_fn(initial, frozen, batch))
        progress["history"].append(entry)
        progress["step"] = i + 1
        if log is not None:
            log(i + 1, entry)
        if (i + 1) % settings.every == 0 or i + 1 == settings.steps:
            if evaluate is not None:
                progress["curve"].append({"step": i + 1, **evaluate(trainable)})
            if out is not None:
                _save_checkpoint(out, trainable, opt_state, progress)
    done = {"step": progress["step"]}
    if out is not None and not _holds(out / "done.json", done):
        atomic_write(out / "done.json", json.dumps(done))
    return trainable, progress


# --------------------------------------------------------------------------- evaluation


@jax.jit(static_argnames=("graphdef", "first"))
def _eval_terms(graphdef, params, frozen, batch, *, first):
    """``(kl, tv, argmax, x0 among the drafter's top 4)`` at the gathered positions."""
    from jaxcert.core import numerics

    model = nnx.merge(graphdef, params, frozen)
    logits = _gathered_logits(model, batch["states"], batch["index"], first)
    kl, tv, _ = window_terms(logits, batch["top_ids"], batch["top_logp"])
    _, top4 = numerics.top_k(logits, 4)  # ties to the lower id, as argmax
    return kl, tv, top4[..., 0], jnp.any(top4 == batch["top_ids"][..., :1], axis=-1)


def evaluate_drafter(
    drafter: Transformer,
    trainable: nnx.State | None,
    records: head_data.HeadRecords,
    states: np.ndarray,
    *,
    rule_names: Sequence[str],
    first: int,
    trained_blocks: int,
    batch_size: int = 4,
    near: float = 0.05,
) -> dict[str, np.ndarray]:
    """The drafter on held-out records, per sequence (the bootstrap unit).

    Per sequence, the mean over its trained positions of: the window ``kl`` (nats) and
    ``tv``; ``agreement``, the drafter's greedy token is the target's ``x0`` (what greedy
    verification accepts); ``accepted:tree:4``, ``x0`` is among the drafter's top 4 (what
    tree top-4 verification accepts); ``certified:<rule>`` for each store rule, ``KL <
    C_p``; ``near:<rule>``, not certified but within ``near`` nats of it (``C_p <= KL <
    C_p + near``: the positions a small step of ``q`` certifies); and ``positions``. With a
    wide held-out window (1,024) the window KL is the full KL up to the target's mass outside
    it (``docs/training.md``).

    Args:
      drafter: the drafter model.
      trainable: fine-tuned parameters (:func:`finetune_drafter`), or ``None``: the drafter
        as it is.
      records: held-out records; ``states``: the drafter's states there ``[N, T, E]``.
      rule_names, first, trained_blocks: as :func:`finetune_drafter`.
      batch_size: sequences per evaluated batch.
      near: the width (nats) of the band above the certificate that ``near:<rule>`` counts.

    Returns:
      ``{name: [N] float64}``.
    """
    graphdef, base, frozen = _split(drafter, trained_blocks, _trains_lm_head(trainable))
    params = base if trainable is None else trainable
    n, t = records.tokens.shape
    mask = records.mask
    rows = [np.arange(i, min(i + batch_size, n)) for i in range(0, n, batch_size)]
    width = _gather_width(mask, rows, 1)

    names = ["kl", "tv", "agreement", "accepted:tree:4", *(f"certified:{r}" for r in rule_names),
             *(f"near:{r}" for r in rule_names)]  # fmt: skip
    sums = {k: np.zeros(n) for k in names}
    counts = np.zeros(n)
    for r in rows:
        pad = np.concatenate([r, np.full(batch_size - len(r), r[-1])])  # one static shape
        index, weight = _gather_plan(mask[pad], 1, width)
        batch = {
            "states": states[pad][None],
            "index": index,
            "top_ids": _pick(records.top_ids, pad, index, 1),
            "top_logp": _pick(records.top_logp, pad, index, 1),
        }
        arrays = jax.tree.map(jnp.asarray, batch)
        kl, tv, top, in4 = (
            np.asarray(x)[0] for x in _eval_terms(graphdef, params, frozen, arrays, first=first)
        )
        cert = _pick(records.certificate, pad, index, 1)[0]
        row_of = index[0] // t  # which of the batch's rows each gathered position is
        valid = weight[0] > 0
        values = {
            "kl": kl,
            "tv": tv,
            "agreement": (top == batch["top_ids"][0][:, 0]).astype(float),
            "accepted:tree:4": in4.astype(float),
            **{
                f"certified:{rn}": (kl < cert[:, j]).astype(float)
                for j, rn in enumerate(rule_names)
            },
            **{
                f"near:{rn}": ((kl >= cert[:, j]) & (kl < cert[:, j] + near)).astype(float)
                for j, rn in enumerate(rule_names)
            },
        }
        for j, seq in enumerate(r):
            at = valid & (row_of == j)
            counts[seq] += at.sum()
            for k in names:
                sums[k][seq] += values[k][at].sum()
    out = {k: sums[k] / np.maximum(counts, 1) for k in names}
    out["positions"] = counts
    return out
