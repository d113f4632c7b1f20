"""Training drafters that are accepted more often: distillation with certificate losses.

Recipe (``jaxcert train-drafter``, ``scripts/train_drafter.py``):

1. The target greedy-decodes real prompts; both models then read prompt + continuation
   once (teacher forcing) and their final hidden states at every continuation position
   are cached (:func:`collect_features`). At these positions the drafter sees exactly
   what it sees inside an accepted greedy run of speculative decoding.
2. The student is a :class:`DraftHead`, a residual MLP between the drafter's final norm
   and its frozen lm_head, trained on the cached states with optax
   (:func:`train_head`): KL(p||q) alone, or KL plus a certificate-violation term.
3. :func:`evaluate` reports on held-out prompts the mean KL, the certified fraction
   (KL < C_p) per rule, greedy agreement, and the exact offline acceptance length of
   greedy chain decoding with a constant draft length; :func:`decoder_acceptance` runs
   the speculative decoder of :mod:`jaxcert.decoding` with the trained drafter.

Why a head on the drafter: it trains in minutes on 2 CPU cores (only ~2M parameters;
the cost is the two full-vocabulary projections per position, which the certificate
needs anyway), the trunk stays frozen so features are computed once, and the result,
:class:`HeadedDrafter`, is an ordinary drafter for :mod:`jaxcert.decoding` (same call
signature as ``models.Transformer``).

Modules: :mod:`~jaxcert.training.heads` (the nnx modules), :mod:`~jaxcert.training.features`
(continuations, cached hidden states, target logits), :mod:`~jaxcert.training.train`
(objectives, optimisation), :mod:`~jaxcert.training.evaluation` (offline and decoder
acceptance) and :mod:`~jaxcert.training.recipe` (the steps of ``jaxcert train-drafter``:
features of both models, the comparison of objectives, results).

EAGLE draft heads (`jaxcert.models.EagleHead`, ``jaxcert train-drafter --head``,
``docs/training.md``): :mod:`~jaxcert.training.head_data` (the target's records, streamed to
disk and resumable), :mod:`~jaxcert.training.eagle` (the window losses and resumable
training, and in-memory training for small targets) and
:mod:`~jaxcert.training.head_recipe` (the steps of head mode: stores, objectives x seeds,
held-out evaluation, decoding, the table).

A drafter model fine-tuned toward its target (``jaxcert finetune-drafter``,
``docs/training.md``, "Fine-tuning a drafter at the boundary"):
:mod:`~jaxcert.training.drafter_states` (the drafter's frozen-bottom states, streamed),
:mod:`~jaxcert.training.finetune` (the objectives on the target's window, resumable
data-parallel training of the top blocks, held-out evaluation)
and :mod:`~jaxcert.training.finetune_recipe` (the steps: records, states, the sweep, runs per
objective and seed, decoder figures, the tables).
"""

from jaxcert.training.evaluation import chain_acceptance_length, decoder_acceptance, evaluate
from jaxcert.training.features import (
    Continuations,
    FeatureSet,
    collect_features,
    feature_set,
    greedy_continuations,
    target_logits,
    teacher_forced_states,
)
from jaxcert.training.heads import DraftHead, HeadedDrafter, Projection
from jaxcert.training.train import Objective, train_head

__all__ = [
    "DraftHead",
    "HeadedDrafter",
    "FeatureSet",
    "Continuations",
    "Projection",
    "greedy_continuations",
    "teacher_forced_states",
    "feature_set",
    "Objective",
    "collect_features",
    "target_logits",
    "train_head",
    "evaluate",
    "chain_acceptance_length",
    "decoder_acceptance",
]
