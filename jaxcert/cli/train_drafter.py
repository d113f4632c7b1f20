"""``jaxcert train-drafter``: the certificate-loss drafter-training recipe, end to end.

Compares, at equal steps and seed, a :class:`jaxcert.training.DraftHead` trained with
(a) KL(p||q) distillation alone, (b) KL + the strict-greedy certificate violation and
(c) KL + the tree-coverage (m = 4) violation, on held-out prompts. See
:mod:`jaxcert.training` for the method.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import pathlib
import sys
import time

import numpy as np

from jaxcert.cli import DEFAULT_TARGET
from jaxcert.cli._common import check_vocabularies, load_model, load_prompt_set
from jaxcert.cli.argtypes import (
    non_negative,
    non_negative_float,
    positive,
    positive_float,
    unit_float,
)

__all__ = ["add_parser", "run"]


def add_parser(sub) -> None:
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
        default=DEFAULT_TARGET,
        help="asset name, checkpoint folder or .gguf (default %(default)s)",
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
        default="mtbench",
        help="'mtbench', 'sharegpt', a JSONL file with a 'prompt' or 'turns' field, or a "
        "ShareGPT-format .json file; first turns (default %(default)s)",
    )
    p.add_argument(
        "--max-prompts",
        type=positive,
        default=80,
        help="first N prompts, training and held-out together (default %(default)s)",
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
        default=150,
        help="optimiser steps per objective (default %(default)s)",
    )
    p.add_argument(
        "--batch-size",
        type=positive,
        default=64,
        help="positions per optimiser step (default %(default)s)",
    )
    p.add_argument(
        "--learning-rate",
        type=positive_float,
        default=1e-3,
        help="peak Adam learning rate, warm-up then cosine decay (default %(default)s)",
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
        default=pathlib.Path("jaxcert-out/train-drafter"),
        help="output folder (default %(default)s)",
    )
    p.set_defaults(func=run)


def _bar(desc):
    from tqdm import tqdm

    bar = tqdm(total=1, desc=desc, file=sys.stderr, dynamic_ncols=True)

    def update(done, total):
        bar.total = total
        bar.n = done
        bar.refresh()

    return bar, update


def _plot(histories: dict, path: pathlib.Path) -> None:
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


def _decode_heldout(args, prompt_set, held, heads, results) -> None:
    """Adds the speculative decoder's acceptance length of each drafter to ``results``."""
    import jax.numpy as jnp

    from jaxcert import models, training
    from jaxcert.base import prompts

    target = load_model("--target", args.target, dtype=jnp.float32)
    if args.drafter is None:
        base = models.truncate(target.model, args.exit_layer)
    else:
        base = load_model("--drafter", args.drafter, dtype=jnp.float32).model
    encoded = prompts.encode_prompts(target.tokenizer, [prompt_set[i] for i in sorted(held)])
    bar, update = _bar("decoder acceptance")
    for i, (result, head) in enumerate(zip(results, heads, strict=True)):
        drafter = base if head is None else training.HeadedDrafter(base, head)
        measured = training.decoder_acceptance(
            target,
            drafter,
            encoded,
            draft_length=args.draft_length,
            max_new_tokens=args.decode_tokens,
            eos_ids=target.eos_ids,
        )
        result["decoder_acceptance_length"] = measured["decoder_acceptance_length"]
        update(i + 1, len(heads))
    bar.close()


def run(args) -> int:
    import jax.numpy as jnp

    from jaxcert import models, training
    from jaxcert.base import prompts
    from jaxcert.core import rules as rules_lib
    from jaxcert.pipeline import report as certify_report

    if not 0 < args.heldout < 1:
        raise ValueError(f"--heldout must be in (0, 1), got {args.heldout}")
    if args.drafter is not None:  # from the configs, before minutes of target features
        check_vocabularies(args.target, args.drafter)
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    prompt_set = load_prompt_set(args.prompts, max_prompts=args.max_prompts)
    # One model in memory at a time (the 1.5B target alone is 7 GB in float32): the
    # trunks are only needed for the features; training needs the two lm_heads.
    target = load_model("--target", args.target, dtype=jnp.float32)
    target_config = target.config
    # Both phases' context needs, before anything compiles (training is not lost to a
    # decode phase that cannot run).
    longest = max(len(ids) for ids in prompts.encode_prompts(target.tokenizer, prompt_set))
    context = [dict(prompt_tokens=longest, new_tokens=args.continuation)]
    if args.decode_tokens > 0:
        context.append(
            dict(
                prompt_tokens=longest,
                new_tokens=args.decode_tokens,
                draft_positions=args.draft_length,
            )
        )
    for need in context:
        models.check_context_length({"target": target}, **need)
    saved = None
    if args.features is not None:
        with np.load(args.features) as f:
            saved = training.FeatureSet(**{k: f[k] for k in f.files})
        if len(saved) == 0 or saved.prompt.max() >= len(prompt_set):
            raise ValueError(
                f"{args.features}: its prompts do not fit --prompts {args.prompts} with "
                f"--max-prompts {args.max_prompts} ({len(prompt_set)} prompts); use the "
                "options of the run that saved it"
            )
    else:
        bar, update = _bar("target continuations")
        conts = training.greedy_continuations(
            target, prompt_set, steps=args.continuation, progress=update
        )
        bar.close()
        target_hidden = training.teacher_forced_states(target, conts)
    target_head = training.Projection(target.model)
    if args.drafter is None:  # early exit of the target itself (weights shared)
        trunk = models.truncate(target.model, args.exit_layer)
        drafter = dataclasses.replace(target, model=trunk, config=trunk.config)
        del target
    else:
        del target
        gc.collect()
        drafter = load_model("--drafter", args.drafter, dtype=jnp.float32)
    models.check_same_vocabulary(target_config, drafter.config)
    for need in context:
        models.check_context_length({"drafter": drafter}, **need)
    if saved is not None:
        features = saved
    else:
        features = training.feature_set(
            conts, target_hidden, training.teacher_forced_states(drafter, conts)
        )
        np.savez(
            out / "features.npz",
            **{
                k: getattr(features, k)
                for k in ("drafter_hidden", "target_hidden", "prompt", "position", "token")
            },
        )
    drafter_head = training.Projection(drafter.model)
    del drafter
    gc.collect()
    rng = np.random.default_rng(args.seed)
    prompt_ids = np.unique(features.prompt)
    held = rng.choice(prompt_ids, max(1, round(args.heldout * len(prompt_ids))), replace=False)
    is_held = np.isin(features.prompt, held)
    train, test = features.select(~is_held), features.select(is_held)
    if len(train) == 0 or len(test) == 0:
        raise ValueError(
            f"{len(prompt_ids)} prompt(s) with positions: need at least 2 to hold some out "
            "(raise --max-prompts)"
        )
    print(
        f"[jaxcert] features: {len(train)} train / {len(test)} held-out positions "
        f"({len(prompt_ids) - len(held)} / {len(held)} prompts)",
        file=sys.stderr,
    )
    rules = (rules_lib.StrictGreedy(), rules_lib.TreeCoverage(4))
    kw = dict(rules=rules, draft_length=args.draft_length)
    results = [
        {
            "drafter": "untrained (plain drafter)",
            **training.evaluate(None, test, target_head, drafter_head, **kw),
        }
    ]
    objectives = (
        training.Objective("(a) KL"),
        training.Objective(
            "(b) KL + greedy violation",
            rules_lib.StrictGreedy(),
            weight=args.weight,
            margin=args.margin,
        ),
        training.Objective(
            "(c) KL + tree:4 violation",
            rules_lib.TreeCoverage(4),
            weight=args.weight,
            margin=args.margin,
        ),
    )
    train_logits = training.target_logits(train, target_head)  # once, for every objective
    histories, heads = {}, [None]
    for objective in objectives:
        bar, update = _bar(objective.name)
        head, history = training.train_head(
            objective,
            train,
            train_logits,
            drafter_head,
            steps=args.train_steps,
            batch_size=args.batch_size,
            learning_rate=args.learning_rate,
            width=args.width,
            seed=args.seed,
            progress=update,
        )
        bar.close()
        histories[objective.name] = history
        heads.append(head)
        result = training.evaluate(head, test, target_head, drafter_head, **kw)
        results.append({"drafter": objective.name, **result})
        print(f"[jaxcert] {objective.name}: {result}", file=sys.stderr)

    def save():  # after training, and again with the decoder's figures
        table = certify_report.markdown_table(results, digits=4)
        seconds = round(time.perf_counter() - started, 1)
        meta = {
            "command": " ".join(sys.argv),
            "args": vars(args),
            "results": results,
            "histories": histories,
            "seconds": seconds,
        }
        (out / "results.json").write_text(json.dumps(meta, indent=2, default=str))
        (out / "results.md").write_text(table + "\n")
        return table

    save()
    _plot(histories, out / "training_curves.png")
    if args.decode_tokens > 0:
        _decode_heldout(args, prompt_set, held, heads, results)
    print(save())
    return 0
