"""Speculative decoding benchmark on real models: target-only vs draft shapes x policies.

Loads the target and the drafter once, encodes MT-Bench first turns (by default 3 of each of
the 8 categories, none of the prompts the ``cert`` policy was tuned on) with the chat
template and, for every temperature, decodes each prompt with the target alone and with every
(draft shape, policy) pair, interleaved prompt by prompt so that every configuration sees the
same machine state (in a new random order for each prompt; the target-only run is repeated
before and after each prompt's speculative runs and averaged). Compilation is ahead of time
and excluded from the timings: a program's first call compiles it before its timed decode
loop starts, and before the first timed unit of each batch size and temperature every
configuration decodes that unit once, untimed, so that first executions (on XLA:CPU the
first decodes of a process ran up to 20% slower) are not timed either (``--no-warmup``:
time them). A warm-up of ``goodput`` also teaches it the round overheads, as an earlier
run on the machine would. The JSON file is rewritten after every prompt, and every
finished unit is kept in ``<out>.units.pkl``: ``--resume`` continues an interrupted run
from there (its random keys and orders are derived from the seed and the unit, so a resumed
run decodes what an uninterrupted one would), and a run refuses to start over a checkpoint
without ``--resume`` or ``--overwrite``.

Per configuration: the speedup over target-only (ratio of total tokens/s) with a 95%
bootstrap interval over prompts, the acceptance length, and at T = 0 whether every output
equals target-only greedy decoding. Pairs of configurations are compared by a paired
bootstrap of their speedup ratio over prompts (cert vs svip and svip vs constant per shape;
goodput vs every other policy of its shape; the fastest configuration vs each other one); a
difference is called significant when the interval of the ratio excludes 1.

``--batch-sizes 1,4,8`` runs the whole protocol at each batch size: a unit is then a batch
of consecutive prompts (decoded together, timed together, the unit of the bootstrap), and
every row and comparison carries its batch size. ``goodput`` measures the pass costs at
each batch size (cached) and corrects them from its own timed calls as it runs, keeping what
it learnt for the next run; ``--fixed-costs`` adds ``fixed-goodput``, the same policy on
the calibrated costs alone, paired with it. ``--hf-peer`` adds Hugging Face transformers
on the same GGUF pair, same token ids, greedy, 2 threads: target-only and assisted
generation (heuristic and constant schedules).

Examples: the full protocol, and the run of "Policies and shapes" in docs/benchmarks.md::

  python scripts/bench_decode.py --batch-sizes 1,4,8 --hf-peer
  python scripts/bench_decode.py --per-category 1 --max-new-tokens 64 --temperatures 0 \\
      --tree-policies svip:0.3,cert --hf-peer --hf-prompts 2

A trained draft head (``--head FOLDER``, from ``jaxcert train-drafter --head``) adds the
configurations ``head/<shape>`` (``--head-shapes``, ``--head-policies``), timed in the same
interleaved protocol and compared with the LM drafter's by the paired bootstrap::

  python scripts/bench_decode.py --head jaxcert-out/train-head/kl-seed0/head \
      --shapes chain --policies svip:0.3 --head-policies constant:4,constant:6

Prompt lookup (``--ngram N``) adds ``ngram/<shape>`` configurations the same way
(``--ngram-shapes``, ``--ngram-policies``, default ``constant:4,goodput``); ``goodput`` in any
policy list measures this machine's pass costs once (cached under the jaxcert cache)::

  python scripts/bench_decode.py --policies svip:0.3,cert,goodput --shapes chain --ngram 3

Prints markdown tables and writes a JSON file (``--out``).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import pathlib
import pickle
import sys
import time

import jax
import numpy as np

from jaxcert import decoding, models
from jaxcert.base import prompts
from jaxcert.base.folders import atomic_write, refuse_other_options
from jaxcert.decoding import run_report
from jaxcert.decoding.config import bucket

DEFAULT_POLICIES = "constant:4,heuristic,confidence:0.4,svip:0.3,cert"
DEFAULT_SHAPES = "chain,tree:2x4,dyntree:4x6x24"
# The cert policy's tuning prompts (docs/benchmarks.md): never benchmarked.
TUNING = {4, 5, 6, 7} | set(range(5, 80, 10))


def _args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    p.add_argument(
        "--drafter",
        default="qwen2.5-coder-0.5b-instruct",
        help="the LM drafter ('none': only --head and --ngram configurations)",
    )
    p.add_argument(
        "--head",
        default=None,
        help="a trained draft-head folder (train-drafter --head): adds 'head/<shape>' "
        "configurations for every --head-shapes shape",
    )
    p.add_argument("--head-shapes", default="chain,tree:2x4", help="shapes drafted by --head")
    p.add_argument(
        "--ngram",
        type=int,
        default=None,
        help="adds 'ngram/<shape>' configurations: prompt lookup of the last N tokens "
        "(decoding.NgramDrafter(N)) for every --ngram-shapes shape",
    )
    p.add_argument("--ngram-shapes", default="chain", help="shapes drafted by --ngram")
    p.add_argument(
        "--ngram-policies",
        default="constant:4,goodput",
        help="policies of the n-gram drafter (POLICY@SHAPE as --head-policies)",
    )
    p.add_argument(
        "--head-policies",
        default=None,
        help="policies of the head (default: --policies); POLICY@SHAPE for one shape only, "
        "e.g. constant:2,goodput@chain",
    )
    p.add_argument(
        "--prompts",
        default="mtbench",
        help="prompt set (as jaxcert decode's; 'sharegpt:edit': code-editing requests, the "
        "task where n-gram drafting pays)",
    )
    p.add_argument(
        "--per-category",
        type=int,
        default=3,
        help="prompts per category (MT-Bench: the first ones not used for tuning)",
    )
    p.add_argument("--prompt-indices", default=None, help="explicit prompt indices instead")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperatures", default="0,1")
    p.add_argument("--policies", default=DEFAULT_POLICIES)
    p.add_argument("--shapes", default=DEFAULT_SHAPES, help="chain, tree:MxD, dyntree:MxDxN")
    p.add_argument("--max-draft", type=int, default=40, help="deepest chain (policy cap)")
    p.add_argument(
        "--tree-policies",
        default=None,
        help="policies for the tree shapes (default: every --policies one)",
    )
    p.add_argument(
        "--buckets",
        default=None,
        help="chain verification widths, e.g. 1,2,4,8,16,24,40 (default: DecodeConfig's)",
    )
    p.add_argument(
        "--batch-sizes",
        default="1",
        help="e.g. 1,4,8: the whole protocol at each batch size, a unit of the bootstrap "
        "being one batch of consecutive prompts (default %(default)s)",
    )
    p.add_argument(
        "--fixed-costs",
        action="store_true",
        help="also run every goodput configuration on its calibrated pass costs alone, "
        "never corrected (policy 'fixed-goodput'), paired with the corrected one",
    )
    p.add_argument(
        "--no-warmup",
        dest="warmup",
        action="store_false",
        help="time the first unit of each batch size and temperature without an untimed "
        "decode of every configuration before it",
    )
    p.add_argument(
        "--ignore-eos",
        action="store_true",
        help="every row decodes --max-new-tokens tokens, end tokens or not (as vLLM's "
        "throughput benchmark): at T > 0 a batch runs until its longest sample ends, so "
        "samples of random length make a batch's tokens/s noisy; see docs/benchmarks.md",
    )
    p.add_argument("--hf-peer", action="store_true", help="also time transformers (PyTorch)")
    p.add_argument("--hf-threads", type=int, default=2)
    p.add_argument("--hf-prompts", type=int, default=None, help="the first N prompts only")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue the run whose checkpoint (<out>.units.pkl) is there: the units it "
        "finished are kept, the rest are decoded",
    )
    p.add_argument(
        "--overwrite", action="store_true", help="discard the checkpoint of an earlier run"
    )
    p.add_argument(
        "--out",
        type=pathlib.Path,
        default=pathlib.Path("jaxcert-out/bench.json"),
        help="JSON results (default jaxcert-out/bench.json)",
    )
    return p.parse_args(argv)


def _select(prompt_set, args) -> list:
    if args.prompt_indices:
        return [prompt_set[int(i)] for i in args.prompt_indices.split(",")]
    chosen, per = [], {}
    for i, p in enumerate(prompt_set):
        tuning = args.prompts == "mtbench" and i in TUNING  # indices into MT-Bench
        if tuning or per.get(p.category, 0) >= args.per_category:
            continue
        per[p.category] = per.get(p.category, 0) + 1
        chosen.append(p)
    return chosen


_OTHER = ("head/", "ngram/")  # configurations of the other drafters: <drafter>/<shape>


@dataclasses.dataclass(frozen=True)
class _FixedCosts:
    """A ``goodput`` configuration that weighs its calibrated costs as they are."""

    policy: decoding.Goodput

    @property
    def spec(self) -> str:
        return "fixed-" + self.policy.spec


def _passes_only(target, drafters, shape, fixed, configs, unit):
    """The calibrated pass costs of a ``fixed-goodput`` run, without what earlier decodes
    taught (learnt overheads, past drafting)."""
    drafter = _drafter(drafters, shape)
    if isinstance(drafter, decoding.NgramDrafter) and drafter.config is None:
        drafter = drafter.for_vocabulary(target.config.vocab_size)  # as speculative_decode
    calibrated = decoding.GoodputController.calibrate(target, drafter, config=configs[shape])
    costs = calibrated.costs(len(unit))
    return dataclasses.replace(
        costs, round_overhead_s=0.0, step_overhead_s=0.0, round_scale=1.0, drafting={}
    )


def _drafter(drafters: dict, shape: str):
    """The drafter of a configuration: ``head/<shape>`` is the head's, ``ngram/<shape>`` the
    lookup's, others the LM's."""
    return drafters[shape.split("/")[0] if shape.startswith(_OTHER) else "lm"]


def _bare(shape: str) -> str:
    """The draft shape of a configuration: ``head/chain`` and ``ngram/chain`` draft ``chain``."""
    return shape.split("/", 1)[1] if shape.startswith(_OTHER) else shape


def _config(shape: str, temperature: float, args, eos) -> decoding.DecodeConfig:
    shape = _bare(shape)
    rule = "greedy" if temperature == 0 else "sample"
    verify = rule if shape == "chain" else f"{shape}+{rule}"
    buckets = None
    if shape == "chain" and args.buckets:
        buckets = tuple(b for b in map(int, args.buckets.split(",")) if b < args.max_draft)
        buckets += (args.max_draft,)
    return decoding.DecodeConfig(
        verification=decoding.parse_verify(verify),
        max_new_tokens=args.max_new_tokens,
        max_draft=args.max_draft,
        temperature=temperature,
        eos_ids=eos,
        collect_stats=False,
        buckets=buckets,
    )


@dataclasses.dataclass
class _Runs:
    """Per-prompt tokens and decode seconds of one configuration (and its round stats)."""

    tokens: list = dataclasses.field(default_factory=list)
    seconds: list = dataclasses.field(default_factory=list)
    identical: list = dataclasses.field(default_factory=list)
    stats: list = dataclasses.field(default_factory=list)

    def add(self, tokens: int, seconds: float, stats=None, identical=None):
        self.tokens.append(tokens)
        self.seconds.append(seconds)
        if stats is not None:
            self.stats.append(stats)
        if identical is not None:
            self.identical.append(identical)

    @property
    def rate(self) -> float:
        return float(np.sum(self.tokens) / np.sum(self.seconds))


def _units(encoded, batch: int) -> list:
    """Consecutive groups of ``batch`` prompts (a remainder that fills no group is left out)."""
    usable = len(encoded) // batch * batch
    return [encoded[i : i + batch] for i in range(0, usable, batch)]


def _decode_all(
    target, drafters, encoded, args, eos, temperatures, policies, shapes, log, save, results
):
    """Every configuration on every unit (a batch of ``b`` prompts, for each ``b`` of
    ``--batch-sizes``); compilation (the first call of each program) is not in the decode
    seconds. ``save(results)`` runs after every unit, so an interrupted run keeps what it
    measured; units already in ``results`` (a resumed run) are not decoded again. Results
    are keyed ``(batch, temperature, shape, policy spec)``. The random key and the order of
    the configurations of a unit depend only on the seed, the batch size, the temperature
    and the unit's index."""
    width = bucket(max(len(e) for e in encoded))
    controllers: dict = {}  # goodput's, one per configuration, held across the units
    tree_pols = policies
    if args.tree_policies:
        tree_pols = [decoding.parse_policy(p) for p in args.tree_policies.split(",")]
        policies = policies + [p for p in tree_pols if p not in policies]
    order = [
        (s, p)
        for s in shapes
        if not s.startswith(_OTHER)
        for p in policies
        if s == "chain" or p in tree_pols
    ]
    head_pols = [(p, None) for p in policies]
    if args.head_policies:
        head_pols = [_restricted(p) for p in args.head_policies.split(",")]
    ngram_pols = [_restricted(p) for p in args.ngram_policies.split(",")]
    for prefix, pols in (("head/", head_pols), ("ngram/", ngram_pols)):
        order += [
            (s, p) for s in shapes if s.startswith(prefix) for p, only in pols
            if only in (None, _bare(s))
        ]  # fmt: skip
    if args.fixed_costs:
        order += [(s, _FixedCosts(p)) for s, p in order if isinstance(p, decoding.Goodput)]
    for batch in _batch_sizes(args):
        units = _units(encoded, batch)
        if len(units) * batch < len(encoded):
            log(f"[bench] batch {batch}: the last {len(encoded) - len(units) * batch} prompts "
                "fill no batch and are left out")  # fmt: skip
        for t_index, temperature in enumerate(temperatures):
            configs = {shape: _config(shape, temperature, args, eos) for shape in shapes}
            kw = dict(
                max_new_tokens=args.max_new_tokens,
                temperature=temperature,
                eos_ids=eos,
                prompt_width=width,
            )
            base = results.setdefault((batch, temperature, "target", "-"), _Runs())
            if base.tokens:
                log(f"[bench] batch {batch} T={temperature}: {len(base.tokens)} units kept")

            def decode(shape, policy, unit, key, configs=configs, temperature=temperature):
                fixed = isinstance(policy, _FixedCosts)
                costs = None
                if fixed:
                    costs = _passes_only(target, drafters, shape, policy, configs, unit)
                elif isinstance(policy, decoding.Goodput):
                    held = (shape, temperature)
                    if held not in controllers:
                        controllers[held] = decoding.GoodputController.calibrate(
                            target, _drafter(drafters, shape), config=configs[shape]
                        )
                    costs = controllers[held]
                return decoding.speculative_decode(
                    target,
                    _drafter(drafters, shape),
                    unit,
                    policy=policy.policy if fixed else policy,
                    config=configs[shape],
                    key=key,
                    prompt_width=width,
                    costs=costs,
                )

            if args.warmup and len(base.tokens) < len(units):
                # One untimed decode of every configuration: first executions (allocations,
                # the runtime's first run of each program) stay out of the timed units.
                warm = units[len(base.tokens)]
                decoding.target_decode(target, warm, key=jax.random.key(0), **kw)
                for shape, policy in order:
                    decode(shape, policy, warm, jax.random.key(0))
                log(f"[bench] batch {batch} T={temperature}: warmed up")
            for i, unit in enumerate(units):
                if i < len(base.tokens):
                    continue  # measured before the run was interrupted
                key = jax.random.fold_in(jax.random.key(args.seed), batch * 1000 + t_index)
                key = jax.random.fold_in(key, i)
                rng = np.random.default_rng([args.seed, batch, t_index, i])
                key, sub = jax.random.split(key)
                first = decoding.target_decode(target, unit, key=sub, **kw)
                outs = {}
                for j in rng.permutation(len(order)):  # a new order per unit: no drift bias
                    shape, policy = order[j]
                    key, sub = jax.random.split(key)
                    outs[shape, policy.spec] = decode(shape, policy, unit, sub)
                again = decoding.target_decode(target, unit, key=sub, **kw)
                seconds = (first.decode_s + again.decode_s) / 2
                base.add(first.num_tokens, seconds)
                for (shape, spec), out in outs.items():
                    same = all(
                        np.array_equal(a, b) for a, b in zip(out.tokens, first.tokens, strict=True)
                    )
                    results.setdefault((batch, temperature, shape, spec), _Runs()).add(
                        out.num_tokens, out.decode_s, out.stats, same if temperature == 0 else None
                    )
                best = max(outs.items(), key=lambda kv: kv[1].num_tokens / kv[1].decode_s)
                log(
                    f"[bench] batch {batch} T={temperature} unit {i + 1}/{len(units)}: target "
                    f"{first.num_tokens / seconds:.2f} tok/s, best {best[0]} "
                    f"{best[1].num_tokens / best[1].decode_s:.2f} tok/s"
                )
                save(results)
                for controller in controllers.values():  # the next run starts from them
                    controller.save()
    return results, width


def _restricted(spec: str):
    """``POLICY`` (every shape of its drafter) or ``POLICY@SHAPE`` (that shape only)."""
    policy, _, shape = spec.partition("@")
    return decoding.parse_policy(policy), shape or None


def _batch_sizes(args) -> list[int]:
    sizes = [int(x) for x in args.batch_sizes.split(",") if x.strip()]
    if not sizes or min(sizes) < 1:
        raise SystemExit(f"--batch-sizes: positive integers, got {args.batch_sizes!r}")
    return sizes


def _rows(results):
    rows = []
    for (batch, temperature, shape, policy), runs in results.items():
        base = results[(batch, temperature, "target", "-")]
        speedup, low, high = run_report.bootstrap_speedup(
            base.tokens, base.seconds, runs.tokens, runs.seconds
        )
        row = {
            "batch": batch,
            "temperature": temperature,
            "shape": shape,
            "policy": policy,
            "prompts": len(runs.tokens),
            "tokens_per_s": round(runs.rate, 3),
            "speedup": round(speedup, 3),
            "ci95": [round(low, 3), round(high, 3)],
        }
        if runs.stats:
            merged = jax.tree.map(lambda *xs: np.concatenate(xs, axis=0), *runs.stats)
            s = run_report.summarize_run(merged, int(np.sum(runs.tokens)), 1.0)
            row |= {
                k: s[k]
                for k in ("mean_accepted", "tokens_per_round", "acceptance_rate", "mean_drafted")
                if k in s
            }
        if runs.identical:
            row["identical"] = f"{sum(runs.identical)}/{len(runs.identical)}"
        rows.append(row)
    return rows


def _paired(results, batch, t, a, b) -> dict:
    """Speedup of configuration ``a`` over ``b`` (each ``(shape, policy)``), paired by unit."""
    ra, rb = results[(batch, t, *a)], results[(batch, t, *b)]
    ratio, low, high = run_report.bootstrap_speedup(rb.tokens, rb.seconds, ra.tokens, ra.seconds)
    return {
        "batch": batch,
        "temperature": t,
        "a": " ".join(a),
        "b": " ".join(b),
        "ratio": round(ratio, 3),
        "ci95": [round(low, 3), round(high, 3)],
        "significant": bool(low > 1 or high < 1),
    }


def _comparisons(results, temperatures, shapes):
    """Paired intervals, per batch size and temperature: cert vs svip and svip vs constant
    per shape, goodput vs every other policy of its shape, and the fastest configuration
    against every other one."""
    pairs = []  # (batch, t, a, b) with a, b = (shape, policy spec); each pair once
    for batch, t in dict.fromkeys(k[:2] for k in results):
        spec = [k[2:] for k in results if k[:2] == (batch, t) and k[2] != "target"]
        if spec:
            best = max(spec, key=lambda k: results[(batch, t, *k)].rate)
            pairs += [(batch, t, best, other) for other in spec if other != best]
        for shape in shapes:
            specs = {
                p.split(":")[0]: p for (bb, tt, s, p) in results if (bb, tt, s) == (batch, t, shape)
            }
            for a, b in (("cert", "svip"), ("svip", "constant")):
                if a in specs and b in specs:
                    pairs.append((batch, t, (shape, specs[a]), (shape, specs[b])))
            if "goodput" in specs:
                pairs += [
                    (batch, t, (shape, specs["goodput"]), (shape, p))
                    for name, p in specs.items()
                    if name != "goodput"
                ]
    return [_paired(results, *pair) for pair in dict.fromkeys(pairs)]


_NOT_PROTOCOL = {"out", "resume", "overwrite", "hf_peer", "hf_threads", "hf_prompts"}


def _protocol(args, prompt_ids) -> dict:
    """What a resumed run must share with the interrupted one: every option that changes
    what a unit decodes or how it is timed, and the prompts."""
    fields = {k: v for k, v in vars(args).items() if k not in _NOT_PROTOCOL}
    return fields | {"prompt_ids": list(prompt_ids)}


@dataclasses.dataclass
class _Checkpoint:
    """The finished units of a run, pickled after every unit (``results`` as
    :func:`_decode_all` keys them, with the protocol that produced them)."""

    path: pathlib.Path
    protocol: dict

    def start(self, *, resume: bool, overwrite: bool) -> dict:
        """The results to continue from: ``{}`` for a new run.

        Raises:
          SystemExit: a checkpoint is there and neither ``resume`` nor ``overwrite`` is
            set, ``resume`` is set and there is none, or its protocol differs (the
            differing options are named).
        """
        if resume and overwrite:
            raise SystemExit("--resume and --overwrite: choose one")
        if not self.path.exists():
            if resume:
                raise SystemExit(f"--resume: no checkpoint at {self.path}")
            return {}
        if overwrite:
            return {}  # the first finished unit replaces it
        if not resume:
            raise SystemExit(
                f"{self.path} holds the units of an earlier run: --resume continues it, "
                "--overwrite discards it"
            )
        with self.path.open("rb") as f:
            saved = pickle.load(f)
        try:
            refuse_other_options(
                self.path, saved["protocol"], self.protocol, advice="rerun with the same options"
            )
        except ValueError as err:
            raise SystemExit(f"--resume: {err}") from None
        return {k: _Runs(**fields) for k, fields in saved["results"].items()}

    def save(self, results: dict) -> None:
        plain = {k: vars(runs).copy() for k, runs in results.items()}  # no class of the script
        # atomic: an interrupted save keeps the previous one
        atomic_write(self.path, pickle.dumps({"protocol": self.protocol, "results": plain}))


def _hf_peer(args, encoded, log):
    """transformers' greedy target-only and assisted generation on the same GGUF files."""
    import torch
    import transformers

    from jaxcert.base import assets

    torch.set_num_threads(args.hf_threads)
    paths = [pathlib.Path(assets.fetch(name)) for name in (args.target, args.drafter)]
    load = lambda p: transformers.AutoModelForCausalLM.from_pretrained(  # noqa: E731
        p.parent, gguf_file=p.name, dtype=torch.float32
    ).eval()
    target, drafter = load(paths[0]), load(paths[1])
    rows = []
    runs = {
        "target": {},
        "assisted heuristic": {"num_assistant_tokens_schedule": "heuristic"},
        "assisted constant": {"num_assistant_tokens_schedule": "constant"},
    }
    encoded = encoded[: args.hf_prompts]
    for name, options in runs.items():
        tokens, seconds = [], []
        for ids in encoded:
            x = torch.tensor([ids])
            kw = dict(
                attention_mask=torch.ones_like(x),
                max_new_tokens=args.max_new_tokens,
                do_sample=False,
            )
            if name != "target":
                drafter.generation_config.num_assistant_tokens_schedule = options[
                    "num_assistant_tokens_schedule"
                ]
                kw["assistant_model"] = drafter
            t0 = time.perf_counter()
            with torch.no_grad():
                out = target.generate(x, **kw)
            seconds.append(time.perf_counter() - t0)
            tokens.append(out.shape[1] - len(ids))
        rows.append(
            {
                "run": f"transformers {name}",
                "tokens": tokens,
                "seconds": seconds,
                "tokens_per_s": round(float(np.sum(tokens) / np.sum(seconds)), 3),
            }
        )
        log(f"[bench] transformers {name}: {rows[-1]['tokens_per_s']} tok/s")
    base = rows[0]
    for row in rows:
        s, low, high = run_report.bootstrap_speedup(
            base["tokens"], base["seconds"], row["tokens"], row["seconds"]
        )
        row |= {"speedup": round(s, 3), "ci95": [round(low, 3), round(high, 3)]}
    return rows


def main(argv=None) -> int:
    args = _args(argv)
    temperatures = [float(t) for t in args.temperatures.split(",")]
    policies = [decoding.parse_policy(s) for s in args.policies.split(",")]
    shapes = args.shapes.split(",")
    log = lambda *a: print(*a, file=sys.stderr, flush=True)  # noqa: E731
    t0 = time.perf_counter()
    prompt_set = _select(prompts.load_prompts(args.prompts), args)
    checkpoint = _Checkpoint(
        args.out.with_suffix(".units.pkl"), _protocol(args, [p.id for p in prompt_set])
    )
    results = checkpoint.start(resume=args.resume, overwrite=args.overwrite)  # before loading
    target = models.load(args.target)
    drafters: dict = {}
    if args.drafter != "none":
        drafters["lm"] = models.load(args.drafter)
        decoding.check_pair(target, drafters["lm"])
    else:
        shapes = []
    if args.head is not None:
        from jaxcert.models import eagle

        drafters["head"] = eagle.load_head(args.head)
        eagle.check_head_fits(drafters["head"], target.config)
        shapes += [f"head/{s}" for s in args.head_shapes.split(",")]
    if args.ngram is not None:
        drafters["ngram"] = decoding.NgramDrafter(args.ngram)
        shapes += [f"ngram/{s}" for s in args.ngram_shapes.split(",")]
    load_s = time.perf_counter() - t0
    eos = () if args.ignore_eos else target.eos_ids
    encoded = prompts.encode_prompts(target.tokenizer, prompt_set)
    log(
        f"[bench] loaded in {load_s:.0f} s; {len(encoded)} prompts; {len(shapes)} shapes x "
        f"{len(policies)} policies x T in {temperatures}"
    )
    meta = {
        "command": " ".join(sys.argv),
        "prompts": [p.id for p in prompt_set],
        "max_new_tokens": args.max_new_tokens,
        "load_s": round(load_s, 1),
        "cpu_count": os.cpu_count(),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)

    def write(**body):
        meta["total_s"] = round(time.perf_counter() - t0, 1)
        args.out.write_text(json.dumps(meta | body, indent=2, default=str))

    def save(results):  # after every unit: partial rows survive an interrupted run
        checkpoint.save(results)
        write(rows=_rows(results), comparisons=_comparisons(results, temperatures, shapes))

    results, width = _decode_all(
        target, drafters, encoded, args, eos, temperatures, policies, shapes, log, save, results
    )
    rows = _rows(results)
    comparisons = _comparisons(results, temperatures, shapes)
    hf_rows = []
    if args.hf_peer:
        del target, drafters
        gc.collect()
        hf_rows = _hf_peer(args, encoded, log)
    print(_tables(rows, comparisons, hf_rows))
    write(rows=rows, comparisons=comparisons, hf=hf_rows)
    log(f"[bench] wrote {args.out} in {meta['total_s']:.0f} s")
    return 0


def _tables(rows, comparisons, hf_rows) -> str:
    lines = [
        "| batch | T | draft | policy | tokens/s | speedup [95% CI] | accepted/round | "
        "tokens/round | identical |",
        "|" + "---|" * 9,
    ]
    for r in rows:
        lo, hi = r["ci95"]
        lines.append(
            f"| {r['batch']} | {r['temperature']:g} | {r['shape']} | {r['policy']} | "
            f"{r['tokens_per_s']:.2f} | "
            f"{r['speedup']:.2f} [{lo:.2f}, {hi:.2f}] | {r.get('mean_accepted', '')} | "
            f"{r.get('tokens_per_round', '')} | {r.get('identical', '')} |"
        )
    if comparisons:
        lines += [
            "",
            "| batch | T | A vs B | ratio [95% CI] | significant |",
            "|---|---|---|---|---|",
        ]
        for c in comparisons:
            lo, hi = c["ci95"]
            lines.append(
                f"| {c['batch']} | {c['temperature']:g} | {c['a']} vs {c['b']} | "
                f"{c['ratio']:.3f} [{lo:.3f}, {hi:.3f}] | {c['significant']} |"
            )
    if hf_rows:
        lines += ["", "| peer | tokens/s | speedup [95% CI] |", "|---|---|---|"]
        for r in hf_rows:
            lo, hi = r["ci95"]
            lines.append(
                f"| {r['run']} | {r['tokens_per_s']:.2f} | {r['speedup']:.2f} "
                f"[{lo:.2f}, {hi:.2f}] |"
            )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
