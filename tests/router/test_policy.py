"""Routing policies without processes: cache-aware prefix affinity and its load
override, least-load, round-robin, sticky keys, and replicas that are down."""

from __future__ import annotations

import random

import pytest

from nvllm.router.policy import (
    CacheAware,
    CacheAwareConfig,
    LeastLoad,
    NoReplicaError,
    RoundRobin,
    StickyRoutes,
    make_policy,
    route,
)

UP2 = [True, True]


def _tenants(n: int, length: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1000) for _ in range(length)] for _ in range(n)]


def _simulate(policy, prompts, replicas=2) -> tuple[list[int], int]:
    """Route prompts one at a time (each finishes before the next); returns where each
    went and how many prompt tokens a replica-side prefix cache would have held."""
    held: list[list[list[int]]] = [[] for _ in range(replicas)]
    sticky = StickyRoutes()
    where, hits = [], 0
    for p in prompts:
        r, _ = route(policy, sticky, p, None, [0] * replicas, [True] * replicas)
        hits += max((_lcp(p, q) for q in held[r]), default=0)
        held[r].append(p)
        where.append(r)
    return where, hits


def _lcp(a, b) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def test_cache_aware_keeps_each_tenant_on_one_replica():
    systems = _tenants(5, 400)
    rng = random.Random(1)
    prompts = [s + [rng.randrange(1000) for _ in range(20)] for _ in range(8) for s in systems]
    where, hits = _simulate(CacheAware(), prompts)
    for t in range(5):
        assert len({where[i] for i in range(t, len(prompts), 5)}) == 1
    assert set(where) == {0, 1}, "new tenants go to the least loaded (taken in turn)"
    _, rr_hits = _simulate(RoundRobin(), prompts)
    assert hits == 35 * 400 and rr_hits == 30 * 400  # RR computes each prefix twice


def test_a_short_match_goes_to_the_least_loaded():
    p = CacheAware(CacheAwareConfig(cache_threshold=0.5))
    p.routed([1, 2, 3, 4], 0)
    assert p.choose([1, 2, 3, 4, 5, 6], [5, 0], UP2) == (0, "prefix_match")  # 4/6 > 0.5
    assert p.choose([1, 2, 9, 9, 9, 9], [5, 0], UP2) == (1, "least_load")  # 2/6


def test_uneven_load_overrides_the_prefix_match():
    p = CacheAware(CacheAwareConfig(balance_abs_threshold=4, balance_rel_threshold=1.5))
    p.routed([7] * 10, 0)
    assert p.choose([7] * 10, [5, 0], UP2) == (1, "load_override")  # 5 - 0 > 4, 5 > 0
    assert p.choose([7] * 10, [4, 0], UP2) == (0, "prefix_match")  # 4 - 0 is not > 4
    assert p.choose([7] * 10, [20, 14], UP2) == (0, "prefix_match")  # 20 < 1.5 * 14


def test_identical_prompts_spread_by_the_load_threshold():
    """64 identical prompts in flight at once, no sticky key: neither replica gets more
    than 75% (the issue's load-balance case, routed without processes)."""
    p = CacheAware(CacheAwareConfig(balance_abs_threshold=16))
    sticky, loads = StickyRoutes(), [0, 0]
    for _ in range(64):
        r, _ = route(p, sticky, [3] * 50, None, loads, UP2)
        loads[r] += 1
    assert max(loads) <= 48 and sum(loads) == 64


def test_least_load_and_its_ties():
    p = LeastLoad()
    assert p.choose([], [3, 1, 2], [True] * 3) == (1, "least_load")
    assert p.choose([], [3, 1, 2], [True, False, True]) == (2, "least_load")
    assert {p.choose([], [0, 0], UP2)[0] for _ in range(2)} == {0, 1}


def test_round_robin_skips_a_replica_that_is_down():
    p = RoundRobin()
    assert [p.choose([], [0] * 3, [True, False, True])[0] for _ in range(4)] == [0, 2, 0, 2]


def test_no_replica_up_is_an_error():
    for name in ("cache_aware", "least_load", "round_robin"):
        with pytest.raises(NoReplicaError):
            make_policy(name).choose([1], [0, 0], [False, False])
    with pytest.raises(ValueError, match="cache_aware, least_load, round_robin"):
        make_policy("random")


def test_a_routing_key_sticks_while_its_replica_is_up():
    p, sticky = RoundRobin(), StickyRoutes()
    first = route(p, sticky, [], "alice", [0, 0], UP2)
    assert first[1] == "round_robin"
    assert [route(p, sticky, [], "alice", [0, 0], UP2) for _ in range(3)] == \
        [(first[0], "sticky")] * 3
    down = [r != first[0] for r in range(2)]
    moved = route(p, sticky, [], "alice", [0, 0], down)
    assert moved == (1 - first[0], "round_robin")
    assert route(p, sticky, [], "alice", [0, 0], UP2) == (moved[0], "sticky")


def test_sticky_table_is_bounded_lru():
    s = StickyRoutes(max_keys=2)
    s.set("a", 0)
    s.set("b", 1)
    assert s.get("a", UP2) == 0  # a is now the most recent
    s.set("c", 0)
    assert len(s) == 2 and s.get("b", UP2) is None and s.get("a", UP2) == 0


def test_a_lost_replica_leaves_the_tree():
    p = CacheAware()
    p.routed([1, 2, 3], 1)
    p.replica_lost(1)
    assert p.tree.match([1, 2, 3]) == {}
