"""``jaxcert finetune-drafter``: a drafter model's top blocks fine-tuned toward its target with
KL and certificate objectives, compared per objective and seed on held-out conversations and
in the decoder; the chosen run written as a Hugging Face folder.

The steps are :mod:`jaxcert.training.finetune_recipe`'s; every phase resumes (rerun the same
command after an interruption).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import pathlib
import sys
import time

from jaxcert.base.folders import check_writable
from jaxcert.cli import DEFAULT_DECODE_TARGET, DEFAULT_DRAFTER
from jaxcert.cli.argtypes import non_negative, non_negative_float, positive, positive_float

__all__ = ["add_parser", "run"]


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "finetune-drafter",
        help="fine-tune a drafter model's top blocks toward the target with KL and "
        "certificate objectives, and compare them",
        description="Records the target's top-64 log-probabilities and exact certificates on "
        "ShareGPT replies and the drafter's frozen-bottom states (both once, resumable), "
        "trains the drafter's top N blocks and final norm with each objective and seed, and "
        "compares the runs on held-out conversations (KL, certified and accepted fractions) "
        "and in the speculative decoder on MT-Bench first turns (tokens per round at T = 0 "
        "and T = 1, tokens/s at batch 1), with paired bootstrap intervals against the "
        "untrained drafter and against kl. docs/training.md, 'Fine-tuning a drafter at the "
        "boundary'.",
    )
    p.add_argument("--target", default=DEFAULT_DECODE_TARGET, help="(default %(default)s)")
    p.add_argument("--drafter", default=DEFAULT_DRAFTER, help="(default %(default)s)")
    p.add_argument(
        "--prompts", default="sharegpt", help="a prompt set with replies (default %(default)s)"
    )
    p.add_argument("--max-prompts", type=positive, default=None, help="first N prompts")
    p.add_argument(
        "--positions",
        type=positive,
        default=200_000,
        help="trained positions recorded from the target (default %(default)s)",
    )
    p.add_argument(
        "--heldout-sequences",
        type=positive,
        default=48,
        help="the prompt set's last N sequences, never trained on (default %(default)s)",
    )
    p.add_argument(
        "--states-after",
        type=positive,
        default=None,
        help="the drafter blocks below the stored states (default: all but the top 4)",
    )
    p.add_argument(
        "--trained-blocks",
        type=positive,
        default=4,
        help="N, the drafter's top blocks trained with its final norm (default %(default)s)",
    )
    p.add_argument(
        "--train-lm-head",
        action="store_true",
        help="train the lm_head too (a tied drafter's untied from its embedding, which stays "
        "frozen; the export then has an lm_head of its own)",
    )
    p.add_argument(
        "--train-steps",
        type=positive,
        default=None,
        help="optimiser steps of every run (default: one pass over the training sequences)",
    )
    p.add_argument(
        "--batch-size", type=positive, default=8, help="sequences a step (default %(default)s)"
    )
    p.add_argument(
        "--learning-rate",
        type=positive_float,
        default=1e-5,
        help="peak Adam rate, warm-up then cosine decay (default %(default)s)",
    )
    p.add_argument(
        "--objectives",
        default="kl,kl+greedy,kl+tree4,kl+tv,kl+miss",
        help="comma-separated, of kl, kl+greedy, kl+tree4, kl+tv, kl+miss (default %(default)s)",
    )
    p.add_argument(
        "--margin",
        type=non_negative_float,
        default=0.05,
        help="nats of slack the certificate terms ask below C_p (kl+greedy, kl+tree4, kl+miss; "
        "default %(default)s)",
    )
    p.add_argument(
        "--weight",
        type=non_negative_float,
        default=1.0,
        help="weight of each objective's term beside KL (default %(default)s)",
    )
    p.add_argument("--seeds", default="0,1", help="one run per seed (default %(default)s)")
    p.add_argument(
        "--sweep",
        default=None,
        metavar="N1,N2,..",
        help="first a short sweep of --trained-blocks (kl, seed 0, --sweep-steps steps each; "
        "the KL change on batches not yet trained on, held-out figures and seconds a step), "
        "then stop",
    )
    p.add_argument(
        "--sweep-steps", type=positive, default=20, help="steps of each sweep run (default 20)"
    )
    p.add_argument(
        "--decode-prompts",
        type=non_negative,
        default=16,
        help="first turns of --decode-source (the first of each category in turn) decoded "
        "with each "
        "drafter; 0 skips the decoder (default %(default)s)",
    )
    p.add_argument(
        "--decode-source",
        default="mtbench",
        help="prompt set of the decoded prompts (as --prompts; default %(default)s)",
    )
    p.add_argument(
        "--decode-tokens", type=positive, default=64, help="new tokens (default %(default)s)"
    )
    p.add_argument(
        "--speed-prompts",
        type=non_negative,
        default=None,
        help="tokens/s at batch 1 on the first N of the decoded prompts, at most "
        "--decode-prompts; 0 skips it (default 8, or all the decoded prompts when fewer)",
    )
    p.add_argument(
        "--speed-seeds",
        type=non_negative,
        default=1,
        help="tokens/s at batch 1 of the runs of the first N seeds (and of the untrained "
        "drafter and target-only); 0 skips it (default %(default)s)",
    )
    p.add_argument(
        "--export",
        type=pathlib.Path,
        default=None,
        help="write a fine-tuned drafter here as a Hugging Face folder (vLLM's draft_model, "
        "jaxcert decode --drafter): the run of --export-run, by default the objective with "
        "the highest held-out greedy-certified fraction, first seed (a new folder, outside "
        "--out)",
    )
    p.add_argument("--export-run", default=None, metavar="OBJECTIVE-seedS")
    p.add_argument(
        "--out",
        type=pathlib.Path,
        default=pathlib.Path("jaxcert-out/finetune"),
        help="output folder (default %(default)s)",
    )
    p.set_defaults(func=run)


def log(message: str) -> None:
    print(f"[jaxcert] {message}", file=sys.stderr, flush=True)


def _objectives(spec: str, margin: float = 0.0, weight: float = 1.0):
    import dataclasses

    from jaxcert.training import finetune

    names = [s.strip() for s in spec.split(",") if s.strip()]
    unknown = [n for n in names if n not in finetune.OBJECTIVES]
    if unknown or not names:
        known = ", ".join(finetune.OBJECTIVES)
        raise ValueError(f"--objectives: unknown {unknown or spec!r}; choose from {known}")
    if len(set(names)) < len(names):
        raise ValueError(f"--objectives: {spec!r} names an objective twice")
    return [
        dataclasses.replace(
            finetune.OBJECTIVES[n],
            weight=weight,
            margin=margin if finetune.OBJECTIVES[n].rule is not None else 0.0,
        )
        for n in names
    ]


def _ints(option: str, spec: str, low: int = 0) -> tuple[int, ...]:
    try:
        values = tuple(int(s) for s in spec.split(",") if s.strip())
    except ValueError:
        raise ValueError(f"{option}: comma-separated integers, got {spec!r}") from None
    if not values:
        raise ValueError(f"{option}: give at least one")
    if min(values) < low or len(set(values)) < len(values):
        raise ValueError(f"{option}: distinct integers >= {low}, got {spec!r}")
    return values


def _check_blocks(args, layers: int) -> int:
    """``s`` (--states-after), once --trained-blocks and --sweep fit the drafter's blocks."""
    states_after = args.states_after if args.states_after is not None else max(layers - 4, 1)
    if not 1 <= states_after < layers:
        raise ValueError(
            f"--states-after must be in [1, {layers}) (the drafter's {layers} blocks), "
            f"got {states_after}"
        )
    room = layers - states_after
    for option, n in [("--trained-blocks", args.trained_blocks)] + [
        ("--sweep", n) for n in (_ints("--sweep", args.sweep, 1) if args.sweep else ())
    ]:
        if n > room:
            raise ValueError(
                f"{option} {n}: the states come after {states_after} of the drafter's {layers} "
                f"blocks, so at most {room} can train (lower --states-after)"
            )
    return states_after


def _check_export(args, out: pathlib.Path, objectives, seeds) -> None:
    if args.export is None:
        if args.export_run is not None:
            raise ValueError("--export-run needs --export FOLDER")
        return
    export = args.export.resolve()
    if export.exists():
        raise ValueError(f"--export: {args.export} exists; choose a new folder")
    check_writable(args.export, "--export")
    if export == out.resolve() or out.resolve() in export.parents:
        raise ValueError(f"--export: {args.export} is inside --out {out}; choose a folder outside")
    runs = [f"{o.name}-seed{s}" for s in seeds for o in objectives]
    if args.export_run is not None and args.export_run not in runs:
        raise ValueError(f"--export-run: no run {args.export_run!r} in this command; choose from "
                         f"{', '.join(runs)}")  # fmt: skip
    if args.sweep is not None:
        raise ValueError("--export with --sweep: the sweep trains no run to export")


def run(args: argparse.Namespace) -> int:
    import dataclasses

    import jax.numpy as jnp

    from jaxcert import models as models_lib
    from jaxcert.cli._common import check_vocabularies, load_model, load_prompt_set
    from jaxcert.pipeline.store import fingerprint_path
    from jaxcert.training import finetune, finetune_recipe
    from jaxcert.training.head_recipe import decode_prompt_ids

    started = time.perf_counter()
    out: pathlib.Path = args.out
    # every option is checked before a model loads or anything is written
    objectives = _objectives(args.objectives, args.margin, args.weight)
    seeds = _ints("--seeds", args.seeds)
    sweep = None if args.sweep is None else _ints("--sweep", args.sweep, 1)
    _check_export(args, out, objectives, seeds)
    if args.speed_prompts is None:
        args.speed_prompts = min(8, args.decode_prompts)
    elif args.speed_prompts > args.decode_prompts:
        raise ValueError(
            f"--speed-prompts {args.speed_prompts}: times the first N of the "
            f"--decode-prompts {args.decode_prompts} decoded prompts; give at most "
            f"{args.decode_prompts}"
        )
    check_vocabularies(args.target, args.drafter)
    try:
        layers = models_lib.read_config(args.drafter).num_layers
    except ValueError as err:
        raise ValueError(f"--drafter: {err}") from None
    states_after = _check_blocks(args, layers)
    prompt_set = load_prompt_set(args.prompts, max_prompts=args.max_prompts)
    if not any(p.response for p in prompt_set):
        raise ValueError(
            f"--prompts: {args.prompts} has no replies to train on (finetune-drafter reads "
            "ShareGPT-style conversations: a human turn, then the assistant's reply)"
        )
    data_options = {
        "target": args.target, "drafter": args.drafter, "prompts": args.prompts,
        "max_prompts": args.max_prompts, "positions": args.positions,
        "heldout_sequences": args.heldout_sequences, "states_after": states_after,
    }  # fmt: skip
    # checked now, recorded with the weights' fingerprints once the data is known to suffice
    finetune_recipe.record_options(out, data_options, record=False)
    log(f"loading the target {args.target} (float32)")
    target = load_model("--target", args.target, dtype=jnp.float32)
    log(f"loading the drafter {args.drafter} (float32)")
    drafter = load_model("--drafter", args.drafter, dtype=jnp.float32)
    try:
        models_lib.check_same_vocabulary(target, drafter)
    except ValueError as err:
        raise ValueError(f"--drafter: {err}") from None
    settings = finetune_recipe.RecipeSettings(
        positions=args.positions, heldout=args.heldout_sequences, states_after=states_after
    )
    fingerprints = {"target_sha256": fingerprint_path(target.path),
                    "drafter_sha256": fingerprint_path(drafter.path)}  # fmt: skip
    store, heldout = finetune_recipe.write_records(
        target, prompt_set, settings, out, options=data_options | fingerprints, log=log
    )
    del target  # not needed again until the decoder runs: its ~6 GB back for training
    gc.collect()
    states, held_states = finetune_recipe.write_states(
        drafter.model, args.drafter, store, heldout, settings, out, log=log
    )
    data = finetune_recipe.Data.load(store, heldout, states, held_states)
    steps = args.train_steps or -(-store.sequences // args.batch_size)  # one pass
    ft = finetune.FinetuneSettings(
        trained_blocks=args.trained_blocks,
        train_lm_head=args.train_lm_head,
        steps=steps,
        batch_size=args.batch_size,
        learning_rate=args.learning_rate,
    )
    settings = dataclasses.replace(settings, finetune=ft, seeds=seeds)
    if sweep is not None:
        rows = finetune_recipe.sweep_blocks(
            drafter.model, data, sweep, settings, args.sweep_steps, out, log=log
        )
        from jaxcert.base.tables import markdown_table

        table = markdown_table(rows)
        (out / "sweep.md").write_text(table + "\n")
        record = json.dumps({"command": " ".join(sys.argv), "rows": rows}, indent=1)
        (out / "sweep.json").write_text(record + "\n")
        print(table)
        return 0
    log(f"{len(objectives)} objectives x {len(seeds)} seeds, {steps} steps of "
        f"{args.batch_size} sequences, top {args.trained_blocks} blocks"
        + (" and the lm_head" if args.train_lm_head else ""))  # fmt: skip
    runs = finetune_recipe.train_runs(drafter.model, data, objectives, settings, out, log=log)
    untrained_folder = out / "untrained"
    untrained_folder.mkdir(exist_ok=True)
    untrained = finetune_recipe.heldout_figures(
        drafter.model, None, data, ft.trained_blocks, untrained_folder / "heldout.json"
    )
    models = {"untrained": drafter.model}
    folders = {"untrained": untrained_folder}
    for r in runs:
        name = pathlib.Path(r["folder"]).name
        folders[name] = pathlib.Path(r["folder"])
        models[name] = finetune.merged_drafter(
            drafter.model, r["trainable"], trained_blocks=ft.trained_blocks
        )
    decoded: dict = {}
    speed: dict = {}
    if args.decode_prompts:
        log(f"loading the target {args.target} again (float32) for the decoder")
        target = load_model("--target", args.target, dtype=jnp.float32)
        prompt_ids = decode_prompt_ids(target, args.decode_source, args.decode_prompts)
        decoded = finetune_recipe.decode_runs(
            target, models, prompt_ids, folders, tokens=args.decode_tokens, log=log
        )
        if args.speed_seeds and args.speed_prompts:
            timed = {
                n: m
                for n, m in models.items()
                if n == "untrained" or int(n.rsplit("seed", 1)[1]) in seeds[: args.speed_seeds]
            }
            speed = finetune_recipe.speed_runs(
                target,
                timed,
                prompt_ids[: args.speed_prompts],
                out / "speed.json",
                tokens=args.decode_tokens,
                log=log,
            )
    summary = finetune_recipe.summarize(runs, untrained, decoded)
    run_seeds = sorted({r["seed"] for r in runs})
    per_seed = {
        str(seed): finetune_recipe.summarize(
            [r for r in runs if r["seed"] == seed], untrained, decoded
        )["objectives"]
        for seed in run_seeds
    }
    summary |= {
        "per_seed": per_seed,
        "command": " ".join(sys.argv),
        "settings": dataclasses.asdict(settings),
        "training_positions": store.positions,
        "training_sequences": store.sequences,
        "heldout_positions": heldout.positions,
        "speed_batch1": speed,
        "curves": {pathlib.Path(r["folder"]).name: r["curve"] for r in runs},
        "active": {
            pathlib.Path(r["folder"]).name: [
                {"step": h["step"], "active": h["active"]} for h in r["history"]
            ]
            for r in runs
        },
        "seconds": round(time.perf_counter() - started, 1),
    }
    (out / "results.json").write_text(json.dumps(summary, indent=1, default=float) + "\n")
    heldout_metrics = ["kl", "tv", "agreement", "accepted:tree:4", "certified:greedy",
                       "certified:tree:4", "near:greedy"]  # fmt: skip
    decode_metrics = [c for c, _, _ in finetune_recipe.DECODE_CONFIGS]
    tables = [
        "Held-out (per conversation), Δ against kl:",
        finetune_recipe.results_table(summary, heldout_metrics, "kl"),
        "Held-out, Δ against the untrained drafter:",
        finetune_recipe.results_table(summary, heldout_metrics, "untrained"),
    ]
    if decoded:
        tables += [
            "Tokens per round (per prompt), Δ against kl:",
            finetune_recipe.results_table(summary, decode_metrics, "kl"),
            "Tokens per round, Δ against the untrained drafter:",
            finetune_recipe.results_table(summary, decode_metrics, "untrained"),
        ]
    if len(per_seed) > 1:
        seed_metrics = ["kl", "certified:greedy", "certified:tree:4"]
        seed_metrics += decode_metrics[:2] if decoded else []
        for seed, objectives in per_seed.items():
            tables += [
                f"Seed {seed} alone, Δ against its kl:",
                finetune_recipe.results_table({"objectives": objectives}, seed_metrics, "kl"),
            ]
    if speed:
        tables += ["Batch 1, T = 0 (cert:0.55), tokens/s:", _speed_table(speed)]
    text = "\n\n".join(tables)
    (out / "results.md").write_text(text + "\n")
    finetune_recipe.plot_curves(runs, out / "learning_curves.png")
    print(text)
    if args.export is not None:
        _export(args, summary, drafter, models, out, seeds)
    return 0


def _speed_table(speed: dict) -> str:
    """Markdown: each method's tokens/s and its ratio to target-only, to the untrained
    drafter and to ``kl`` of the same seed, with 95% bootstrap intervals over the prompts."""
    from jaxcert.training.finetune_recipe import relative_speed

    def ratio(method: str, base: str) -> str:
        if base not in speed or method in (base, "target-only"):
            return "-"
        r, low, high = relative_speed(speed[method], speed[base])
        if math.isnan(low):  # one prompt: no interval
            return f"{r:.3f}"
        return f"{r:.3f} [{low:.3f}, {high:.3f}]"

    rows = [
        "| method | tokens/s | vs target-only | vs untrained | vs kl | same output as target |",
        "|---|---|---|---|---|---|",
    ]
    for m, r in speed.items():
        kl = "kl-seed" + m.rsplit("-seed", 1)[1] if "-seed" in m else ""
        rows.append(
            f"| {m} | {r['tokens_per_s']:.2f} | {ratio(m, 'target-only')} | "
            f"{ratio(m, 'untrained')} | {ratio(m, kl)} | {r['same_as_target']}/"
            f"{len(r['per_prompt_tokens'])} |"
        )
    return "\n".join(rows)


def _export(args, summary, drafter, models, out, seeds) -> None:
    import dataclasses

    from jaxcert.models.export import save_hf

    name = args.export_run
    if name is None:
        objectives = {k: v for k, v in summary["objectives"].items() if k != "untrained"}
        best = max(objectives, key=lambda k: objectives[k]["certified:greedy"][0])
        name = f"{best}-seed{seeds[0]}"
    if name not in models or name == "untrained":
        choices = ", ".join(n for n in models if n != "untrained")
        raise ValueError(f"--export-run: no run {name!r} here; choose from {choices}")
    loaded = dataclasses.replace(drafter, model=models[name], config=models[name].config)
    folder = save_hf(loaded, args.export, overwrite=False, keep=[out])
    log(f"wrote {name} as a Hugging Face folder: {folder}")
