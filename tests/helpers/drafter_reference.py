"""A NumPy float64 reference of a drafter's terms against a target, from the spec."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxcert import models
from jaxcert.core.reference import certificate_np
from jaxcert.pipeline import report


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


def check_drafter_rows(rows, mine, ref, shown, rules, seen: dict) -> None:
    """Asserts a certify run's drafter columns at the rows ``mine`` of ``rows`` (a table as
    a dict of columns): ``kl`` and ``tv`` against ``ref``; ``drafter_token`` and every
    rule's ``accepted_<rule>`` against ``shown`` (what the drafter proposes; ``ref`` for a
    language model); ``certified_<rule>`` against ``ref`` wherever KL and ``C_p`` are apart
    (not within rounding); never certified and rejected. Adds the certified and
    uncertified counts to ``seen``."""
    got = {k: np.asarray([rows[k][r] for r in mine]) for k in ("kl", "tv", "drafter_token")}
    np.testing.assert_allclose(got["kl"], ref["kl"], rtol=5e-4, atol=1e-5)
    np.testing.assert_allclose(got["tv"], ref["tv"], rtol=5e-4, atol=1e-5)
    np.testing.assert_array_equal(got["drafter_token"], shown["drafter_token"])
    for j, rule in enumerate(rules):
        certified = np.asarray([rows[report.certified_column(rule)][r] for r in mine])
        accepted = np.asarray([rows[report.accepted_column(rule)][r] for r in mine])
        np.testing.assert_array_equal(accepted, shown["accepted"][:, j], err_msg=rule.spec)
        apart = np.abs(ref["kl"] - ref["cert"][:, j]) > 1e-3 * (1 + ref["kl"])
        np.testing.assert_array_equal(certified[apart], ref["certified"][apart, j])
        assert not np.any(certified & ~accepted), rule.spec
        seen["certified"] += int(certified.sum())
        seen["uncertified"] += int((~certified).sum())
