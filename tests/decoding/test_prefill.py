"""The prompt's width out of the decode programs: prompts of different lengths decoded one
at a time share every compiled program (their room in the caches is a multiple of 512), and
the prefill reads them in 64-token chunks, only as many as they fill, with the outputs of a
prefill that reads each prompt in one pass."""

import numpy as np
import pytest

from jaxcert import decoding
from jaxcert.decoding import loop
from jaxcert.decoding.config import prompt_room
from tests.helpers.tiny_decoding import CONFIG

LENGTHS = (5, 47, 64, 70, 110)  # 1, 1, 1, 2 and 2 chunks of 64


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(7)
    return [rng.integers(0, CONFIG.vocab_size, n).tolist() for n in LENGTHS]


def test_prompt_room_and_chunk():
    assert [prompt_room(n) for n in (1, 130, 512, 513)] == [512, 512, 512, 1024]
    assert [loop.prefill_chunk(w) for w in (512, 1024, 9, 100)] == [64, 64, 9, 100]
    with pytest.raises(ValueError, match="n"):
        prompt_room(0)


@pytest.mark.parametrize("drafter", ["similar", "head"])
def test_prompts_of_different_widths_compile_each_program_once(target, drafters, prompts, drafter):
    from flax import nnx

    from jaxcert.models import EagleHead

    d = drafters["similar"]
    if drafter == "head":
        d = EagleHead.from_target(target, rngs=nnx.Rngs(3), taps=(0, 1))
    config = decoding.DecodeConfig(verification="greedy", max_new_tokens=8, max_draft=3)
    shared, one_pass = decoding.Programs(), decoding.Programs()
    for prompt in prompts:
        spec = decoding.speculative_decode(
            target, d, [prompt], policy=decoding.Constant(k=3), config=config, programs=shared
        )
        plain = decoding.target_decode(target, [prompt], max_new_tokens=8, programs=shared)
        # A width that is no multiple of 64: the prompt read in one pass, as it always was.
        width = len(prompt) + (1 if (len(prompt) + 1) % 64 else 2)
        whole = decoding.target_decode(
            target, [prompt], max_new_tokens=8, prompt_width=width, programs=one_pass
        )
        whole_spec = decoding.speculative_decode(
            target, d, [prompt], policy=decoding.Constant(k=3), config=config,
            prompt_width=width, programs=one_pass,
        )  # fmt: skip
        assert len(plain.tokens[0]) == 8
        for out in (spec, whole, whole_spec):
            np.testing.assert_array_equal(out.tokens[0], plain.tokens[0])
        if drafter == "head":  # the head's drafts, read from a chunked prefill, agree too
            np.testing.assert_array_equal(spec.stats.accepted, whole_spec.stats.accepted)
    # Five widths, one program each of prefill, round loop, target-only prefill and steps;
    # padded to each width, every width compiles its prefills anew.
    assert shared.compiled == 4
    assert one_pass.compiled >= 2 * len(LENGTHS)
