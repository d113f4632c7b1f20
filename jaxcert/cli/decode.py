"""``jaxcert decode``: speculative decoding with a target and a drafter, against the target.

Orchestration only; the summaries, tables and outputs are :mod:`jaxcert.decoding.run_report`'s.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import sys
import time

from jaxcert import mesh as mesh_lib
from jaxcert._argtypes import non_negative_float, positive, unit_float
from jaxcert.cli import DEFAULT_DECODE_TARGET, DEFAULT_DRAFTER
from jaxcert.cli._common import (
    add_prompt_arguments,
    load_model,
    load_prompt_set,
    policy_arg,
    verify_arg,
)

__all__ = ["add_parser", "run"]


def add_parser(sub) -> None:
    p = sub.add_parser(
        "decode",
        help="speculative decoding with a target and a drafter: speed, acceptance, certificates",
        description="Decode each prompt with the target alone and with speculative decoding "
        "(drafter + policy + verification rule), in the same run, and report throughput, "
        "speedup, acceptance and, per drafted position, KL(p||q) and the certificate C_p. "
        "Writes rounds.parquet, nodes.parquet, outputs.jsonl and summary.json to --out. "
        "With --mesh data=D,model=M each batch's rows are split over the D data devices "
        "(a batch is padded to a multiple of D with rows that are dropped) and the weights "
        "of both models over the M model devices; greedy outputs are identical to a "
        "one-device run.",
    )
    p.add_argument(
        "--target",
        default=DEFAULT_DECODE_TARGET,
        help=f"asset name, checkpoint folder or .gguf (default: {DEFAULT_DECODE_TARGET})",
    )
    p.add_argument(
        "--drafter",
        default=DEFAULT_DRAFTER,
        help=f"the same for the drafter (default: {DEFAULT_DRAFTER})",
    )
    add_prompt_arguments(p)
    p.add_argument(
        "--policy",
        type=policy_arg,
        default="svip:0.3",
        help="draft-length policy: constant:K | heuristic | confidence[:TAU] | "
        "svip[:H] | cert[:LAMBDA[:BETA]], optional /KMAX "
        "(default svip:0.3)",
    )
    p.add_argument(
        "--verify",
        type=verify_arg,
        default="greedy",
        help="[SHAPE+]RULE: greedy | additive:T | multiplicative:A | topk:K | typical "
        "| sample, SHAPE = tree:MxD | dyntree:MxDxN (default greedy)",
    )
    p.add_argument(
        "--temperature",
        type=non_negative_float,
        default=0.0,
        help="0 for greedy/relaxed rules; > 0 with 'sample' (default 0)",
    )
    p.add_argument("--top-p", type=unit_float, default=1.0, help="nucleus for sampling")
    p.add_argument("--max-new-tokens", type=positive, default=128, help="per prompt")
    p.add_argument(
        "--max-draft",
        type=positive,
        default=None,
        help="deepest chain (default: the policy's cap, 40 if dynamic)",
    )
    p.add_argument("--batch-size", type=positive, default=1, help="prompts decoded together")
    p.add_argument("--max-prompts", type=positive, default=4, help="first N prompts (default 4)")
    p.add_argument("--seed", type=int, default=0, help="PRNG seed (sampling)")
    p.add_argument("--no-baseline", action="store_true", help="skip the target-only run")
    p.add_argument(
        "--no-certificates",
        action="store_true",
        help="skip the per-node certificates (KL is still recorded)",
    )
    p.add_argument(
        "--out",
        type=pathlib.Path,
        default=pathlib.Path("jaxcert-out/decode"),
        help="output folder (default jaxcert-out/decode)",
    )
    mesh_lib.add_mesh_argument(p, "batch rows over data, both models' weights over model")
    p.set_defaults(func=run)


def run(args) -> int:
    import jax
    from tqdm import tqdm

    import jaxcert
    from jaxcert import decoding, prompts
    from jaxcert.decoding import run_report

    policy = decoding.parse_policy(args.policy)
    verification = decoding.parse_verify(args.verify)
    max_draft = args.max_draft or policy.k_max
    config = decoding.DecodeConfig(
        verification=verification,
        max_new_tokens=args.max_new_tokens,
        max_draft=max_draft,
        temperature=args.temperature,
        top_p=args.top_p,
        collect_stats=not args.no_certificates,
    )  # validates temperature against the rule before anything is loaded
    device_mesh = mesh_lib.make_mesh(args.mesh)
    mesh = device_mesh if device_mesh.size > 1 else None  # one device: no placement at all
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    cache_dir = jaxcert.enable_compilation_cache()  # a rerun on this machine compiles nothing
    prompt_set = load_prompt_set(args.prompts, turn=args.turn, max_prompts=args.max_prompts)
    t0 = time.perf_counter()
    target = load_model("--target", args.target, mesh=mesh)  # each weight onto its shards
    drafter = load_model("--drafter", args.drafter, mesh=mesh)
    decoding.check_pair(target, drafter)
    load_s = time.perf_counter() - t0
    config = dataclasses.replace(config, eos_ids=target.eos_ids)
    encoded = prompts.encode_prompts(
        target.tokenizer, prompt_set, chat=not args.no_chat, system_prompt=args.system_prompt
    )
    short = [p.id for p, e in zip(prompt_set, encoded, strict=True) if len(e) < 2]
    if short:  # checked before anything is decoded
        raise ValueError(
            f"prompts {short} encode to fewer than 2 tokens; speculative decoding needs 2"
        )
    width = decoding.bucket(max(len(e) for e in encoded))  # one program for every batch
    print(
        f"[jaxcert] target {target.path.name} ({target.config.num_layers} layers), drafter "
        f"{drafter.path.name} ({drafter.config.num_layers} layers), V={target.config.vocab_size},"
        f" loaded in {load_s:.1f} s; {len(encoded)} prompts; policy {policy.spec}, verify "
        f"{verification.spec}, T={args.temperature}; mesh {mesh_lib.describe(device_mesh)}",
        file=sys.stderr,
    )
    key = jax.random.key(args.seed)
    total = len(encoded) * args.max_new_tokens * (1 if args.no_baseline else 2)
    bar = tqdm(total=total, unit="tok", desc="decode", file=sys.stderr, dynamic_ncols=True)
    compiled_before = decoding.compilations()

    def compiling(name):  # the bar says so while XLA compiles (minutes for a large model)
        bar.set_description(f"compiling {name}")

    runs = {"target": [], "speculative": []}
    ids = [p.id for p in prompt_set]
    for start in range(0, len(encoded), args.batch_size):
        batch = encoded[start : start + args.batch_size]
        key, k1, k2 = jax.random.split(key, 3)
        done = bar.n
        tick = lambda n, done=done: bar.update(done + n - bar.n)  # noqa: E731
        if not args.no_baseline:
            runs["target"].append(
                decoding.target_decode(
                    target,
                    batch,
                    max_new_tokens=args.max_new_tokens,
                    temperature=args.temperature,
                    top_p=args.top_p,
                    eos_ids=config.eos_ids,
                    key=k1,
                    prompt_width=width,
                    progress=tick,
                    on_compile=compiling,
                )
            )
            bar.set_description("decode")
            done = bar.n = done + len(batch) * args.max_new_tokens
            tick = lambda n, done=done: bar.update(done + n - bar.n)  # noqa: E731
        runs["speculative"].append(
            decoding.speculative_decode(
                target,
                drafter,
                batch,
                policy=policy,
                config=config,
                key=k2,
                prompt_width=width,
                progress=tick,
                on_compile=compiling,
            )
        )
        bar.set_description("decode")
        bar.n = done + len(batch) * args.max_new_tokens
        bar.refresh()
    bar.close()
    summary = run_report.summarize_runs(runs)
    run_report.write_tables(out, runs["speculative"], ids, args.batch_size)
    run_report.write_outputs(out / "outputs.jsonl", runs, ids, target.tokenizer.decode)
    meta = {
        "command": " ".join(sys.argv),
        "target": str(target.path),
        "drafter": str(drafter.path),
        "prompts": args.prompts,
        "policy": policy.spec,
        "verify": verification.spec,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "max_new_tokens": args.max_new_tokens,
        "max_draft": max_draft,
        "batch_size": args.batch_size,
        "mesh": dict(device_mesh.shape),
        "seed": args.seed,
        "load_s": round(load_s, 2),
        "compile_s": round(sum(r.compile_s for rs in runs.values() for r in rs), 1),
        "programs_compiled": decoding.compilations() - compiled_before,
        "compilation_cache": str(cache_dir) if cache_dir else None,
        "total_s": round(time.perf_counter() - started, 1),
    }
    (out / "summary.json").write_text(json.dumps(meta | summary, indent=2, default=str))
    print(run_report.markdown_summary(summary))
    print(
        f"[jaxcert] wrote {out}/rounds.parquet, nodes.parquet, outputs.jsonl, summary.json",
        file=sys.stderr,
    )
    return 0
