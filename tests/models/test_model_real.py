"""Real GGUF models (skipped unless cached): greedy output must be sensible text."""

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from jaxcert.models import KVCache, forward, load

pytestmark = pytest.mark.real


def greedy(lm, messages, steps):
    """Greedy-decodes `steps` tokens after the chat prompt; returns the decoded text."""
    prompt = lm.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
    graphdef, state = nnx.split(lm.model)
    step = jax.jit(forward, static_argnums=0, donate_argnames="cache")
    cache = KVCache.create(lm.config, 1, len(ids) + steps)
    logits, cache = step(graphdef, state, jnp.asarray([ids], jnp.int32), cache)
    cache = cache.commit(len(ids))
    out = []
    for _ in range(steps):
        out.append(int(jnp.argmax(logits[0, -1])))
        if out[-1] in lm.config.eos_token_ids:
            break
        logits, cache = step(graphdef, state, jnp.asarray([out[-1:]], jnp.int32), cache)
        cache = cache.commit(1)
    return lm.tokenizer.decode(out, skip_special_tokens=True)


def test_qwen_coder_writes_python(real_asset):
    lm = load(real_asset("qwen2.5-coder-0.5b-instruct"))
    assert lm.config.architecture == "qwen2" and not lm.config.tie_embeddings
    text = greedy(
        lm,
        [{"role": "user", "content": "Write a Python function that returns the sum of a list."}],
        40,
    )
    assert "def " in text and "sum" in text, text


def test_smollm2_answers_in_english(real_asset):
    """A wrong rotary layout still runs but writes nonsense; this catches it."""
    lm = load(real_asset("smollm2-135m-instruct"))
    assert lm.config.architecture == "llama" and lm.config.rope_layout == "interleaved"
    text = greedy(lm, [{"role": "user", "content": "What is the capital of France?"}], 20)
    assert "Paris" in text, text
