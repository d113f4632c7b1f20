"""The published EAGLE-3 head: parity with a PyTorch module of the engines' layout, export and
import in the ``eagle3`` and ``speculators`` layouts, and refusal of bad folders."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

from jaxcert.decoding.protocols import context_before
from jaxcert.models import EagleHead
from jaxcert.models.eagle import OOV_INIT_MASS, load_head, save_head
from jaxcert.models.eagle3 import engine_format, export_head, import_head, read_head
from tests.helpers import tiny_models

torch = pytest.importorskip("torch")

CONFIG = tiny_models.tiny_config(num_layers=8, rope_theta=1e6)
V, E = CONFIG.vocab_size, CONFIG.hidden_size
IDS = np.array([0, 2, 3, 7, 9, 10, 21, 33, 40, 41, 50, 63], np.int32)
TAPS = (0, 2, 4)


def _randomise(module, seed: int):
    """O(1) random parameters (norm scales near 1), so every weight matters."""
    graphdef, state = nnx.split(module)
    params = nnx.state(module, nnx.Param)
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    leaves, treedef = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    new = []
    for key, (path, leaf) in zip(keys, flat, strict=True):
        noise = jax.random.normal(key, leaf.shape, jnp.float32)
        scale = "scale" in jax.tree_util.keystr(path)
        new.append((1.0 + 0.1 * noise if scale else 0.2 * noise).astype(leaf.dtype))
    nnx.update(state, jax.tree.unflatten(treedef, new))
    return nnx.merge(graphdef, state)


@pytest.fixture(scope="module")
def target():
    return tiny_models.random_model(CONFIG, seed=5)


def _head(target, seed=0, **kw):
    kw = dict(taps=TAPS, draft_vocab=IDS, arch="eagle3") | kw
    return _randomise(EagleHead.from_target(target, rngs=nnx.Rngs(seed), **kw), seed + 1)


# A PyTorch reference of the engines' EAGLE-3 model, written from the layout (vLLM's
# llama_eagle3: first layer over [input_layernorm(embeds), hidden_norm(hidden)], residual
# before or after hidden_norm, fused add-norms, final norm, lm_head over V', d2t to V with
# -inf elsewhere), reading the exported folder's tensors by their engine names.


def _rms(x, w, eps):
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)) * w


def _rope(x, positions, theta):
    d = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    ang = positions[:, :, None].float() * inv  # [B, T, D/2]
    cos = torch.cat([ang.cos(), ang.cos()], -1)[:, None]
    sin = torch.cat([ang.sin(), ang.sin()], -1)[:, None]
    half = torch.cat([-x[..., d // 2 :], x[..., : d // 2]], -1)
    return x * cos + half * sin


def torch_eagle3(folder, embed, target_states, tokens, *, layer_prefix="midlayer."):
    """Teacher-forced logits `[B, T - 1, V]` of tokens 1.. (float32, -inf outside the draft
    vocabulary): token t + 1 reads fc(states at t), as vLLM's proposer and SpecForge pair
    them; there is no entry for token 0."""
    cfg = json.loads((folder / "config.json").read_text())
    cfg = cfg.get("transformer_layer_config", cfg) | {
        k: cfg[k] for k in ("draft_vocab_size", "norm_before_residual") if k in cfg
    }
    w = {k: torch.as_tensor(v) for k, v in load_file(folder / "model.safetensors").items()}
    p = lambda name: w[layer_prefix + name]  # noqa: E731
    eps, theta = cfg["rms_norm_eps"], cfg["rope_theta"]
    h, g, d = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    tokens = torch.as_tensor(np.asarray(tokens), dtype=torch.long)
    b, t = tokens.shape
    hidden = torch.as_tensor(np.asarray(target_states))[:, :-1] @ w["fc.weight"].T  # [B, T-1, E]
    tokens = tokens[:, 1:]  # token t + 1 reads the states at t
    b, t = tokens.shape
    embeds = torch.as_tensor(np.array(embed))[tokens]
    normed = _rms(hidden, p("hidden_norm.weight"), eps)
    residual = normed if cfg.get("norm_before_residual") else hidden
    x = torch.cat([_rms(embeds, p("input_layernorm.weight"), eps), normed], -1)
    bias = lambda n: w.get(layer_prefix + f"self_attn.{n}_proj.bias")  # noqa: E731
    lin = lambda x, n: torch.nn.functional.linear(  # noqa: E731
        x, p(f"self_attn.{n}_proj.weight"), bias(n)
    )
    pos = torch.arange(t)[None].expand(b, t)
    q = _rope(lin(x, "q").view(b, t, h, d).transpose(1, 2), pos, theta)
    k = _rope(lin(x, "k").view(b, t, g, d).transpose(1, 2), pos, theta)
    v = lin(x, "v").view(b, t, g, d).transpose(1, 2)
    k, v = k.repeat_interleave(h // g, 1), v.repeat_interleave(h // g, 1)
    scores = (q @ k.transpose(-1, -2)) * d**-0.5
    scores = scores.masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(), float("-inf"))
    attn = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, t, h * d)
    residual = residual + lin(attn, "o")
    m = _rms(residual, p("post_attention_layernorm.weight"), eps)
    act = torch.nn.functional.silu(m @ p("mlp.gate_proj.weight").T) * (
        m @ p("mlp.up_proj.weight").T
    )
    residual = residual + act @ p("mlp.down_proj.weight").T
    logits = _rms(residual, w["norm.weight"], eps) @ w["lm_head.weight"].T  # [B, T, V']
    full = torch.full((b, t, cfg["vocab_size"]), float("-inf"))
    full[..., torch.arange(logits.shape[-1]) + w["d2t"]] = logits
    return full.numpy()


def _jax_logits(head, target_states, tokens, outside=None):
    b, t = tokens.shape
    context = context_before(head, jnp.asarray(target_states))
    logits, _ = head(jnp.asarray(tokens), head.init_cache(b, t), context=context, outside=outside)
    return np.asarray(logits)


@pytest.mark.parametrize(
    "fmt,options",
    [
        ("eagle3", {}),
        ("eagle3", dict(norm_before_residual=True)),
        ("speculators", dict(attention_bias=True)),
    ],
)
def test_teacher_forced_logits_match_a_torch_reference_of_the_layout(
    target, tmp_path, fmt, options
):
    head = _head(target, **options)
    folder = export_head(head, tmp_path / "h", format=fmt)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, V, (2, 9))
    states = rng.standard_normal((2, 9, 3 * E)).astype(np.float32)
    prefix = "midlayer." if fmt == "eagle3" else "layers.0."
    want = torch_eagle3(folder, head.embedding[...], states, tokens, layer_prefix=prefix)
    got = _jax_logits(head, states, tokens)[:, 1:]  # slot 0 (x_0) has no engine counterpart
    outside = np.setdiff1d(np.arange(V), IDS)
    assert np.all(np.isneginf(got[..., outside])) and np.all(np.isneginf(want[..., outside]))
    np.testing.assert_allclose(got[..., IDS], want[..., IDS], rtol=1e-5, atol=1e-5)
    assert np.abs(got[..., IDS]).max() > 1.0  # the logits are not trivially small


def test_oov_logits_agree_inside_and_are_finite_outside(target):
    head = _head(target)
    rng = np.random.default_rng(1)
    tokens, states = rng.integers(0, V, (1, 5)), rng.standard_normal((1, 5, 3 * E))
    drafting = _jax_logits(head, states.astype(np.float32), tokens)
    finite = _jax_logits(head, states.astype(np.float32), tokens, outside="oov")
    np.testing.assert_array_equal(drafting[..., IDS], finite[..., IDS])
    outside = np.setdiff1d(np.arange(V), IDS)
    np.testing.assert_array_equal(finite[..., outside], float(head.oov_logit[...]))
    assert np.all(np.isfinite(finite))


def test_engine_aux_layers_are_the_taps_one_block_earlier(target):
    """SpecForge taps transformers' hidden_states[i], the stream entering layer i: jaxcert's
    tap i - 1 (the module docstring of jaxcert.models.eagle3)."""
    import transformers

    hf = tiny_models.hf_config("qwen2")
    model = tiny_models.torch_model("qwen2")
    from jaxcert.models._weights import model_from_tensors

    tensors = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    ours = model_from_tensors(tiny_models.ModelConfig.from_hf(hf), tensors)
    tokens = np.array([[3, 1, 4, 1, 5, 9, 2, 6]])
    with torch.no_grad():
        out = model(torch.as_tensor(tokens), output_hidden_states=True)
    n = ours.config.num_layers
    cache = ours.init_cache(1, tokens.shape[1])
    _, _, tapped = ours.tapped_features(jnp.asarray(tokens), cache, tuple(range(n - 1)))
    tapped = np.asarray(tapped).reshape(1, tokens.shape[1], n - 1, -1)
    for i in range(1, n):  # hidden_states[n] is after the final norm
        np.testing.assert_allclose(
            tapped[:, :, i - 1], out.hidden_states[i].numpy(), rtol=1e-5, atol=1e-5
        )
    assert isinstance(model, transformers.Qwen2ForCausalLM)


@pytest.mark.parametrize("fmt", ["eagle3", "speculators"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_export_then_import_is_bit_exact(target, tmp_path, fmt, dtype):
    head = _head(target, seed=3, param_dtype=jnp.dtype(dtype), dtype=jnp.dtype(dtype))
    folder = export_head(head, tmp_path / "h", format=fmt, dtype=dtype)
    assert engine_format(folder) == fmt
    back = import_head(folder, target)
    a, b = nnx.to_flat_state(nnx.state(head)), nnx.to_flat_state(nnx.state(back))
    a = {path: v.get_value() for path, v in a}
    b = {path: v.get_value() for path, v in b}
    assert set(a) == set(b)
    for path in a:
        if path == ("embedding",) and fmt == "eagle3":  # none written: the target's, cast
            np.testing.assert_array_equal(
                np.asarray(b[path]), np.asarray(target.embedding[...].astype(dtype))
            )
            continue
        assert a[path].dtype == b[path].dtype, path
        np.testing.assert_array_equal(np.asarray(a[path]), np.asarray(b[path]), err_msg=str(path))
    assert back.taps == head.taps and back.arch == "eagle3" and back.outside == "-inf"
    # and it writes again the same tensors, metadata and config (the header's key order is
    # the safetensors writer's)
    again = export_head(back, tmp_path / "again", format=fmt, dtype=dtype)
    first, second = load_file(folder / "model.safetensors"), load_file(again / "model.safetensors")
    assert first.keys() == second.keys()
    for name in first:
        assert first[name].dtype == second[name].dtype
        np.testing.assert_array_equal(first[name], second[name])
    assert _metadata(again) == _metadata(folder)
    assert (again / "config.json").read_text() == (folder / "config.json").read_text()


def _metadata(folder):
    import safetensors

    with safetensors.safe_open(folder / "model.safetensors", framework="numpy") as f:
        return f.metadata()


def test_export_writes_the_engines_names_dtypes_and_config(target, tmp_path):
    head = _head(target)
    folder = export_head(head, tmp_path / "h", dtype="bfloat16")
    tensors = load_file(folder / "model.safetensors")
    e, q, kv, f = (
        E,
        CONFIG.num_heads * CONFIG.head_dim,
        2 * CONFIG.head_dim,
        CONFIG.intermediate_size,
    )
    shapes = {
        "fc.weight": (e, 3 * e),
        "midlayer.input_layernorm.weight": (e,),
        "midlayer.hidden_norm.weight": (e,),
        "midlayer.post_attention_layernorm.weight": (e,),
        "midlayer.self_attn.q_proj.weight": (q, 2 * e),
        "midlayer.self_attn.k_proj.weight": (kv, 2 * e),
        "midlayer.self_attn.v_proj.weight": (kv, 2 * e),
        "midlayer.self_attn.o_proj.weight": (e, q),
        "midlayer.mlp.gate_proj.weight": (f, e),
        "midlayer.mlp.up_proj.weight": (f, e),
        "midlayer.mlp.down_proj.weight": (e, f),
        "norm.weight": (e,),
        "lm_head.weight": (IDS.size, e),
        "d2t": (IDS.size,),
        "t2d": (V,),
    }
    assert {k: v.shape for k, v in tensors.items()} == shapes
    assert tensors["d2t"].dtype == np.int64 and tensors["t2d"].dtype == np.bool_
    assert tensors["fc.weight"].dtype.name == "bfloat16"
    np.testing.assert_array_equal(np.arange(IDS.size) + tensors["d2t"], IDS)
    np.testing.assert_array_equal(np.flatnonzero(tensors["t2d"]), IDS)
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert (config["num_hidden_layers"], config["vocab_size"], config["draft_vocab_size"]) == (
        1,
        V,
        IDS.size,
    )
    assert config["eagle_aux_hidden_state_layer_ids"] == [1, 3, 5]  # entering, as vLLM counts
    assert config["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": [0, 2, 4]}  # SpecForge
    assert config["target_hidden_size"] == E and config["rope_theta"] == 1e6


def test_a_head_from_elsewhere_drafts_and_gets_the_initial_shared_logit(target, tmp_path):
    """A folder without jaxcert's metadata and with the engines' default aux layers."""
    head = _head(target, taps=(1, 3, 4))
    folder = export_head(head, tmp_path / "h")
    tensors = load_file(folder / "model.safetensors")
    save_file(tensors, str(folder / "model.safetensors"))  # drops the metadata
    config = json.loads((folder / "config.json").read_text())
    del config["eagle_aux_hidden_state_layer_ids"], config["eagle_config"]
    (folder / "config.json").write_text(json.dumps(config))
    back = read_head(folder, target)
    assert back.taps == (1, 3, 4)  # the engines' default layers (2, 4, 5) of an 8-layer target
    b0 = np.log(OOV_INIT_MASS / (V - IDS.size))
    np.testing.assert_allclose(float(back.oov_logit[...]), b0, rtol=1e-6)


def test_jaxcert_layout_keeps_the_arch(target, tmp_path):
    head = _head(target, norm_before_residual=True)
    back = load_head(save_head(head, tmp_path / "h"))
    assert (back.arch, back.outside, back.norm_before_residual) == ("eagle3", "-inf", True)
    rng = np.random.default_rng(2)
    tokens, states = rng.integers(0, V, (1, 4)), rng.standard_normal((1, 4, 3 * E))
    np.testing.assert_array_equal(
        _jax_logits(head, states.astype(np.float32), tokens),
        _jax_logits(back, states.astype(np.float32), tokens),
    )


def _exported(target, tmp_path):
    return export_head(_head(target), tmp_path / "h")


def _edit_tensors(folder, change):
    tensors = load_file(folder / "model.safetensors")
    change(tensors)
    save_file(tensors, str(folder / "model.safetensors"))


def _edit_config(folder, change):
    config = json.loads((folder / "config.json").read_text())
    change(config)
    (folder / "config.json").write_text(json.dumps(config))


BAD_FOLDERS = {
    "missing tensors": (lambda t: t.pop("norm.weight"), None, "missing tensors ['norm.weight']"),
    "extra tensors": (
        lambda t: t.update(extra=np.zeros(1, np.float32)),
        None,
        "unexpected ['extra']",
    ),
    "d2t not int64": (lambda t: t.update(d2t=t["d2t"].astype(np.int32)), None, "d2t must be int64"),
    "d2t outside": (
        lambda t: t["d2t"].__setitem__(-1, 1000),
        None,
        "d2t points outside the vocabulary",
    ),
    "d2t repeats": (lambda t: t["d2t"].__setitem__(1, t["d2t"][0] - 1), None, "maps two draft ids"),
    "t2d disagrees": (lambda t: t["t2d"].__setitem__(1, True), None, "t2d disagrees with d2t"),
    "lm_head shape": (
        lambda t: t.update({"lm_head.weight": t["lm_head.weight"][:, :-1]}),
        None,
        "lm_head.weight",
    ),
    "hidden size": (None, lambda c: c.update(hidden_size=E * 2), "hidden_size is 64"),
    "target hidden": (None, lambda c: c.update(target_hidden_size=E + 1), "target_hidden_size"),
    "vocabulary": (None, lambda c: c.update(vocab_size=V + 1), "vocab_size is 65"),
    "aux layers": (
        None,
        lambda c: (c.pop("eagle_config"), c.update(eagle_aux_hidden_state_layer_ids=[1, 2, 9])),
        "eagle_aux_hidden",
    ),
    "two layers": (None, lambda c: c.update(num_hidden_layers=2), "num_hidden_layers must be 1"),
    "mixed dtypes": (
        lambda t: t.update({"fc.weight": t["fc.weight"].astype(np.float16)}),
        None,
        "must share one float dtype",
    ),
    "integer weights": (
        lambda t: t.update({"norm.weight": t["norm.weight"].astype(np.int32)}),
        None,
        "must share one float dtype",
    ),
    "a flag as a string": (
        None,
        lambda c: c.update(norm_before_residual="false"),
        "norm_before_residual must be true or false",
    ),
    "gelu": (None, lambda c: c.update(hidden_act="gelu"), "hidden_act 'gelu'"),
    "qwen3 layer": (None, lambda c: c.update(model_type="qwen3"), "model_type 'qwen3'"),
    "rope scaling": (None, lambda c: c.update(rope_scaling={"rope_type": "yarn"}), "rope_scaling"),
    "rope theta string": (
        None,
        lambda c: c.update(rope_theta="1e4"),
        "rope_theta must be a positive",
    ),
    "rope parameters list": (None, lambda c: c.update(rope_parameters=[1]), "rope_parameters must"),
    "eps null": (None, lambda c: c.update(rms_norm_eps=None), "rms_norm_eps must be a positive"),
    "eagle_config a list": (
        None,
        lambda c: c.update(eagle_config=[0, 2, 4]),
        "eagle_config must be",
    ),
    "aux counts disagree": (
        None,
        lambda c: c.update(eagle_config={"eagle_aux_hidden_state_layer_ids": [0, 2, 5]}),
        "disagree",
    ),
    "aux repeated": (
        None,
        lambda c: (c.pop("eagle_config"), c.update(eagle_aux_hidden_state_layer_ids=[1, 1, 3])),
        "three distinct",
    ),
    "aux bool": (
        None,
        lambda c: (c.pop("eagle_config"), c.update(eagle_aux_hidden_state_layer_ids=[True, 3, 5])),
        "three distinct",
    ),
    "no vocab_size": (None, lambda c: c.pop("vocab_size"), "no vocab_size"),
}


@pytest.mark.parametrize("case", sorted(BAD_FOLDERS))
def test_bad_folders_are_refused_naming_the_field(target, tmp_path, case):
    tensors, config, message = BAD_FOLDERS[case]
    folder = _exported(target, tmp_path)
    if tensors is not None:
        _edit_tensors(folder, tensors)
    if config is not None:
        _edit_config(folder, config)
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")) as err:
        import_head(folder, target)
    assert "\n" not in str(err.value)


def test_refusals_of_export(target, tmp_path):
    jaxcert_head = EagleHead.from_target(target, taps=TAPS, draft_vocab=IDS)
    with pytest.raises(ValueError, match="arch is 'jaxcert'"):
        export_head(jaxcert_head, tmp_path / "a")
    head = _head(target)
    with pytest.raises(ValueError, match="format must be one of"):
        export_head(head, tmp_path / "b", format="onnx")
    with pytest.raises(ValueError, match="dtype must be one of"):
        export_head(head, tmp_path / "c", dtype="float16")
    export_head(head, tmp_path / "d")
    with pytest.raises(ValueError, match="exists; pass overwrite"):
        export_head(head, tmp_path / "d")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d"]  # nothing else left behind


def test_a_failed_export_leaves_nothing(target, tmp_path, monkeypatch):
    import safetensors.numpy

    def broken(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(safetensors.numpy, "save_file", broken)
    with pytest.raises(OSError, match="disk full"):
        export_head(_head(target), tmp_path / "h")
    assert list(tmp_path.iterdir()) == []


def test_eagle3_needs_one_layer_and_three_taps(target):
    with pytest.raises(ValueError, match="one layer and three taps"):
        EagleHead.from_target(target, taps=(0, 1), arch="eagle3")
    with pytest.raises(ValueError, match="arch must be one of"):
        EagleHead.from_target(target, taps=TAPS, arch="eagle9")
    with pytest.raises(ValueError, match="outside must be one of"):
        EagleHead.from_target(target, taps=TAPS, arch="eagle3", outside="zero")


def test_aux_layers_from_specforges_eagle_config_count_the_layer_they_leave(target, tmp_path):
    folder = _exported(target, tmp_path)
    _edit_config(folder, lambda c: c.pop("eagle_aux_hidden_state_layer_ids"))
    _edit_config(
        folder, lambda c: c.update(eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 4, 6]})
    )
    assert import_head(folder, target).taps == (1, 4, 6)


def test_speculators_writes_the_embedding_and_vocab_only_when_reduced(target, tmp_path):
    full = _head(target, draft_vocab=None)
    folder = export_head(full, tmp_path / "full", format="speculators", verifier="tiny")
    tensors = load_file(folder / "model.safetensors")
    assert "d2t" not in tensors and "t2d" not in tensors
    np.testing.assert_array_equal(tensors["embed_tokens.weight"], np.asarray(full.embedding[...]))
    config = json.loads((folder / "config.json").read_text())
    assert config["speculators_config"]["verifier"] == {
        "name_or_path": "tiny",
        "architectures": ["Qwen2ForCausalLM"],
    }
    assert config["norm_before_residual"] is False  # written: vLLM reads an absent one as True
    back = import_head(folder, target)
    assert back.draft_vocab is None and back.norm_before_residual is False
    np.testing.assert_array_equal(np.asarray(back.lm_head[...]), np.asarray(full.lm_head[...]))


@pytest.mark.parametrize("option", ["fc_norm", "norm_before_fc", "norm_output"])
def test_variants_jaxcert_does_not_run_are_refused(target, tmp_path, option):
    folder = _exported(target, tmp_path)
    _edit_config(folder, lambda c: c.update({option: True}))
    with pytest.raises(ValueError, match=f"{option} heads are not supported"):
        import_head(folder, target)


def test_unreadable_configs_and_metadata_are_named(target, tmp_path):
    folder = _exported(target, tmp_path)
    (folder / "config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="config.json: not a JSON object"):
        read_head(folder, target)
    (folder / "config.json").write_text("{")
    with pytest.raises(ValueError, match="config.json: not readable JSON"):
        read_head(folder, target)
    folder = export_head(_head(target), tmp_path / "m")
    tensors = load_file(folder / "model.safetensors")
    for text in ("7fc00000", "zz", "1ffffffff"):
        save_file(tensors, str(folder / "model.safetensors"), metadata={"jaxcert.oov_logit": text})
        with pytest.raises(ValueError, match="is not a finite float32"):
            import_head(folder, target)
    spec = export_head(_head(target), tmp_path / "s", format="speculators")
    _edit_config(spec, lambda c: c.update(transformer_layer_config="llama"))
    with pytest.raises(ValueError, match="transformer_layer_config must be a JSON object"):
        import_head(spec, target)


def test_aux_layers_listed_out_of_order_are_read_in_layer_order(target, tmp_path):
    """The engines concatenate the aux states in layer order, whatever order the list has."""
    folder = _exported(target, tmp_path)
    _edit_config(folder, lambda c: c.pop("eagle_config"))
    _edit_config(folder, lambda c: c.update(eagle_aux_hidden_state_layer_ids=[5, 1, 3]))
    assert import_head(folder, target).taps == (0, 2, 4)
    with pytest.raises(ValueError, match="taps must increase"):
        EagleHead.from_target(target, taps=(4, 2, 0), arch="eagle3")


def test_export_never_replaces_what_it_reads_or_the_working_folder(target, tmp_path, monkeypatch):
    head = _head(target)
    saved = save_head(head, tmp_path / "src")
    (tmp_path / "keepme").write_text("x")
    monkeypatch.chdir(tmp_path)
    for out in (".", "", "..", str(tmp_path)):
        with pytest.raises(ValueError, match="working folder"):
            export_head(head, out, overwrite=True)
    with pytest.raises(ValueError, match="holds what is being written out"):
        export_head(head, saved, overwrite=True, keep=[saved])
    with pytest.raises(ValueError, match="keepme exists and is not a folder"):
        export_head(head, "keepme", overwrite=True)
    with pytest.raises(ValueError, match="is not a folder"):
        export_head(head, "keepme/sub")
    assert (tmp_path / "keepme").read_text() == "x" and (saved / "head.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keepme", "src"]
