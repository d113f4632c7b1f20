"""EAGLE-style draft head: drafts from the current token and the target's feature before it.

The head reads, at position t, the embedding of token x_t and a feature f_{t-1} of the
position before it, and predicts the next token::

  u_t = fc([embed_norm(embed(x_t)), context_norm(f_{t-1})])        # [B, T, 2E] -> [B, T, E]
  h_t = norm(blocks(u_t))                                          # num_layers Blocks, own cache
  q(. | x_<=t) = softmax(project(h_t))                             # [B, T, V]

The feature comes from the target (:meth:`EagleHead.fuse`):

- EAGLE-1 (``taps=()``): the target's final-norm hidden state, as is;
- EAGLE-3 (``taps=(low, mid, high)``): the residual stream after those target blocks
  (`Transformer.tapped_features`), concatenated and mixed by a linear ``len(taps)*E -> E``.

When the head drafts several tokens in a row, the context of the next step is the head's own
output ``h_t`` (:meth:`EagleHead.features`' hidden, the final-norm state that
:meth:`EagleHead.project` reads). Both inputs are RMS-normalised before ``fc`` (as EAGLE-3
does), so the head's own state and the target's feature may differ in scale.

Reduced draft vocabulary (EAGLE-3 drafts over the 32k most frequent of 151,936 tokens). With
``draft_vocab`` (V' sorted ids) the lm_head has V' columns, and :meth:`EagleHead.project`
still returns logits over the full vocabulary V: each draft-vocabulary token gets its lm_head
logit and every one of the V - V' other tokens gets one shared learnt logit b (the scalar
parameter ``oov_logit``). So q is a proper distribution over all V tokens with q > 0
everywhere::

  q(x) = exp(b) / Z  for every x outside,   q_out = (V - V') exp(b) / Z  in all,

and KL(p || q) stays finite for any target p (certificates keep their meaning). Splitting
the vocabulary into inside and outside::

  KL(p || q) = kl(p_out || q_out) + (1 - p_out) KL(p_in || q_in)
               + p_out (log(V - V') - H(p | outside)),

with kl the binary KL and p_in, q_in the distributions within the draft vocabulary: the
outside tokens add at most p_out log(V - V') beyond the binary term, since q is uniform
there. The learnt b matches the mass outside in total (d KL / d b = q_out - p_out), not
token by token. b starts at ``log(1e-4 / (V - V'))`` (`OOV_INIT_MASS`): all outside tokens
together weigh 1e-4 of one token of logit 0. The full logits are one scatter of the V'
logits into an array filled with b, at the (sorted, unique) ids.

Positions: the head's cache slot t holds the pair (x_t, f_{t-1}); the decoder feeds x_0 with
a zero feature (there is no position before it), so for a prompt x_0..x_n slot t holds x_t
for every t; its RoPE positions default to the slot (``length + t``), as the target's.

Initialisation: :meth:`EagleHead.from_target` copies the target's embedding (the same array
when the dtypes agree: no copy in memory), its final-norm scale and the draft-vocabulary
columns of its lm_head.
EAGLE keeps embedding and lm_head frozen; `TRAINABLE` selects the rest (``fc``, ``fuse_fc``,
the norms, the blocks, ``oov_logit``).

The published EAGLE-3 head (``arch="eagle3"``), the one vLLM, SGLang, tpu-inference and
TensorRT-LLM serve and SpecForge and speculators train, differs from the above in its one
layer: ``fc`` `[3E, E]` mixes the three tapped target states (as ``fuse_fc`` above), and the
layer's attention reads the embedding and the context side by side::

  a_t = attn([input_norm(embed(x_t)), hidden_norm(c_{t-1})])       # q/k/v over 2E inputs
  r_t = c_{t-1} + a_t        (hidden_norm(c_{t-1}) + a_t with ``norm_before_residual``)
  h_t = r_t + mlp(post_attention_norm(r_t))                        # the pre-norm state
  q(. | x_<=t) = softmax(lm_head(norm(h_t)))                       # [B, T, V'] -> d2t

and the context of the next drafted token is the pre-norm ``h_t`` (what vLLM's proposer
feeds back), so there :meth:`EagleHead.features` returns ``h_t`` and
:meth:`EagleHead.project` applies the final norm. The engines' draft caches begin at ``x_1``
(paired with the target's state at ``x_0``; SpecForge trains the same way): an ``eagle3``
head keeps slot 0 (``x_0`` with a zero context) invisible to every later token. Outside the
draft vocabulary the engines draft with a ``-inf`` logit; an ``eagle3`` head does too
(``outside="-inf"``), while ``project(hidden, outside="oov")`` gives the shared learnt logit
above wherever a finite ``KL(p || q)`` is wanted (training, certificates). A ``jaxcert``
head drafts with the shared logit (``outside="oov"``).
`jaxcert.models.eagle3` reads and writes the engines' folders.

Shape letters as in `jaxcert.models`; K = ``len(taps)``, V' = draft-vocabulary size.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import pathlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxcert.models.cache import KVCache
from jaxcert.models.config import ModelConfig
from jaxcert.models.sharding import Layout, constrain
from jaxcert.models.transformer import (
    MLP,
    Attention,
    Block,
    RMSNorm,
    Transformer,
    check_call,
    lm_head_logits,
    rope_angles,
    slot_mask,
)

__all__ = [
    "FORMAT_VERSION",
    "OOV_INIT_MASS",
    "TRAINABLE",
    "ARCHS",
    "OUTSIDE",
    "DraftVocab",
    "Eagle3Layer",
    "EagleHead",
    "check_head_target",
    "check_taps",
    "draft_vocab_from_counts",
    "load_head",
    "save_head",
    "target_features",
    "target_step",
]

OOV_INIT_MASS = 1e-4  # initial weight of all outside tokens together, vs one token of logit 0
FORMAT_VERSION = 1  # of the head.json / head.safetensors pair
_INIT = nnx.initializers.normal(0.02)
_FROZEN = ("embedding", "lm_head")  # shared with / copied from the target; EAGLE freezes them
TRAINABLE = nnx.All(nnx.Param, nnx.Not(nnx.Any(*(nnx.PathContains(n) for n in _FROZEN))))


class DraftVocab(nnx.Variable):
    """The draft vocabulary's ids, `[V']` int32 sorted (state, but not a trainable Param)."""


def _param(value: jax.Array, names: tuple[str | None, ...]) -> nnx.Param:
    return nnx.Param(value, out_sharding=names, eager_sharding=False)


def _check_draft_vocab(ids: Any, vocab_size: int) -> np.ndarray:
    """The ids `[V']` as sorted int32 numpy, after checking them.

    Raises:
      ValueError: not a non-empty 1-D integer array, an id outside `[0, vocab_size)`, or a
        duplicated id (each named).
    """
    ids = np.asarray(ids)
    if ids.ndim != 1 or ids.size == 0 or not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(
            f"draft_vocab must be a non-empty [V'] integer array, got {ids.shape} {ids.dtype}."
        )
    bad = ids[(ids < 0) | (ids >= vocab_size)]
    if bad.size:
        raise ValueError(f"draft_vocab ids out of range [0, {vocab_size}): {bad[:5].tolist()}.")
    ids = np.sort(ids)
    dup = np.unique(ids[1:][ids[1:] == ids[:-1]])
    if dup.size:
        raise ValueError(f"draft_vocab has duplicated ids: {dup[:5].tolist()}.")
    return ids.astype(np.int32)


def draft_vocab_from_counts(counts: np.ndarray, size: int) -> np.ndarray:
    """The `size` most frequent token ids, sorted: `[size]` int32 (ties: the lower id).

    Args:
      counts: `[V]` occurrences (or any non-negative weights) of each token.
      size: V', how many ids to keep, in `[1, V]`.

    Raises:
      ValueError: `counts` not 1-D, or `size` outside `[1, V]`.
    """
    counts = np.asarray(counts)
    if counts.ndim != 1:
        raise ValueError(f"counts must be [V], got shape {counts.shape}.")
    if not 1 <= size <= counts.shape[0]:
        raise ValueError(f"size must be in [1, {counts.shape[0]}], got {size}.")
    top = np.argsort(-counts, kind="stable")[:size]
    return np.sort(top).astype(np.int32)


ARCHS = ("jaxcert", "eagle3")
OUTSIDE = ("oov", "-inf")


class Eagle3Layer(nnx.Module):
    """The published EAGLE-3 layer: attention over `[input_norm(e), hidden_norm(c)]` (2E
    inputs), then a pre-norm MLP; returns the pre-norm state (see the module docstring).

    Parameter names follow the engines' (``midlayer.*``) through `jaxcert.models.eagle3`.
    """

    def __init__(
        self, config: ModelConfig, *, rngs: nnx.Rngs, dtype, param_dtype, norm_before_residual
    ):
        c = config
        e, q, kv = c.hidden_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        kw = dict(eps=c.rms_norm_eps, dtype=dtype, param_dtype=param_dtype)
        self.input_norm = RMSNorm(e, **kw)
        self.hidden_norm = RMSNorm(e, **kw)
        self.attn = Attention(c, rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        init = lambda shape: _INIT(rngs.params(), shape, param_dtype)  # noqa: E731
        self.attn.q_proj = _param(init((2 * e, q)), (None, "heads"))  # [2E, Q]
        self.attn.k_proj = _param(init((2 * e, kv)), (None, "kv_heads"))  # [2E, G*D]
        self.attn.v_proj = _param(init((2 * e, kv)), (None, "kv_heads"))  # [2E, G*D]
        self.post_attention_norm = RMSNorm(e, **kw)
        self.mlp = MLP(c, rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        self.norm_before_residual = bool(norm_before_residual)

    def __call__(self, embeds, context, cos, sin, k_buf, v_buf, length, mask, layout=None):
        """`embeds`, `context` `[B, T, E]` -> `(pre-norm state [B, T, E], k_buf, v_buf)`;
        the other arguments as `Block.__call__`."""
        normed = self.hidden_norm(context)
        residual = normed if self.norm_before_residual else context
        x = jnp.concatenate([self.input_norm(embeds), normed], axis=-1)  # [B, T, 2E]
        a, k_buf, v_buf = self.attn(x, cos, sin, k_buf, v_buf, length, mask, layout)
        residual = residual + a
        return residual + self.mlp(self.post_attention_norm(residual), layout), k_buf, v_buf


class EagleHead(nnx.Module):
    """An EAGLE draft head over a target of config `target_config` (see the module docstring).

    Attributes:
      arch: ``"jaxcert"`` (``fc`` over the normalised embedding and context, then ordinary
        blocks) or ``"eagle3"`` (the published EAGLE-3 layer, `Eagle3Layer`).
      config: the head's `ModelConfig`: the target's sizes and vocabulary, ``num_layers`` =
        the head's blocks (what its `KVCache` holds).
      target_config: the target's config (``num_layers`` = the target's blocks).
      taps: the target blocks whose residual streams :meth:`fuse` mixes; ``()`` for the
        target's final-norm hidden state (EAGLE-1).
      draft_vocab: `DraftVocab` `[V']` int32 sorted ids, or ``None`` (full vocabulary).
      draft_size: V' (V without a draft vocabulary), columns of ``lm_head`` `[E, V']`.
      oov_logit: scalar Param, the logit of every token outside the draft vocabulary
        (``None`` without one).
      outside: what :meth:`project` gives tokens outside the draft vocabulary by default:
        ``"oov"`` (``oov_logit``) or ``"-inf"`` (as the engines draft).
    """

    embed_norm: RMSNorm | None
    context_norm: RMSNorm | None
    fc: nnx.Param | None
    layers: nnx.List[Any]

    def __init__(
        self,
        target_config: ModelConfig,
        *,
        rngs: nnx.Rngs,
        num_layers: int = 1,
        taps: tuple[int, ...] | None = None,
        draft_vocab: jax.Array | np.ndarray | None = None,
        dtype=jnp.float32,
        param_dtype=jnp.float32,
        arch: str = "jaxcert",
        outside: str | None = None,
        norm_before_residual: bool = False,
        attention_bias: bool = False,
    ):
        """Builds a randomly initialised head.

        Args:
          arch: ``"jaxcert"`` or ``"eagle3"`` (one layer, three taps; its attention has
            biases with `attention_bias`, its residual as `norm_before_residual` says).
          outside: :attr:`outside`; default ``"oov"`` for ``"jaxcert"``, ``"-inf"`` for
            ``"eagle3"``.

        Raises:
          ValueError: `num_layers` < 1; a tap that is not a distinct block index in
            `[0, target_config.num_layers)`; a `draft_vocab` that is not a non-empty 1-D
            integer array of distinct ids in `[0, V)`; an unknown `arch` or `outside`; an
            ``"eagle3"`` head with other than one layer and three taps (each named).
        """
        if not isinstance(num_layers, int) or num_layers < 1:
            raise ValueError(f"num_layers must be a positive int, got {num_layers!r}.")
        if arch not in ARCHS:
            raise ValueError(f"arch must be one of {ARCHS}, got {arch!r}.")
        outside = ("-inf" if arch == "eagle3" else "oov") if outside is None else outside
        if outside not in OUTSIDE:
            raise ValueError(f"outside must be one of {OUTSIDE}, got {outside!r}.")
        taps = check_taps(() if taps is None else taps, target_config.num_layers)
        if arch == "eagle3" and (num_layers != 1 or len(taps) != 3):
            raise ValueError(
                f"an eagle3 head has one layer and three taps, got num_layers={num_layers}, "
                f"taps={taps}."
            )
        if arch == "eagle3" and list(taps) != sorted(taps):
            raise ValueError(
                f"an eagle3 head's taps must increase (the engines concatenate the states in "
                f"layer order), got {taps}."
            )
        v, e = target_config.vocab_size, target_config.hidden_size
        ids = None if draft_vocab is None else _check_draft_vocab(draft_vocab, v)
        self.arch = arch
        self.outside = outside
        if arch == "eagle3":  # a Llama layer: biases as the checkpoint says, rotate_half RoPE
            self.config = dataclasses.replace(
                target_config, architecture="llama", num_layers=1, qkv_bias=attention_bias,
                o_bias=attention_bias, qk_norm=False, rope_layout="half",
            )  # fmt: skip
        else:
            self.config = dataclasses.replace(target_config, num_layers=num_layers)
        self.target_config = target_config
        self.taps = taps
        self.draft_size = v if ids is None else int(ids.size)
        self.dtype = dtype
        self.layout: Layout | None = None  # set by `jaxcert.models.shard`, as a Transformer's

        init = lambda shape: _INIT(rngs.params(), shape, param_dtype)  # noqa: E731
        kw = dict(eps=target_config.rms_norm_eps, dtype=dtype, param_dtype=param_dtype)
        self.embedding = _param(init((v, e)), ("vocab", "embed"))  # [V, E]
        self.fuse_fc = _param(init((len(taps) * e, e)), (None, "embed")) if taps else None
        if arch == "eagle3":
            self.embed_norm = self.context_norm = self.fc = None
            self.layers = nnx.List(
                [
                    Eagle3Layer(
                        self.config, rngs=rngs, dtype=dtype, param_dtype=param_dtype,
                        norm_before_residual=norm_before_residual,
                    )
                ]
            )  # fmt: skip
        else:
            self.embed_norm = RMSNorm(e, **kw)
            self.context_norm = RMSNorm(e, **kw)
            self.fc = _param(init((2 * e, e)), (None, "embed"))  # [2E, E]
            self.layers = nnx.List(
                [
                    Block(self.config, rngs=rngs, dtype=dtype, param_dtype=param_dtype)
                    for _ in range(num_layers)
                ]
            )
        self.norm = RMSNorm(e, **kw)
        self.lm_head = _param(init((e, self.draft_size)), ("embed", "vocab"))  # [E, V']
        if ids is None:
            self.draft_vocab, self.oov_logit = None, None
        else:
            self.draft_vocab = DraftVocab(jnp.asarray(ids))
            b0 = math.log(OOV_INIT_MASS / max(v - ids.size, 1))
            self.oov_logit = _param(jnp.asarray(b0, jnp.float32), ())

    @property
    def norm_before_residual(self) -> bool:
        """An ``eagle3`` head's residual is taken after ``hidden_norm`` (``False`` otherwise)."""
        return self.arch == "eagle3" and bool(self.layers[0].norm_before_residual)

    @classmethod
    def from_target(cls, target: Transformer, *, rngs: nnx.Rngs | None = None, **kw) -> EagleHead:
        """A head whose embedding, final-norm scale and lm_head come from `target`.

        The embedding is the target's array (shared when `param_dtype` is the target's, else
        a cast copy); the lm_head holds the target's lm_head columns (or tied embedding
        rows) of the draft vocabulary.

        Args:
          target: the target `Transformer`.
          rngs: for the other parameters (default ``nnx.Rngs(0)``).
          **kw: the other arguments of `EagleHead` (`dtype` defaults to the target's,
            `param_dtype` to its embedding's).

        Raises:
          ValueError: as `EagleHead`.
        """
        param_dtype = kw.pop("param_dtype", target.embedding[...].dtype)
        kw.setdefault("dtype", target.dtype)
        head = cls(
            target.config,
            rngs=nnx.Rngs(0) if rngs is None else rngs,
            param_dtype=param_dtype,
            **kw,
        )
        embedding = target.embedding[...]
        head.embedding.set_value(embedding.astype(param_dtype))
        head.norm.scale.set_value(target.norm.scale[...].astype(param_dtype))
        full = embedding.T if target.lm_head is None else target.lm_head[...]  # [E, V]
        if head.draft_vocab is not None:
            full = jnp.take(full, head.draft_vocab[...], axis=1)
        head.lm_head.set_value(full.astype(param_dtype))
        return head

    def init_cache(self, batch_size: int, max_length: int) -> KVCache:
        """An empty `KVCache` (the head's L blocks, B = `batch_size`, S = `max_length`).

        Raises:
          ValueError: non-positive `batch_size` or `max_length`.
        """
        return KVCache.create(self.config, batch_size, max_length, dtype=self.dtype)

    def fuse(self, target_states: jax.Array) -> jax.Array:
        """The target's states -> the feature the head reads: `[B, T, E]` compute dtype.

        Args:
          target_states: `[B, T, K*E]` the residual streams after the blocks `taps`
            (`Transformer.tapped_features` with these taps), or, for ``taps == ()``, the
            `[B, T, E]` final-norm hidden state (returned as is).

        Raises:
          ValueError: the last axis is not `K*E` (`E` without taps).
        """
        e = self.config.hidden_size
        width = len(self.taps) * e if self.taps else e
        if target_states.ndim != 3 or target_states.shape[-1] != width:
            raise ValueError(
                f"target_states must be [B, T, {width}] (taps={self.taps}), got "
                f"{target_states.shape}."
            )
        x = target_states.astype(self.dtype)
        if self.fuse_fc is None:
            return x
        return jnp.einsum("BTK,KE->BTE", x, self.fuse_fc[...].astype(self.dtype))

    def features(
        self,
        tokens: jax.Array,
        cache: KVCache,
        *,
        context: jax.Array,
        positions: jax.Array | None = None,
        attention_mask: jax.Array | None = None,
    ) -> tuple[jax.Array, KVCache]:
        """The head without the lm_head: `(hidden [B, T, E], cache)`.

        Cache semantics as `Transformer.__call__`: the T entries go to slots
        `[length, length + T)` and the returned cache keeps `length` (the caller commits).

        Args:
          tokens: `[B, T]` int ids.
          cache: the head's `KVCache` (`init_cache`).
          context: `[B, T, E]` the feature of the position before each token: :meth:`fuse`
            of the target's states, or the head's own earlier `hidden`.
          positions: `[B, T]` int32 RoPE positions; default `length[b] + t`.
          attention_mask: `[B, T, T]` bool among the new tokens; default causal.

        Returns:
          `hidden` `[B, T, E]` in the compute dtype: the state :meth:`project` reads and the
          context of the next drafted token (after the final norm for a ``jaxcert`` head,
          before it for an ``eagle3`` one, as the engines feed it back).

        Raises:
          ValueError: inconsistent shapes or dtypes (at trace time).
        """
        tokens = jnp.asarray(tokens)
        context = jnp.asarray(context)
        positions = None if positions is None else jnp.asarray(positions, jnp.int32)
        attention_mask = None if attention_mask is None else jnp.asarray(attention_mask)
        t, positions = self._check(tokens, cache, context, positions, attention_mask)
        c = self.config
        mask = slot_mask(cache.length, t, cache.max_length, attention_mask)
        cos, sin = rope_angles(positions, c.head_dim, c.rope_theta)
        x = jnp.take(self.embedding[...], tokens, axis=0).astype(self.dtype)  # [B, T, E]
        if self.arch == "eagle3":
            # The engines never write x_0 (it has no target state before it): slot 0 stays
            # invisible to every other token, as if the cache began at x_1.
            slots = jnp.arange(cache.max_length, dtype=jnp.int32)
            query = cache.length[:, None] + jnp.arange(t, dtype=jnp.int32)  # [B, T]
            mask = mask & ((slots[None, None, :] != 0) | (query[:, :, None] == 0))
            layer = self.layers[0]
            x, k_buf, v_buf = layer(
                x, context.astype(self.dtype), cos, sin, cache.keys[0], cache.values[0],
                cache.length, mask, self.layout,
            )  # fmt: skip
            x = constrain(self.layout, x, ("batch", None, "embed"))
            return x, KVCache(keys=(k_buf,), values=(v_buf,), length=cache.length)
        assert self.embed_norm is not None and self.context_norm is not None and self.fc
        x = jnp.concatenate([self.embed_norm(x), self.context_norm(context)], axis=-1)
        x = jnp.einsum("BTF,FE->BTE", x, self.fc[...].astype(self.dtype))  # F = 2E
        x = constrain(self.layout, x, ("batch", None, "embed"))
        keys, values = [], []
        for layer, k_buf, v_buf in zip(self.layers, cache.keys, cache.values, strict=True):
            x, k_buf, v_buf = layer(x, cos, sin, k_buf, v_buf, cache.length, mask, self.layout)
            keys.append(k_buf)
            values.append(v_buf)
        return self.norm(x), KVCache(keys=tuple(keys), values=tuple(values), length=cache.length)

    def draft_logits(self, hidden: jax.Array) -> jax.Array:
        """`[..., E]` hidden (:meth:`features`) -> `[..., V']` float32 logits of the draft
        vocabulary (the lm_head; an ``eagle3`` head applies its final norm first)."""
        if self.arch == "eagle3":
            hidden = self.norm(hidden)
        return lm_head_logits(hidden, self.lm_head[...], tied=False)  # [..., V']

    def project(self, hidden: jax.Array, *, outside: str | None = None) -> jax.Array:
        """`[..., E]` hidden -> `[..., V]` float32 logits over the full target vocabulary.

        With a draft vocabulary, tokens outside it all get the logit ``oov_logit``
        (``outside="oov"``) or ``-inf`` (``outside="-inf"``, as the engines draft); the
        default is the head's :attr:`outside`.

        Raises:
          ValueError: an unknown `outside`.
        """
        outside = self.outside if outside is None else outside
        if outside not in OUTSIDE:
            raise ValueError(f"outside must be one of {OUTSIDE}, got {outside!r}.")
        logits = self.draft_logits(hidden)  # [..., V']
        if self.draft_vocab is None or self.oov_logit is None:
            return logits
        shape = logits.shape[:-1] + (self.config.vocab_size,)
        fill = -jnp.inf if outside == "-inf" else self.oov_logit[...].astype(jnp.float32)
        full = jnp.broadcast_to(jnp.asarray(fill, jnp.float32), shape)
        return full.at[..., self.draft_vocab[...]].set(
            logits, indices_are_sorted=True, unique_indices=True
        )

    def __call__(
        self,
        tokens: jax.Array,
        cache: KVCache,
        *,
        context: jax.Array,
        positions: jax.Array | None = None,
        attention_mask: jax.Array | None = None,
        return_hidden: bool = False,
        outside: str | None = None,
    ):
        """:meth:`features` then :meth:`project` (with `outside`): `(logits [B, T, V]
        float32, cache)`, or `(logits, cache, hidden [B, T, E])` with `return_hidden`.

        Raises:
          ValueError: as :meth:`features`.
        """
        hidden, cache = self.features(
            tokens, cache, context=context, positions=positions, attention_mask=attention_mask
        )
        logits = self.project(hidden, outside=outside)
        return (logits, cache, hidden) if return_hidden else (logits, cache)

    def _check(self, tokens, cache, context, positions, attention_mask):
        """`(T, positions [B, T])` after checking every input's shape and dtype."""
        c = self.config
        b, t, positions = check_call(c, tokens, cache, positions, attention_mask)
        if context.shape != (b, t, c.hidden_size) or not jnp.issubdtype(
            context.dtype, jnp.floating
        ):
            raise ValueError(
                f"context must be float [B, T, E]={(b, t, c.hidden_size)}, got "
                f"{context.shape} {context.dtype}."
            )
        return t, positions


def save_head(head: EagleHead, folder: str | os.PathLike) -> pathlib.Path:
    """Writes `head.safetensors` (every state array, flat dotted names such as
    ``layers.0.attn.q_proj``) and `head.json` (format version, target config, head layers,
    taps, draft-vocabulary size, dtypes, arch and its options) into `folder` (created);
    returns the folder. The engines' layouts: `jaxcert.models.eagle3.export_head`."""
    from safetensors.flax import save_file

    folder = pathlib.Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(_flat_arrays(head), str(folder / "head.safetensors"))
    meta = {
        "format": "jaxcert-eagle-head",
        "version": FORMAT_VERSION,
        "target_config": dataclasses.asdict(head.target_config),
        "num_layers": head.config.num_layers,
        "taps": list(head.taps),
        "draft_vocab_size": None if head.draft_vocab is None else head.draft_size,
        "dtype": jnp.dtype(head.dtype).name,
        "param_dtype": jnp.dtype(head.embedding[...].dtype).name,
        "arch": head.arch,
        "outside": head.outside,
        "norm_before_residual": head.norm_before_residual,
        "attention_bias": head.arch == "eagle3" and head.config.qkv_bias,
    }
    (folder / "head.json").write_text(json.dumps(meta, indent=2) + "\n")
    return folder


def is_head_folder(path: str | os.PathLike) -> bool:
    """Whether `path` is a folder `save_head` wrote (it holds a `head.json`)."""
    return (pathlib.Path(path) / "head.json").is_file()


def read_head_config(folder: str | os.PathLike) -> ModelConfig:
    """The target `ModelConfig` recorded in `folder`'s `head.json`, without reading tensors.

    Raises:
      ValueError: no `head.json` in `folder`; one that is not a head's (unreadable, another
        format or version, keys missing).
    """
    path = pathlib.Path(folder) / "head.json"
    if not path.is_file():
        raise ValueError(f"{folder} has no head.json (see save_head).")
    return _target_config(path, _read_meta(path))


_META_KEYS = ("target_config", "draft_vocab_size", "num_layers", "taps", "dtype", "param_dtype")


def _read_meta(path: pathlib.Path) -> dict:
    """``head.json`` at ``path``, checked: a JSON object of this format and version with
    every key `load_head` reads (ValueError naming the file otherwise)."""
    try:
        meta = json.loads(path.read_text())
    except ValueError as e:
        raise ValueError(f"{path}: not readable JSON ({e}).") from None
    if not isinstance(meta, dict):
        raise ValueError(f"{path}: not a JSON object.")
    if meta.get("format") != "jaxcert-eagle-head" or meta.get("version") != FORMAT_VERSION:
        raise ValueError(
            f"{path}: format {meta.get('format')!r} version "
            f"{meta.get('version')!r}; expected 'jaxcert-eagle-head' {FORMAT_VERSION}."
        )
    missing = [k for k in _META_KEYS if k not in meta]
    if missing:
        raise ValueError(f"{path}: lacks {', '.join(missing)} (see save_head).")
    return meta


def _target_config(path: pathlib.Path, meta: dict) -> ModelConfig:
    cfg = meta["target_config"]
    if not isinstance(cfg, dict) or not isinstance(cfg.get("eos_token_ids"), list):
        raise ValueError(f"{path}: target_config is not a model configuration with eos_token_ids.")
    try:
        return ModelConfig(**dict(cfg, eos_token_ids=tuple(cfg["eos_token_ids"])))
    except TypeError as e:
        raise ValueError(f"{path}: target_config is not a model configuration ({e}).") from None


def target_features(
    target: Transformer, tokens: jax.Array, cache: KVCache, taps: tuple[int, ...], **kwargs
) -> tuple[jax.Array, KVCache, jax.Array]:
    """One target pass, with the states that a head with these `taps` reads.

    Args:
      target: the target model.
      tokens: `[B, T]` int32 tokens; `cache` the target's cache; `kwargs` the `positions`
        and `attention_mask` of `Transformer.__call__`.
      taps: the head's taps; `()` for an EAGLE-1 head.

    Returns:
      `(hidden [B, T, E], cache, states)`: the target's final-norm hidden states (what its
      lm_head reads), its cache, and `states`, the input of :meth:`EagleHead.fuse`: the
      residual streams after the blocks `taps`, `[B, T, len(taps) * E]`, or `hidden` itself
      for `taps == ()`.

    Raises:
      ValueError: the errors of `Transformer.tapped_features`.
    """
    hidden, cache, states = target.tapped_features(tokens, cache, taps, **kwargs)
    return hidden, cache, (states if taps else hidden)


def target_step(
    graphdef: nnx.GraphDef,
    params: nnx.State,
    token: jax.Array,
    cache: KVCache,
    active: jax.Array,
    taps: tuple[int, ...],
) -> tuple[jax.Array, KVCache, jax.Array]:
    """`jaxcert.models.decode_step` that also returns what a head with these `taps` reads.

    The same pass as `decode_step` (`Transformer.features` is `tapped_features` without
    taps), so the logits are the plain step's.

    Args:
      graphdef, params: the target, split with `nnx.split`.
      token: `[B]` int32, the token each row appends.
      cache: the target's cache (`B` rows).
      active: `[B]` bool; inactive rows compute but do not commit their entry.
      taps: the head's taps; `()` for an EAGLE-1 head.

    Returns:
      `(logits [B, V] float32, cache, states [B, Z])`: the next position's logits, the cache
      with one more committed entry on the active rows, and the states after reading `token`
      (:func:`target_features`' `states`, `Z = len(taps) * E` or `E`).

    Raises:
      ValueError: the errors of `Transformer.tapped_features`.
    """
    model = nnx.merge(graphdef, params)
    hidden, cache, states = target_features(model, token[:, None], cache, taps)
    logits = model.project(hidden)[:, 0]
    return logits, cache.commit(active.astype(jnp.int32)), states[:, 0]


def check_taps(taps, num_layers: int) -> tuple[int, ...]:
    """`taps` as a tuple of ints if they are distinct block indices of a target with
    `num_layers` blocks (the blocks an EAGLE-3 head fuses).

    Raises:
      ValueError: a tap that is not an int in `[0, num_layers)`, or a repeated tap.
    """
    taps = tuple(taps)
    if any(not isinstance(i, (int, np.integer)) or not 0 <= i < num_layers for i in taps):
        raise ValueError(f"taps must be target block indices in [0, {num_layers}), got {taps}.")
    if len(set(taps)) != len(taps):
        raise ValueError(f"taps must be distinct, got {taps}.")
    return tuple(int(i) for i in taps)


def check_head_fits(head: EagleHead, target_config: ModelConfig) -> None:
    """Refuses a head trained for another target.

    Raises:
      ValueError: the vocabulary size, hidden width or block count of `target_config`
        differs from the head's recorded target (each named).
    """
    check_head_target(head.target_config, target_config)


def check_head_target(recorded: ModelConfig, target_config: ModelConfig) -> None:
    """Refuses a target other than the one a head records (`read_head_config` reads it from
    a head folder without its tensors; :func:`check_head_fits` from a loaded head).

    Raises:
      ValueError: the vocabulary size, hidden width or block count of `target_config`
        differs from `recorded` (each named, on one line).
    """
    fields = ("vocab_size", "hidden_size", "num_layers")
    diff = [
        f"{f} {getattr(recorded, f)} (head) vs {getattr(target_config, f)} (target)"
        for f in fields
        if getattr(recorded, f) != getattr(target_config, f)
    ]
    if diff:
        raise ValueError(f"the draft head was built for another target: {'; '.join(diff)}")


def load_head(folder: str | os.PathLike) -> EagleHead:
    """The head `save_head` wrote into `folder`.

    Raises:
      ValueError: a missing file, another format or version, or tensors that do not match the
        recorded head (names, shapes, dtypes).
    """
    from safetensors.flax import load_file

    folder = pathlib.Path(folder)
    if not (folder / "head.json").is_file() or not (folder / "head.safetensors").is_file():
        raise ValueError(f"{folder} lacks head.json or head.safetensors (see save_head).")
    meta = _read_meta(folder / "head.json")
    config = _target_config(folder / "head.json", meta)
    try:
        tensors = load_file(str(folder / "head.safetensors"))
    except Exception as e:  # safetensors' own error types: empty, truncated, corrupt
        raise ValueError(f"{folder / 'head.safetensors'}: cannot be read ({e}).") from None
    size = meta["draft_vocab_size"]
    ids = None if size is None else np.asarray(tensors.get("draft_vocab", np.zeros(0, np.int32)))
    if ids is not None and ids.shape != (size,):
        raise ValueError(f"draft_vocab has shape {ids.shape}; head.json records {size} ids.")
    build = lambda: EagleHead(  # noqa: E731
        config,
        rngs=nnx.Rngs(0),
        num_layers=meta["num_layers"],
        taps=tuple(meta["taps"]),
        draft_vocab=ids,
        dtype=jnp.dtype(meta["dtype"]),
        param_dtype=jnp.dtype(meta["param_dtype"]),
        arch=meta.get("arch", "jaxcert"),  # heads written before there were two archs
        outside=meta.get("outside"),
        norm_before_residual=bool(meta.get("norm_before_residual", False)),
        attention_bias=bool(meta.get("attention_bias", False)),
    )
    graphdef, state = nnx.split(nnx.eval_shape(build))
    flat = nnx.to_flat_state(state)
    names = {".".join(map(str, path)): (path, v) for path, v in flat}
    if set(names) != set(tensors):
        missing, extra = sorted(set(names) - set(tensors)), sorted(set(tensors) - set(names))
        raise ValueError(f"head.safetensors: missing {missing[:5]}, unexpected {extra[:5]}.")
    for name, (_, var) in names.items():
        want, got = var.get_value(), tensors[name]
        if (want.shape, want.dtype) != (got.shape, got.dtype):
            raise ValueError(
                f"head.safetensors: {name} is {got.shape} {got.dtype}, expected "
                f"{want.shape} {want.dtype}."
            )
        var.set_value(got)
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


def _flat_arrays(head: EagleHead) -> dict[str, jax.Array]:
    """Every state array of `head` by dotted path."""
    flat = nnx.to_flat_state(nnx.state(head))
    return {".".join(map(str, path)): var.get_value() for path, var in flat}
