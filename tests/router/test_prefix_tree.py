"""The router's approximate prefix tree: matches per replica, edge splits, LRU eviction
to a token budget, and its invariants after random traffic."""

from __future__ import annotations

import random

from nvllm.router.prefix_tree import PrefixTree


def _check_invariants(tree: PrefixTree) -> None:
    """Sizes equal what the nodes hold; a replica on a node is on its parent; no node is
    held by nobody."""
    sizes: dict[int, int] = {}
    stack = [tree.root]
    while stack:
        node = stack.pop()
        for first, c in node.children.items():
            assert c.key and c.key[0] == first and c.parent is node
            assert c.replicas, "a node no replica holds stayed in the tree"
            if node is not tree.root:
                assert set(c.replicas) <= set(node.replicas)
            for r in c.replicas:
                sizes[r] = sizes.get(r, 0) + len(c.key)
            stack.append(c)
    assert sizes == {r: s for r, s in tree.size.items() if s}


def test_match_reports_each_replicas_longest_prefix():
    t = PrefixTree()
    t.insert([1, 2, 3, 4, 5], 0)
    t.insert([1, 2, 3, 9], 1)
    assert t.match([1, 2, 3, 4, 5, 6]) == {0: 5, 1: 3}
    assert t.match([1, 2, 3, 9, 9]) == {0: 3, 1: 4}
    assert t.match([1, 2]) == {0: 2, 1: 2}  # ends inside an edge
    assert t.match([7]) == {}
    assert t.size == {0: 5, 1: 4}
    _check_invariants(t)


def test_reinserting_counts_nothing_twice():
    t = PrefixTree()
    for _ in range(3):
        t.insert([5, 6, 7], 2)
        t.insert([5, 6], 2)
    assert t.size[2] == 3 and t.num_nodes() == 2
    _check_invariants(t)


def test_eviction_takes_the_least_recently_used_prefix_first():
    t = PrefixTree()
    t.budgets[0] = 100
    old, new = list(range(1000, 1060)), list(range(2000, 2040))
    t.insert(old, 0)
    t.insert(new, 0)
    t.insert(old[:10], 0)  # touches old's first 10 tokens only
    t.insert(list(range(3000, 3030)), 0)  # 130 > 100: trim to 90
    assert t.size[0] <= 90
    m = t.match(old)
    assert m.get(0) == 10, "the touched head of the old prompt stays, its tail goes"
    assert t.match(new) == {0: 40}, "used after the old tail: kept"
    t.insert(list(range(4000, 4030)), 0)  # 110 > 100: the next oldest, `new`, goes
    assert 0 not in t.match(new) and t.match(old) == {0: 10}
    _check_invariants(t)


def test_eviction_is_per_replica():
    t = PrefixTree()
    t.budgets[1] = 20
    t.insert(list(range(30)), 0)
    t.insert(list(range(30)), 1)  # over replica 1's budget: only its share shrinks
    assert t.match(list(range(30)))[0] == 30
    assert t.size[0] == 30 and t.size[1] <= 18
    t.remove_replica(0)
    assert 0 not in t.match(list(range(30)))
    _check_invariants(t)


def test_random_traffic_keeps_the_invariants():
    rng = random.Random(0)
    t = PrefixTree()
    t.budgets = {0: 300, 1: 500, 2: 10_000}
    prefixes = [[rng.randrange(50) for _ in range(rng.randrange(1, 40))] for _ in range(12)]
    for _ in range(400):
        tokens = rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randrange(30))]
        t.insert(tokens, rng.randrange(3))
        assert all(t.size[r] <= t.budget(r) for r in range(3))
        got = t.match(tokens)
        assert all(0 <= v <= len(tokens) for v in got.values())
    _check_invariants(t)
    t.remove_replica(1)
    _check_invariants(t)
