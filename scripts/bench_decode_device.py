"""Decode speed of target-only, the 0.5B drafter and a draft head where their weights cannot go.

Built for ``scripts/device_check.sh``: an accelerator machine that the real checkpoints
cannot reach. The models are built from their configs alone (``models.read_config``: by
default the kept shapes in ``scripts/shapes/``) with random weights in ``--dtype``; the
head is an EAGLE-3 head over the target with the trained head's taps and draft vocabulary
size (``--taps``, ``--draft-vocab``). Prompts are random token ids.

A round's work does not depend on what is accepted when its draft length is fixed
(``constant:K``: K drafted tokens, a verification of K + 1), so the seconds a round measured
here are what the real weights would cost. What random weights cannot give is acceptance
(almost nothing is accepted). Per batch size and configuration the script reports:

- target-only tokens/s, measured;
- seconds a round and tokens/s, measured (random drafts are rejected: a floor);
- the projected tokens/s and speedup over target-only: the tokens per round that the real
  weights reached on CPU (``--acceptance``, a ``bench_decode.py`` JSON; batch 1, T = 0) over
  the seconds a round measured here. At batch > 1 the batch-1 acceptance is used.

The configurations and the CPU rows whose acceptance they take: the 0.5B chain (``chain
cert:0.55``), the head's chain (``head/chain constant:2``) and its ``tree:2x2``
(``head/tree:2x2 constant:2``). K is the row's own for a ``constant:K`` row, else its mean
drafted tokens a round, rounded (3 for the 0.5B).

Example (on the GPU machine; ``--tiny`` runs tiny configs in seconds, a sanity run)::

  python scripts/bench_decode_device.py --dtype bfloat16 --batch-sizes 1,8 \\
      --json /tmp/decode_device.json

Raises ``SystemExit`` (argparse's message) for a config that cannot be read or an
``--acceptance`` file without the rows it needs.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import platform
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxcert import decoding, models
from jaxcert.cli.argtypes import positive
from jaxcert.decoding import policies
from jaxcert.models import eagle

ROOT = pathlib.Path(__file__).resolve().parents[1]
SHAPES = ROOT / "scripts" / "shapes"
ACCEPTANCE = ROOT / "docs" / "results" / "decode_head_128.json"


@dataclasses.dataclass(frozen=True)
class Setup:
    """One speculative configuration: who drafts, the draft shape, the CPU row it reads."""

    name: str
    drafter: str  # "lm" (the drafter model) or "head"
    shape: str  # "chain" or "tree:MxD"
    cpu_shape: str  # the `shape` of the CPU benchmark's row
    cpu_policy: str  # its `policy`


SETUPS = (
    Setup("0.5B chain", "lm", "chain", "chain", "cert:0.55"),
    Setup("head chain", "head", "chain", "head/chain", "constant:2"),
    Setup("head tree:2x2", "head", "tree:2x2", "head/tree:2x2", "constant:2"),
)


def tiny_configs() -> tuple[models.ModelConfig, models.ModelConfig]:
    """A tiny target (8 blocks) and drafter (2 blocks) of one vocabulary: a sanity run."""
    target = models.ModelConfig.tiny()
    return target, models.ModelConfig.tiny(num_layers=2, hidden_size=32, head_dim=8)


def cpu_rows(path: pathlib.Path) -> dict[tuple[str, str], dict]:
    """The batch-1, T = 0 rows of a ``bench_decode.py`` JSON that the setups read.

    Raises:
      ValueError: the file is missing, not JSON, or lacks a setup's row (named).
    """
    try:
        rows = json.loads(path.read_text())["rows"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"--acceptance {path}: not a bench_decode.py JSON ({e})") from None
    found = {
        (r["shape"], r["policy"]): r
        for r in rows
        if r.get("batch") == 1 and r.get("temperature") == 0.0 and "tokens_per_round" in r
    }
    for s in SETUPS:
        if (s.cpu_shape, s.cpu_policy) not in found:
            raise ValueError(
                f"--acceptance {path}: no batch-1 T=0 row for {s.cpu_shape} {s.cpu_policy} "
                f"(needed by {s.name!r})"
            )
    return found


def parse_taps(text: str, num_layers: int) -> tuple[int, ...]:
    """``--taps`` as distinct block indices of the target, checked before any model is built.

    Raises:
      ValueError: not comma-separated integers, repeated, or outside ``[0, num_layers)``.
    """
    try:
        taps = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"--taps must be comma-separated block indices, got {text!r}") from None
    try:
        return eagle.check_taps(taps, num_layers)  # the head's own check
    except ValueError:
        raise ValueError(
            f"--taps must be distinct target blocks in [0, {num_layers}), got {text!r}"
        ) from None


def draft_length(setup: Setup, cpu_row: dict) -> int:
    """K of the setup's ``constant:K``: the CPU row's own if constant, else its mean drafted
    tokens a round, rounded (at least 1)."""
    if setup.cpu_policy.startswith("constant:"):
        return int(setup.cpu_policy.split(":")[1])
    return max(1, round(float(cpu_row["mean_drafted"])))


def _timed(run, repeats: int):
    """The first call compiles; returns the output with the median ``decode_s`` of the rest."""
    run()
    outs = [run() for _ in range(repeats)]
    seconds = float(np.median([o.decode_s for o in outs]))
    return outs[-1], seconds


def measure(
    target, drafter, head, *, batch: int, prompt_length: int, new_tokens: int, repeats: int,
    accept: dict[tuple[str, str], dict], log=print,
) -> list[dict]:  # fmt: skip
    """Target-only and each setup at one batch size; rows as dicts (see the module docstring)."""
    vocab = target.config.vocab_size
    rng = np.random.default_rng(batch)
    prompts = [rng.integers(0, vocab, prompt_length).tolist() for _ in range(batch)]
    base, base_s = _timed(
        lambda: decoding.target_decode(target, prompts, max_new_tokens=new_tokens), repeats
    )
    base_tps = base.num_tokens / base_s
    step_ms = base_s / new_tokens * 1e3
    log(f"batch {batch}: target only {base_tps:.1f} tok/s ({step_ms:.2f} ms a step)")
    rows = [dict(batch=batch, setup="target only", tokens_per_s=base_tps, step_ms=step_ms)]
    for s in SETUPS:
        cpu = accept[(s.cpu_shape, s.cpu_policy)]
        k = draft_length(s, cpu)
        config = decoding.DecodeConfig(verification=s.shape, max_new_tokens=new_tokens, max_draft=k)
        model = drafter if s.drafter == "lm" else head
        policy = policies.parse_policy(f"constant:{k}")
        out, secs = _timed(
            lambda m=model, c=config, p=policy: decoding.speculative_decode(
                target, m, prompts, policy=p, config=c
            ),
            repeats,
        )
        rounds = float(np.mean(out.rounds))
        round_ms = secs / rounds * 1e3
        tpr = float(cpu["tokens_per_round"])
        projected = batch * tpr / (secs / rounds)
        row = dict(
            batch=batch, setup=s.name, policy=f"constant:{k}", round_ms=round_ms,
            round_in_steps=round_ms / step_ms, tokens_per_s=out.num_tokens / secs,
            speedup=out.num_tokens / secs / base_tps, cpu_tokens_per_round=tpr,
            projected_tokens_per_s=projected, projected_speedup=projected / base_tps,
        )  # fmt: skip
        rows.append(row)
        log(
            f"batch {batch}: {s.name:>13} constant:{k}: a round {round_ms:.2f} ms "
            f"({row['round_in_steps']:.2f} steps); measured {row['tokens_per_s']:.1f} tok/s "
            f"(random weights); at {tpr:.2f} tokens/round {projected:.1f} tok/s = "
            f"{row['projected_speedup']:.2f}x target-only"
        )
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--model",
        default=str(SHAPES / "qwen2.5-coder-1.5b-instruct"),
        help="the target's config (a folder, .gguf file or asset name)",
    )
    p.add_argument(
        "--drafter", default=str(SHAPES / "qwen2.5-coder-0.5b-instruct"), help="its config"
    )
    p.add_argument("--tiny", action="store_true", help="tiny configs (a sanity run, seconds)")
    p.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--taps", default="2,14,25", help="the head's target blocks (tiny: 1,4,6)")
    p.add_argument("--draft-vocab", type=positive, default=32768, help="the head's V' (tiny: V/4)")
    p.add_argument("--batch-sizes", default="1,8")
    p.add_argument("--prompt-length", type=positive, default=128)
    p.add_argument("--max-new-tokens", type=positive, default=128)
    p.add_argument("--repeats", type=positive, default=3)
    p.add_argument("--acceptance", type=pathlib.Path, default=ACCEPTANCE)
    p.add_argument("--json", type=pathlib.Path, default=None, help="write the rows here")
    args = p.parse_args(argv)
    try:
        accept = cpu_rows(args.acceptance)
        if args.tiny:
            t_config, d_config = tiny_configs()
            taps, draft = (1, 4, 6), t_config.vocab_size // 4
        else:
            t_config, d_config = models.read_config(args.model), models.read_config(args.drafter)
            taps, draft = parse_taps(args.taps, t_config.num_layers), args.draft_vocab
        batches = [positive(x) for x in args.batch_sizes.split(",")]
        dt = jnp.dtype(args.dtype)
        target = models.Transformer(t_config, rngs=nnx.Rngs(0), dtype=dt, param_dtype=dt)
        drafter = models.Transformer(d_config, rngs=nnx.Rngs(1), dtype=dt, param_dtype=dt)
        draft_ids = np.arange(min(draft, t_config.vocab_size), dtype=np.int32)
        head = models.EagleHead.from_target(target, taps=taps, draft_vocab=draft_ids)
    except (ValueError, argparse.ArgumentTypeError) as e:
        p.error(str(e))
    print(
        f"{jax.default_backend()} {jax.devices()[0].device_kind}; {args.dtype}, random weights; "
        f"target E={t_config.hidden_size} L={t_config.num_layers}, drafter "
        f"E={d_config.hidden_size} L={d_config.num_layers}, head taps {taps} V'={draft_ids.size}",
        flush=True,
    )
    rows, start = [], time.perf_counter()
    for batch in batches:
        rows += measure(
            target, drafter, head, batch=batch, prompt_length=args.prompt_length,
            new_tokens=args.max_new_tokens, repeats=args.repeats, accept=accept,
            log=lambda m: print(m, flush=True),
        )  # fmt: skip
        if args.json:  # after every batch size: a killed run keeps what it measured
            args.json.parent.mkdir(parents=True, exist_ok=True)
            meta = dict(
                backend=jax.default_backend(), device=jax.devices()[0].device_kind,
                dtype=args.dtype, tiny=args.tiny, taps=list(taps), draft_vocab=int(draft_ids.size),
                prompt_length=args.prompt_length, max_new_tokens=args.max_new_tokens,
                acceptance=str(args.acceptance), machine=platform.platform(),
                seconds=round(time.perf_counter() - start, 1),
            )  # fmt: skip
            args.json.write_text(json.dumps(meta | {"rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
