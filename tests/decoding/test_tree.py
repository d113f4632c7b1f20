"""Tree shapes, static structure, ancestor masks and longest accepted root paths."""

import jax.numpy as jnp
import numpy as np
import pytest

from jaxcert.decoding import tree as T


@pytest.mark.parametrize(
    "spec, expected",
    [
        ("chain", T.Chain()),
        ("tree:4x6", T.StaticTree(m=4, depth=6)),
        ("dyntree:4x6x24", T.DynamicTree(m=4, depth=6, nodes=24)),
    ],
    ids=["chain", "tree:4x6", "dyntree:4x6x24"],
)
def test_parse_tree(spec, expected):
    assert T.parse_tree(spec) == expected
    assert T.parse_tree(expected.spec) == expected


@pytest.mark.parametrize("bad", ["tree:4", "tree:0x3", "dyntree:2x2x9", "forest:2x2", "chain:3"])
def test_parse_tree_errors(bad):
    with pytest.raises(ValueError):
        T.parse_tree(bad)


def test_static_structure_of_two_branches():
    st = T.static_structure(2, 3)
    np.testing.assert_array_equal(st.parent, [-1, -1, 0, 1, 2, 3])
    np.testing.assert_array_equal(st.depth, [1, 1, 2, 2, 3, 3])
    np.testing.assert_array_equal(st.rank, [0, 1, 0, 0, 0, 0])
    np.testing.assert_array_equal(st.q_index, [0, 0, 1, 2, 3, 4])
    # Node 4 (position 5) descends from nodes 2 and 0 (positions 3 and 1) and the root.
    np.testing.assert_array_equal(np.nonzero(st.mask[5])[0], [0, 1, 3, 5])
    chain = T.static_structure(1, 4)
    np.testing.assert_array_equal(chain.mask, np.tril(np.ones((5, 5), bool)))


def test_ancestor_mask_matches_static_structure():
    st = T.static_structure(3, 4)
    parent = jnp.asarray(st.parent[None].repeat(2, 0), jnp.int32)
    np.testing.assert_array_equal(T.ancestor_mask(parent, 4)[1], st.mask)


def _tree():
    #        root
    #      0      1
    #     2 3     4
    #     5
    parent = jnp.array([[-1, -1, 0, 0, 1, 2]], jnp.int32)
    depth = jnp.array([[1, 1, 2, 2, 2, 3]], jnp.int32)
    return parent, depth, T.ancestor_mask(parent, 3)


@pytest.mark.parametrize(
    "passes, best, length",
    [
        ([0, 0, 0, 0, 0, 0], 0, 0),  # nothing: the root
        ([1, 1, 0, 0, 1, 0], 5, 2),  # 1 -> 4 (node 4 = position 5)
        ([1, 1, 1, 1, 1, 1], 6, 3),  # 0 -> 2 -> 5, the deepest
        ([0, 1, 1, 1, 0, 1], 2, 1),  # children of a rejected node do not count
        ([1, 0, 1, 1, 0, 0], 3, 2),  # tie at depth 2: the lower node index
    ],
    ids=["none", "one-branch", "deepest", "rejected-parent", "tie"],
)
def test_accept_longest_path(passes, best, length):
    parent, depth, mask = _tree()
    on_path, got_best, got_length = T.accept_longest_path(jnp.asarray([passes], bool), depth, mask)
    assert int(got_best[0]) == best and int(got_length[0]) == length
    assert int(on_path.sum()) == length
    offsets = T.path_offsets(on_path, depth, 3)
    expected = {
        0: [0, 0, 0, 0],
        5: [0, 2, 5, 0],
        6: [0, 1, 3, 6],
        2: [0, 2, 0, 0],
        3: [0, 1, 3, 0],
    }[best]
    np.testing.assert_array_equal(offsets[0], expected)


def test_dynamic_selection_keeps_a_topologically_ordered_tree():
    """EAGLE-2 re-ranking keeps parents of kept nodes, listed before their children."""
    from jaxcert.decoding.draft import _select_dynamic

    rng = np.random.default_rng(0)
    m, depth, b = 3, 4, 5
    pool = m + (depth - 1) * m * m
    parent = np.full((b, pool), -1)
    dep = np.ones((b, pool), int)
    cum = np.zeros((b, pool))
    cum[:, :m] = np.log(rng.dirichlet(np.ones(m), b))
    frontier = np.tile(np.arange(m), (b, 1))
    for d in range(1, depth):
        at = m + (d - 1) * m * m
        for r in range(b):
            for f in range(m):
                logq = np.sort(np.log(rng.dirichlet(np.ones(8))))[::-1][:m]
                idx = at + f * m + np.arange(m)
                parent[r, idx] = frontier[r, f]
                dep[r, idx] = d + 1
                cum[r, idx] = cum[r, frontier[r, f]] + logq
            frontier[r] = at + np.argsort(-cum[r, at : at + m * m], kind="stable")[:m]
    nodes = {
        "tokens": jnp.broadcast_to(jnp.arange(pool, dtype=jnp.int32), (b, pool)),  # = pool index
        "valid": jnp.ones((b, pool), bool),
        "cum": jnp.asarray(cum, jnp.float32),
        "parent": jnp.asarray(parent, jnp.int32),
        "depth": jnp.asarray(dep, jnp.int32),
        "rank": jnp.zeros((b, pool), jnp.int32),
        "q_index": jnp.zeros((b, pool), jnp.int32),
    }
    n = 10
    tree = _select_dynamic(nodes, jnp.zeros((b, 1, 4)), n)
    par, d = np.asarray(tree.parent), np.asarray(tree.depth)
    assert np.all(np.asarray(tree.valid))
    for r in range(b):
        for i in range(n):
            assert par[r, i] < i  # parents first (or the root, -1)
            assert d[r, i] == (1 if par[r, i] < 0 else d[r, par[r, i]] + 1)
        # The kept nodes are the n best by cumulative log-probability.
        best = np.argsort(-cum[r].astype(np.float32), kind="stable")[:n]
        assert set(np.asarray(tree.tokens[r]).tolist()) == set(best.tolist())
