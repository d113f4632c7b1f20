"""``jaxcert certify``: exact certificates of every rule at every greedy position of a model."""

from __future__ import annotations

import argparse
import csv
import json
import pathlib
import sys
import textwrap
import time

from jaxcert.cli import DEFAULT_RULES, DEFAULT_TARGET
from jaxcert.cli._common import (
    add_distributed_arguments,
    add_mesh_argument,
    add_prompt_arguments,
    load_model,
    load_prompt_set,
    rules_arg,
)
from jaxcert.cli.argtypes import non_negative, positive
from jaxcert.models import mesh as mesh_lib
from jaxcert.pipeline import distributed

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
  --out and send it to process 0 through JAX's coordination service at the end (no shared
  file system is needed). Process 0 merges the parts into positions.parquet (the
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
            "certificate C_p (nats) of every rule. Writes positions.parquet, summary tables "
            "and plots to --out.",
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
        help="write a shard at least this often (seconds; bounds what a kill loses; default 60)",
    )
    add_mesh_argument(p, "each batch of prompts is split over data")
    add_distributed_arguments(p)
    p.set_defaults(func=run)


def _write_csv(path: pathlib.Path, rows: list[dict]) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


_EXCHANGE = "certify/positions"


def _to_bytes(table, header: dict) -> bytes:
    import pyarrow as pa
    import pyarrow.parquet as pq

    sink = pa.BufferOutputStream()
    meta = {b"jaxcert": json.dumps(header, default=str).encode()}
    pq.write_table(table.replace_schema_metadata(meta), sink)
    return sink.getvalue().to_pybytes()


def _from_bytes(payload: bytes):
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pq.read_table(pa.BufferReader(payload))
    header = json.loads(table.schema.metadata[b"jaxcert"])
    return table.replace_schema_metadata(None), header


def _check_part(i: int, header: dict, fingerprint: dict) -> None:
    mine = json.loads(json.dumps(fingerprint, default=str))
    theirs = header["fingerprint"]
    if theirs != mine:
        differ = sorted(k for k in set(mine) | set(theirs) if mine.get(k) != theirs.get(k))
        raise ValueError(
            f"process {i} ran a different job than process 0 ({', '.join(differ)} differ); "
            "every process must run the same command"
        )


def _merged_info(infos: list[dict]) -> dict:
    """One ``info`` for the whole run: counts of the first part, sums of the work, the
    slowest process's timings, and every part's own ``info`` under ``processes``."""
    first = infos[0]
    keys = ("prompts_given", "prompts_used", "prompts_skipped_short", "prompts_skipped_long")
    info = {k: first[k] for k in keys}
    for key in ("positions", "prefill_tokens", "prefill_padded_tokens", "decode_slot_steps",
                "decode_active_steps"):  # fmt: skip
        info[key] = sum(i[key] for i in infos)
    for key in ("prefill_s", "decode_s", "compile_s"):
        info[key] = max(i[key] for i in infos)
    info["prompts_resumed"] = first.get("prompts_resumed", 0)
    info["processes"] = infos
    return info


_START = "certify/start"


class _Peers:
    """This process's side of the meetings of a multi-process run (no-ops for one process).

    Two meetings: at the start process 0 tells the others what is already done
    (:func:`jaxcert.pipeline.distributed.broadcast_bytes`), at the end the parts go to process 0
    (:func:`jaxcert.pipeline.distributed.exchange_bytes`), which announces the outcome
    (:func:`jaxcert.pipeline.distributed.announce_result`). A process that fails says so at
    once, exactly once, instead of leaving the others waiting.
    """

    def __init__(self, dist: distributed.Distributed):
        self.dist = dist
        self.single = dist.process_count == 1
        self.started = self.single or not dist.is_main  # process 0 has to send the start
        self.told = self.single

    def start(self, done: dict | None) -> dict:
        """Process 0 passes ``{"done": [...], "complete": bool}``; every process gets it."""
        if self.single:
            return done or {}
        self.started = True
        payload = None if done is None else json.dumps(done).encode()
        return json.loads(distributed.broadcast_bytes(_START, payload, self.dist))

    def send(self, payload: bytes) -> list | None:
        """Process 0: every process's part or :class:`ProcessFailed`; elsewhere ``None``
        once process 0 has merged them."""
        self.told = not self.dist.is_main  # process 0 still has to announce the outcome
        return distributed.exchange_bytes(_EXCHANGE, payload, self.dist)

    def done(self) -> None:
        if not self.told:
            self.told = True
            distributed.announce_result(_EXCHANGE, self.dist)

    def fail(self, err: BaseException) -> None:
        message = f"{type(err).__name__}: {err}"
        if not self.started:
            self.started = True
            distributed.fail_broadcast(_START, self.dist, message)
        if self.told:
            return
        self.told = True
        if self.dist.is_main:
            distributed.announce_result(_EXCHANGE, self.dist, error=message)
        else:
            distributed.exchange_bytes(_EXCHANGE, None, self.dist, error=message)


def run(args) -> int:
    # Before anything touches JAX's devices: join the other processes, if any.
    dist = distributed.initialize_distributed(
        args.coordinator,
        args.num_processes,
        args.process_id,
        auto=args.distributed,
        timeout_s=args.join_timeout,
    )
    peers = _Peers(dist)
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
        self.bar = None
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
        self.bar.set_postfix_str(f"{p.positions} positions, {rate:.1f} pos/s", refresh=False)
        self.bar.refresh()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _spelling(source: str) -> str:
    """A file or folder argument by its name alone (``./x``, ``/abs/x`` and another host's
    copy are one run: the content is fingerprinted beside it); a registry name as it is."""
    path = pathlib.Path(source)
    return path.resolve().name if path.exists() else source


def _prompts_digest(prompt_set) -> str:
    import hashlib

    h = hashlib.sha256()
    for p in prompt_set:
        h.update(json.dumps([p.id, p.text, p.category]).encode())
    return h.hexdigest()


def _run(args, dist: distributed.Distributed, peers: _Peers) -> int:
    import jax.numpy as jnp

    import jaxcert
    from jaxcert.core.rules import parse_rules
    from jaxcert.pipeline import engine as certify
    from jaxcert.pipeline import store as certify_store

    multi = dist.process_count > 1
    tag = f"[jaxcert {dist.process_index + 1}/{dist.process_count}]" if multi else "[jaxcert]"
    rules = parse_rules(args.rules)
    options = certify.CertifyOptions(
        steps=args.steps,
        batch_size=args.batch_size,
        min_prompt_tokens=args.min_prompt_tokens,
        max_prompt_tokens=args.max_prompt_tokens,
        stop_at_eos=not args.ignore_eos,
        chat=not args.no_chat,
        system_prompt=args.system_prompt,
    )
    device_mesh = mesh_lib.make_mesh(args.mesh)
    mesh = device_mesh if device_mesh.size > 1 else None  # one device: no placement at all
    out = args.out
    resume = args.resume
    if dist.is_main:  # before loading anything
        held = certify_store.check_output(out, resume=resume, overwrite=args.overwrite)
        if resume and not held:
            print(f"{tag} nothing saved in {out} yet: starting the run", file=sys.stderr)
            resume = False
    started = time.perf_counter()
    compile_cache = jaxcert.enable_compilation_cache()
    prompt_set = load_prompt_set(args.prompts, turn=args.turn, max_prompts=args.max_prompts)
    print(f"{tag} loading target {args.target} ...", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    dtype = jnp.bfloat16 if args.dtype == "bfloat16" else jnp.float32
    lm = load_model("--target", args.target, dtype=dtype, mesh=mesh)  # each weight onto its shards
    load_s = time.perf_counter() - t0
    print(
        f"{tag} target {lm.path.name}: {lm.config.num_layers} layers, "
        f"V={lm.config.vocab_size}, loaded in {load_s:.1f} s; {len(prompt_set)} prompts, "
        f"rules: {', '.join(r.spec for r in rules)}; mesh {mesh_lib.describe(device_mesh)}"
        + (f"; process {dist.process_index} of {dist.process_count}" if multi else ""),
        file=sys.stderr,
    )
    meta = {
        "command": " ".join(sys.argv),
        "target": str(lm.path),
        "prompts": args.prompts,
        "rules": [r.spec for r in rules],
        "options": vars(options) | {},
        "load_s": round(load_s, 2),
        "mesh": dict(device_mesh.shape),
        "compilation_cache": None if compile_cache is None else str(compile_cache),
    }
    if multi:
        meta["process_count"] = dist.process_count
    # What a resumed run, and every process of a multi-process run, must agree on. Not the
    # process count: a row's numbers do not depend on it (each part has the whole run's
    # shapes), so a run may be resumed with more or fewer processes.
    fingerprint = {
        "target": _spelling(args.target),
        "model_sha256": certify_store.fingerprint_path(lm.path),
        "dtype": args.dtype,
        "prompts": _spelling(args.prompts),
        "prompts_sha256": _prompts_digest(prompt_set),
        "turn": args.turn,
        "rules": meta["rules"],
        "options": meta["options"],
        "mesh": meta["mesh"],
        "jaxcert": jaxcert.__version__,
    }
    # Process 0 streams into --out and knows what is done; the others stream into a hidden
    # scratch folder of theirs, sent to process 0 at the end (no shared file system needed).
    scratch = out / f".process-{dist.process_index:05d}" if not dist.is_main else None
    writer = certify_store.ShardWriter(
        scratch or out,
        fingerprint,
        resume=resume and scratch is None,
        overwrite=args.overwrite or scratch is not None,
        shard_rows=args.shard_rows,
        shard_seconds=args.shard_seconds,
    )
    start = peers.start(
        {"done": sorted(writer.done_prompts), "complete": writer.resumed_status == "complete"}
        if dist.is_main
        else None
    )
    done = set(start.get("done", ()))
    desc = f"certify {dist.process_index + 1}/{dist.process_count}" if multi else "certify"
    display = _Display(desc)
    part = (dist.process_index, dist.process_count) if multi else None
    run = certify.Certifier(
        lm, prompt_set, rules, options, mesh=mesh, part=part, skip=done, progress=display
    )
    # The shards decide, not the manifest's word: a complete run missing a shard goes on.
    if start.get("complete") and run.usable <= done:
        return _already_complete(out, tag, dist, peers)
    if done:
        print(f"{tag} resuming: {len(done)} prompts already in {out}", file=sys.stderr)
    try:
        for table in run:
            writer.write(table)
    except BaseException as err:
        display.close()
        status = "interrupted" if isinstance(err, KeyboardInterrupt) else "failed"
        writer.close(status, error=f"{type(err).__name__}: {err}", info=run.info)
        if writer.rows_written and dist.is_main:  # everything computed is kept
            print(
                f"{tag} {status}; {writer.rows_written} positions of "
                f"{len(writer.done_prompts)} prompts are saved in {writer.out} (--resume "
                "continues)",
                file=sys.stderr,
            )
        raise
    display.close()
    info = run.info
    info["prompts_resumed"] = len(done)
    writer.close("running", info=info)  # "complete" only once every part is in
    if multi:
        info = _merge_parts(writer, fingerprint, info, scratch, dist, peers, tag)
        if info is None:  # not process 0: its part is merged
            return 0
    missing = sorted(run.usable - writer.done_prompts)
    if missing:  # every part arrived, yet prompts are missing: never call this complete
        writer.close("incomplete", info=info, missing_prompts=missing)
        raise ValueError(f"{len(missing)} prompts are missing from {out} after the merge")
    writer.close("complete", info=info)
    _write_report(args, out, info, meta, rules, options, started)
    peers.done()
    return 0


def _merge_parts(writer, fingerprint, info, scratch, dist, peers, tag) -> dict | None:
    """The end of a multi-process run: the parts go to process 0, which adds each one that
    arrived to the dataset. Returns the merged ``info`` on process 0 (``None`` elsewhere).

    Raises:
      ProcessFailed: on process 0, a process failed or sent nothing; its manifest then says
        ``incomplete`` with every part that did arrive, for ``--resume`` to finish.
    """
    import shutil

    from jaxcert.pipeline import store as certify_store

    payload = b""
    if writer.rows_written:  # a process may have had nothing left to do
        table = certify_store.read_positions(writer.out)
        payload = _to_bytes(table, {"fingerprint": fingerprint, "info": info})
        del table
    outcomes = peers.send(payload)
    if not dist.is_main:  # process 0 has merged the parts: this one is done
        shutil.rmtree(scratch, ignore_errors=True)
        print(
            f"{tag} {info['positions']} positions of {info['part']['prompts']} prompts "
            "sent to process 0, which wrote the tables",
            file=sys.stderr,
        )
        return None
    infos, failures = [info], []
    for i, outcome in enumerate(outcomes[1:], start=1):
        if isinstance(outcome, distributed.ProcessFailed):
            failures.append(str(outcome))
            continue
        if not outcome:
            continue
        table, header = _from_bytes(outcome)
        try:
            _check_part(i, header, fingerprint)
        except ValueError as err:  # its rows are not this run's: not merged
            failures.append(str(err))
            continue
        writer.add_shard(table)
        infos.append(header["info"])
    info = _merged_info(infos)
    if failures:
        writer.close("incomplete", info=info, error="; ".join(failures))
        raise distributed.ProcessFailed(
            f"{'; '.join(failures)}. {len(writer.done_prompts)} prompts are saved in "
            f"{writer.out} (manifest: incomplete); run again with --resume to certify the rest"
        )
    return info


def _already_complete(out, tag, dist, peers) -> int:
    """``--resume`` of a finished run: say so, show its summary, compute nothing."""
    peers.done()
    if dist.is_main:
        summary = out / "summary.md"
        print(f"{tag} {out} is already complete: nothing to resume", file=sys.stderr)
        if summary.exists():
            print(summary.read_text())
    return 0


def _write_report(args, out, info, meta, rules, options, started) -> None:
    from jaxcert.pipeline import engine as certify
    from jaxcert.pipeline import report as certify_report
    from jaxcert.pipeline import store as certify_store

    rule_cols = [certify.rule_column(r) for r in rules]
    stat_cols = ["top1", f"top{options.top}_coverage", "margin", "entropy"]
    # Only the numeric columns the summaries need (the rows stay on disk otherwise).
    table = certify_store.read_positions(out, [*stat_cols, *rule_cols])
    summary = certify_report.summarize_positions(table, stat_cols + rule_cols)
    runs = certify_report.run_lengths(table, rule_cols)
    _write_csv(out / "summary.csv", summary)
    _write_csv(out / "run_lengths.csv", runs)
    padded = info.get("prefill_padded_tokens", 0)
    text = (
        f"## Positions: {table.num_rows} ({info['prompts_used']} prompts x up to "
        f"{options.steps} greedy steps)\n\n{certify_report.markdown_table(summary)}\n\n"
        f"## Mean certified run length (positions) at uniform KL budget eps\n\n"
        f"{certify_report.markdown_table(runs, digits=2)}\n"
    )
    (out / "summary.md").write_text(text)
    if not args.no_plots:
        certify_report.plot_report(table, rule_cols, out)
    meta.update(info, status="ok", total_s=round(time.perf_counter() - started, 1))
    meta["positions_this_run"] = info.get("positions", 0)
    meta["positions"] = table.num_rows  # the whole dataset, resumed prompts included
    (out / "run.json").write_text(json.dumps(meta, indent=2, default=str))
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
        "summary.md/.csv, run_lengths.csv"
        f"{'' if args.no_plots else ', certificate_cdf.png, certificate_vs_margin.png'} "
        f"in {meta['total_s']} s",
        file=sys.stderr,
    )
