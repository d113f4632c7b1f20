"""A sweep of 200 decoding configurations in one process compiles a bounded number of
programs, and its memory maps and resident memory stay flat.

A sweep used to compile two programs per budget (budget, end tokens, temperature and top-p
were static) until XLA's memory maps reached the system's limit and the process died in
compilation (``max_new_tokens = 51`` on a tiny model).
"""

from __future__ import annotations

import itertools
import pathlib
import resource

import numpy as np
import pytest

from jaxcert import decoding
from jaxcert.base.programs import default_programs
from tests.helpers.tiny_decoding import PROMPTS


def _maps() -> int:
    return len(pathlib.Path("/proc/self/maps").read_text().splitlines())


def _rss_mb() -> float:
    fields = pathlib.Path("/proc/self/status").read_text().split("VmRSS:")[1].split()
    return int(fields[0]) / 1024


def _configs():
    """200 configurations: budgets 1-40, end-token sets, temperatures, top-p and policies,
    over two static shapes (greedy chain, speculative sampling) and target-only."""
    rng = np.random.default_rng(0)
    policies = ["constant:2", "constant:4", "heuristic", "svip:0.3", "confidence:0.4", "cert"]
    out = []
    for i in itertools.count():
        if len(out) == 200:
            return out
        # The first 24 cover every (decoder, buffer bucket) pair: the warm-up compiles all.
        budget = (5, 20, 40)[(i // 4) % 3] if i < 24 else int(rng.integers(1, 41))
        eos = tuple(int(t) for t in rng.choice(48, int(rng.integers(0, 4)), replace=False))
        kind = i % 4
        if kind == 3:
            temp = (0.0, 0.7)[(i // 12) % 2] if i < 24 else float(rng.choice([0.0, 0.7, 1.3]))
            out.append(("target", budget, eos, temp, 0.9, None))
        elif kind == 2:
            temp, top_p = float(rng.uniform(0.3, 1.5)), float(rng.choice([1.0, 0.8]))
            out.append(("sample", budget, eos, temp, top_p, policies[i % len(policies)]))
        else:
            out.append(("greedy", budget, eos, 0.0, 1.0, policies[i % len(policies)]))


def _run(target, drafter, config):
    verify, budget, eos, temperature, top_p, policy = config
    if verify == "target":
        return decoding.target_decode(
            target, PROMPTS, max_new_tokens=budget, temperature=temperature, top_p=top_p,
            eos_ids=eos,
        )  # fmt: skip
    cfg = decoding.DecodeConfig(
        verification=verify, max_new_tokens=budget, max_draft=4, eos_ids=eos,
        temperature=temperature, top_p=top_p, buckets=(2, 4),
    )  # fmt: skip
    return decoding.speculative_decode(
        target, drafter, PROMPTS, policy=decoding.parse_policy(policy), config=cfg
    )


@pytest.mark.slow  # a minute: runs in CI (--run-slow)
def test_a_sweep_compiles_a_bounded_number_of_programs_with_flat_memory(target, drafters):
    configs = _configs()
    before = default_programs().compiled
    warm = configs[:60]
    for config in warm:
        out = _run(target, drafters["similar"], config)
        # Budgets and end tokens are honoured though they are no longer compiled in.
        for row in out.tokens:
            assert 1 <= len(row) <= config[1]
            assert not any(t in config[2] for t in row[:-1])
    compiled_warm = default_programs().compiled - before
    maps, rss = _maps(), _rss_mb()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    for config in configs[60:]:
        out = _run(target, drafters["similar"], config)
    compiled = default_programs().compiled - before
    print(f"compiled {compiled}; maps {maps} -> {_maps()}; RSS {rss:.0f} -> {_rss_mb():.0f} MB")
    # Budgets 1-40 fall in 3 buffer buckets (16, 32, 48). Per bucket: prefill and rounds of
    # the greedy and the sampling decoder, the target-only prefill and its greedy and sampled
    # steps: 7 programs, whatever the budgets, end tokens, temperatures, top-p and policies.
    assert compiled <= 3 * 7, compiled
    assert compiled == compiled_warm  # the last 140 configurations compiled nothing
    assert _maps() - maps <= 20, (maps, _maps())
    assert _rss_mb() - rss <= 64, (rss, _rss_mb(), peak)


def test_compiled_programs_are_bounded(target, drafters, monkeypatch):
    """The cache of compiled decoders evicts the least recently used program beyond
    max_programs (each holds hundreds of memory maps); evicted shapes compile again."""

    monkeypatch.setattr(default_programs(), "max_programs", 2)
    default_programs().clear()
    first = _run(target, drafters["similar"], ("greedy", 5, (), 0.0, 1.0, "constant:2"))
    _run(target, drafters["similar"], ("greedy", 20, (), 0.0, 1.0, "constant:2"))
    assert len(default_programs()) == 2
    before = default_programs().compiled
    again = _run(target, drafters["similar"], ("greedy", 5, (), 0.0, 1.0, "constant:2"))
    assert default_programs().compiled - before == 2 and again.compiled == 2  # it was evicted
    for a, b in zip(first.tokens, again.tokens, strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize(
    "verify, max_draft, want",
    [
        ("greedy", 40, (1, 2, 4, 8, 16, 24, 40)),  # 7 target copies, not one per depth
        ("greedy", 8, (1, 2, 4, 8)),
        ("greedy", 5, (1, 2, 4, 5)),
        ("greedy", 1, (1,)),
        ("tree:2x4", 40, (2, 4, 8)),  # levels 1, 2, 4 of 2 branches
        ("dyntree:4x6x24", 40, (6, 12, 24)),
    ],
)
def test_default_verification_buckets(verify, max_draft, want):
    config = decoding.DecodeConfig(verification=verify, max_draft=max_draft)
    assert config.verify_buckets() == want
    assert config.verify_buckets()[-1] == config.num_nodes
