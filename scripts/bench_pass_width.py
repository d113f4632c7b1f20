"""Seconds of one target forward pass by width (tokens scored at once) on a KV cache.

The cost curve behind ``DecodeConfig``'s default verification buckets: padding a pass to
the next bucket is cheap where the pass is memory-bound and costly where it is
compute-bound. Loads the real model (float32), warms every width up once, then prints the
median of 5 passes per width.

Example::

  python scripts/bench_pass_width.py --model qwen2.5-coder-1.5b-instruct
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxcert import models


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    p.add_argument("--widths", default="1,2,3,4,5,6,8,10,12,16,20,24,32,40")
    p.add_argument("--context", type=int, default=200, help="tokens already in the cache")
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)
    lm = models.load(args.model)
    graphdef, state = nnx.split(lm.model)
    step = jax.jit(models.forward, static_argnums=0)
    for w in (int(x) for x in args.widths.split(",")):
        cache = models.KVCache.create(lm.config, batch_size=1, max_length=args.context + 64)
        cache = cache.commit(args.context)
        tokens = jnp.ones((1, w), jnp.int32)
        jax.block_until_ready(step(graphdef, state, tokens, cache))  # compile
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            jax.block_until_ready(step(graphdef, state, tokens, cache))
            times.append(time.perf_counter() - t0)
        print(f"width {w:3d}: {1000 * np.median(times):7.1f} ms", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
