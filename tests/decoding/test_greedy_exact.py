"""Strict greedy speculative decoding reproduces target-only greedy decoding token for token."""

import jax
import numpy as np
import pytest

from jaxcert import decoding
from jaxcert.decoding import run_report
from tests.helpers.tiny_decoding import MAX_NEW, PROMPTS, WIDTH

POLICIES = ["constant:3", "heuristic", "confidence:0.4", "svip:0.3", "cert:1"]
SHAPES = {
    # Three verification widths: also exercises the bucketed verification pass.
    "chain": dict(verify="greedy", max_draft=6, buckets=(2, 4, 6)),
    "static_tree": dict(verify="tree:2x3", buckets=(6,)),
    "dynamic_tree": dict(verify="dyntree:3x3x6", buckets=(6,)),
}


@pytest.mark.parametrize("drafter_name", ["similar", "unlike"])
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("policy", POLICIES)
def test_greedy_output_is_target_greedy(
    target, drafters, greedy_reference, run_cache, drafter_name, shape, policy
):
    out = run_cache(target, drafters[drafter_name], drafter_name, policy=policy, **SHAPES[shape])
    for row, (got, want) in enumerate(zip(out.tokens, greedy_reference, strict=True)):
        np.testing.assert_array_equal(got, want, err_msg=f"row {row}")
    assert all(len(t) == MAX_NEW for t in out.tokens)


def test_similar_drafter_accepts_and_unlike_rejects(target, drafters, run_cache):
    similar = run_cache(target, drafters["similar"], "similar", **SHAPES["chain"])
    unlike = run_cache(target, drafters["unlike"], "unlike", **SHAPES["chain"])
    rate = lambda o: o.stats.accepted.sum() / o.stats.drafted.sum()  # noqa: E731
    assert rate(similar) > 0.6 > rate(unlike)
    # Rows finish in different rounds: per-row acceptance lengths differ.
    assert len(set(similar.rounds.tolist()) | set(unlike.rounds.tolist())) > 1


def test_end_token_stops_a_row(target, drafters, greedy_reference):
    # A token that row `row` first emits at index `at >= 2`.
    row, at = next(
        (r, i)
        for r, toks in enumerate(greedy_reference)
        for i in range(2, MAX_NEW)
        if toks[i] not in toks[:i]
    )
    eos = int(greedy_reference[row][at])
    config = decoding.DecodeConfig(
        verification=decoding.parse_verify("tree:2x3"),
        max_new_tokens=MAX_NEW,
        eos_ids=(eos,),
        buckets=(6,),
    )
    out = decoding.speculative_decode(
        target,
        drafters["similar"],
        PROMPTS,
        policy=decoding.Constant(k=3),
        config=config,
        prompt_width=WIDTH,
    )
    base = decoding.target_decode(
        target, PROMPTS, max_new_tokens=MAX_NEW, eos_ids=(eos,), prompt_width=WIDTH
    )
    for got, want in zip(out.tokens, base.tokens, strict=True):
        np.testing.assert_array_equal(got, want)
    assert len(out.tokens[row]) == at + 1 and out.tokens[row][-1] == eos


def test_batch_rows_match_rows_decoded_alone(target, drafters, run_cache):
    """A row's output does not depend on the other rows (a batch of one prompt repeated)."""
    batch = run_cache(target, drafters["unlike"], "unlike", **SHAPES["chain"])
    for row, prompt in enumerate(PROMPTS):
        alone = run_cache(
            target, drafters["unlike"], "unlike", prompts=[prompt] * 3, **SHAPES["chain"]
        )
        for got in alone.tokens:
            np.testing.assert_array_equal(got, batch.tokens[row])


def test_vocabulary_mismatch_is_a_clear_error(target):
    from tests.helpers.tiny_decoding import CONFIG, random_model

    small = random_model(CONFIG.__class__(**{**CONFIG.__dict__, "vocab_size": 40}), seed=3)
    with pytest.raises(ValueError, match="target has 48 .* drafter 40"):
        decoding.check_pair(target, small)


@pytest.mark.parametrize(
    "prompts, match",
    [
        ([[3, 48]], r"prompt 0: token ids must be in \[0, 48\)"),
        ([[1, 2], [-1, 4]], r"prompt 1: token ids must be in"),
        ([[1.5, 2.0]], "integer token ids"),
        ([1, 2, 3], "list of token-id sequences"),
    ],
    ids=["too-large", "negative", "float", "flat-list"],
)
def test_bad_token_ids_are_rejected(target, drafters, prompts, match):
    config = decoding.DecodeConfig(max_new_tokens=4, max_draft=2)
    with pytest.raises(ValueError, match=match):
        decoding.speculative_decode(
            target, drafters["similar"], prompts, policy=decoding.Constant(k=2), config=config
        )
    with pytest.raises(ValueError, match=match):
        decoding.target_decode(target, prompts, max_new_tokens=4)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(temperature=float("nan")), "temperature must be a finite number >= 0"),
        (dict(temperature=-1.0), "temperature must be"),
        (dict(top_p=0.0), "top_p must be in"),
        (dict(max_new_tokens=0), "max_new_tokens must be an integer >= 1"),
    ],
    ids=["temperature-nan", "temperature-negative", "top_p-zero", "max_new_tokens-zero"],
)
def test_target_decode_checks_its_settings(target, kwargs, match):
    with pytest.raises(ValueError, match=match):
        decoding.target_decode(target, PROMPTS, **({"max_new_tokens": 4} | kwargs))


def test_decode_config_takes_spellings():
    config = decoding.DecodeConfig(verification="tree:2x3+greedy", eos_ids=[5, 7])
    assert config.verification == decoding.parse_verify("tree:2x3+greedy")
    assert config.eos_ids == (5, 7) and config.num_nodes == 6
    with pytest.raises(ValueError, match="unknown|expected"):
        decoding.DecodeConfig(verification="bogus")


def test_short_prompt_is_rejected(target, drafters):
    with pytest.raises(ValueError, match="at least 2 tokens"):
        decoding.speculative_decode(
            target,
            drafters["similar"],
            [[3]],
            policy=decoding.Constant(k=2),
            config=decoding.DecodeConfig(max_new_tokens=4, max_draft=2),
        )


def test_drafter_with_a_trained_head(target, drafters, greedy_reference):
    """Any module with the `models.Transformer` interface drafts, e.g. `training.HeadedDrafter`."""
    import jax
    from flax import nnx

    from jaxcert.training import DraftHead, HeadedDrafter

    head = DraftHead(target.config.hidden_size, 16, rngs=nnx.Rngs(0))
    head.w_out[...] = 0.05 * jax.random.normal(jax.random.key(3), head.w_out[...].shape)
    drafter = HeadedDrafter(drafters["similar"], head)
    config = decoding.DecodeConfig(
        verification=decoding.parse_verify("tree:2x3"), max_new_tokens=MAX_NEW, buckets=(6,)
    )
    out = decoding.speculative_decode(
        target, drafter, PROMPTS, policy=decoding.parse_policy("cert"), config=config,
        prompt_width=WIDTH,
    )  # fmt: skip
    for got, want in zip(out.tokens, greedy_reference, strict=True):
        np.testing.assert_array_equal(got, want)
    assert out.stats.accepted.sum() > 0


def test_statistics_count_emitted_tokens_when_the_end_token_is_drafted(target, greedy_reference):
    """Drafter = target, K = 6, the end token is the first drafted token of the first round:
    the round emits 1 token, so 1 drafted token was accepted (the vLLM definitions: drafted,
    accepted = emitted drafts, emitted), not 6; the later drafts were never emitted."""
    row = 0
    eos = int(greedy_reference[row][0])  # the first token the drafter drafts
    config = decoding.DecodeConfig(
        verification=decoding.parse_verify("greedy"),
        max_new_tokens=MAX_NEW,
        max_draft=6,
        eos_ids=(eos,),
        buckets=(6,),
    )
    out = decoding.speculative_decode(
        target, target, PROMPTS[row : row + 1], policy=decoding.Constant(k=6), config=config,
        prompt_width=WIDTH,
    )  # fmt: skip
    np.testing.assert_array_equal(out.tokens[0], greedy_reference[row][:1])
    s = jax.device_get(out.stats)
    a = s.active
    assert a.sum() == 1  # one round
    assert s.depth[a].tolist() == [6] and s.drafted[a].tolist() == [6]
    assert s.emitted[a].tolist() == [1]  # the end token
    assert s.accepted[a].tolist() == [1]  # not 6
    assert s.nodes.accepted[a].sum() == 1  # node verdicts agree: only the emitted draft
    summary = run_report.summarize_run(s, num_tokens=1, decode_s=1.0)
    assert summary["mean_accepted"] == 1.0
    assert summary["tokens_per_round"] == 1.0
    assert summary["acceptance_rate"] == round(1 / 6, 4)  # accepted / drafted
    # Depth 1 was tested and accepted; depths 2-6 were never tested (nothing emitted there).
    rates = run_report.acceptance_by_depth(s)
    assert rates[0] == 1.0 and np.all(np.isnan(rates[1:6])), rates


def test_decoding_past_the_context_length_is_refused_before_compiling():
    """A model of 32 positions: a 30-token prompt and 20 new tokens used to decode all 20
    tokens at positions past the model's range, speculative and target-only."""
    import dataclasses

    from tests.helpers.tiny_decoding import CONFIG, random_model

    short = random_model(dataclasses.replace(CONFIG, max_position_embeddings=32), seed=3)
    prompt = [list(range(1, 31))]
    with pytest.raises(ValueError, match="30 tokens plus 20 new tokens need 50 positions"):
        decoding.target_decode(short, prompt, max_new_tokens=20)
    config = decoding.DecodeConfig(
        verification=decoding.parse_verify("tree:2x3"), max_new_tokens=2, buckets=(6,)
    )
    # 30 + 2 fit, but the tree drafts 3 deep past the last emitted token.
    with pytest.raises(ValueError, match="plus 3 draft positions need 35 positions.*supports 32"):
        decoding.speculative_decode(
            short, short, prompt, policy=decoding.Constant(k=3), config=config
        )
    assert len(decoding.target_decode(short, prompt, max_new_tokens=2).tokens[0]) == 2
