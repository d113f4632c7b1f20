"""A NumPy float64 reference of a drafter's terms against a target, from the spec."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxcert import models
from jaxcert.core.reference import certificate_np


def drafter_reference(p_logits, q_logits, rules) -> dict[str, np.ndarray]:
    """Per row of ``[N, V]`` logits: ``kl`` = KL(p||q), ``tv`` = 1 - sum min(p, q), ``cert``
    ``[N, R]`` (C_p of the reference solver), ``certified`` = KL < C_p, ``accepted`` (one of
    q's top-m tokens, by a stable sort: ties to the lower id, is in the reference solver's
    U) and ``drafter_token`` (q's greedy token), all in float64."""
    rows = []
    p_logits, q_logits = np.asarray(p_logits, np.float64), np.asarray(q_logits, np.float64)
    for x, y in zip(p_logits, q_logits, strict=True):
        p = np.exp(x - x.max())
        p /= p.sum()
        q = np.exp(y - y.max())
        q /= q.sum()
        kl = float(np.sum(np.where(p > 0, p * (np.log(p) - np.log(q)), 0.0)))
        order = np.argsort(-q, kind="stable")
        certs, accepted = [], []
        for rule in rules:
            ref = certificate_np(p, rule)
            certs.append(ref.value)
            accepted.append(bool(np.isin(order[: rule.list_size], ref.upper_set).any()))
        rows.append((kl, 1.0 - np.minimum(p, q).sum(), certs, accepted, order[0]))
    kl, tv, certs, accepted, token = (np.asarray(c) for c in zip(*rows, strict=True))
    return {"kl": kl, "tv": tv, "cert": certs, "certified": kl[:, None] < certs,
            "accepted": accepted, "drafter_token": token}  # fmt: skip


def teacher_forced_logits(lm, ids) -> np.ndarray:
    """``[T, V]`` logits of a loaded model at every position of ``ids``, from one prefill."""
    graphdef, state = nnx.split(lm.model)
    cache = models.KVCache.create(lm.config, 1, len(ids) + 1)
    logits, _ = models.forward(graphdef, state, jnp.asarray([ids], jnp.int32), cache)
    return np.asarray(logits[0])
