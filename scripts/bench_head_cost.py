"""Cost of one drafted token of an EAGLE head, relative to one target step (random weights).

Builds the target from its config only (random weights of the real shape, float32, batch 1;
no checkpoint is read) and three heads over it: EAGLE-1 over the full vocabulary, EAGLE-3
(taps low / mid / high) over the full vocabulary, and EAGLE-3 over a reduced draft
vocabulary. Times one-token steps on a cache already holding ``--context`` entries (median of
``--repeats`` after a compile run) and prints each head's cost per drafted token as a
fraction of the target's step; ``fuse`` (once per verified target position, not per drafted
token) is timed apart. The config is the cached asset's (``--target``) if it is in the asset
cache, else its kept shape in ``scripts/shapes/`` (the default models' ``config.json``);
``--tiny`` runs a tiny config (a sanity run).

Example::

  python scripts/bench_head_cost.py --json jaxcert-out/head_cost.json
  python scripts/bench_head_cost.py --tiny
"""

from __future__ import annotations

import argparse
import json
import pathlib
import platform
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxcert import models
from jaxcert.base import assets

# The default models' shapes (config.json alone), for a machine where they are not cached.
SHAPES = pathlib.Path(__file__).resolve().parent / "shapes"


def target_config(name: str, tiny: bool) -> tuple[models.ModelConfig, str]:
    """``(config, where it came from)``: tiny, the cached asset's, or its kept shape.

    Raises:
      SystemExit: ``name`` is neither cached nor kept in ``scripts/shapes/``.
    """
    if tiny:
        return models.ModelConfig.tiny(), "tiny"
    path = assets.cached_path(name) if name in assets.ASSETS else None
    if path is not None:
        return models.read_config(path), f"asset {name}"
    if (SHAPES / name / "config.json").is_file():
        return models.read_config(SHAPES / name), f"kept shape {name}"
    kept = ", ".join(sorted(p.name for p in SHAPES.iterdir() if p.is_dir()))
    raise SystemExit(f"--target {name!r}: not cached and no kept shape (kept: {kept})")


def _median_ms(fn, *args, repeats: int, **kw) -> float:
    jax.block_until_ready(fn(*args, **kw))  # compile
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args, **kw))
        times.append(time.perf_counter() - t0)
    return 1000 * float(np.median(times))


def time_step(model, filled: int, repeats: int, **kw) -> float:
    """Milliseconds of one one-token `forward` of `model` on a cache of `filled` entries."""
    graphdef, params = nnx.split(model)
    cache = model.init_cache(1, filled + 8).commit(filled)
    step = jax.jit(models.forward, static_argnums=0)
    tokens = jnp.ones((1, 1), jnp.int32)
    return _median_ms(step, graphdef, params, tokens, cache, repeats=repeats, **kw)


def time_fuse(head, repeats: int) -> float:
    """Milliseconds of `head.fuse` of one position's tapped states."""
    graphdef, params = nnx.split(head)
    fuse = jax.jit(lambda g, s, x: nnx.merge(g, s).fuse(x), static_argnums=0)
    width = len(head.taps) * head.config.hidden_size
    return _median_ms(fuse, graphdef, params, jnp.ones((1, 1, width)), repeats=repeats)


def run(config: models.ModelConfig, *, draft_size: int, context: int, repeats: int) -> dict:
    """The timings (ms) and ratios (head step / target step) as a dict."""
    target = models.Transformer(config, rngs=nnx.Rngs(0))
    e, n = config.hidden_size, config.num_layers
    taps = (min(2, n - 1), n // 2, max(n - 3, 0))
    taps = tuple(sorted(set(taps)))
    draft_size = min(draft_size, config.vocab_size)
    ids = np.arange(draft_size, dtype=np.int32)  # which ids does not change the cost
    ctx = dict(context=jnp.ones((1, 1, e), jnp.float32))
    out: dict = {"target_ms": time_step(target, context, repeats)}
    heads = {
        "eagle1_full": dict(),
        "eagle3_full": dict(taps=taps),
        f"eagle3_draft{draft_size}": dict(taps=taps, draft_vocab=ids),
    }
    for name, kw in heads.items():
        head = models.EagleHead.from_target(target, **kw)
        ms = time_step(head, context, repeats, **ctx)
        out[f"{name}_ms"] = ms
        out[f"{name}_ratio"] = ms / out["target_ms"]
        print(f"{name:>22}: {ms:8.2f} ms  = {ms / out['target_ms']:.3f} target steps", flush=True)
        if kw.get("taps") and "fuse_ms" not in out:
            out["fuse_ms"] = time_fuse(head, repeats)
    out.update(taps=list(taps), draft_size=draft_size)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="qwen2.5-coder-1.5b-instruct", help="asset (if cached)")
    p.add_argument("--tiny", action="store_true", help="a tiny config (sanity run, seconds)")
    p.add_argument(
        "--draft-vocab", type=int, default=None, help="V' of the reduced head (32000; tiny: V/4)"
    )
    p.add_argument("--context", type=int, default=200, help="entries already in each cache")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", type=pathlib.Path, default=pathlib.Path("jaxcert-out/head_cost.json"))
    args = p.parse_args(argv)
    config, source = target_config(args.target, args.tiny)
    print(
        f"target: {source} (V={config.vocab_size}, E={config.hidden_size}, "
        f"L={config.num_layers}), float32, batch 1, context {args.context}",
        flush=True,
    )
    draft = args.draft_vocab or (config.vocab_size // 4 if args.tiny else 32_000)
    out = run(config, draft_size=draft, context=args.context, repeats=args.repeats)
    print(f"{'target':>22}: {out['target_ms']:8.2f} ms", flush=True)
    if "fuse_ms" in out:
        print(f"{'fuse (per target pos)':>22}: {out['fuse_ms']:8.2f} ms", flush=True)
    meta = {
        "config_source": source,
        "config": {k: v for k, v in vars(config).items() if not k.endswith("_ids")},
        "context": args.context,
        "repeats": args.repeats,
        "backend": jax.default_backend(),
        "devices": [str(d) for d in jax.devices()],
        "machine": platform.platform(),
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(meta | out, indent=2) + "\n")
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
