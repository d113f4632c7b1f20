"""Fixtures of the decoder tests: a tiny target and two drafters, shared decoding runs.

Every drafter has the target's architecture, so one compiled decoder serves all of them:
``similar`` is the target with small weight noise (long accepted runs), ``unlike`` an
independent random model (mostly rejections).
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jaxcert import decoding
from jaxcert.base.programs import default_programs
from tests.helpers.tiny_decoding import CONFIG, MAX_NEW, PROMPTS, WIDTH, random_model

# Compilation dominates these tests (tiny models, a dozen decoder configurations) and LLVM's
# optimisations buy nothing at this size: -O0 halves the decoders' compile time.
default_programs().compiler_options["xla_backend_optimization_level"] = 0


@pytest.fixture(scope="session")
def target():
    return random_model(CONFIG, seed=1)


@pytest.fixture(scope="session")
def drafters(target):
    from flax import nnx

    from jaxcert.models import EagleHead

    half = range(0, CONFIG.vocab_size, 2)
    return {
        "similar": random_model(CONFIG, seed=7, noise_of=target, scale=0.003),
        "unlike": random_model(CONFIG, seed=2),
        "eagle": EagleHead.from_target(target, rngs=nnx.Rngs(3), taps=(0, 1), draft_vocab=half),
    }


@pytest.fixture(scope="session")
def greedy_reference(target):
    """Target-only greedy outputs of `PROMPTS` (each row decoded alone and in the batch)."""
    batch = decoding.target_decode(target, PROMPTS, max_new_tokens=MAX_NEW, prompt_width=WIDTH)
    alone = [
        decoding.target_decode(target, [p], max_new_tokens=MAX_NEW, prompt_width=WIDTH).tokens[0]
        for p in PROMPTS
    ]
    for a, b in zip(batch.tokens, alone, strict=True):
        np.testing.assert_array_equal(a, b)  # the tiny models have no near-ties here
    return batch.tokens


@pytest.fixture(scope="session")
def run_cache():
    """Memoised `speculative_decode` runs shared by several tests: `run(drafter, verify, ...)`."""
    results = {}

    def run(target, drafter, name, verify, policy="constant:3", prompts=None, **kw):
        prompts = PROMPTS if prompts is None else prompts
        key = (name, verify, policy, str(prompts), tuple(sorted(kw.items())))
        if key not in results:
            config = decoding.DecodeConfig(
                verification=decoding.parse_verify(verify),
                max_new_tokens=kw.pop("max_new_tokens", MAX_NEW),
                **kw,
            )
            results[key] = decoding.speculative_decode(
                target,
                drafter,
                prompts,
                policy=decoding.parse_policy(policy),
                config=config,
                key=jax.random.key(0),
                prompt_width=WIDTH,
            )
        return results[key]

    return run
