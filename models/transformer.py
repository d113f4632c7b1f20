"""Flax NNX decoder-only transformer (llama / qwen2 / qwen3) over a `KVCache`.

Shape letters (also the einsum letters; the package's, see `jaxcert.models`): B batch,
T new tokens, S cache slots, V vocabulary, E hidden size, F MLP width, H query heads, G
key/value heads, J = H // G query heads per key/value head, D head dim, Q = H*D the flattened
query width and O a projection's output width (Q or G*D).

Layout choices, measured with XLA on a 2-core CPU (Qwen2.5-0.5B sizes):
- projection kernels are 2-D `[in, out]`: 2-3x faster than `[out, in]` for 2-16 rows (batched
  decode, tree verification), within 20% for one row; 3-D kernels (`[E, H, D]`) made XLA copy
  the weights on every call;
- the untied lm_head is `[E, V]` (31 vs 49 ms for 8 rows); a tied one reuses the `[V, E]`
  embedding;
- the cache is `[B, G, S, D]` so the attention dots read it in place.

Sharding (`jaxcert.models.sharding`): every parameter carries logical axis names
(`nnx.with_partitioning`, never applied eagerly: a model is built on one device and placed on a
mesh by `shard` or a loader's `mesh=`). A placed model has ``layout`` set and then constrains
its activations and cache buffers to the mesh (`jax.lax.with_sharding_constraint`); without a
mesh (``layout is None``) the forward pass is exactly the single-device one.
"""

from __future__ import annotations

import dataclasses
from typing import TypeVar

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax
from jax.sharding import Mesh

from jaxcert.models.cache import Cache, KVCache
from jaxcert.models.config import ModelConfig
from jaxcert.models.sharding import Layout, constrain

_INIT = nnx.initializers.normal(0.02)
_MASKED = -1e30  # finite, so a fully masked row gives uniform weights instead of NaN

# Logical axis names of activations (see `jaxcert.models.sharding`).
_BTE = ("batch", None, "embed")
_CACHE = ("batch", "kv_heads", None, None)  # [B, G, S, D]

CacheT = TypeVar("CacheT", bound=Cache)  # any cache: forward and decode_step are generic


def _param(rngs: nnx.Rngs, shape: tuple[int, ...], names: tuple[str, ...], dtype) -> nnx.Param:
    """A `_INIT`-initialised parameter with logical axis `names` (not placed on any mesh)."""
    init = nnx.with_partitioning(_INIT, names, eager_sharding=False)
    return nnx.Param(init(rngs.params(), shape, dtype))


def _const(value: jax.Array, names: tuple[str, ...]) -> nnx.Param:
    """A parameter holding `value` with logical axis `names` (not placed on any mesh)."""
    return nnx.Param(value, out_sharding=names, eager_sharding=False)


class RMSNorm(nnx.Module):
    """`x / rms(x) * scale` over the last axis, computed in float32.

    `axis` is the logical name of that axis (``"embed"``, or ``"head_dim"`` for q/k norms).
    """

    def __init__(self, size: int, *, eps: float, dtype, param_dtype, axis: str = "embed"):
        self.scale = _const(jnp.ones((size,), param_dtype), (axis,))  # [size]
        self.eps = eps
        self.dtype = dtype

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        y = x32 * lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return y.astype(self.dtype) * self.scale[...].astype(self.dtype)


def rope_angles(positions: jax.Array, head_dim: int, theta: float) -> tuple[jax.Array, jax.Array]:
    """cos and sin, each `[B, T, D/2]` float32, of `positions` `[B, T]` int."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, D/2]
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array, layout: str) -> jax.Array:
    """Rotates `x` `[B, T, N, D]` by `cos`/`sin` `[B, T, D/2]`; same dtype as `x`.

    'half' pairs dims (i, i + D/2) (Hugging Face rotate_half); 'interleaved' pairs (2i, 2i + 1)
    (llama.cpp / GPT-J). The two agree when the q/k weight rows are permuted accordingly.
    """
    c, s = cos[:, :, None, :], sin[:, :, None, :]
    x32 = x.astype(jnp.float32)
    if layout == "half":
        x1, x2 = jnp.split(x32, 2, axis=-1)
        out = jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)
    elif layout == "interleaved":
        pairs = x32.reshape(*x.shape[:-1], -1, 2)
        x1, x2 = pairs[..., 0], pairs[..., 1]
        out = jnp.stack([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1).reshape(x.shape)
    else:
        raise ValueError(f"Unknown rope layout {layout!r}.")
    return out.astype(x.dtype)


def slot_mask(
    length: jax.Array, t: int, slots: int, attention_mask: jax.Array | None = None
) -> jax.Array:
    """`[B, T, S]` bool: which cache slots each of T new tokens attends to.

    Committed slots `s < length[b]` are visible to every new token; new token t' (at slot
    `length[b] + t'`) is visible to token t when `t' <= t` (causal, `attention_mask=None`) or
    when `attention_mask[b, t, t']` (`[B, T, T]` bool, a draft tree's ancestor mask).
    """
    s = jnp.arange(slots, dtype=jnp.int32)
    if attention_mask is None:  # causal: slot s visible iff s <= length + t
        new_pos = length[:, None] + jnp.arange(t, dtype=jnp.int32)  # [B, T]
        return s[None, None, :] <= new_pos[:, :, None]
    b = length.shape[0]
    rel = s[None, :] - length[:, None]  # [B, S]
    idx = jnp.broadcast_to(jnp.clip(rel, 0, t - 1)[:, None, :], (b, t, slots))
    tree = jnp.take_along_axis(attention_mask, idx, axis=2)  # [B, T, S]
    return (rel < 0)[:, None, :] | (((rel >= 0) & (rel < t))[:, None, :] & tree)


def _write(buf: jax.Array, new: jax.Array, start: jax.Array) -> jax.Array:
    """Writes `new` `[B, G, T, D]` into `buf` `[B, G, S, D]` at slots `start[b]` per row."""
    update = lambda b, n, s: lax.dynamic_update_slice(b, n.astype(b.dtype), (0, s, 0))
    return jax.vmap(update)(buf, new, start)


class Attention(nnx.Module):
    """Grouped-query attention with optional q/k/v(/o) biases and q/k RMSNorm."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs, dtype, param_dtype):
        c = config
        q, kv, e = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.hidden_size
        param = lambda shape, names: _param(rngs, shape, names, param_dtype)
        zeros = lambda n, name, on: _const(jnp.zeros((n,), param_dtype), (name,)) if on else None
        self.q_proj = param((e, q), ("embed", "heads"))  # [E, Q]
        self.k_proj = param((e, kv), ("embed", "kv_heads"))  # [E, G*D]
        self.v_proj = param((e, kv), ("embed", "kv_heads"))  # [E, G*D]
        self.o_proj = param((q, e), ("heads", "embed"))  # [Q, E]
        self.q_bias = zeros(q, "heads", c.qkv_bias)  # [Q] or None
        self.k_bias = zeros(kv, "kv_heads", c.qkv_bias)  # [G*D] or None
        self.v_bias = zeros(kv, "kv_heads", c.qkv_bias)  # [G*D] or None
        self.o_bias = zeros(e, "embed", c.o_bias)  # [E] or None
        norm = lambda: RMSNorm(
            c.head_dim, eps=c.rms_norm_eps, dtype=dtype, param_dtype=param_dtype, axis="head_dim"
        )
        self.q_norm = norm() if c.qk_norm else None
        self.k_norm = norm() if c.qk_norm else None
        self.config = config
        self.dtype = dtype

    def _project(self, x: jax.Array, w: nnx.Param, b: nnx.Param | None) -> jax.Array:
        """`[B, T, E]` -> `[B, T, N, D]` for N heads."""
        y = jnp.einsum("BTE,EO->BTO", x, w[...].astype(self.dtype))
        y = y if b is None else y + b[...].astype(self.dtype)
        return y.reshape(*x.shape[:2], -1, self.config.head_dim)

    def __call__(self, x, cos, sin, k_buf, v_buf, length, mask, layout: Layout | None = None):
        """One attention layer.

        Args:
          x: `[B, T, E]` normalised input.
          cos, sin: `[B, T, D/2]` float32 rotary angles.
          k_buf, v_buf: `[B, G, S, D]` this layer's cache buffers.
          length: `[B]` int32, slot of the first new token per row.
          mask: `[B, T, S]` bool, which slots each new token attends to.
          layout: the model's mesh layout; `None` on one device (no constraints).

        Returns:
          `([B, T, E], new k_buf, new v_buf)`.
        """
        c = self.config
        q = self._project(x, self.q_proj, self.q_bias)  # [B, T, H, D]
        k = self._project(x, self.k_proj, self.k_bias)  # [B, T, G, D]
        v = self._project(x, self.v_proj, self.v_bias)  # [B, T, G, D]
        q = constrain(layout, q, ("batch", None, "heads", None))
        k = constrain(layout, k, ("batch", None, "kv_heads", None))
        v = constrain(layout, v, ("batch", None, "kv_heads", None))
        if self.q_norm is not None and self.k_norm is not None:  # both or neither (qk_norm)
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rope(q, cos, sin, c.rope_layout)
        k = apply_rope(k, cos, sin, c.rope_layout)
        k_buf = constrain(layout, _write(k_buf, k.transpose(0, 2, 1, 3), length), _CACHE)
        v_buf = constrain(layout, _write(v_buf, v.transpose(0, 2, 1, 3), length), _CACHE)

        b, t = x.shape[:2]
        g, r, d = c.num_kv_heads, c.queries_per_kv_head, c.head_dim
        q = q.reshape(b, t, g, r, d).transpose(0, 2, 3, 1, 4)  # [B, G, J, T, D]
        q = q * jnp.asarray(d**-0.5, q.dtype)
        kk = k_buf.astype(self.dtype)
        scores = jnp.einsum("BGJTD,BGSD->BGJTS", q, kk, preferred_element_type=jnp.float32)
        scores = jnp.where(mask[:, None, None], scores, _MASKED)
        probs = jax.nn.softmax(scores, axis=-1).astype(self.dtype)  # [B, G, J, T, S]
        out = jnp.einsum("BGJTS,BGSD->BTGJD", probs, v_buf.astype(self.dtype))
        out = out.reshape(b, t, c.num_heads * d)  # [B, T, Q]
        y = jnp.einsum("BTQ,QE->BTE", out, self.o_proj[...].astype(self.dtype))
        if self.o_bias is not None:
            y = y + self.o_bias[...].astype(self.dtype)
        return constrain(layout, y, _BTE), k_buf, v_buf


class MLP(nnx.Module):
    """SwiGLU: `down(silu(gate(x)) * up(x))`."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs, dtype, param_dtype):
        e, f = config.hidden_size, config.intermediate_size
        self.gate_proj = _param(rngs, (e, f), ("embed", "mlp"), param_dtype)  # [E, F]
        self.up_proj = _param(rngs, (e, f), ("embed", "mlp"), param_dtype)  # [E, F]
        self.down_proj = _param(rngs, (f, e), ("mlp", "embed"), param_dtype)  # [F, E]
        self.dtype = dtype

    def __call__(self, x: jax.Array, layout: Layout | None = None) -> jax.Array:
        """`[B, T, E]` -> `[B, T, E]` (`layout`: see `Attention.__call__`)."""
        w = lambda p: p[...].astype(self.dtype)
        gate = jnp.einsum("BTE,EF->BTF", x, w(self.gate_proj))
        up = jnp.einsum("BTE,EF->BTF", x, w(self.up_proj))
        h = constrain(layout, jax.nn.silu(gate) * up, ("batch", None, "mlp"))
        return constrain(layout, jnp.einsum("BTF,FE->BTE", h, w(self.down_proj)), _BTE)


class Block(nnx.Module):
    """Pre-norm residual block: attention then MLP."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs, dtype, param_dtype):
        kw = dict(dtype=dtype, param_dtype=param_dtype)
        self.input_norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps, **kw)
        self.attn = Attention(config, rngs=rngs, **kw)
        self.post_attention_norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps, **kw)
        self.mlp = MLP(config, rngs=rngs, **kw)

    def __call__(self, x, cos, sin, k_buf, v_buf, length, mask, layout: Layout | None = None):
        """`x` `[B, T, E]` -> `([B, T, E], k_buf, v_buf)`; see `Attention.__call__`."""
        h, k_buf, v_buf = self.attn(
            self.input_norm(x), cos, sin, k_buf, v_buf, length, mask, layout
        )
        x = x + h
        return x + self.mlp(self.post_attention_norm(x), layout), k_buf, v_buf


class Transformer(nnx.Module):
    """Decoder-only transformer with a KV cache.

    Layers are a Python list of separate modules (no `scan`): per-layer buffers decode faster on
    CPU than a scan over stacked weights.

    Attributes:
      layout: `None` on one device; a `jaxcert.models.sharding.Layout` once placed on a mesh
        (`jaxcert.models.shard`, or a loader's ``mesh=``): then activations and cache buffers
        are constrained to the mesh (batch over ``data``, heads / MLP / vocabulary over
        ``model`` with the default rules).
    """

    def __init__(
        self, config: ModelConfig, *, rngs: nnx.Rngs, dtype=jnp.float32, param_dtype=jnp.float32
    ):
        kw = dict(dtype=dtype, param_dtype=param_dtype)
        v, e = config.vocab_size, config.hidden_size
        self.embedding = _param(rngs, (v, e), ("vocab", "embed"), param_dtype)  # [V, E]
        self.layers = nnx.List([Block(config, rngs=rngs, **kw) for _ in range(config.num_layers)])
        self.norm = RMSNorm(e, eps=config.rms_norm_eps, **kw)
        if config.tie_embeddings:
            self.lm_head = None  # the embedding [V, E] is the lm_head
        else:
            self.lm_head = _param(rngs, (e, v), ("embed", "vocab"), param_dtype)  # [E, V]
        self.config = config
        self.dtype = dtype
        self.layout: Layout | None = None

    def init_cache(self, batch_size: int, max_length: int, *, mesh: Mesh | None = None) -> KVCache:
        """An empty `KVCache` of B = `batch_size` rows and S = `max_length` slots for this model.

        Buffers are in the compute dtype; `mesh` places them on their shards (see
        `KVCache.create`).

        Raises:
          ValueError: non-positive `batch_size` or `max_length`.
        """
        return KVCache.create(self.config, batch_size, max_length, dtype=self.dtype, mesh=mesh)

    def __call__(
        self,
        tokens: jax.Array,
        cache: KVCache,
        *,
        positions: jax.Array | None = None,
        attention_mask: jax.Array | None = None,
        return_hidden: bool = False,
    ):
        """Runs T new tokens per row against the committed cache.

        Row b's tokens are written to cache slots `[length[b], length[b] + T)`; query t attends
        to the committed slots `s < length[b]` and to new slot `length[b] + t'` iff
        `attention_mask[b, t, t']`. The returned cache keeps the same `length`: the caller
        commits (`commit`), discards (`rollback`) or keeps a tree path (`select`).
        The caller guarantees `length[b] + T <= S` (otherwise committed entries get overwritten).

        Args:
          tokens: `[B, T]` int token ids (ids outside `[0, V)` give NaN logits).
          cache: a `KVCache` with B rows and L layers.
          positions: `[B, T]` int32 RoPE positions; default `length[b] + t` (for a draft tree:
            `length + depth`).
          attention_mask: `[B, T, T]` bool among the new tokens; default causal (`t' <= t`).
          return_hidden: also return the final-norm hidden states.

        Returns:
          `(logits, cache)` or `(logits, cache, hidden)`: logits `[B, T, V]` float32 (the lm_head
          accumulates in float32), hidden `[B, T, E]` in the compute dtype (what the lm_head sees).

        Raises:
          ValueError: inconsistent shapes or dtypes (at trace time).
        """
        hidden, new_cache = self.features(
            tokens, cache, positions=positions, attention_mask=attention_mask
        )
        logits = self.project(hidden)
        return (logits, new_cache, hidden) if return_hidden else (logits, new_cache)

    def features(
        self,
        tokens: jax.Array,
        cache: KVCache,
        *,
        positions: jax.Array | None = None,
        attention_mask: jax.Array | None = None,
    ) -> tuple[jax.Array, KVCache]:
        """`__call__` without the lm_head: `(hidden [B, T, E], cache)` (final-norm output)."""
        hidden, cache, _ = self.tapped_features(
            tokens, cache, (), positions=positions, attention_mask=attention_mask
        )
        return hidden, cache

    def tapped_features(
        self,
        tokens: jax.Array,
        cache: KVCache,
        taps: tuple[int, ...],
        *,
        positions: jax.Array | None = None,
        attention_mask: jax.Array | None = None,
    ) -> tuple[jax.Array, KVCache, jax.Array]:
        """:meth:`features` and the residual stream after the blocks `taps` (indices in
        `[0, L)`), concatenated: `(hidden, cache, tapped [B, T, len(taps) * E])` (what an
        EAGLE-3 draft head fuses; `[B, T, 0]` for no taps).

        Raises:
          ValueError: a tap outside `[0, L)`; the errors of :meth:`__call__`.
        """
        tokens = jnp.asarray(tokens)
        positions = None if positions is None else jnp.asarray(positions, jnp.int32)
        attention_mask = None if attention_mask is None else jnp.asarray(attention_mask)
        b, t, positions, attention_mask = self._check(tokens, cache, positions, attention_mask)
        if any(not 0 <= i < self.config.num_layers for i in taps):
            raise ValueError(
                f"taps must be block indices in [0, {self.config.num_layers}), got {taps}."
            )
        length = cache.length
        mask = slot_mask(length, t, cache.max_length, attention_mask)
        cos, sin = rope_angles(positions, self.config.head_dim, self.config.rope_theta)

        layout = self.layout
        x = jnp.take(self.embedding[...], tokens, axis=0).astype(self.dtype)  # [B, T, E]
        x = constrain(layout, x, _BTE)
        keys, values, tapped = [], [], {}
        for i, (layer, k_buf, v_buf) in enumerate(
            zip(self.layers, cache.keys, cache.values, strict=True)
        ):
            x, k_buf, v_buf = layer(x, cos, sin, k_buf, v_buf, length, mask, layout)
            keys.append(k_buf)
            values.append(v_buf)
            if i in taps:
                tapped[i] = x
        hidden = constrain(layout, self.norm(x), _BTE)  # [B, T, E]
        cache = cache.replace(keys=tuple(keys), values=tuple(values))
        if not taps:
            return hidden, cache, jnp.zeros((b, t, 0), self.dtype)
        return hidden, cache, jnp.concatenate([tapped[i] for i in taps], axis=-1)

    def project(self, hidden: jax.Array) -> jax.Array:
        """The lm_head: `[..., E]` final-norm hidden states -> `[..., V]` float32 logits.

        On a mesh the logits stay split over the vocabulary (``model``) and the leading axis
        over the batch (``data``).
        """
        weights = self.embedding if self.lm_head is None else self.lm_head
        return lm_head_logits(hidden, weights[...], tied=self.lm_head is None, layout=self.layout)

    def _check(self, tokens, cache, positions, attention_mask):
        c = self.config
        if (cache.keys[0].shape[1], cache.keys[0].shape[3]) != (c.num_kv_heads, c.head_dim):
            raise ValueError(f"cache buffers {cache.keys[0].shape} do not match the config.")
        b, t, positions = check_call(c, tokens, cache, positions, attention_mask)
        return b, t, positions, attention_mask


def check_call(
    config: ModelConfig,
    tokens: jax.Array,
    cache: KVCache,
    positions: jax.Array | None,
    attention_mask: jax.Array | None,
) -> tuple[int, int, jax.Array]:
    """Checks the inputs of a model call over a `KVCache` of `config`'s layers.

    Returns:
      `(B, T, positions)`: positions `[B, T]` int32, by default `length[b] + t`.

    Raises:
      ValueError: tokens not `[B, T]` int; a cache of other rows or layers, or with fewer
        than T slots; positions not `[B, T]`; a mask not bool `[B, T, T]` (each named).
    """
    if tokens.ndim != 2 or not jnp.issubdtype(tokens.dtype, jnp.integer):
        raise ValueError(f"tokens must be [B, T] int, got {tokens.shape} {tokens.dtype}.")
    b, t = tokens.shape
    if cache.batch_size != b or cache.num_layers != config.num_layers:
        raise ValueError(
            f"cache has B={cache.batch_size}, L={cache.num_layers}; expected B={b}, "
            f"L={config.num_layers}."
        )
    if t > cache.max_length:
        raise ValueError(f"T={t} exceeds the cache's S={cache.max_length} slots.")
    if positions is None:
        positions = cache.length[:, None] + jnp.arange(t, dtype=jnp.int32)
    elif positions.shape != (b, t):
        raise ValueError(f"positions must be [B, T]={(b, t)}, got {positions.shape}.")
    if attention_mask is not None and (
        attention_mask.shape != (b, t, t) or attention_mask.dtype != jnp.bool_
    ):
        raise ValueError(
            f"attention_mask must be bool [B, T, T]={(b, t, t)}, got "
            f"{attention_mask.shape} {attention_mask.dtype}."
        )
    return b, t, positions


def untied(model: Transformer) -> Transformer:
    """`model` with an lm_head of its own, so that the lm_head can be trained apart from the
    embedding: a tied model's `[V, E]` embedding copied, transposed, into an `[E, V]`
    `lm_head` (`config.tie_embeddings` False; the same logits, in the untied einsum). An
    untied model is returned as it is. Not for a model placed on a mesh (its layout is
    dropped).

    Raises:
      ValueError: `model` is placed on a mesh.
    """
    if model.lm_head is not None:
        return model
    if model.layout is not None:
        raise ValueError("untied: the model is placed on a mesh; untie it before placing it")
    config = dataclasses.replace(model.config, tie_embeddings=False)
    embedding = model.embedding[...]
    dtypes = dict(dtype=model.dtype, param_dtype=embedding.dtype)
    out = nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0), **dtypes))
    nnx.update(out, nnx.state(model))
    out.lm_head = _const(embedding.T, ("embed", "vocab"))
    return out


def lm_head_logits(
    hidden: jax.Array, weights: jax.Array, *, tied: bool, layout: Layout | None = None
) -> jax.Array:
    """`[..., E]` hidden states -> `[..., V]` float32 logits (accumulated in float32).

    Args:
      hidden: `[..., E]` final-norm hidden states (cast to the weights' dtype).
      weights: the embedding `[V, E]` when `tied`, else the lm_head `[E, V]`.
      tied: which of the two `weights` is.
      layout: a model's `Layout` on a mesh (logits split over the vocabulary and the leading
        axis over the batch), or `None`.
    """
    spec = "...E,VE->...V" if tied else "...E,EV->...V"
    logits = jnp.einsum(
        spec, hidden.astype(weights.dtype), weights, preferred_element_type=jnp.float32
    )
    lead = ("batch",) + (None,) * (logits.ndim - 2) if logits.ndim > 1 else ()
    return constrain(layout, logits, lead + ("vocab",))


def forward(
    graphdef: nnx.GraphDef,
    params: nnx.State,
    tokens: jax.Array,
    cache: CacheT,
    **kwargs,
) -> tuple[jax.Array, CacheT]:
    """Pure `__call__` of the model split into `(graphdef, params)`, for `jax.jit`.

    Example::

      graphdef, params = nnx.split(model)
      step = jax.jit(forward, static_argnums=0, static_argnames="return_hidden",
                     donate_argnames="cache")
      logits, cache = step(graphdef, params, tokens, cache)

    Donating `cache` lets XLA update the buffers in place; without it each call copies them.
    Compiles once per shape of `tokens`/`cache` and per option set.
    """
    return nnx.merge(graphdef, params)(tokens, cache, **kwargs)


def decode_step(
    graphdef: nnx.GraphDef,
    params: nnx.State,
    token: jax.Array,
    cache: CacheT,
    active: jax.Array,
) -> tuple[jax.Array, CacheT]:
    """One autoregressive step: feeds `token` (`[B]` int32) and commits it on `active` rows.

    The step of every target-only loop of the package (`jaxcert certify`'s greedy scan and
    the decoder's target-only baseline), so both read the same logits.

    Args:
      graphdef, params: the model, split with `nnx.split`.
      token: `[B]` int32, the token each row appends.
      cache: the model's cache (`B` rows).
      active: `[B]` bool; inactive rows compute but do not commit their entry.

    Returns:
      `(logits, cache)`: `[B, V]` logits of the next position, and the cache with one more
      committed entry on the active rows.
    """
    logits, cache = forward(graphdef, params, token[:, None], cache)
    return logits[:, 0], cache.commit(active.astype(jnp.int32))


def truncate(model: Transformer, num_layers: int) -> Transformer:
    """The first `num_layers` blocks of `model`, then its final norm and lm_head (early exit).

    The new model shares every array with `model` (nothing is copied). It is the trunk of a
    self-speculative drafter: a cheap early exit of the target itself.

    Raises:
      ValueError: `num_layers` is not in `[1, model.config.num_layers]`.
    """
    total = model.config.num_layers
    if not 1 <= num_layers <= total:
        raise ValueError(f"num_layers must be in [1, {total}], got {num_layers}.")
    config = dataclasses.replace(model.config, num_layers=num_layers)
    param_dtype = model.embedding[...].dtype
    abstract = nnx.eval_shape(
        lambda: Transformer(config, rngs=nnx.Rngs(0), dtype=model.dtype, param_dtype=param_dtype)
    )
    graphdef, params = nnx.split(abstract)
    pure = nnx.to_pure_dict(nnx.state(model))
    pure["layers"] = {i: pure["layers"][i] for i in range(num_layers)}
    nnx.replace_by_pure_dict(params, pure)
    out = nnx.merge(graphdef, params)
    out.layout = model.layout
    return out
