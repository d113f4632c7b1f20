"""Cached teacher-forced features: the target's greedy continuations, both models' hidden
states at every continuation position, and the target's logits there."""

from __future__ import annotations

import dataclasses
import pathlib
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxcert.base import prompts
from jaxcert.base.prompts import pad_prompts
from jaxcert.base.validate import round_up
from jaxcert.core import rules as rules_lib
from jaxcert.models import check_same_vocabulary
from jaxcert.pipeline import engine
from jaxcert.training.heads import LmHead, project

if TYPE_CHECKING:
    from jaxcert.models import KVCache, LoadedModel

__all__ = [
    "Continuations",
    "FeatureSet",
    "collect_features",
    "feature_set",
    "greedy_continuations",
    "target_logits",
    "teacher_forced_states",
]


@dataclasses.dataclass(frozen=True)
class FeatureSet:
    """Cached teacher-forced features, one row per continuation position.

    Attributes:
      drafter_hidden: ``[N, Eq]`` float32 final-norm hidden states of the drafter.
      target_hidden: ``[N, Ep]`` float32 final-norm hidden states of the target.
      prompt: ``[N]`` int32 index of the prompt.
      position: ``[N]`` int32 position in the continuation (0 = first generated token).
      token: ``[N]`` int32 the target's greedy token at that position.
    """

    drafter_hidden: np.ndarray
    target_hidden: np.ndarray
    prompt: np.ndarray
    position: np.ndarray
    token: np.ndarray

    def __len__(self) -> int:
        return int(self.token.shape[0])

    def select(self, mask: np.ndarray) -> FeatureSet:
        """The rows where ``mask`` (``[N]`` bool) holds."""
        return FeatureSet(*(getattr(self, f.name)[mask] for f in dataclasses.fields(self)))

    def save(self, path: pathlib.Path | str) -> None:
        """Writes every field to ``path`` (``numpy.savez``; :meth:`load` reads it)."""
        np.savez(path, **{f.name: getattr(self, f.name) for f in dataclasses.fields(self)})

    @classmethod
    def load(cls, path: pathlib.Path | str) -> FeatureSet:
        """The features :meth:`save` wrote to ``path``."""
        with np.load(path) as f:
            return cls(**{k: f[k] for k in f.files})


@dataclasses.dataclass(frozen=True)
class Continuations:
    """Prompts and the target's greedy continuations, by prompt index.

    Attributes:
      prompt_ids: prompt index -> token ids of the prompt (chat template applied).
      generated: prompt index -> the target's greedy continuation (token ids).
    """

    prompt_ids: dict[int, list[int]]
    generated: dict[int, list[int]]


def greedy_continuations(
    target_lm: LoadedModel,
    prompt_set: Sequence[prompts.Prompt],
    *,
    steps: int = 96,
    batch_size: int = 8,
    progress: Callable[[int, int], None] | None = None,
) -> Continuations:
    """The target's greedy continuation of every prompt (up to ``steps`` tokens or EOS).

    ``progress`` is called as ``progress(prompts_done, prompts_total)``.
    """
    options = engine.CertifyOptions(steps=steps, batch_size=batch_size)
    table, _ = engine.certify_prompts(
        target_lm,
        prompt_set,
        (rules_lib.StrictGreedy(),),
        options,
        progress=None if progress is None else lambda p: progress(p.prompts_done, p.prompts_total),
    )
    encoded = prompts.encode_prompts(target_lm.tokenizer, prompt_set)
    rows = table.select(["prompt_id", "token"]).to_pydict()
    index = {p.id: i for i, p in enumerate(prompt_set)}
    generated: dict[int, list[int]] = {}
    for pid, token in zip(rows["prompt_id"], rows["token"], strict=True):
        generated.setdefault(index[pid], []).append(int(token))
    return Continuations({i: encoded[i] for i in generated}, dict(sorted(generated.items())))


def _features_fn(
    graphdef: nnx.GraphDef, params: nnx.State, tokens: jax.Array, cache: KVCache
) -> jax.Array:
    return nnx.merge(graphdef, params).features(tokens, cache)[0]


_features = jax.jit(_features_fn, static_argnames="graphdef")


def teacher_forced_states(lm: LoadedModel, continuations: Continuations) -> np.ndarray:
    """``[N, E]`` float32 final hidden states of ``lm`` at every continuation position.

    One prefill of prompt + continuation per prompt (one padded width, so one compile);
    row order is prompt index, then position.
    """
    graphdef, params = nnx.split(lm.model)
    lengths = [
        len(continuations.prompt_ids[i]) + len(g) for i, g in continuations.generated.items()
    ]
    width = round_up(max(lengths), 64)
    out = []
    for i, generated in continuations.generated.items():
        ids = continuations.prompt_ids[i] + generated
        tokens, _ = pad_prompts([ids], width=width)
        cache = lm.model.init_cache(1, width)
        hidden = _features(graphdef, params, jnp.asarray(tokens), cache)[0]
        first = len(continuations.prompt_ids[i]) - 1  # predicts the first generated token
        out.append(np.asarray(hidden[first : first + len(generated)], np.float32))
    return np.concatenate(out)


def feature_set(
    continuations: Continuations, target_hidden: np.ndarray, drafter_hidden: np.ndarray
) -> FeatureSet:
    """Assembles a :class:`FeatureSet` from :func:`teacher_forced_states` of both models."""
    generated = continuations.generated
    return FeatureSet(
        drafter_hidden=drafter_hidden,
        target_hidden=target_hidden,
        prompt=np.concatenate([np.full(len(g), i, np.int32) for i, g in generated.items()]),
        position=np.concatenate([np.arange(len(g), dtype=np.int32) for g in generated.values()]),
        token=np.concatenate([np.asarray(g, np.int32) for g in generated.values()]),
    )


def collect_features(
    target_lm: LoadedModel,
    drafter_lm: LoadedModel,
    prompt_set: Sequence[prompts.Prompt],
    *,
    steps: int = 96,
    batch_size: int = 8,
    progress: Callable[[int, int], None] | None = None,
) -> FeatureSet:
    """Greedy continuations of the target, then teacher-forced hidden states of both models.

    Raises:
      ValueError: the two models have different vocabulary sizes.
    """
    check_same_vocabulary(target_lm.config, drafter_lm.config)
    conts = greedy_continuations(
        target_lm, prompt_set, steps=steps, batch_size=batch_size, progress=progress
    )
    return feature_set(
        conts, teacher_forced_states(target_lm, conts), teacher_forced_states(drafter_lm, conts)
    )


def target_logits(data: FeatureSet, target_model: LmHead, *, chunk: int = 256) -> np.ndarray:
    """``[N, V]`` float32 target logits of every position (computed once for training).

    The target's projection is the costliest part of a training step (``E_p x V``
    multiply-adds per position); precomputing it makes each step read a batch instead.
    """
    graphdef, params = nnx.split(target_model)
    project_jit = jax.jit(project, static_argnames="graphdef")
    return np.concatenate([
        np.asarray(project_jit(graphdef, params, jnp.asarray(data.target_hidden[i : i + chunk])))
        for i in range(0, len(data), chunk)
    ])  # fmt: skip
