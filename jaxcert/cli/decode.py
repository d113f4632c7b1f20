"""``jaxcert decode``: speculative decoding with a target and a drafter, against the target.

Orchestration only; the summaries, tables and outputs are :mod:`jaxcert.decoding.run_report`'s.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import sys
import time
from collections.abc import Callable
from typing import Any

from jaxcert.base.tables import counted
from jaxcert.cli import DEFAULT_DECODE_TARGET, DEFAULT_DRAFTER
from jaxcert.cli._common import (
    add_mesh_argument,
    add_prompt_arguments,
    check_vocabularies,
    clamp_kls,
    describe_drafter,
    load_drafter,
    load_model,
    load_prompt_set,
    policy_arg,
    verify_arg,
)
from jaxcert.cli.argtypes import non_negative_float, positive, unit_float
from jaxcert.models import mesh as mesh_lib

__all__ = ["DecodeProgress", "add_parser", "run"]


def add_parser(sub) -> None:
    p = sub.add_parser(
        "decode",
        help="speculative decoding with a target and a drafter: speed, acceptance, certificates",
        description="Decode each prompt with the target alone and with speculative decoding "
        "(drafter + policy + verification rule), in the same run, and report throughput, "
        "speedup, acceptance and, per drafted position, KL(p||q) and the certificate C_p. "
        "Writes rounds.parquet, nodes.parquet, outputs.jsonl and summary.json to --out "
        "(a previous run there is refused without --overwrite). "
        "With --mesh data=D,model=M each batch's rows are split over the D data devices "
        "(a batch is padded to a multiple of D with rows that are dropped) and the weights "
        "of both models over the M model devices; greedy outputs are identical to a "
        "one-device run.",
    )
    p.add_argument(
        "--target",
        default=DEFAULT_DECODE_TARGET,
        help="asset name, checkpoint folder or .gguf (default %(default)s)",
    )
    p.add_argument(
        "--drafter",
        default=DEFAULT_DRAFTER,
        help="the same for the drafter, with the target's vocabulary; a draft head's "
        "folder (head.json + head.safetensors, written by jaxcert.models.eagle.save_head) "
        "trained for the target, or an EAGLE-3 (SpecForge) or speculators folder; or "
        "ngram:N[:MIN], prompt lookup of the last N (at least MIN) tokens in the prompt and "
        "output, no model (default %(default)s)",
    )
    p.add_argument(
        "--head-outside",
        choices=("oov", "-inf"),
        default=None,
        help="a draft head with a reduced vocabulary: the logit of the tokens outside it, "
        "-inf as the engines draft (the default of EAGLE-3 heads; KL and certificates are "
        "then infinite wherever the target puts mass outside) or the head's shared learnt "
        "logit (finite KL; the default of jaxcert's own heads); greedy drafts are the same "
        "unless the shared logit beats every drafted one (default: the head's own)",
    )
    add_prompt_arguments(p)
    p.add_argument(
        "--policy",
        type=policy_arg,
        default="svip:0.3",
        help="draft-length policy: constant:K | heuristic | confidence[:TAU] | "
        "svip[:H] | cert[:LAMBDA[:BETA]] | goodput[:PRIOR[:BETA]][:patience=P][:spread=S]"
        "[:memory=M] (cost-aware: measures this machine's pass costs once, cached), "
        "optional /KMAX (default %(default)s)",
    )
    p.add_argument(
        "--verify",
        type=verify_arg,
        default="greedy",
        help="[SHAPE+]RULE: greedy | additive:T | multiplicative:A | topk:K | typical "
        "| sample, SHAPE = tree:MxD | dyntree:MxDxN, e.g. tree:2x4+greedy "
        "(default %(default)s)",
    )
    p.add_argument(
        "--temperature",
        type=non_negative_float,
        default=0.0,
        help="0 for greedy/relaxed rules; > 0 with 'sample' (default 0)",
    )
    p.add_argument(
        "--top-p",
        type=unit_float,
        default=1.0,
        help="nucleus for sampling; 1 keeps every token (default %(default)s)",
    )
    p.add_argument(
        "--max-new-tokens",
        type=positive,
        default=128,
        help="new tokens per prompt (default %(default)s)",
    )
    p.add_argument(
        "--max-draft",
        type=positive,
        default=None,
        help="deepest chain (default: the policy's cap, 40 if dynamic)",
    )
    p.add_argument(
        "--batch-size",
        type=positive,
        default=1,
        help="prompts decoded together (default %(default)s)",
    )
    p.add_argument(
        "--max-prompts", type=positive, default=4, help="first N prompts (default %(default)s)"
    )
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default %(default)s)")
    p.add_argument("--no-baseline", action="store_true", help="skip the target-only run")
    p.add_argument(
        "--costs",
        type=pathlib.Path,
        default=None,
        help="goodput's pass costs from a file instead of measuring them: JSON mapping "
        "batch rows to measured costs, as scripts/bench_pass_width.py --json writes; "
        "corrected as the decode runs, the file is not changed (default: measured on this "
        "machine once per batch size, cached, and what the decodes learn is kept there)",
    )
    p.add_argument(
        "--no-certificates",
        action="store_true",
        help="skip the per-node certificates (KL is still recorded)",
    )
    p.add_argument(
        "--out",
        type=pathlib.Path,
        default=pathlib.Path("jaxcert-out/decode"),
        help="output folder (default %(default)s)",
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace the decode run already in --out (its summary.json, rounds.parquet, "
        "nodes.parquet and outputs.jsonl; other files stay); without it, it is refused",
    )
    add_mesh_argument(p, "batch rows over data, both models' weights over model")
    p.set_defaults(func=run)


class DecodeProgress:
    """The decode progress bar: tokens of the run, with a rate and ETA of decoding alone.

    While a program compiles (minutes for a large model) the bar says ``compiling <program>``
    and shows no rate or ETA. The pause ends with the next tokens: the time since the
    compile began (compile, prefill and the first decode call) leaves the bar's clock and
    those tokens its count, so the rate (``tokens / seconds``, not smoothed) and the ETA are
    those of decoding.

    The description names the run the tokens come from: ``target-only`` (the baseline,
    unless ``--no-baseline``) or ``speculative``, and the batch (``batch i/n``).

    Args:
      total: tokens of the whole run (every batch, both runs: target-only and speculative).
      file: the stream the bar writes to (default ``sys.stderr``).
    """

    COMPILING = "{l_bar}{bar}| {n_fmt}/{total_fmt}"  # l_bar: "<desc>: <percent>|"
    DECODING = COMPILING + " [{elapsed}<{remaining}, {rate_fmt}]"

    def __init__(self, total: int, *, file=None):
        from tqdm import tqdm

        self.bar = tqdm(
            total=total,
            unit="tok",
            desc="decode",
            file=sys.stderr if file is None else file,
            dynamic_ncols=True,
            smoothing=0,  # the mean rate over the bar's clock, which skips compiling
            bar_format=self.DECODING,
        )
        self._paused_at: float | None = None
        self._desc = "decode"

    def label(self, run: str) -> None:
        """Names the run (and batch) the next tokens come from, e.g. ``"target-only,
        batch 1/2"``."""
        self._desc = f"decode [{run}]"
        if self._paused_at is None:
            self.bar.set_description(self._desc)

    def compiling(self, name: str) -> None:
        """Shows ``compiling <name>`` without rate or ETA, and pauses the bar's clock."""
        if self._paused_at is None:
            self._paused_at = time.time()  # tqdm's clock
        self.bar.set_description(f"compiling {name}", refresh=False)
        self.bar.bar_format = self.COMPILING
        self.bar.refresh()

    def advance(self, position: int) -> None:
        """Moves the bar to ``position`` tokens; ends a compile pause."""
        if self._paused_at is not None:
            self.bar.start_t += time.time() - self._paused_at
            self.bar.initial += position - self.bar.n  # tokens not in the rate
            self._paused_at = None
            self.bar.set_description(self._desc, refresh=False)
            self.bar.bar_format = self.DECODING
        self.bar.update(position - self.bar.n)

    def close(self) -> None:
        self.bar.close()


def run(args) -> int:
    import jaxcert
    from jaxcert import decoding
    from jaxcert.base.folders import atomic_write
    from jaxcert.base.programs import default_programs
    from jaxcert.decoding import run_report

    policy, config = _config(args)  # validates temperature against the rule before loading
    given_costs = None
    if args.costs is not None and not isinstance(policy, decoding.Goodput):
        raise ValueError(f"--costs is goodput's pass costs; --policy {policy.spec} weighs none")
    if args.costs is not None:
        given_costs = decoding.GoodputController.load(args.costs)  # checked before loading
    out = args.out
    replace = run_report.check_output(out, overwrite=args.overwrite)  # before any loading
    device_mesh = mesh_lib.make_mesh(args.mesh)
    mesh = device_mesh if device_mesh.size > 1 else None  # one device: no placement at all
    check_vocabularies(args.target, args.drafter)  # from the configs: no weights read yet
    prompt_set = load_prompt_set(args.prompts, turn=args.turn, max_prompts=args.max_prompts)
    if given_costs is not None:  # before loading, and before the output folder is made
        n, size = len(prompt_set), args.batch_size
        missing = sorted({min(size, n - i) for i in range(0, n, size)} - set(given_costs.table))
        if missing:
            raise ValueError(
                f"--costs {args.costs} has no costs for batches of {missing} rows "
                f"(it has {sorted(given_costs.table)})"
            )
    started = time.perf_counter()
    cache_dir = jaxcert.enable_compilation_cache()  # a rerun on this machine compiles nothing
    print(f"[jaxcert] loading target {args.target} and drafter {args.drafter} ...",
          file=sys.stderr, flush=True)  # fmt: skip
    target, drafter, load_s = _load(args, mesh)
    config = dataclasses.replace(config, eos_ids=target.eos_ids)
    encoded = _encode(args, target, prompt_set)
    d_name, d_what = describe_drafter(drafter)
    print(
        f"[jaxcert] target {target.path.name} ({counted(target.config.num_layers, 'layer')}), "
        f"drafter {d_name} ({d_what}), V={target.config.vocab_size},"
        f" loaded in {load_s:.1f} s; {counted(len(encoded), 'prompt')}; policy {policy.spec}, "
        "verify "
        f"{config.verification.spec}, T={args.temperature}; mesh "
        f"{mesh_lib.describe(device_mesh)}",
        file=sys.stderr,
    )
    compiled_before = default_programs().compiled
    goodput = _goodput(policy, given_costs, target, drafter, config)
    print("[jaxcert] compiling the decoding programs first (a minute or more for a large "
          "model on the first run; cached for later runs) ...",
          file=sys.stderr, flush=True)  # fmt: skip
    runs = _decode(args, target, drafter, encoded, policy, config, goodput)
    if goodput is not None and given_costs is None:
        goodput.save()  # the next run on this machine starts from what these decodes learnt
    summary = run_report.summarize_runs(runs)
    if replace:  # the previous run's files go only now that this one is ready
        run_report.remove_outputs(out)
    out.mkdir(parents=True, exist_ok=True)  # only now: a failed load leaves no empty folder
    ids = [p.id for p in prompt_set]
    run_report.write_tables(out, runs["speculative"], ids, args.batch_size)
    run_report.write_outputs(out / "outputs.jsonl", runs, ids, target.tokenizer.decode)
    meta = _meta(args, target, drafter, policy, config, device_mesh, load_s) | {
        "compile_s": round(sum(r.compile_s for rs in runs.values() for r in rs), 1),
        "programs_compiled": default_programs().compiled - compiled_before,
        "compilation_cache": str(cache_dir) if cache_dir else None,
        "total_s": round(time.perf_counter() - started, 1),
    }
    summary = clamp_kls(summary)  # a KL is >= 0: no -0.0 from float rounding
    atomic_write(out / "summary.json", json.dumps(meta | summary, indent=2, default=str))
    print(run_report.markdown_summary(meta | summary))  # with the compile time
    print(
        f"[jaxcert] wrote {out}/rounds.parquet, nodes.parquet, outputs.jsonl, summary.json",
        file=sys.stderr,
    )
    return 0


def _config(args):
    """``(policy, config)`` from the command line (checked before anything is loaded)."""
    from jaxcert import decoding

    policy = decoding.parse_policy(args.policy)
    config = decoding.DecodeConfig(
        verification=decoding.parse_verify(args.verify),
        max_new_tokens=args.max_new_tokens,
        max_draft=args.max_draft or policy.k_max,
        temperature=args.temperature,
        top_p=args.top_p,
        collect_stats=not args.no_certificates,
    )
    return policy, config


def _load(args, mesh):
    """``(target, drafter, load_s)``: both models (checked as a pair) and their load time."""
    from jaxcert import decoding

    t0 = time.perf_counter()
    target = load_model("--target", args.target, mesh=mesh)  # each weight onto its shards
    drafter = load_drafter(args.drafter, target, mesh=mesh)
    head = getattr(drafter, "model", None)
    if args.head_outside is not None and hasattr(head, "outside"):
        head.outside = args.head_outside
    decoding.check_pair(target, drafter)
    return target, drafter, time.perf_counter() - t0


def _encode(args, target, prompt_set) -> list:
    """The prompts' token ids (checked before anything is decoded)."""
    from jaxcert.base import prompts

    encoded = prompts.encode_prompts(
        target.tokenizer, prompt_set, chat=not args.no_chat, system_prompt=args.system_prompt
    )
    short = [p.id for p, e in zip(prompt_set, encoded, strict=True) if len(e) < 2]
    if short:
        raise ValueError(
            f"prompts {short} encode to fewer than 2 tokens; speculative decoding needs 2"
        )
    return encoded


def _goodput(policy, given, target, drafter, config):
    """``goodput``'s controller: the ``--costs`` table, else this machine's calibration
    (measured once per batch size, cached); ``None`` for the other policies."""
    from jaxcert import decoding

    if not isinstance(policy, decoding.Goodput):
        return None
    if given is not None:
        return given
    return decoding.GoodputController.calibrate(
        target, drafter, config=config,
        log=lambda line: print(f"[jaxcert] {line}", file=sys.stderr),
    )  # fmt: skip


def _decode(args, target, drafter, encoded, policy, config, goodput=None) -> dict:
    """Each batch decoded by the target alone (unless ``--no-baseline``) and speculatively:
    ``{"target": [...], "speculative": [...]}``, one output per batch, with a progress bar."""
    import jax

    from jaxcert import decoding
    from jaxcert.decoding.config import prompt_room

    key = jax.random.key(args.seed)
    width = prompt_room(max(len(e) for e in encoded))  # one program for every batch
    progress = DecodeProgress(len(encoded) * args.max_new_tokens * (1 if args.no_baseline else 2))
    runs: dict[str, list] = {"target": [], "speculative": []}
    common: dict[str, Any] = {"prompt_width": width, "on_compile": progress.compiling}

    def advance_from(offset: int) -> Callable[[int], None]:
        """A call's progress callback: the bar at ``offset`` plus the call's ``n`` new tokens."""
        return lambda n: progress.advance(offset + n)

    batches = -(-len(encoded) // args.batch_size)
    for start in range(0, len(encoded), args.batch_size):
        batch = encoded[start : start + args.batch_size]
        of = f", batch {start // args.batch_size + 1}/{batches}" if batches > 1 else ""
        key, k1, k2 = jax.random.split(key, 3)
        done = progress.bar.n
        if not args.no_baseline:
            progress.label(f"target-only{of}")
            runs["target"].append(decoding.target_decode(
                target, batch, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                top_p=args.top_p, eos_ids=config.eos_ids, key=k1,
                progress=advance_from(done), **common,
            ))  # fmt: skip
            done += len(batch) * args.max_new_tokens  # rows that ended early count in full
            progress.advance(done)
        progress.label(f"speculative{of}")
        runs["speculative"].append(decoding.speculative_decode(
            target, drafter, batch, policy=policy, config=config, key=k2,
            progress=advance_from(done), costs=goodput, **common,
        ))  # fmt: skip
        progress.advance(done + len(batch) * args.max_new_tokens)
    progress.close()
    return runs


def _meta(args, target, drafter, policy, config, device_mesh, load_s) -> dict:
    """What summary.json records about the run besides its results."""
    return {
        "command": " ".join(sys.argv),
        "target": str(target.path),
        "drafter": str(getattr(drafter, "path", None) or describe_drafter(drafter)[0]),
        "prompts": args.prompts,
        "policy": policy.spec,
        "verify": config.verification.spec,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "max_new_tokens": args.max_new_tokens,
        "max_draft": config.max_draft,
        "batch_size": args.batch_size,
        "mesh": dict(device_mesh.shape),
        "seed": args.seed,
        "load_s": round(load_s, 2),
    }
