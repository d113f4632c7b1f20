"""``jaxcert certify``: exact certificates of every rule at every greedy position of a model."""

from __future__ import annotations

import argparse
import pathlib
import sys
import textwrap
import time
from typing import TYPE_CHECKING

from jaxcert.base.tables import counted
from jaxcert.cli import DEFAULT_RULES, DEFAULT_TARGET
from jaxcert.cli._common import (
    add_distributed_arguments,
    add_mesh_argument,
    add_prompt_arguments,
    check_vocabularies,
    load_drafter,
    load_model,
    load_prompt_set,
    rules_arg,
    warn_undefined_drafter,
)
from jaxcert.cli.argtypes import non_negative, positive
from jaxcert.models import mesh as mesh_lib
from jaxcert.pipeline import distributed

if TYPE_CHECKING:
    from tqdm import tqdm

__all__ = ["add_parser", "run"]

_SCALING = """
scaling out:
  --mesh data=D,model=M spreads each process's work over its local devices: every batch of
  prompts is split over the D data devices (the batch size is rounded up to a multiple of
  D) and the weights over the M model devices (tensor parallelism; M = 1: replicated). The
  default puts every local device on data. With M = 1 each row's numbers are bit-identical
  to a one-device run whose --batch-size is the rows per device, and equal to float32
  rounding to any other one-device run; M > 1 changes summation orders (float32 rounding
  too). The greedy tokens are the same.

  Several processes (hosts, nodes, or CPU processes on one machine) split the prompts:
  each certifies its share (the prompts left to do, sorted by length, dealt round-robin)
  on its own devices, with the shapes of a one-process run. Process 0 streams its share
  into --out; the others stream theirs into a hidden .process-IIIII folder of their own
  --out and send it to process 0 at the end, over TCP (a small store process 0 serves; no
  shared file system is needed). Process 0 merges the parts into positions.parquet (the
  one-process table, row for row); the manifest says "complete" only once every prompt is
  in it. If a process fails, the others exit with an error naming it, and process 0's
  manifest says "incomplete" with what it holds: --resume (with one process or several)
  certifies the rest. Processes first meet on the coordinator's address: one that does
  not come within --join-timeout seconds is an error. Every process runs the same command:

    TPU pod (run on every host):   jaxcert certify --distributed ...
    SLURM, one task per node:      srun --ntasks-per-node=1 jaxcert certify --distributed ...
    anything else (ssh, localhost; process 0 listens on PORT of HOST):
      jaxcert certify --coordinator HOST:PORT --num-processes N --process-id I ...
      (or JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID in the environment)

  --distributed lets jax.distributed.initialize() detect the cluster (Cloud TPU, SLURM,
  Open MPI). On GPU clusters run one process per node (each drives its node's GPUs) or one
  per GPU (CUDA_VISIBLE_DEVICES or JAX_LOCAL_DEVICE_IDS). CPU processes use gloo.
"""


def add_parser(sub) -> None:
    p = sub.add_parser(
        "certify",
        help="exact certificates of every rule at every greedy position of a real model",
        description=textwrap.fill(
            "Greedy-decode each prompt with the target and record, per position, the "
            "target's top-1 probability, top-10 coverage, margin, entropy and the exact "
            "certificate C_p (nats) of every rule. Writes positions.parquet/ (Parquet "
            "shards) and manifest.json as it goes (the first shard once the first prompt is "
            "finished), then summary.md, summary.csv, "
            "run_lengths.csv, run.json and the plots certificate_cdf.png and "
            "certificate_vs_margin.png (unless --no-plots) to --out. With --drafter, a "
            "language model or a draft head reads the same tokens and every position also "
            "gets its KL(p||q) "
            "(nats), TV, and per rule whether it is certified (KL < C_p) and whether the "
            "rule accepts its proposal; the summary gives both fractions per rule, plus "
            "drafter.csv and the plot kl_vs_certificate.png.",
            width=90,
        ),
        epilog=_SCALING,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--target",
        default=DEFAULT_TARGET,
        help="asset name, Hugging Face checkpoint folder or .gguf file "
        f"(default: {DEFAULT_TARGET})",
    )
    p.add_argument(
        "--drafter",
        default=None,
        help="a drafter to certify against the target: a language model of its vocabulary "
        "(an asset name, a Hugging Face checkpoint folder or a .gguf file) or a draft head "
        "of the target (a jaxcert head folder, or an EAGLE-3 / speculators folder), as "
        "jaxcert decode --drafter takes them (default: none). It reads each prompt and the "
        "target's greedy continuation (teacher-forced); a head reads each token with the "
        "target's states at the position before it, as the decoder drafts",
    )
    add_prompt_arguments(p)
    p.add_argument(
        "--rules",
        type=rules_arg,
        default=DEFAULT_RULES,
        help=f"comma-separated rules (default: {DEFAULT_RULES}); tree+relaxed is "
        "written tree:4+additive:0.3",
    )
    p.add_argument(
        "--steps",
        type=positive,
        default=128,
        help="greedy continuation length per prompt (default 128)",
    )
    p.add_argument(
        "--max-prompts",
        type=positive,
        default=None,
        help="use only the first N prompts (default: all)",
    )
    p.add_argument(
        "--min-prompt-tokens",
        type=non_negative,
        default=0,
        help="skip prompts shorter than this after the chat template (default 0)",
    )
    p.add_argument(
        "--max-prompt-tokens",
        type=positive,
        default=None,
        help="skip prompts longer than this after the chat template (default: none; every "
        "decoding step attends over the longest prompt kept)",
    )
    p.add_argument("--batch-size", type=positive, default=8, help="decoding slots")
    p.add_argument(
        "--ignore-eos",
        action="store_true",
        help="keep recording after the end-of-turn token",
    )
    p.add_argument(
        "--dtype",
        choices=("float32", "bfloat16"),
        default="float32",
        help="model weights and compute dtype (default float32). With bfloat16 the logits "
        "are still float32 and every certificate is computed in float32, but bf16 rounding "
        "inside the model depends on the batch shape: the same prompt's logits (and so its "
        "certificates) can differ with --batch-size; use float32 for reproducible figures",
    )
    p.add_argument(
        "--out",
        type=pathlib.Path,
        default=pathlib.Path("jaxcert-out/certify"),
        help="output folder (default jaxcert-out/certify)",
    )
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    group = p.add_mutually_exclusive_group()
    group.add_argument(
        "--resume",
        action="store_true",
        help="continue the interrupted, failed or incomplete run in --out (same options, any "
        "number of processes); finished prompts are not recomputed; with nothing saved yet, "
        "start the run",
    )
    group.add_argument(
        "--overwrite",
        action="store_true",
        help="replace the run already in --out (without it, an existing run is refused)",
    )
    p.add_argument(
        "--shard-rows",
        type=positive,
        default=65_536,
        help="positions per Parquet shard of the streamed output (default 65536)",
    )
    p.add_argument(
        "--shard-seconds",
        type=positive,
        default=60,
        help="write a shard at least this often (seconds; default 60). The first shard is "
        "written as soon as the first prompt is finished, then one whenever --shard-rows "
        "positions or --shard-seconds have accumulated, so a kill (even kill -9) loses at "
        "most the prompts finished since the last shard; --resume continues from there",
    )
    add_mesh_argument(p, "each batch of prompts is split over data")
    add_distributed_arguments(p)
    p.set_defaults(func=run)


def run(args) -> int:
    # Before anything touches JAX's devices: join the other processes, if any.
    dist = distributed.initialize_distributed(
        args.coordinator,
        args.num_processes,
        args.process_id,
        auto=args.distributed,
        timeout_s=args.join_timeout,
    )
    peers = distributed.Peers(dist)
    try:
        return _run(args, dist, peers)
    except BaseException as err:
        peers.fail(err)
        if isinstance(err, distributed.ProcessFailed):  # another process's failure
            print(f"jaxcert certify: error: {err}", file=sys.stderr)
            return 2
        raise


class _Display:
    """The run's one progress bar: prompts done, positions/s, stage and ETA (created at the
    first report, so a run that fails or has nothing to do shows no empty bar)."""

    def __init__(self, desc: str):
        self.bar: tqdm | None = None
        self.desc = desc
        self.started: float | None = None

    def __call__(self, p) -> None:
        from tqdm import tqdm

        if self.bar is None:
            self.bar = tqdm(total=p.prompts_total, unit="prompt", desc=self.desc,
                            file=sys.stderr, dynamic_ncols=True)  # fmt: skip
        now = time.perf_counter()
        if self.started is None and p.stage != "compile":
            self.started = now
        rate = p.positions / (now - self.started) if self.started and now > self.started else 0.0
        self.bar.total = p.prompts_total
        self.bar.n = p.prompts_done
        stage = {"compile": "compiling (cached for later runs)"}.get(p.stage, p.stage)
        self.bar.set_description(f"{self.desc} [{stage}]", refresh=False)
        self.bar.set_postfix_str(f"{counted(p.positions, 'position')}, {rate:.1f} pos/s",
                                 refresh=False)  # fmt: skip
        self.bar.refresh()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _options(args):
    from jaxcert.pipeline import engine

    return engine.CertifyOptions(
        steps=args.steps,
        batch_size=args.batch_size,
        min_prompt_tokens=args.min_prompt_tokens,
        max_prompt_tokens=args.max_prompt_tokens,
        stop_at_eos=not args.ignore_eos,
        chat=not args.no_chat,
        system_prompt=args.system_prompt,
    )


def _run(args, dist: distributed.Distributed, peers: distributed.Peers) -> int:
    import jaxcert
    from jaxcert.core.rules import parse_rules
    from jaxcert.pipeline import engine
    from jaxcert.pipeline import report as certify_report
    from jaxcert.pipeline import store as certify_store

    multi = dist.process_count > 1
    where = f" {dist.process_index + 1}/{dist.process_count}" if multi else ""
    tag = f"[jaxcert{where}]"
    rules, options = parse_rules(args.rules), _options(args)
    device_mesh = mesh_lib.make_mesh(args.mesh)
    mesh = device_mesh if device_mesh.size > 1 else None  # one device: no placement at all
    if args.drafter is not None:
        _check_drafter(args)  # from the configs: no weights read yet
    resume = _check_output(args, dist, tag)  # before loading anything
    started = time.perf_counter()
    prompt_set = load_prompt_set(args.prompts, turn=args.turn, max_prompts=args.max_prompts)
    # The fingerprint needs the checkpoint's files, not its weights: a resumed run with other
    # options is refused, and a complete one reported, before the model is loaded.
    fingerprint = _fingerprint(args, prompt_set, rules, options, device_mesh)
    writer = peers.writer(
        args.out, fingerprint, resume=resume, overwrite=args.overwrite,
        shard_rows=args.shard_rows, shard_seconds=args.shard_seconds,
    )  # fmt: skip
    done, complete = peers.agree(writer)
    if complete:  # its shards hold every prompt its manifest lists (the shards decide)
        return _already_complete(args.out, tag, dist, peers)
    compile_cache = jaxcert.enable_compilation_cache()
    lm, drafter, load_s = _load(args, mesh, tag)
    meta = _meta(args, lm, drafter, rules, options, load_s, device_mesh, compile_cache, dist)
    _say_loaded(tag, lm, drafter, prompt_set, load_s, meta, device_mesh, dist)
    display = _Display(f"certify{where}")
    part = (dist.process_index, dist.process_count) if multi else None
    run = engine.Certifier(
        lm, prompt_set, rules, options, drafter=drafter, mesh=mesh, part=part, skip=done,
        progress=display,
    )  # fmt: skip
    if done:
        print(f"{tag} resuming: {counted(len(done), 'prompt')} already in {args.out}",
              file=sys.stderr)  # fmt: skip
    print(f"{tag} compiling the certificate programs first (about a minute for a large model "
          "on the first run; cached for later runs) ...", file=sys.stderr, flush=True)  # fmt: skip
    info = _certify(run, writer, display, dist, tag) | {"prompts_resumed": len(done)}
    writer.close("running", info=info)  # "complete" only once every part is in
    if multi:
        merged = peers.merge(writer, fingerprint, info)
        if merged is None:  # not process 0: its part is merged
            print(f"{tag} {counted(run.info['positions'], 'position')} of "
                  f"{counted(len(run.order), 'prompt')} sent "
                  "to process 0, which wrote the tables", file=sys.stderr)  # fmt: skip
            return 0
        info = merged
    certify_store.finish(writer, run.usable, info)
    text = certify_report.write_report(
        args.out, info, meta, rules, options, started=started, plots=not args.no_plots,
        drafter=None if drafter is None else drafter.path.name,
    )  # fmt: skip
    _print_report(text, info, meta, args)
    undefined = meta.get("drafter_summary", {}).get("kl_undefined", 0)
    warn_undefined_drafter(undefined, meta["positions"])
    peers.done()
    return 0


def _check_output(args, dist, tag) -> bool:
    """Whether to resume: ``--resume`` of a run with nothing saved yet starts it afresh."""
    from jaxcert.pipeline import store as certify_store

    if not dist.is_main:  # process 0 alone owns --out
        return args.resume
    held = certify_store.check_output(args.out, resume=args.resume, overwrite=args.overwrite)
    if args.resume and not held:
        print(f"{tag} nothing saved in {args.out} yet: starting the run", file=sys.stderr)
        return False
    return args.resume


def _check_drafter(args) -> None:
    """Refuses a ``--drafter`` that is no language model of the target's vocabulary nor a
    draft head of the target, from the configs alone (before anything is written or
    loaded)."""
    from jaxcert import models
    from jaxcert.decoding.ngram import parse_ngram
    from jaxcert.models import eagle

    try:
        lookup = parse_ngram(str(args.drafter)) is not None
    except ValueError:  # ngram with a bad spelling: prompt lookup all the same
        lookup = True
    if lookup:
        raise ValueError(
            f"--drafter {args.drafter}: prompt lookup proposes tokens without a distribution "
            "(no KL to certify); give a language model or a draft head"
        )
    try:
        check_vocabularies(args.target, args.drafter)
    except ValueError as err:  # a mismatch is the drafter's fault; the rest names its option
        raise ValueError(str(err) if str(err).startswith("--") else f"--drafter: {err}") from None
    # A jaxcert head records its target; an EAGLE-3 folder's head is checked when it is read
    # against the loaded target (`load_drafter`).
    if eagle.is_head_folder(args.drafter):
        try:
            recorded = eagle.read_head_config(args.drafter)
            eagle.check_head_target(recorded, models.read_config(args.target))
        except ValueError as err:
            raise ValueError(f"--drafter: {err}") from None


def _load(args, mesh, tag):
    """``(lm, drafter, load_s)``: the target, the drafter (or ``None``) and their load time."""
    import jax.numpy as jnp

    from jaxcert.pipeline import engine

    both = "" if args.drafter is None else f" and drafter {args.drafter}"
    print(f"{tag} loading target {args.target}{both} ...", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    dtype = jnp.bfloat16 if args.dtype == "bfloat16" else jnp.float32
    lm = load_model("--target", args.target, dtype=dtype, mesh=mesh)  # each weight onto its shards
    drafter = None
    if args.drafter is not None:  # a language model, or a head (in its own dtype)
        drafter = load_drafter(args.drafter, lm, dtype=dtype, mesh=mesh)
        try:
            engine.check_drafter(lm, drafter)  # the tokenizers too, now that they are loaded
        except ValueError as err:
            raise ValueError(f"--drafter: {err}") from None
    return lm, drafter, time.perf_counter() - t0


def _say_loaded(tag, lm, drafter, prompt_set, load_s, meta, device_mesh, dist) -> None:
    print(
        f"{tag} target {lm.path.name}: {counted(lm.config.num_layers, 'layer')}, "
        + ("" if drafter is None else
           f"drafter {drafter.path.name}: {counted(drafter.config.num_layers, 'layer')}, ")
        + f"V={lm.config.vocab_size}, loaded in {load_s:.1f} s; "
        f"{counted(len(prompt_set), 'prompt')}, "
        f"rules: {', '.join(meta['rules'])}; mesh {mesh_lib.describe(device_mesh)}"
        + (f"; process {dist.process_index} of {dist.process_count}"
           if dist.process_count > 1 else ""),
        file=sys.stderr,
    )  # fmt: skip


def _fingerprint(args, prompt_set, rules, options, device_mesh) -> dict:
    """What a resumed run and every process must agree on
    (:func:`jaxcert.pipeline.store.run_fingerprint`), from the checkpoint's files (no
    weights are loaded; an asset is fetched, as loading it would)."""
    import jaxcert
    from jaxcert import models
    from jaxcert.pipeline import store as certify_store

    paths = {}
    for option, name in (("--target", args.target), ("--drafter", args.drafter)):
        if name is not None:
            try:
                paths[option] = models.model_path(name)
            except ValueError as err:
                raise ValueError(f"{option}: {err}") from None
    # A run without a drafter keeps the fingerprint it always had (its runs still resume).
    drafter = {} if args.drafter is None else certify_store.drafter_fingerprint(
        args.drafter, paths["--drafter"]
    )  # fmt: skip
    return certify_store.run_fingerprint(
        target=args.target, model_path=paths["--target"], dtype=args.dtype,
        prompts=args.prompts, prompt_set=prompt_set, turn=args.turn,
        rules=[r.spec for r in rules], options=vars(options) | {},
        mesh=dict(device_mesh.shape), jaxcert=jaxcert.__version__, **drafter,
    )  # fmt: skip


def _meta(args, lm, drafter, rules, options, load_s, device_mesh, compile_cache, dist) -> dict:
    """What run.json records besides the run's ``info``."""
    meta = {
        "command": " ".join(sys.argv),
        "target": str(lm.path),
        "drafter": None if drafter is None else str(drafter.path),
        "prompts": args.prompts,
        "rules": [r.spec for r in rules],
        "options": vars(options) | {},
        "load_s": round(load_s, 2),
        "mesh": dict(device_mesh.shape),
        "compilation_cache": None if compile_cache is None else str(compile_cache),
    }
    if dist.process_count > 1:
        meta["process_count"] = dist.process_count
    return meta


def _certify(run, writer, display: _Display, dist, tag) -> dict:
    """Streams the run into ``writer``; returns its ``info``. On a failure or an interrupt
    the manifest says so and what was computed is kept (``--resume`` continues)."""
    from jaxcert.pipeline import store as certify_store

    try:
        certify_store.write_all(writer, run)
    except BaseException as err:
        display.close()
        if writer.rows_written and dist.is_main:  # everything computed is kept
            status = "interrupted" if isinstance(err, KeyboardInterrupt) else "failed"
            print(
                f"{tag} {status}; {counted(writer.rows_written, 'position')} of "
                f"{counted(len(writer.done_prompts), 'prompt')} "
                f"{'is' if len(writer.done_prompts) == 1 else 'are'} saved in {writer.out} "
                "(--resume continues)",
                file=sys.stderr,
            )
        raise
    display.close()
    return run.info


def _already_complete(out, tag, dist, peers) -> int:
    """``--resume`` of a finished run: say so, show its summary, compute nothing."""
    peers.done()
    if dist.is_main:
        summary = out / "summary.md"
        print(f"{tag} {out} is already complete: nothing to resume", file=sys.stderr)
        if summary.exists():
            print(summary.read_text())
    return 0


def _print_report(text: str, info: dict, meta: dict, args) -> None:
    out, padded = args.out, info.get("prefill_padded_tokens", 0)
    print(text)
    print(
        "[jaxcert] prefill padding "
        + (f"{1 - info.get('prefill_tokens', 0) / padded:.1%}, " if padded else "n/a, ")
        + f"compile {info.get('compile_s', 0):.1f} s, prefill {info.get('prefill_s', 0):.1f} s, "
        f"decode {info.get('decode_s', 0):.1f} s",
        file=sys.stderr,
    )
    print(
        f"[jaxcert] wrote {out}/positions.parquet/ (Parquet shards), manifest.json, "
        "summary.md/.csv, run_lengths.csv, run.json"
        f"{'' if args.drafter is None else ', drafter.csv'}"
        f"{'' if args.no_plots else ', certificate_cdf.png, certificate_vs_margin.png'}"
        f"{'' if args.no_plots or args.drafter is None else ', kl_vs_certificate.png'} "
        f"in {meta['total_s']} s",
        file=sys.stderr,
    )
