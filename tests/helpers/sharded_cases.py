"""Sharded certificates, statistics and losses against one device (run in a subprocess).

Usage: ``python tests/helpers/sharded_cases.py V LAYOUT:MODE [LAYOUT:MODE ...]`` with 8 virtual CPU
devices (this file sets ``XLA_FLAGS`` before importing jax). LAYOUT is ``batch``, ``vocab``,
``both``, ``shard_map`` (your own shard_map over the batch) or ``shard_map_vocab`` (your own
shard_map over batch and vocabulary, with ``axis_name``); MODE is ``auto`` (GSPMD axes, under
jit), ``explicit`` (sharding in types, under jit) or ``eager`` (no jit, concrete sharded
arrays). Prints one JSON object per LAYOUT:MODE: per case the largest difference from the
single-device result, and the sharding of the outputs (gradients for GRAD_RULES). The test
(tests/core/test_sharding.py) asserts on it; an XLA abort kills only this process.
"""

from __future__ import annotations

import json
import os
import sys

if __name__ == "__main__":  # not when pytest imports this file (e.g. for doctests)
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    )

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxcert  # noqa: E402
from jaxcert import losses  # noqa: E402

RULES = (
    jaxcert.StrictGreedy(),
    jaxcert.Additive(0.3),
    jaxcert.Multiplicative(0.1),
    jaxcert.TargetTopK(2),
    jaxcert.Typical(),
    jaxcert.TreeCoverage(4),
    jaxcert.TreeCoverage(2, base=jaxcert.Additive(0.1)),
)
GRAD_RULES = (RULES[0], RULES[4], RULES[6])
SPECS = {
    "batch": P(("data", "model"), None),
    "vocab": P(None, "model"),
    "both": P("data", "model"),
    "shard_map": P(("data", "model"), None),
    "shard_map_vocab": P("data", "model"),
}


def _diff(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    if got.shape != want.shape:
        return float("inf")
    same = (got == want) | (np.isnan(got) & np.isnan(want))
    close = np.where(same, 0.0, np.abs(got - want))
    return float(np.max(close)) if close.size else 0.0


def _spec(x) -> str:
    return str(getattr(x.sharding, "spec", x.sharding))


def loss_fn(d, t, rule, axis_name=None):
    kl = losses.kl_divergence(drafter_logits=d, target_logits=t, axis_name=axis_name)
    viol = losses.certificate_violation(
        d, t, rule, margin=0.05, differentiate_target=True, axis_name=axis_name
    )
    return kl + viol


def reference(vocab: int):
    """Inputs and their single-device results."""
    key_t, key_d = jax.random.split(jax.random.key(0))
    # Flat rows (many threshold-rule rows take the exact full-vocabulary path) and peaked ones.
    scale = jnp.where(jnp.arange(16)[:, None] % 2 == 0, 3.0, 0.3)
    target = scale * jax.random.normal(key_t, (16, vocab))
    drafter = target + 0.5 * jax.random.normal(key_d, (16, vocab))
    want_c = jaxcert.certificates(target, RULES, return_q=True, top_k=8)
    want_s = jaxcert.distribution_stats(target, top=5)
    want_g = [
        jax.grad(lambda d, t, r=r: jnp.sum(loss_fn(d, t, r)), argnums=(0, 1))(drafter, target)
        for r in GRAD_RULES
    ]
    return target, drafter, want_c, want_s, want_g


def main(layout: str, mode: str, ref) -> dict:
    target, drafter, want_c, want_s, want_g = ref
    types = (AxisType.Explicit,) * 2 if mode == "explicit" else (AxisType.Auto,) * 2
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=types)
    spec = SPECS[layout]
    sharding = NamedSharding(mesh, spec)
    t_s, d_s = jax.device_put(target, sharding), jax.device_put(drafter, sharding)

    if layout.startswith("shard_map"):
        axis = "model" if layout == "shard_map_vocab" else None
        lead = P(spec[0])

        def certs(x):
            body = lambda a: jaxcert.certificates(a, RULES, top_k=8, axis_name=axis)  # noqa: E731
            out_specs = tuple(
                jaxcert.Certificate(lead, lead, lead, P(spec[0], None), lead, lead, lead)
                for _ in RULES
            )
            return jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=out_specs)(x)

        def stats(x):
            body = lambda a: jaxcert.distribution_stats(a, top=5, axis_name=axis)  # noqa: E731
            return jax.shard_map(
                body, mesh=mesh, in_specs=spec, out_specs=jaxcert.DistributionStats(*[lead] * 5)
            )(x)

        def grads(d, t, rule):
            def body(d, t):
                g = jax.grad(lambda a, b: jnp.sum(loss_fn(a, b, rule, axis)), argnums=(0, 1))
                return g(d, t)

            return jax.shard_map(body, mesh=mesh, in_specs=(spec, spec), out_specs=(spec, spec))(
                d, t
            )

        certs, stats, grads = jax.jit(certs), jax.jit(stats), jax.jit(grads, static_argnums=2)
    else:

        def certs(x):
            return jaxcert.certificates(x, RULES, return_q=True, top_k=8)

        def stats(x):
            return jaxcert.distribution_stats(x, top=5)

        def grads(d, t, rule):
            return jax.grad(lambda a, b: jnp.sum(loss_fn(a, b, rule)), argnums=(0, 1))(d, t)

        if mode != "eager":
            certs, stats, grads = jax.jit(certs), jax.jit(stats), jax.jit(grads, static_argnums=2)

    ctx = jax.set_mesh(mesh) if mode == "explicit" else _nullcontext()
    out = {"cases": {}, "shardings": {}}
    with ctx:
        got_c = certs(t_s)
        got_s = stats(t_s)
        for rule, got, want in zip(RULES, got_c, want_c, strict=True):
            fields = ("value", "margin", "greedy_token", "competitor", "pool_size", "level")
            if not layout.startswith("shard_map"):
                fields += ("q_star",)
            out["cases"][f"cert {rule.spec}"] = max(
                _diff(getattr(got, f), getattr(want, f)) for f in fields
            )
        out["shardings"]["value"] = _spec(got_c[0].value)
        if got_c[0].q_star is not None:
            out["shardings"]["q_star"] = _spec(got_c[0].q_star)
        out["cases"]["stats"] = max(
            _diff(getattr(got_s, f), getattr(want_s, f))
            for f in ("greedy_token", "top1", "top_coverage", "margin", "entropy")
        )
        for rule, want in zip(GRAD_RULES, want_g, strict=True):
            got = grads(d_s, t_s, rule)
            out["cases"][f"grad {rule.spec}"] = max(_diff(got[0], want[0]), _diff(got[1], want[1]))
        out["shardings"]["grad"] = _spec(got[0])
    return out


class _nullcontext:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


if __name__ == "__main__":
    # XLA:CPU dispatches programs asynchronously; each 8-device program's collectives wait
    # for one thread per simulated device. Eagerly, every primitive is its own program, and
    # on 2 loaded cores two programs' collectives could interleave and wait on each other
    # for ever (CI hung once in the eager case: "Expected 4 threads to join the
    # rendezvous"). Synchronous dispatch finishes each program on every device before the
    # next one starts: same results, no interleaving.
    jax.config.update("jax_cpu_enable_async_dispatch", False)
    ref = reference(int(sys.argv[1]))
    results = {}
    for pair in sys.argv[2:]:
        layout, mode = pair.split(":")
        results[pair] = main(layout, mode, ref)
    print(json.dumps(results))
