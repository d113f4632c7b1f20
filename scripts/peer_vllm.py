"""vLLM as the referee: the same prompts, drafters and draft lengths in vLLM and in jaxcert.

Four steps, each a subcommand writing into one run folder (``--run``); every step writes its
JSON after each configuration and skips the configurations already there, so an
interrupted run resumes:

1. ``prompts`` (jaxcert's environment): the held-out MT-Bench first turns (the first of each
   category that the ``cert`` policy was not tuned on, as ``bench_decode.py --per-category
   1``), encoded with the target's chat template -> ``prompts.json`` (token ids).
2. ``jaxcert`` (jaxcert's environment): jaxcert's decoder on those ids, batch 1, T = 0,
   float32: target-only, n-gram, the draft model and the head, each drafter at its draft
   lengths (``constant:K`` chains, greedy verification) -> ``jaxcert.json``.
3. ``vllm`` (vLLM's own environment, never jaxcert's: see docs/benchmarks.md for its
   set-up): vLLM's ``LLM`` on the exported target folder (``jaxcert export-model``), the
   same ids, batch 1 (one request at a time), T = 0, in ``--dtype`` float32 (acceptance)
   or bfloat16 (speed): target-only, ``ngram``, ``draft_model`` and ``eagle3`` with the
   exported head (``jaxcert export-head``) -> ``vllm-<dtype>.json``. The accepted tokens
   per draft position are the deltas of ``vllm:spec_decode_num_accepted_tokens_per_pos``
   and ``vllm:spec_decode_num_drafts`` around each request.
4. ``report`` (either): per configuration, tokens/s of each engine, the accepted fraction
   at each draft position in both engines with 95% bootstrap intervals over prompts, and
   whether the greedy outputs equal the same engine's target-only output and the other
   engine's -> ``report.json`` and ``report.md``.

Example (the run of docs/benchmarks.md, "vLLM as the referee")::

  jaxcert export-model qwen2.5-coder-1.5b-instruct --out jaxcert-out/hf/target
  jaxcert export-model qwen2.5-coder-0.5b-instruct --out jaxcert-out/hf/drafter
  jaxcert export-head HEAD --format eagle3 --out jaxcert-out/hf/head
  python scripts/peer_vllm.py prompts --run jaxcert-out/peer
  python scripts/peer_vllm.py jaxcert --run jaxcert-out/peer --head HEAD
  VENV/bin/python scripts/peer_vllm.py vllm --run jaxcert-out/peer --dtype float32
  VENV/bin/python scripts/peer_vllm.py vllm --run jaxcert-out/peer --dtype bfloat16
  python scripts/peer_vllm.py report --run jaxcert-out/peer

Only the standard library is imported at the top: the ``vllm`` step runs where jaxcert is
not installed (and must stay so), the others where vLLM is not.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import time

DEFAULT_LENGTHS = "1,2,3,4,5"
HF = pathlib.Path("jaxcert-out/hf")


def _args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="step", required=True)
    for name in ("prompts", "jaxcert", "vllm", "report"):
        s = sub.add_parser(name)
        s.add_argument("--run", type=pathlib.Path, required=True, help="the run folder")
        if name == "prompts":
            s.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
            s.add_argument("--per-category", type=int, default=1)
        if name in ("jaxcert", "vllm"):
            s.add_argument("--max-new-tokens", type=int, default=64)
            s.add_argument("--ngram", default="3:2", help="N:MIN, the n-gram lookup's sizes")
            s.add_argument("--ngram-k", type=int, default=4)
            s.add_argument("--drafter-k", type=int, default=3)
            s.add_argument("--head-lengths", default=DEFAULT_LENGTHS, help="K of the head")
            s.add_argument("--configs", default=None, help="comma-separated subset (default: all)")
        if name == "jaxcert":
            s.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
            s.add_argument("--drafter", default="qwen2.5-coder-0.5b-instruct")
            s.add_argument(
                "--head", default=None, help="the head (any layout jaxcert reads; eagle3 configs)"
            )
        if name == "vllm":
            s.add_argument("--target-hf", type=pathlib.Path, default=HF / "target")
            s.add_argument("--drafter-hf", type=pathlib.Path, default=HF / "drafter")
            s.add_argument("--head-hf", type=pathlib.Path, default=HF / "head")
            s.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
            s.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    return p.parse_args(argv)


def configs(args) -> list[tuple[str, str | None, int]]:
    """``(name, drafter kind, K)`` of every configuration, in run order."""
    out: list[tuple[str, str | None, int]] = [("target", None, 0)]
    out.append((f"ngram/k{args.ngram_k}", "ngram", args.ngram_k))
    out.append((f"draft/k{args.drafter_k}", "draft", args.drafter_k))
    for k in (int(x) for x in args.head_lengths.split(",")):
        out.append((f"eagle3/k{k}", "eagle3", k))
    if args.configs:
        keep = set(args.configs.split(","))
        unknown = keep - {name for name, _, _ in out}
        if unknown:
            sys.exit(f"peer_vllm: unknown --configs {sorted(unknown)}")
        out = [c for c in out if c[0] in keep]
    return out


def _load(path: pathlib.Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def _save(path: pathlib.Path, data: dict) -> None:
    _folders().atomic_write(path, json.dumps(data, indent=1) + "\n")


def _folders():
    """``jaxcert.base.folders`` read from its file (it imports the standard library alone):
    the ``vllm`` step runs where jaxcert is not installed."""
    import importlib.util

    path = pathlib.Path(__file__).resolve().parents[1] / "jaxcert" / "base" / "folders.py"
    spec = importlib.util.spec_from_file_location("_jaxcert_folders", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# 1. prompts ---------------------------------------------------------------------------


def step_prompts(args) -> None:
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
    from bench_decode import TUNING

    from jaxcert.base import prompts

    prompt_set = prompts.load_prompts("mtbench")
    chosen, per = [], {}
    for i, p in enumerate(prompt_set):
        if i in TUNING or per.get(p.category, 0) >= args.per_category:
            continue
        per[p.category] = per.get(p.category, 0) + 1
        chosen.append(p)
    ids = prompts.encode_prompts(_tokenizer(args.target), chosen)
    args.run.mkdir(parents=True, exist_ok=True)
    rows = [
        {"id": p.id, "category": p.category, "ids": i} for p, i in zip(chosen, ids, strict=True)
    ]
    _save(args.run / "prompts.json", {"target": args.target, "prompts": rows})
    print(f"{len(rows)} prompts -> {args.run / 'prompts.json'}")


def _tokenizer(target: str):
    """The target's tokenizer without loading its weights (a folder's, or a GGUF's header)."""
    from jaxcert.base import assets
    from jaxcert.models._tokenizer import tokenizer_from_gguf
    from jaxcert.models.gguf import read_gguf

    path = pathlib.Path(target)
    if path.is_dir():
        import transformers

        return transformers.AutoTokenizer.from_pretrained(path)
    file = path if path.is_file() else assets.fetch(target)
    return tokenizer_from_gguf(read_gguf(file)[1])


# 2. jaxcert ---------------------------------------------------------------------------


def step_jaxcert(args) -> None:
    import numpy as np

    from jaxcert import decoding, models
    from jaxcert.cli._common import load_drafter

    run = _load(args.run / "prompts.json")
    prompt_ids = [r["ids"] for r in run["prompts"]]
    out_path = args.run / "jaxcert.json"
    results = _load(out_path)
    todo = [c for c in configs(args) if c[0] not in results]
    if not todo:
        print("jaxcert: every configuration is done")
        return
    if args.head is None and any(kind == "eagle3" for _, kind, _ in todo):
        sys.exit(
            "peer_vllm: the eagle3 configurations need --head (or leave them out of --configs)"
        )
    target = models.load(args.target)
    eos = target.eos_ids
    width = max(len(p) for p in prompt_ids)  # one compilation for every prompt
    drafters: dict[str, object] = {}
    for name, kind, k in todo:
        if kind == "draft" and kind not in drafters:
            drafters[kind] = models.load(args.drafter).model
        elif kind == "eagle3" and kind not in drafters:
            drafters[kind] = load_drafter(args.head, target).model
        elif kind == "ngram" and kind not in drafters:
            drafters[kind] = load_drafter(f"ngram:{args.ngram}", target)

        def decode(ids, kind=kind, k=k):
            if kind is None:
                return decoding.target_decode(
                    target.model, [ids], max_new_tokens=args.max_new_tokens, eos_ids=eos,
                    prompt_width=width,
                )  # fmt: skip
            config = decoding.DecodeConfig(
                verification=decoding.parse_verify("greedy"),
                max_new_tokens=args.max_new_tokens,
                max_draft=k,
                eos_ids=eos,
                collect_stats=False,
            )
            return decoding.speculative_decode(
                target.model, drafters[kind], [ids], policy=decoding.Constant(k=k),
                config=config, prompt_width=width,
            )  # fmt: skip

        decode(prompt_ids[0])  # compiles; untimed
        rows = []
        for ids in prompt_ids:
            out = decode(ids)
            row = {
                "tokens": [int(t) for t in out.tokens[0]],
                "seconds": float(out.prefill_s + out.decode_s),
            }
            if out.stats is not None:
                s = out.stats
                drafting = np.asarray(s.active[:, 0]) & (np.asarray(s.depth[:, 0]) > 0)
                acc = np.asarray(s.accepted[:, 0])[drafting]
                row["drafts"] = int(drafting.sum())
                row["accepted_per_pos"] = [int((acc > i).sum()) for i in range(k)]
            rows.append(row)
        results[name] = {"engine": "jaxcert", "dtype": "float32", "k": k, "prompts": rows}
        _save(out_path, results)
        total = sum(len(r["tokens"]) for r in rows) / sum(r["seconds"] for r in rows)
        print(f"jaxcert {name}: {total:.2f} tokens/s", flush=True)


# 3. vLLM ------------------------------------------------------------------------------


def _metric(metrics, name):
    for m in metrics:
        if m.name == name:
            return list(m.values) if hasattr(m, "values") else m.value
    return None


def step_vllm(args) -> None:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    from vllm import LLM, SamplingParams

    run = _load(args.run / "prompts.json")
    prompt_ids = [r["ids"] for r in run["prompts"]]
    out_path = args.run / f"vllm-{args.dtype}.json"
    results = _load(out_path)
    n, lo = (int(x) for x in args.ngram.split(":"))
    for name, kind, k in configs(args):
        if name in results:
            continue
        spec = None
        if kind == "ngram":
            spec = {"method": "ngram", "num_speculative_tokens": k,
                    "prompt_lookup_max": n, "prompt_lookup_min": lo}  # fmt: skip
        elif kind == "draft":
            spec = {"method": "draft_model", "model": str(args.drafter_hf),
                    "num_speculative_tokens": k}  # fmt: skip
        elif kind == "eagle3":
            spec = {"method": "eagle3", "model": str(args.head_hf), "num_speculative_tokens": k}
        llm = LLM(
            model=str(args.target_hf), dtype=args.dtype, speculative_config=spec,
            max_model_len=1024, disable_log_stats=False, seed=0, enforce_eager=True,
        )  # fmt: skip
        params = SamplingParams(temperature=0.0, max_tokens=args.max_new_tokens)
        llm.generate([{"prompt_token_ids": prompt_ids[0]}], params, use_tqdm=False)  # warm-up
        rows = []
        for ids in prompt_ids:
            before = llm.get_metrics()
            start = time.perf_counter()
            out = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)
            seconds = time.perf_counter() - start
            after = llm.get_metrics()
            row = {"tokens": list(out[0].outputs[0].token_ids), "seconds": seconds}
            if spec is not None:
                drafts = [_metric(m, "vllm:spec_decode_num_drafts") or 0 for m in (before, after)]
                per = [
                    _metric(m, "vllm:spec_decode_num_accepted_tokens_per_pos") or [0] * k
                    for m in (before, after)
                ]
                row["drafts"] = int(drafts[1] - drafts[0])
                row["accepted_per_pos"] = [int(b - a) for a, b in zip(per[0], per[1], strict=True)]
            rows.append(row)
        results[name] = {"engine": "vllm", "dtype": args.dtype, "k": k, "prompts": rows}
        _save(out_path, results)
        total = sum(len(r["tokens"]) for r in rows) / sum(r["seconds"] for r in rows)
        print(f"vllm {args.dtype} {name}: {total:.2f} tokens/s", flush=True)
        del llm
        import gc

        gc.collect()


# 4. report ----------------------------------------------------------------------------


def _bootstrap(num, den, rng, reps=2000):
    """95% interval of ``sum(num) / sum(den)`` resampling prompts."""
    import numpy as np

    num, den = np.asarray(num, float), np.asarray(den, float)
    idx = rng.integers(0, len(num), (reps, len(num)))
    ratios = num[idx].sum(1) / np.maximum(den[idx].sum(1), 1e-12)
    return [float(np.quantile(ratios, 0.025)), float(np.quantile(ratios, 0.975))]


def step_report(args) -> None:
    import numpy as np

    runs = {
        "jaxcert float32": _load(args.run / "jaxcert.json"),
        "vllm float32": _load(args.run / "vllm-float32.json"),
        "vllm bfloat16": _load(args.run / "vllm-bfloat16.json"),
    }
    rng = np.random.default_rng(0)
    report: dict = {}
    names = list(dict.fromkeys(n for r in runs.values() for n in r))
    lines = [
        "| configuration | engine | tokens/s | speedup | identical to own target-only | "
        "identical to jaxcert target-only | accepted fraction per position [95% CI] |",
        "|---|---|---|---|---|---|---|",
    ]
    base_tokens = {e: r.get("target", {}).get("prompts") for e, r in runs.items()}
    jax_base = base_tokens["jaxcert float32"]
    for name in names:
        for engine, r in runs.items():
            if name not in r:
                continue
            rows = r[name]["prompts"]
            tps = sum(len(x["tokens"]) for x in rows) / sum(x["seconds"] for x in rows)
            base = base_tokens[engine]
            speed = None
            if base:
                base_tps = sum(len(x["tokens"]) for x in base) / sum(x["seconds"] for x in base)
                speed = tps / base_tps
            own = (
                sum(a["tokens"] == b["tokens"] for a, b in zip(rows, base, strict=True))
                if base
                else None
            )
            cross = (
                sum(a["tokens"] == b["tokens"] for a, b in zip(rows, jax_base, strict=True))
                if jax_base
                else None
            )
            per = []
            if "drafts" in rows[0]:
                drafts = [x["drafts"] for x in rows]
                for i in range(r[name]["k"]):
                    acc = [x["accepted_per_pos"][i] for x in rows]
                    per.append(
                        {
                            "fraction": sum(acc) / max(sum(drafts), 1),
                            "ci": _bootstrap(acc, drafts, rng),
                        }  # fmt: skip
                    )
            report.setdefault(name, {})[engine] = {
                "tokens_per_s": tps, "speedup": speed, "identical_own": own,
                "identical_jaxcert": cross, "prompts": len(rows), "accepted_per_pos": per,
                "drafts": sum(x.get("drafts", 0) for x in rows),
            }  # fmt: skip
            cell = " / ".join(
                f"{p['fraction']:.2f} [{p['ci'][0]:.2f}, {p['ci'][1]:.2f}]" for p in per
            )
            lines.append(
                f"| {name} | {engine} | {tps:.2f} | "
                f"{'' if speed is None else f'{speed:.2f}x'} | "
                f"{'' if own is None else f'{own}/{len(rows)}'} | "
                f"{'' if cross is None else f'{cross}/{len(rows)}'} | {cell} |"
            )
    _save(args.run / "report.json", report)
    (args.run / "report.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def main(argv=None) -> None:
    args = _args(argv)
    {"prompts": step_prompts, "jaxcert": step_jaxcert, "vllm": step_vllm,
     "report": step_report}[args.step](args)  # fmt: skip


if __name__ == "__main__":
    main()
