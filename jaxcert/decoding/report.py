"""Host-side tables and summaries of decoding runs (numpy / pyarrow, no device work)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pyarrow as pa

from jaxcert.decoding.state import RoundStats

__all__ = ["round_table", "node_table", "summarize", "acceptance_by_depth"]


def round_table(stats: RoundStats, prompt_ids: Sequence[str], *, start_round: int = 0) -> pa.Table:
    """One row per (round, batch row) that took part: drafted, depth, accepted, emitted."""
    r, b = np.nonzero(stats.active)
    return pa.table(
        {
            "prompt_id": [prompt_ids[i] for i in b],
            "round": (r + start_round).astype(np.int32),
            "drafted": stats.drafted[r, b],
            "depth": stats.depth[r, b],
            "accepted": stats.accepted[r, b],
            "emitted": stats.emitted[r, b],
        }
    )


def node_table(stats: RoundStats, prompt_ids: Sequence[str], *, start_round: int = 0) -> pa.Table:
    """One row per drafted node: its depth, rank, verdicts, KL, certificates and entropy."""
    ns = stats.nodes
    r, b, i = np.nonzero(ns.valid)
    kl, cert = ns.kl[r, b, i], ns.cert[r, b, i]
    return pa.table(
        {
            "prompt_id": [prompt_ids[x] for x in b],
            "round": (r + start_round).astype(np.int32),
            "node": i.astype(np.int32),
            "depth": ns.depth[r, b, i],
            "rank": ns.rank[r, b, i],
            "passes": ns.passes[r, b, i],
            "accepted": ns.accepted[r, b, i],
            "reached": ns.reached[r, b, i],
            "kl": kl,
            "cert": cert,
            "certified": kl < cert,
            "cert_list": ns.cert_list[r, b, i],
            "covered": ns.covered[r, b, i],
            "entropy": ns.entropy[r, b, i],
            "q_top": ns.q_top[r, b, i],
            "q_cert": ns.q_cert[r, b, i],
        }
    )


def acceptance_by_depth(stats: RoundStats, max_depth: int = 8) -> list[float]:
    """Per-position acceptance rate: P(depth-d path accepted | depth d-1 accepted, d drafted).

    For trees: a depth counts as accepted when the accepted path reaches it.
    """
    active = stats.active
    drafted, accepted = stats.depth[active], stats.accepted[active]
    rates = []
    for d in range(1, max_depth + 1):
        reached = (accepted >= d - 1) & (drafted >= d)
        rates.append(float(np.mean(accepted[reached] >= d)) if reached.any() else float("nan"))
    return rates


def summarize(stats: RoundStats | None, num_tokens: int, decode_s: float) -> dict:
    """Throughput and acceptance summary of one run (``stats=None``: target-only)."""
    out = {"tokens": int(num_tokens), "decode_s": round(decode_s, 3)}
    out["tokens_per_s"] = round(num_tokens / decode_s, 3) if decode_s > 0 else float("nan")
    if stats is None or not np.any(stats.active):
        return out
    a = stats.active
    ns = stats.nodes
    valid = ns.valid
    first = valid & (ns.rank == 0)
    with np.errstate(invalid="ignore"):
        certified = ns.kl < ns.cert
    out |= {
        "rounds": int(a.sum()),
        "mean_drafted": round(float(stats.drafted[a].mean()), 3),
        "mean_depth": round(float(stats.depth[a].mean()), 3),
        "mean_accepted": round(float(stats.accepted[a].mean()), 3),
        "tokens_per_round": round(float(stats.emitted[a].mean()), 3),
        "acceptance_rate": round(float(stats.accepted[a].sum() / max(stats.depth[a].sum(), 1)), 4),
        "acceptance_by_depth": [  # None where no round drafted that deep (JSON has no NaN)
            None if np.isnan(x) else round(x, 4) for x in acceptance_by_depth(stats)
        ],
        "mean_kl": round(float(np.mean(ns.kl[first])), 4) if first.any() else float("nan"),
        "mean_drafter_entropy": round(float(np.mean(ns.entropy[first])), 4)
        if first.any()
        else float("nan"),
    }
    if not np.all(np.isnan(ns.cert[valid])):
        rejected = first & ~ns.passes
        out |= {
            "certified_fraction": round(float(np.mean(certified[first])), 4),
            "certified_then_rejected": int(np.sum(certified & rejected)),
        }
    return out
