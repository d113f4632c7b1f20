"""``jaxcert train-drafter``: the certificate-loss drafter-training recipe, end to end.

Compares, at equal steps and seed, a :class:`jaxcert.training.DraftHead` trained with
(a) KL(p||q) distillation alone, (b) KL + the strict-greedy certificate violation and
(c) KL + the tree-coverage (m = 4) violation, on held-out prompts. See
:mod:`jaxcert.training` for the method.
"""

from __future__ import annotations

import argparse
import contextlib
import pathlib
import sys
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from jaxcert.base.tables import counted
from jaxcert.cli import DEFAULT_DECODE_TARGET, DEFAULT_TARGET, train_head
from jaxcert.cli._common import check_vocabularies, load_model, load_prompt_set
from jaxcert.cli.argtypes import (
    non_negative,
    non_negative_float,
    positive,
    positive_float,
    unit_float,
)
from jaxcert.cli.train_head import add_head_arguments
from jaxcert.cli.train_head import log as _log

if TYPE_CHECKING:
    from jaxcert.models import LoadedModel
    from jaxcert.training import FeatureSet, recipe

__all__ = ["add_parser", "run"]


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "train-drafter",
        help="train drafter heads with KL vs KL + certificate violation and compare them",
        description="Teacher-forced features of target and drafter on real prompts, then a "
        "residual head on the drafter trained with (a) KL, (b) KL + strict-greedy violation, "
        "(c) KL + tree:4 violation; held-out KL, certified fraction, agreement and "
        "acceptance length (offline, and in the speculative decoder). The default run "
        "(the 0.5B target, its first 6 layers as drafter, 80 MT-Bench prompts) takes about "
        "21 minutes on 2 CPU cores; --features reuses a run's features and skips their "
        "computation.",
    )
    p.add_argument(
        "--target",
        default=None,
        help=f"asset name, checkpoint folder or .gguf (default {DEFAULT_TARGET}; "
        f"{DEFAULT_DECODE_TARGET} with --head)",
    )
    p.add_argument(
        "--exit-layer",
        type=positive,
        default=6,
        help="self-speculative drafter: the target's first N layers + the head "
        "(default %(default)s); ignored with --drafter",
    )
    p.add_argument(
        "--drafter",
        default=None,
        help="a separate drafter model instead (asset, folder or .gguf, with the target's "
        "vocabulary); the head then sits on its final hidden states (default: none, the "
        "early-exit drafter of --exit-layer)",
    )
    p.add_argument(
        "--prompts",
        default=None,
        help="'mtbench', 'sharegpt', a JSONL file with a 'prompt' or 'turns' field, or a "
        "ShareGPT-format .json file; first turns (default mtbench; sharegpt with --head)",
    )
    p.add_argument(
        "--max-prompts",
        type=positive,
        default=None,
        help="first N prompts, training and held-out together (default 80; all with --head)",
    )
    p.add_argument(
        "--heldout",
        type=unit_float,
        default=0.25,
        help="fraction of prompts held out for evaluation (default %(default)s)",
    )
    p.add_argument(
        "--continuation",
        type=positive,
        default=128,
        help="greedy tokens of the target per prompt (default %(default)s)",
    )
    p.add_argument(
        "--train-steps",
        type=positive,
        default=None,
        help="optimiser steps per objective (default 150; 1000 with --head)",
    )
    p.add_argument(
        "--batch-size",
        type=positive,
        default=None,
        help="positions per optimiser step (default 64; with --head sequences, 4)",
    )
    p.add_argument(
        "--learning-rate",
        type=positive_float,
        default=None,
        help="peak Adam learning rate, warm-up then cosine decay (default 0.001; 0.0003 "
        "with --head)",
    )
    p.add_argument(
        "--width",
        type=positive,
        default=1024,
        help="hidden width of the head (default %(default)s)",
    )
    p.add_argument(
        "--weight",
        type=non_negative_float,
        default=1.0,
        help="lambda of the violation term of (b) and (c) (default %(default)s)",
    )
    p.add_argument(
        "--margin",
        type=non_negative_float,
        default=0.0,
        help="nats of slack in the hinge relu(KL - C_p + margin) (default %(default)s)",
    )
    p.add_argument(
        "--draft-length",
        type=positive,
        default=5,
        help="K of the chain acceptance length, offline and in the decoder (default %(default)s)",
    )
    p.add_argument(
        "--decode-tokens",
        type=non_negative,
        default=64,
        help="new tokens per held-out prompt in the speculative decoder "
        "(greedy chain, constant K) with each trained drafter; 0 skips it "
        "(default %(default)s)",
    )
    p.add_argument(
        "--seed",
        type=int,
        default=0,
        help="seed of the held-out split, the heads' initialisation and the batches "
        "(default %(default)s)",
    )
    p.add_argument(
        "--features",
        type=pathlib.Path,
        default=None,
        help="reuse features saved by an earlier run (its features.npz; default: compute "
        "them and save them to --out)",
    )
    p.add_argument(
        "--out",
        type=pathlib.Path,
        default=None,
        help="output folder (default jaxcert-out/train-drafter; jaxcert-out/train-head with "
        "--head)",
    )
    add_head_arguments(p)
    p.set_defaults(func=run)


@contextlib.contextmanager
def _bar(desc: str) -> Iterator[Callable[[int, int], None]]:
    """A tqdm bar on stderr for one phase; yields its ``progress(done, total)``."""
    from tqdm import tqdm

    bar = tqdm(total=1, desc=desc, file=sys.stderr, dynamic_ncols=True)

    def update(done: int, total: int) -> None:
        bar.total = total
        bar.n = done
        bar.refresh()

    try:
        yield update
    finally:
        bar.close()


def _loaders(args: argparse.Namespace) -> recipe.Loaders:
    import jax.numpy as jnp

    from jaxcert.training import recipe

    def target() -> LoadedModel:
        return load_model("--target", args.target, dtype=jnp.float32)

    def drafter() -> LoadedModel:
        return load_model("--drafter", args.drafter, dtype=jnp.float32)

    return recipe.Loaders(target, None if args.drafter is None else drafter, args.exit_layer)


def _saved_features(args: argparse.Namespace, num_prompts: int) -> Callable[[], FeatureSet] | None:
    """Reads ``--features`` (``None`` without it), refused unless they fit this run's prompts.

    A callable: ``recipe.prepare`` reads them once the target's context is checked.
    """
    if args.features is None:
        return None

    def load() -> FeatureSet:
        from jaxcert.training import FeatureSet

        saved = FeatureSet.load(args.features)
        if len(saved) == 0 or saved.prompt.max() >= num_prompts:
            raise ValueError(
                f"{args.features}: its prompts do not fit --prompts {args.prompts} with "
                f"--max-prompts {args.max_prompts} ({counted(num_prompts, 'prompt')}); use the "
                "options of the run that saved it"
            )
        return saved

    return load


_RESIDUAL_DEFAULTS = dict(
    target=DEFAULT_TARGET,
    prompts="mtbench",
    max_prompts=80,
    train_steps=150,
    batch_size=64,
    learning_rate=1e-3,
    out=pathlib.Path("jaxcert-out/train-drafter"),
)


def run(args: argparse.Namespace) -> int:
    from jaxcert.training import recipe

    if args.head is not None:
        return train_head.run(args)
    for name, value in _RESIDUAL_DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if not 0 < args.heldout < 1:
        raise ValueError(f"--heldout must be in (0, 1), got {args.heldout}")
    if args.drafter is not None:  # from the configs, before minutes of target features
        check_vocabularies(args.target, args.drafter)
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    prompt_set = load_prompt_set(args.prompts, max_prompts=args.max_prompts)
    loaders = _loaders(args)
    prepared = recipe.prepare(
        loaders,
        prompt_set,
        continuation=args.continuation,
        decode_tokens=args.decode_tokens,
        draft_length=args.draft_length,
        load_saved=_saved_features(args, len(prompt_set)),
        save_to=out / "features.npz",
        bars=_bar,
    )
    split = recipe.split_heldout(prepared.features, args.heldout, seed=args.seed)
    _log(f"features: {split.summary()}")
    settings = recipe.TrainSettings(
        steps=args.train_steps,
        batch_size=args.batch_size,
        learning_rate=args.learning_rate,
        width=args.width,
        seed=args.seed,
    )
    objectives = recipe.comparison_objectives(args.weight, args.margin)
    comparison = recipe.compare(
        prepared, split, objectives, settings, draft_length=args.draft_length, bars=_bar, log=_log
    )

    def save() -> str:  # after training, and again with the decoder's figures
        seconds = time.perf_counter() - started
        return recipe.write_results(
            out, comparison, command=" ".join(sys.argv), args=vars(args), seconds=seconds
        )

    save()
    recipe.plot_histories(comparison.histories, out / "training_curves.png")
    if args.decode_tokens > 0:
        lengths = recipe.decode_heldout(
            loaders, prompt_set, split.held, comparison.heads,
            draft_length=args.draft_length, max_new_tokens=args.decode_tokens, bars=_bar,
        )  # fmt: skip
        for result, length in zip(comparison.results, lengths, strict=True):
            result["decoder_acceptance_length"] = length
    print(save())
    return 0
