"""Pairing a target with a drafter: checked, resolved and placed, before anything compiles.

:func:`pair` binds a drafter that takes the target's vocabulary (the n-gram drafter),
checks that the two share a vocabulary, resolves the config for the pair and policy (a draft
head's taps, one-hot proposals, ``max_skip``), and puts both models on one mesh when either
lives on one (``docs/scaling.md``): the prompts are then split over the mesh's ``batch`` axis,
padded with copies of the last prompt to a multiple of its size (the copies are dropped
from the output), and a model not yet on the mesh is placed there with
:func:`jaxcert.models.shard` (once per call: shard it yourself to avoid the transfer).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxcert import models
from jaxcert.base.prompts import pad_prompts
from jaxcert.decoding import drafters
from jaxcert.decoding import policies as policies_lib
from jaxcert.decoding.config import DecodeConfig
from jaxcert.decoding.drafters import Drafter
from jaxcert.decoding.ngram import NgramDrafter
from jaxcert.decoding.protocols import DecoderModel, reads_target
from jaxcert.models import sharding as sharding_lib

__all__ = [
    "Pair",
    "check_pair",
    "on_mesh",
    "pair",
    "place_prompts",
    "replicated",
    "resolved_config",
    "split_model",
    "vocab_size",
]


def split_model(model) -> tuple[nnx.GraphDef, nnx.State]:
    """``(graphdef, params)`` of a ``models.LoadedModel``, an ``nnx.Module`` or such a pair."""
    if isinstance(model, tuple) and len(model) == 2:
        return model
    module = getattr(model, "model", model)
    if not isinstance(module, nnx.Module):
        raise ValueError(f"expected a models.LoadedModel or an nnx.Module, got {type(model)}")
    if not isinstance(module, DecoderModel):
        surface = ("config", "init_cache", "features", "project", "__call__")
        missing = [a for a in surface if not hasattr(module, a)]
        raise ValueError(
            f"{type(module).__name__} lacks {', '.join(missing)}: a target or drafter needs the "
            "jaxcert.decoding.protocols.DecoderModel surface"
        )
    return nnx.split(module)


def place_prompts(prompts, width, minimum, vocab_size, placement=None):
    """``(tokens [B', T], lengths [B'])`` on the device(s); ``B' = B`` unless on a mesh.

    With ``placement = (mesh, rules)`` the batch is padded with copies of the last prompt to
    a multiple of the size of the mesh axes of ``batch``, then split over them.
    """
    if placement is not None and len(prompts) and not isinstance(prompts[0], (int, np.integer)):
        mesh, rules = placement
        n = sharding_lib.axis_size("batch", mesh, rules)
        prompts = list(prompts) + [prompts[-1]] * (-len(prompts) % n)
    tokens, lengths = pad_prompts(prompts, width=width, minimum=minimum, vocab_size=vocab_size)
    if placement is None:
        return jnp.asarray(tokens), jnp.asarray(lengths)
    layout = sharding_lib.Layout.create(*placement)
    tokens = jax.device_put(tokens, layout.sharding(("batch", None), tokens.shape))
    return tokens, jax.device_put(lengths, layout.sharding(("batch",), lengths.shape))


def _model_mesh(model):
    """The mesh a model (``LoadedModel``, module or ``(graphdef, params)``) lives on, or None."""
    if isinstance(model, tuple) and len(model) == 2:
        return sharding_lib.mesh_of(model[1])
    layout = sharding_lib.layout_of(model)
    if layout is not None:
        return layout.mesh
    module = getattr(model, "model", model)
    return sharding_lib.mesh_of(nnx.state(module)) if isinstance(module, nnx.Module) else None


def on_mesh(models_, mesh):
    """Puts every model on one mesh: ``(models, (mesh, rules) or None)``.

    The mesh is ``mesh`` if given, else the one the models live on (``None``: nothing to do,
    the single-device path). A model elsewhere is placed with ``models.shard`` (the rules of
    the first sharded model, else the default rules).

    Raises:
      ValueError: the models live on different meshes (and no ``mesh`` was given), or an
        ``Explicit`` mesh.
    """
    found = [_model_mesh(m) for m in models_]
    if mesh is None:
        meshes = {m for m in found if m is not None}
        if len(meshes) > 1:
            raise ValueError(
                "the target and the drafter live on different meshes; place them on one "
                "(jaxcert.models.shard) or pass mesh="
            )
        if not meshes:
            return models_, None
        mesh = meshes.pop()
    sharding_lib.check_mesh(mesh)
    layouts = [sharding_lib.layout_of(m) for m in models_ if not isinstance(m, tuple)]
    rules = next((x.rules for x in layouts if x is not None), sharding_lib.LOGICAL_RULES)
    placed = []
    for model, where in zip(models_, found, strict=True):
        if where != mesh:
            if isinstance(model, tuple) and len(model) == 2:
                model = nnx.split(models.shard(nnx.merge(*model), mesh, rules))
            else:
                model = models.shard(getattr(model, "model", model), mesh, rules)
        placed.append(model)
    return placed, (mesh, rules)


def replicated(tree, placement):
    """``tree`` replicated on the mesh (``tree`` itself without one)."""
    if placement is None:
        return tree
    return jax.device_put(
        tree, jax.sharding.NamedSharding(placement[0], jax.sharding.PartitionSpec())
    )


def vocab_size(model) -> int | None:
    config = models.config_of(model)  # None for a (graphdef, params) pair: ids >= 0 only
    return None if config is None else int(config.vocab_size)


check_pair = models.check_same_vocabulary
"""Raises ``ValueError`` unless target and drafter share one vocabulary (and tokenizer)."""


def _with_head(config: DecodeConfig, target, drafter) -> DecodeConfig:
    """``config`` with ``head_taps`` set when ``drafter`` is a draft head.

    Raises:
      ValueError: the head fuses a block the target does not have, or the target cannot
        hand over its intermediate states (no ``tapped_features``).
    """
    head = getattr(drafter, "model", drafter)
    if isinstance(head, tuple) or not reads_target(head):
        return dataclasses.replace(config, head_taps=None)
    taps = tuple(int(i) for i in head.taps)
    t_model = getattr(target, "model", target)
    if not isinstance(t_model, tuple) and not hasattr(t_model, "tapped_features"):
        raise ValueError(
            f"the draft head fuses target blocks {taps}, but the target "
            f"({type(t_model).__name__}) has no tapped_features to hand them over "
            "(jaxcert.decoding.protocols.TappedTarget)"
        )
    layers = getattr(getattr(t_model, "config", None), "num_layers", None)
    if layers is not None and any(not 0 <= i < layers for i in taps):
        raise ValueError(
            f"the draft head fuses target blocks {taps}, but the target has {layers} blocks"
        )
    return dataclasses.replace(config, head_taps=taps)


def resolved_config(
    config: DecodeConfig, target, drafter, policy: policies_lib.Policy
) -> DecodeConfig:
    """``config`` as :func:`speculative_decode` runs it with this pair and policy: the draft
    head's taps, whether the drafter proposes one-hot tokens, and ``max_skip`` (``None``:
    8 with :class:`~jaxcert.decoding.policies.Goodput`, else 0). Its verification widths
    are the ones :func:`~jaxcert.decoding.costs.calibrate` should measure.

    Raises:
      ValueError: as :func:`speculative_decode` for a head the target cannot feed.
    """
    config = _with_head(config, target, drafter)
    proposes = bool(getattr(getattr(drafter, "model", drafter), "proposes_tokens", False))
    goodput = isinstance(policy, policies_lib.Goodput)
    skips = config.max_skip if config.max_skip is not None else (8 if goodput else 0)
    return dataclasses.replace(config, proposes_tokens=proposes, max_skip=skips)


def _bound(drafter, target):
    """An :class:`~jaxcert.decoding.ngram.NgramDrafter` built without a vocabulary size
    takes the target's; any other drafter is returned as it is."""
    if isinstance(drafter, NgramDrafter) and drafter.config is None:
        size = vocab_size(target)
        if size is None:
            raise ValueError(
                "NgramDrafter needs the target's vocabulary size: pass a target with a "
                "config, or build it with NgramDrafter(n, vocab_size=V)"
            )
        return drafter.for_vocabulary(size)
    return drafter


@dataclasses.dataclass(frozen=True)
class Pair:
    """A target and a drafter ready to decode (made by :func:`pair`).

    Attributes:
      t_graphdef, t_params: the target split (``nnx.split``), on one device or on a mesh.
      drafter, d_params: the drafter's object for its method
        (:func:`~jaxcert.decoding.drafters.for_model`) and its parameters, on the same.
      config: the :class:`~jaxcert.decoding.config.DecodeConfig` resolved for the pair and
        the policy (:func:`resolved_config`).
      placement: ``(mesh, logical rules)`` or ``None`` on one device.
      vocab_size: the target's vocabulary ``V`` (``None`` for a ``(graphdef, params)`` pair).
      models: the models as given (the drafter bound), by role, for the context checks.
    """

    t_graphdef: nnx.GraphDef
    t_params: nnx.State
    drafter: Drafter
    d_params: nnx.State
    config: DecodeConfig
    placement: tuple | None
    vocab_size: int | None
    models: dict


def pair(target, drafter, *, config: DecodeConfig, policy, mesh=None) -> Pair:
    """The :class:`Pair` of ``target`` and ``drafter`` for ``config`` and ``policy``.

    Raises:
      ValueError: mismatched vocabularies; a draft head the target cannot feed; an n-gram
        drafter without a vocabulary beside a target without a config; models on different
        meshes, or an ``Explicit`` mesh.
    """
    drafter = _bound(drafter, target)
    check_pair(target, drafter)
    config = resolved_config(config, target, drafter, policy)
    given = {"target": target, "drafter": drafter}
    (target, drafter), placement = on_mesh((target, drafter), mesh)
    t_graphdef, t_params = split_model(target)
    d_graphdef, d_params = split_model(drafter)
    d_object = drafters.for_model(d_graphdef, nnx.merge(d_graphdef, d_params))
    return Pair(
        t_graphdef, t_params, d_object, d_params, config, placement, vocab_size(target), given
    )
