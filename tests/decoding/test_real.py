"""Real Qwen2.5-Coder-0.5B with its own early exit as drafter (skipped unless cached)."""

import numpy as np
import pytest

from jaxcert import decoding
from jaxcert.base.programs import default_programs

pytestmark = pytest.mark.real


@pytest.fixture(scope="module")
def qwen():
    from jaxcert import models
    from jaxcert.base import assets, prompts

    if assets.cached_path("qwen2.5-coder-0.5b-instruct") is None:
        pytest.skip("qwen2.5-coder-0.5b-instruct is not cached (jaxcert fetch it)")
    lm = models.load("qwen2.5-coder-0.5b-instruct")
    text = prompts.Prompt("0", "Write a Python function that returns the sum of a list.")
    return lm, prompts.encode_prompts(lm.tokenizer, [text])[0]


def test_greedy_speculative_equals_target_on_a_real_vocabulary(qwen, monkeypatch):
    """151,936 logits (padding ids included), a self-speculative drafter, one chat prompt."""
    from jaxcert import models

    monkeypatch.setattr(
        default_programs(), "compiler_options", {}
    )  # optimised code for a real model

    lm, prompt = qwen
    drafter = models.truncate(lm.model, 12)  # the target's first 12 of 24 layers
    eos = tuple(lm.config.eos_token_ids)
    base = decoding.target_decode(lm, [prompt], max_new_tokens=24, eos_ids=eos)
    config = decoding.DecodeConfig(max_new_tokens=24, max_draft=4, eos_ids=eos, buckets=(2, 4))
    out = decoding.speculative_decode(
        lm, drafter, [prompt], policy=decoding.parse_policy("cert"), config=config
    )
    np.testing.assert_array_equal(out.tokens[0], base.tokens[0])
    ns = out.stats.nodes
    first = ns.valid & (ns.rank == 0)
    assert not np.any(first & (ns.kl < ns.cert) & ~ns.passes)  # certificate never violated
    assert "python" in lm.tokenizer.decode(out.tokens[0]).lower()
    assert out.stats.accepted.sum() > 0
