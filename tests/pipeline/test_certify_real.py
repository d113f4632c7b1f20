"""``jaxcert certify`` and ``certify-logits`` on the real 0.5B model (skipped unless cached)."""

from __future__ import annotations

import json

import numpy as np
import pyarrow.parquet as pq
import pytest

from jaxcert import cli, models
from jaxcert.base import assets, prompts
from jaxcert.core import rules as R
from jaxcert.pipeline import engine as certify
from jaxcert.pipeline import logits as certify_logits

pytestmark = pytest.mark.real

TARGET = "qwen2.5-coder-0.5b-instruct"
RULES = R.parse_rules("greedy,additive:0.3,multiplicative:0.1,typical,topk:2,tree:2,tree:4,tree:8")


def _record(top) -> str:
    """An OpenAI chat-completions response line carrying ``[T, K]`` top log-probabilities."""
    content = [{"token": "?", "logprob": float(r[0]),
                "top_logprobs": [{"token": "?", "logprob": float(v)} for v in r]}
               for r in top]  # fmt: skip
    return json.dumps({"choices": [{"logprobs": {"content": content}}]})


@pytest.fixture(scope="module")
def lm():
    if assets.cached_path(TARGET) is None:
        pytest.skip(f"{TARGET} is not cached (jaxcert fetch {TARGET})")
    return models.load(TARGET)


def test_sharegpt_prompts_certify(lm, tmp_path):
    if assets.cached_path("sharegpt") is None:
        pytest.skip("sharegpt is not cached (jaxcert fetch sharegpt)")
    prompt_set = prompts.load_prompts("sharegpt", max_prompts=3)
    assert len(prompt_set) == 3 and all(p.text.strip() for p in prompt_set)
    options = certify.CertifyOptions(steps=4, batch_size=2)
    table, info = certify.certify_prompts(lm, prompt_set, RULES[:2], options)
    assert set(table["prompt_index"].to_pylist()) == {0, 1, 2}
    assert info["prefill_padded_tokens"] - info["prefill_tokens"] < 16 * 3


def test_top_20_records_of_the_real_model_match_certify(lm, tmp_path):
    """jaxcert's own logits as an engine's top-20 logprobs: determined positions agree."""
    prompt_set = prompts.load_prompts("mtbench", max_prompts=2)
    options = certify.CertifyOptions(steps=16, batch_size=2)
    table, _ = certify.certify_prompts(lm, prompt_set, RULES, options)
    # Teacher-forced logits of the same continuations, one prefill per prompt.
    import jax.numpy as jnp
    from flax import nnx

    graphdef, state = nnx.split(lm.model)
    encoded = prompts.encode_prompts(lm.tokenizer, prompt_set)
    lines = []
    for i, ids in enumerate(encoded):
        generated = table.filter(table["prompt_index"].to_numpy() == i)["token"].to_pylist()
        full = ids + generated
        cache = models.KVCache.create(lm.config, 1, len(full) + 1)
        logits, _ = models.forward(graphdef, state, jnp.asarray([full], jnp.int32), cache)
        logits = np.asarray(logits[0, len(ids) - 1 : len(full) - 1], np.float64)
        logp = logits - np.logaddexp.reduce(logits, axis=-1, keepdims=True)
        top = -np.sort(-logp, axis=-1)[:, :20]
        lines.append(_record(top))
    path = tmp_path / "records.jsonl"
    path.write_text("\n".join(lines) + "\n")
    out = tmp_path / "out"
    spec = ",".join(r.spec for r in RULES)
    assert cli.main(["certify-logits", str(path), "--rules", spec, "--vocab-size",
                     str(lm.config.vocab_size), "--out", str(out)]) == 0  # fmt: skip
    got = pq.read_table(out / "certificates.parquet").to_pydict()
    mine = table.to_pydict()
    for rule in RULES:
        det = np.asarray(got[f"determined_{rule.spec}"])
        a = np.asarray(got[f"cert_{rule.spec}"])[det]
        b = np.asarray(mine[f"cert_{rule.spec}"])[det]
        np.testing.assert_allclose(a, b, rtol=1e-3, atol=2e-5, err_msg=rule.spec)
        if rule.static_upper_size is not None:
            assert det.all()


def test_transformers_on_the_real_model_gives_the_certificates_of_certify(lm, tmp_path):
    """A real engine: transformers (PyTorch, CPU) loads the same GGUF file, generates the
    same MT-Bench prompts greedily and returns logits; as OpenAI-style top-20 records and as
    a dense dump, they give jaxcert certify's certificates at every determined position."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    steps = 12
    prompt_set = prompts.load_prompts("mtbench", max_prompts=2)
    table, _ = certify.certify_prompts(
        lm, prompt_set, RULES, certify.CertifyOptions(steps=steps, stop_at_eos=False)
    )
    path = assets.cached_path(TARGET)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    ).eval()
    lines, dense, agree = [], [], []
    for i, ids in enumerate(prompts.encode_prompts(lm.tokenizer, prompt_set)):
        mask = torch.ones(1, len(ids), dtype=int)
        with torch.no_grad():
            out = hf.generate(torch.tensor([ids]), attention_mask=mask,
                              max_new_tokens=steps, min_new_tokens=steps, do_sample=False,
                              output_logits=True, return_dict_in_generate=True)  # fmt: skip
        logits = certify_logits.stack_generate_logits(out.logits)[0].astype(np.float64)
        # Compare up to the first token the two frameworks pick differently (a near-tie).
        theirs = out.sequences[0, len(ids) :].tolist()
        ours = table.filter(table["prompt_index"].to_numpy() == i)["token"].to_pylist()
        same = [a == b for a, b in zip(theirs, ours, strict=True)] + [False]
        agree.append(same.index(False) + 1)
        dense.append(logits.astype(np.float32))
        logp = logits - np.logaddexp.reduce(logits, axis=-1, keepdims=True)
        top = -np.sort(-logp, axis=-1)[:, :20]
        lines.append(_record(top))
    (tmp_path / "hf.jsonl").write_text("\n".join(lines) + "\n")
    np.save(tmp_path / "hf.npy", np.stack(dense))
    mine = table.to_pydict()
    spec = ",".join(r.spec for r in RULES)
    for name in ("hf.jsonl", "hf.npy"):
        out = tmp_path / name.replace(".", "-")
        assert cli.main(["certify-logits", str(tmp_path / name), "--rules", spec, "--vocab-size",
                         str(lm.config.vocab_size), "--out", str(out)]) == 0  # fmt: skip
        got = pq.read_table(out / "certificates.parquet").to_pydict()
        seq = got["record"] if name.endswith("jsonl") else got["sequence"]
        rows = [i * steps + t for i, t in zip(seq, got["position"], strict=True)]
        inside = np.array([t < agree[i] for i, t in zip(seq, got["position"], strict=True)])
        assert inside.sum() >= steps  # most positions are compared
        for rule in RULES:
            det = np.asarray(got.get(f"determined_{rule.spec}", [True] * len(rows))) & inside
            a = np.asarray(got[f"cert_{rule.spec}"])[det]
            b = np.asarray(mine[f"cert_{rule.spec}"])[rows][det]
            np.testing.assert_allclose(a, b, rtol=2e-3, atol=2e-4, err_msg=f"{name} {rule.spec}")
