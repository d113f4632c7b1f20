"""Draft-tree shapes, their static structure, tree attention masks and root-path acceptance.

Shapes (``M`` branching, ``K`` depth):

* :class:`Chain`: one token per depth (``M = 1``); the depth is the policy's draft length.
* :class:`StaticTree` ``tree:MxD``: the root gets the drafter's top-``M`` children (``M``
  draws without replacement when sampling), then every child is extended by a chain (greedy,
  or sampled) down to depth ``K``. ``N = M * K`` nodes, level-major; the policy decides the
  depth, reading the distribution of the branch with the highest drafter probability.
* :class:`DynamicTree` ``dyntree:MxDxN``: EAGLE-2's dynamic tree. The frontier holds the
  ``M`` nodes of highest cumulative drafter log-probability; each depth expands every frontier
  node into its top-``M`` children and keeps the best ``M`` of the ``M*M`` as the next
  frontier; after the last depth every node ever generated is re-ranked by cumulative
  log-probability and the best ``N`` are verified (a parent always ranks above its children,
  so the kept set is a tree). Deterministic drafting only: the kept set depends on the drafted
  tokens' own probabilities, which would bias speculative sampling.

Verification sees position 0 (the root, the last committed token) and node ``i`` at position
``i + 1``; positions are ``length + depth`` and each position attends to its ancestors and
itself (see :func:`ancestor_mask`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxcert.base.validate import check_int

__all__ = [
    "Chain",
    "StaticTree",
    "DynamicTree",
    "TreeShape",
    "parse_tree",
    "static_structure",
    "ancestor_mask",
    "accept_longest_path",
    "path_offsets",
]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Chain:
    """A chain of drafted tokens (``M = 1``); its maximum depth is the decoder's ``max_draft``."""

    @property
    def m(self) -> int:
        return 1

    @property
    def spec(self) -> str:
        return "chain"


@dataclasses.dataclass(frozen=True, kw_only=True)
class StaticTree:
    """Top-``m`` children of the root, each extended by a chain to ``depth``.

    Attributes:
      m: branching at the root, ``>= 1``.
      depth: maximum depth ``K``, ``>= 1``.
    """

    m: int
    depth: int

    def __post_init__(self):
        check_int("StaticTree.m", self.m)
        check_int("StaticTree.depth", self.depth)

    @property
    def spec(self) -> str:
        return f"tree:{self.m}x{self.depth}"


@dataclasses.dataclass(frozen=True, kw_only=True)
class DynamicTree:
    """EAGLE-2-like dynamic tree: frontier of ``m`` best nodes, ``depth`` levels, ``nodes`` kept.

    Attributes:
      m: frontier width and children per expanded node, ``>= 1``.
      depth: maximum depth, ``>= 1``.
      nodes: nodes verified per round, ``>= 1``.
    """

    m: int
    depth: int
    nodes: int

    def __post_init__(self):
        check_int("DynamicTree.m", self.m)
        check_int("DynamicTree.depth", self.depth)
        check_int("DynamicTree.nodes", self.nodes)
        if self.nodes > self.pool_size:
            raise ValueError(
                f"DynamicTree.nodes={self.nodes} exceeds the {self.pool_size} nodes that "
                f"m={self.m}, depth={self.depth} generate"
            )

    @property
    def pool_size(self) -> int:
        """Nodes generated per round: ``m`` at depth 1, ``m * m`` at every further depth."""
        return self.m + (self.depth - 1) * self.m * self.m

    @property
    def spec(self) -> str:
        return f"dyntree:{self.m}x{self.depth}x{self.nodes}"


TreeShape = Chain | StaticTree | DynamicTree


def parse_tree(spec: str) -> TreeShape:
    """Parses ``chain``, ``tree:MxD`` or ``dyntree:MxDxN``.

    Raises:
      ValueError: anything else.
    """
    text = spec.strip().lower()
    name, _, arg = text.partition(":")
    try:
        if name == "chain" and not arg:
            return Chain()
        numbers = [int(x) for x in arg.split("x")] if arg else []
        if name == "tree" and len(numbers) == 2:
            return StaticTree(m=numbers[0], depth=numbers[1])
        if name == "dyntree" and len(numbers) == 3:
            return DynamicTree(m=numbers[0], depth=numbers[1], nodes=numbers[2])
    except ValueError as err:
        raise ValueError(f"tree {spec!r}: {err}") from None
    raise ValueError(f"unknown tree shape {spec!r}; expected chain | tree:MxD | dyntree:MxDxN")


@dataclasses.dataclass(frozen=True)
class StaticStructure:
    """Numpy structure of a chain or static tree of ``N = M * K`` level-major nodes.

    Attributes:
      parent: ``[N]`` parent node index (``-1``: the root).
      depth: ``[N]`` depth, 1-based.
      rank: ``[N]`` rank among siblings.
      q_index: ``[N]`` expanded node holding the parent's drafter distribution.
      mask: ``[N + 1, N + 1]`` bool ancestor-or-self mask over positions (root first).
    """

    parent: np.ndarray
    depth: np.ndarray
    rank: np.ndarray
    q_index: np.ndarray
    mask: np.ndarray


def static_structure(m: int, depth: int) -> StaticStructure:
    """Structure of ``m`` branches of ``depth`` nodes (``m = 1``: a chain)."""
    n = m * depth
    i = np.arange(n)
    d, r = i // m + 1, i % m
    parent = np.where(d == 1, -1, i - m)
    rank = np.where(d == 1, r, 0)
    # Expanded node 0 is the root; frontier node (d, r) is expanded as 1 + (d - 1) * m + r.
    q_index = np.where(d == 1, 0, 1 + (d - 2) * m + r)
    mask = np.eye(n + 1, dtype=bool)
    mask[:, 0] = True
    for node in range(n):
        a = node
        while a >= 0:
            mask[node + 1, a + 1] = True
            a = parent[a]
    return StaticStructure(parent, d, rank, q_index, mask)


def ancestor_mask(parent: jax.Array, max_depth: int) -> jax.Array:
    """Ancestor-or-self mask over positions (root at 0, node ``i`` at ``i + 1``).

    Args:
      parent: ``[B, N]`` int32 parent node index (``-1``: the root); parents precede children.
      max_depth: the deepest possible node (bounds the pointer chase).

    Returns:
      ``[B, N + 1, N + 1]`` bool: ``mask[b, s, t]`` iff position ``t`` is ``s`` or an ancestor
      (the root is an ancestor of every position).
    """
    b, n = parent.shape
    parent_pos = jnp.concatenate([jnp.zeros((b, 1), jnp.int32), parent + 1], axis=1)  # [B, N+1]
    current = jnp.broadcast_to(jnp.arange(n + 1, dtype=jnp.int32), (b, n + 1))
    mask = jax.nn.one_hot(current, n + 1, dtype=bool) | jax.nn.one_hot(
        jnp.zeros_like(current), n + 1, dtype=bool
    )
    for _ in range(max_depth):
        current = jnp.take_along_axis(parent_pos, current, axis=1)
        mask = mask | jax.nn.one_hot(current, n + 1, dtype=bool)
    return mask


def accept_longest_path(
    passes: jax.Array, depth: jax.Array, mask: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The deepest node whose whole root path passes the rule.

    Args:
      passes: ``[B, N]`` bool, the node is drafted and its token passes the rule at its
        position (given the target distribution at its parent).
      depth: ``[B, N]`` int32 node depths.
      mask: ``[B, N + 1, N + 1]`` ancestor-or-self mask over positions.

    Returns:
      ``(on_path, best, length)``: ``[B, N]`` bool nodes of the accepted path, ``[B]`` int32 the
      path's last position (0: the root, nothing accepted) and ``[B]`` int32 its length. Ties
      between equally deep paths go to the lower node index (the drafter's earlier choice).
    """
    n = passes.shape[1]
    node_anc = mask[:, 1:, 1:]  # [B, N, N] node-to-node
    ok = jnp.all(~node_anc | passes[:, None, :], axis=-1)  # [B, N]: all ancestors pass
    score = jnp.where(ok, depth * (n + 1) + (n - jnp.arange(n)), -1)
    best_node = jnp.argmax(score, axis=-1)
    any_ok = jnp.any(ok, axis=-1)
    best = jnp.where(any_ok, best_node + 1, 0).astype(jnp.int32)
    on_path = jnp.take_along_axis(mask, best[:, None, None], axis=1)[:, 0, 1:]  # [B, N]
    on_path = on_path & any_ok[:, None]
    length = jnp.sum(on_path, axis=-1, dtype=jnp.int32)
    return on_path, best, length


def path_offsets(on_path: jax.Array, depth: jax.Array, max_depth: int) -> jax.Array:
    """Positions of an accepted path in depth order, for ``KVCache.select``.

    Args:
      on_path: ``[B, N]`` bool nodes of the path (at most one per depth).
      depth: ``[B, N]`` int32 node depths.
      max_depth: ``K``.

    Returns:
      ``[B, K + 1]`` int32: entry 0 is the root (position 0), entry ``d`` the position of the
      path's node at depth ``d`` (0 past the path's end).
    """
    b, n = on_path.shape
    rows = jnp.arange(b)[:, None]
    slot = jnp.where(on_path, depth, max_depth + 1)
    positions = jnp.broadcast_to(jnp.arange(1, n + 1, dtype=jnp.int32), (b, n))
    return jnp.zeros((b, max_depth + 1), jnp.int32).at[rows, slot].set(positions, mode="drop")
