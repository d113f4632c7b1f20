"""``jaxcert train-drafter --head eagle1|eagle3``: EAGLE draft heads trained on a target's
records, compared per objective and seed on held-out conversations.

The steps are :mod:`jaxcert.training.head_recipe`'s; every phase resumes (rerun the same
command after an interruption).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

from jaxcert.cli import DEFAULT_DECODE_TARGET
from jaxcert.cli._common import load_model, load_prompt_set

__all__ = ["add_head_arguments", "run"]


def add_head_arguments(p: argparse.ArgumentParser) -> None:
    """The options of head mode (``--head``); the shared ones are train-drafter's."""
    from jaxcert.cli.argtypes import non_negative, positive

    g = p.add_argument_group(
        "draft heads (--head)",
        "train EAGLE heads on the target's records; defaults in head mode: --target "
        f"{DEFAULT_DECODE_TARGET}, --prompts sharegpt, --train-steps 1000, --batch-size 4 "
        "(sequences), --learning-rate 3e-4, --out jaxcert-out/train-head",
    )
    g.add_argument(
        "--head",
        choices=("eagle1", "eagle3"),
        default=None,
        help="train draft heads: eagle1 reads the target's final-norm state, eagle3 fuses "
        "blocks 2, L/2 and L-3 (default: off, the residual-head recipe)",
    )
    g.add_argument(
        "--arch",
        choices=("jaxcert", "eagle3"),
        default="jaxcert",
        help="with --head eagle3: jaxcert's head (fc over the normalised embedding and "
        "feature, ordinary blocks, taps 2, L/2, L-3) or the published EAGLE-3 layer that "
        "vLLM and SGLang serve (one layer, the engines' taps; jaxcert export-head writes it "
        "for them) (default %(default)s)",
    )
    g.add_argument(
        "--data",
        choices=("replies", "greedy"),
        default="replies",
        help="training text: the prompt set's own replies (ShareGPT's assistant turns) or the "
        "target's greedy continuations (default %(default)s)",
    )
    g.add_argument(
        "--positions",
        type=positive,
        default=100_000,
        help="trained positions to record from the target (default %(default)s)",
    )
    g.add_argument(
        "--heldout-sequences",
        type=positive,
        default=48,
        help="the last N sequences of the prompt set, never trained on (default %(default)s)",
    )
    g.add_argument(
        "--draft-vocab",
        type=non_negative,
        default=32_768,
        help="reduced draft vocabulary, 0 for the full one (default %(default)s)",
    )
    g.add_argument(
        "--head-layers", type=positive, default=1, help="decoder blocks (default %(default)s)"
    )
    g.add_argument(
        "--ttt-depth",
        type=positive,
        default=1,
        help="training-time test: train each head on the D tokens it drafts in a round, "
        "the later ones reading its own earlier states; 1 is teacher forcing (default "
        "%(default)s)",
    )
    g.add_argument(
        "--objectives",
        default="kl,kl+greedy,kl+tree4,kl+tv",
        help="comma-separated, of kl, kl+greedy, kl+tree4, kl+tv (default %(default)s)",
    )
    g.add_argument(
        "--decode-prompts",
        type=non_negative,
        default=8,
        help="first turns of --decode-source decoded with each head at T = 0 and T = 1 "
        "(greedy chain and speculative sampling, constant --draft-length), the first of "
        "each category in turn; 0 skips it (default %(default)s)",
    )
    g.add_argument(
        "--decode-seeds",
        type=positive,
        default=None,
        help="decode with the heads of the first N seeds only (the decoder figures are the "
        "costly part of the evaluation; default: every seed)",
    )
    g.add_argument(
        "--decode-source",
        default="mtbench",
        help="prompt set of the decoded prompts (as --prompts; default %(default)s)",
    )
    g.add_argument(
        "--seeds", default="0,1", help="comma-separated seeds, a head each (default %(default)s)"
    )


def log(message: str) -> None:
    """A ``[jaxcert]`` progress line on stderr (shared with train-drafter)."""
    print(f"[jaxcert] {message}", file=sys.stderr)


def _greedy_progress(done: int, goal: int) -> None:
    """Progress of the greedy continuations (``--data greedy``); the held-out prompts
    (``goal == -1``) come first."""
    of = f" / {goal:,}" if goal > 0 else " held-out"
    log(f"greedy continuations: {done:,}{of} positions")


def _seeds(spec: str) -> tuple[int, ...]:
    try:
        seeds = tuple(int(s) for s in spec.split(",") if s.strip())
    except ValueError:
        raise ValueError(f"--seeds: comma-separated integers, got {spec!r}") from None
    if not seeds:
        raise ValueError("--seeds: give at least one seed")
    return seeds


def _settings(args: argparse.Namespace, num_layers: int, seeds: tuple[int, ...]):
    from jaxcert.training import head_recipe

    return head_recipe.HeadSettings(
        data=args.data,
        arch=args.arch,
        taps=_taps(args, num_layers),
        num_layers=args.head_layers,
        ttt_depth=args.ttt_depth,
        draft_vocab=args.draft_vocab,
        positions=args.positions,
        heldout=args.heldout_sequences,
        steps=args.train_steps or 1000,
        batch_size=args.batch_size or 4,
        learning_rate=args.learning_rate or 3e-4,
        seeds=seeds,
    )


def _taps(args: argparse.Namespace, num_layers: int) -> tuple[int, ...]:
    """The target blocks the head fuses, as ``--head`` and ``--arch`` say."""
    from jaxcert.models.eagle3 import engine_taps
    from jaxcert.training import head_recipe

    if args.arch == "eagle3":
        if args.head != "eagle3" or args.head_layers != 1:
            raise ValueError("--arch eagle3: the published head is --head eagle3, --head-layers 1")
        return engine_taps(num_layers)
    return head_recipe.default_taps(num_layers) if args.head == "eagle3" else ()


def _objectives(spec: str, weight: float, margin: float):
    from jaxcert.training import head_recipe

    known = {o.name: o for o in head_recipe.head_objectives(weight, margin)}
    names = [s.strip() for s in spec.split(",") if s.strip()]
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        raise ValueError(f"--objectives: unknown {unknown}; choose from {', '.join(known)}")
    return [known[n] for n in names]


def run(args: argparse.Namespace) -> int:
    import jax.numpy as jnp

    from jaxcert.training import head_recipe

    out = args.out or pathlib.Path("jaxcert-out/train-head")
    objectives = _objectives(args.objectives, args.weight, args.margin)  # before any loading
    seeds = _seeds(args.seeds)
    started = time.perf_counter()
    prompt_set = load_prompt_set(args.prompts or "sharegpt", max_prompts=args.max_prompts)
    target = load_model("--target", args.target or DEFAULT_DECODE_TARGET, dtype=jnp.float32)
    settings = _settings(args, target.config.num_layers, seeds)
    seqs = head_recipe.sequences(
        target, prompt_set, settings, cache=out / "greedy.jsonl", progress=_greedy_progress
    )
    train, held = head_recipe.split_sequences(seqs, settings.heldout)
    store, heldout = head_recipe.write_stores(target, train, held, settings, out, log=log)
    decode_prompts = head_recipe.decode_prompt_ids(target, args.decode_source, args.decode_prompts)
    rows = head_recipe.compare_heads(
        target.model, store, heldout, objectives, settings, out,
        decode_prompts=decode_prompts, decode_seeds=args.decode_seeds,
        decode_tokens=args.decode_tokens,
        draft_length=args.draft_length, eos_ids=target.config.eos_token_ids, log=log,
    )  # fmt: skip
    summary = head_recipe.summarize(rows, store, settings)
    summary["seconds"] = time.perf_counter() - started
    summary["command"] = " ".join(sys.argv)
    (out / "results.json").write_text(json.dumps(summary, indent=1) + "\n")
    table = head_recipe.results_table(summary)
    (out / "results.md").write_text(table + "\n")
    print(table)
    return 0
