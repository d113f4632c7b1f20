"""Key/value cache with a per-row committed length, rollback and tree-path selection.

Shapes: B batch rows, S cache slots, L layers, G key/value heads, D head dim, P selected path
length. Buffers are `[B, G, S, D]` (heads before slots): the attention dots then need no
transposed copy of the cache (with `[B, S, G, D]` XLA on CPU copies every layer's buffer per
step; measured 4x slower attention at B=8, S=2048). Slots `[0, length[b])` of row b hold
committed entries; everything at or beyond `length[b]` is stale and is never attended (see
`models.transformer`).

`Cache` is the protocol a cache offers the speculative decoder (`jaxcert.decoding`): any
model's cache with these methods works there, whatever it stores; `KVCache` is one.

On a mesh (``KVCache.create(..., mesh=...)``, or the forward pass of a sharded model) the buffers
are split over batch rows (``data``) and key/value heads (``model``); heads replicate over
``model`` when G is not divisible by its size, rows over ``data`` when B is not.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any, Protocol, Self, runtime_checkable

import jax
import jax.numpy as jnp
from flax import struct
from jax import lax
from jax.sharding import Mesh
from jax.typing import ArrayLike

from jaxcert.models.config import ModelConfig
from jaxcert.models.sharding import LOGICAL_RULES, Layout


@runtime_checkable
class Cache(Protocol):
    """A pure cache of committed entries per row: every method returns a new cache.

    A model call with ``T`` new tokens writes their entries at slots ``[length, length + T)``
    and returns a cache with the same ``length``; the decoder then commits, rolls back or
    selects. Every method must work under ``jax.jit`` with traced arguments.

    Attributes:
      length: ``[B]`` int32 committed entries per row.
    """

    length: jax.Array

    def commit(self, num_tokens: ArrayLike) -> Self:
        """Marks ``num_tokens`` (scalar or ``[B]``) more entries per row as committed."""
        ...

    def rollback(self, length: ArrayLike) -> Self:
        """Sets the committed length (scalar or ``[B]``); later entries become stale."""
        ...

    def select(self, offsets: ArrayLike, count: ArrayLike) -> Self:
        """Keeps one path of the last call's ``T`` entries (``offsets`` ``[B, P]``, the entry
        at ``length + offsets[b, i]`` moves to ``length + i``) and commits ``count`` ``[B]`` of
        them (draft trees)."""
        ...

    def repeat(self, times: int) -> Self:
        """Each row ``times`` times in a row: ``B`` rows -> ``B * times`` (row ``b`` becomes
        rows ``b * times`` to ``b * times + times - 1``); one row per tree branch."""
        ...

    def take_rows(self, rows: ArrayLike) -> Self:
        """The rows ``rows`` (``[B']`` int32 indices), in that order."""
        ...

    def copy_segments(self, src: ArrayLike, start: ArrayLike, width: int) -> Self:
        """Row ``r``'s entries at slots ``[start[r], start[r] + width)`` become row
        ``src[r]``'s (``src``, ``start``: ``[B]`` int32; ``width`` static). A dynamic tree
        re-points a branch to another parent this way."""
        ...

    def put_rows(self, rows: Self, at: ArrayLike) -> Self:
        """Row ``i`` of ``rows`` (a cache of ``B'`` rows and the same slots) replaces row
        ``at[i]`` (``at``: ``[B']`` int32); the other rows stay. A batch refills a finished
        slot with a new prompt's prefilled row this way."""
        ...


@struct.dataclass
class KVCache:
    """Per-layer key/value buffers and the number of committed tokens per row.

    Every method is pure and jit-safe: it returns a new cache and leaves this one untouched.
    A forward pass writes its T new entries at slots `[length[b], length[b] + T)` and returns a
    cache with the same `length`; the caller then `commit`s, `rollback`s or `select`s.

    Attributes:
      keys: L arrays `[B, G, S, D]`, keys after RoPE (separate buffers per layer).
      values: L arrays `[B, G, S, D]`.
      length: `[B]` int32, committed tokens per row (rows may differ).
    """

    keys: tuple[jax.Array, ...]  # L × [B, G, S, D]
    values: tuple[jax.Array, ...]  # L × [B, G, S, D]
    length: jax.Array  # [B] int32

    if TYPE_CHECKING:  # struct.dataclass adds it at run time, out of mypy's sight

        def replace(self, **updates: Any) -> KVCache: ...

    @classmethod
    def create(
        cls,
        config: ModelConfig,
        batch_size: int,
        max_length: int,
        dtype=jnp.float32,
        *,
        mesh: Mesh | None = None,
        rules=LOGICAL_RULES,
    ) -> KVCache:
        """An empty cache (all lengths 0) of `max_length` = S slots per row.

        Args:
          config: the model's config (L, G, D).
          batch_size, max_length: B and S.
          dtype: the buffers' dtype.
          mesh: if given (``Auto`` axes), each `[B, G, S, D]` buffer is created directly on
            its shards: ``("batch", "kv_heads", None, None)`` under `rules` (B over ``data``,
            G over ``model`` by default; a dimension not divisible by its axes replicates),
            and ``length`` over ``batch``. Works eagerly and under `jax.jit`.
          rules: logical -> mesh axis rules (`jaxcert.models.sharding.LOGICAL_RULES`).

        Raises:
          ValueError: non-positive `batch_size` or `max_length`; an ``Explicit`` mesh.
        """
        if batch_size <= 0 or max_length <= 0:
            raise ValueError(
                f"batch_size and max_length must be positive, got {batch_size}, {max_length}."
            )
        shape = (batch_size, config.num_kv_heads, max_length, config.head_dim)
        if mesh is None:
            keys = tuple(jnp.zeros(shape, dtype) for _ in range(config.num_layers))
            values = tuple(jnp.zeros(shape, dtype) for _ in range(config.num_layers))
            return cls(keys=keys, values=values, length=jnp.zeros((batch_size,), jnp.int32))
        layout = Layout.create(mesh, rules, config)
        buf = _zeros(shape, dtype, layout.sharding(("batch", "kv_heads", None, None), shape))
        keys = tuple(buf() for _ in range(config.num_layers))
        values = tuple(buf() for _ in range(config.num_layers))
        length = _zeros((batch_size,), jnp.int32, layout.sharding(("batch",), (batch_size,)))()
        return cls(keys=keys, values=values, length=length)

    @property
    def max_length(self) -> int:
        """S, slots per row."""
        return self.keys[0].shape[2]

    @property
    def batch_size(self) -> int:
        """B, rows."""
        return self.keys[0].shape[0]

    @property
    def num_layers(self) -> int:
        """L, layers."""
        return len(self.keys)

    def commit(self, num_tokens: ArrayLike) -> KVCache:
        """Marks `num_tokens` (scalar or `[B]` int) more entries per row as committed."""
        n = self._per_row(num_tokens, "num_tokens")
        return self.replace(length=self.length + n)

    def rollback(self, length: ArrayLike) -> KVCache:
        """Sets the committed length (scalar or `[B]` int); entries beyond it become stale."""
        return self.replace(length=self._per_row(length, "length"))

    def select(self, offsets: ArrayLike, count: ArrayLike) -> KVCache:
        """Keeps one path of the last forward's T entries and commits it.

        The last forward wrote T entries at slots `length + j`, j in `[0, T)`. For each row b and
        i < count[b], the entry at `length + offsets[b, i]` moves to `length + i`; then `length`
        grows by `count`. Entries `i >= count[b]` are not written (their offsets are ignored).

        Args:
          offsets: `[B, P]` int32, offsets into the last forward's entries, `offsets[b, i] >= i`
            for the kept ones (a root-to-leaf path of a topologically ordered tree).
          count: `[B]` int32 in `[0, P]`, how many entries of the path to keep.

        Raises:
          ValueError: wrong ranks or batch sizes (at trace time).
        """
        offsets = jnp.asarray(offsets, jnp.int32)
        count = self._per_row(count, "count")
        if offsets.ndim != 2 or offsets.shape[0] != self.batch_size:
            raise ValueError(f"offsets must be [B={self.batch_size}, P], got {offsets.shape}.")
        s = self.max_length
        i = jnp.arange(offsets.shape[1], dtype=jnp.int32)
        src = jnp.clip(self.length[:, None] + offsets, 0, s - 1)  # [B, P]
        # Slots at i >= count get index S, which `mode="drop"` ignores.
        dst = jnp.where(i[None, :] < count[:, None], self.length[:, None] + i[None, :], s)  # [B, P]

        def move(buf: jax.Array) -> jax.Array:
            return jax.vmap(lambda x, a, b: x.at[:, b].set(x[:, a], mode="drop"))(buf, src, dst)

        return KVCache(
            keys=tuple(move(k) for k in self.keys),
            values=tuple(move(v) for v in self.values),
            length=self.length + count,
        )

    def repeat(self, times: int) -> KVCache:
        """Each row `times` times in a row: `[B, ...]` -> `[B * times, ...]` (row b becomes rows
        `b * times .. b * times + times - 1`)."""
        rep = lambda x: jnp.repeat(x, times, axis=0)  # noqa: E731
        return jax.tree.map(rep, self)

    def take_rows(self, rows: ArrayLike) -> KVCache:
        """The rows `rows` (`[B']` int32 indices into `[0, B)`), in that order."""
        rows = jnp.asarray(rows, jnp.int32)
        return jax.tree.map(lambda x: x[rows], self)

    def put_rows(self, rows: KVCache, at: ArrayLike) -> KVCache:
        """Row ``i`` of ``rows`` replaces row ``at[i]`` (``[B']`` int32)."""
        return put_rows(self, rows, at)

    def copy_segments(self, src: ArrayLike, start: ArrayLike, width: int) -> KVCache:
        """Row r's slots `[start[r], start[r] + width)` become row `src[r]`'s same slots.

        Args:
          src: `[B]` int32 source rows (all reads happen before any write).
          start: `[B]` int32 first slot of each row's segment (`start + width <= S`).
          width: static segment length in slots.
        """
        src = jnp.asarray(src, jnp.int32)
        start = self._per_row(start, "start")
        take = jax.vmap(lambda x, s: lax.dynamic_slice_in_dim(x, s, width, axis=1))
        put = jax.vmap(lambda x, r, s: lax.dynamic_update_slice_in_dim(x, r, s, axis=1))

        def move(buf: jax.Array) -> jax.Array:  # [B, G, S, D]
            return put(buf, take(buf, start)[src], start)

        return self.replace(
            keys=tuple(move(k) for k in self.keys), values=tuple(move(v) for v in self.values)
        )

    def _per_row(self, x: ArrayLike, name: str) -> jax.Array:
        x = jnp.asarray(x)
        if not jnp.issubdtype(x.dtype, jnp.integer):
            raise ValueError(f"{name} must be an integer array, got dtype {x.dtype}.")
        if x.ndim == 0:
            x = jnp.broadcast_to(x, (self.batch_size,))
        if x.shape != (self.batch_size,):
            raise ValueError(f"{name} must be a scalar or [B={self.batch_size}], got {x.shape}.")
        return x.astype(jnp.int32)


def _zeros(shape, dtype, sharding):
    """A function making zeros of `shape` directly on `sharding` (eagerly or under jit)."""
    return jax.jit(functools.partial(jnp.zeros, shape, dtype), out_shardings=sharding)


def put_rows(cache, rows, at: ArrayLike):
    """``cache`` (a pytree of batch-first arrays) with row ``i`` of ``rows`` in row ``at[i]``
    (``at``: ``[B']`` int32); written as a select over the batch, so a cache split over
    the batch axis stays split."""
    at = jnp.atleast_1d(jnp.asarray(at, jnp.int32))

    def put(buf, new):
        hit = jnp.arange(buf.shape[0])[:, None] == at[None, :]  # [B, B']
        row = jnp.take(new, jnp.argmax(hit, axis=1), axis=0).astype(buf.dtype)  # [B, ...]
        keep = jnp.any(hit, axis=1).reshape((-1,) + (1,) * (buf.ndim - 1))
        return jnp.where(keep, row, buf)

    return jax.tree.map(put, cache, rows)
