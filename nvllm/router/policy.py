"""Which replica serves a request: the routing policies and the sticky-key table.

Pure functions of what the router knows (each replica's in-flight count, whether it is
up, the prompt's token ids), so they are tested without processes. Load is the router's
own count of requests it has in flight on each replica, as SGLang's router counts it: no
round trip to ask a replica, and it moves the moment a request is routed.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from nvllm.router.prefix_tree import PrefixTree

POLICIES = ("cache_aware", "least_load", "round_robin")
# Why a request went where it did (the router counts each, /metrics).
DECISIONS = ("sticky", "prefix_match", "load_override", "least_load", "round_robin")


class NoReplicaError(RuntimeError):
    """No replica is up to take a request."""


@dataclass(frozen=True, slots=True)
class CacheAwareConfig:
    """SGLang's knobs, by its names. A prompt goes to the replica holding its longest
    prefix when that covers more than ``cache_threshold`` of it, else to the least
    loaded; but while loads are uneven (max - min > ``balance_abs_threshold`` and
    max > ``balance_rel_threshold`` * min) every request goes to the least loaded.
    ``max_tree_tokens``: each replica's share of the tree (None: its KV capacity)."""

    cache_threshold: float = 0.5
    balance_abs_threshold: int = 16
    balance_rel_threshold: float = 1.5
    max_tree_tokens: int | None = None

    def __post_init__(self) -> None:
        if not 0.0 <= self.cache_threshold <= 1.0:
            raise ValueError(f"cache_threshold must be in [0, 1], got {self.cache_threshold}")
        if self.balance_abs_threshold < 0 or self.balance_rel_threshold < 1.0:
            raise ValueError("balance_abs_threshold must be >= 0 and balance_rel_threshold "
                             ">= 1")


class Policy(Protocol):
    name: str

    def choose(self, key: Sequence[int], loads: Sequence[int],
               up: Sequence[bool]) -> tuple[int, str]:
        """(replica, decision) for a prompt whose routing key (token ids) is `key`."""
        ...

    def routed(self, key: Sequence[int], replica: int) -> None:
        """The request went to `replica` (by this policy or a sticky key)."""
        ...

    def replica_lost(self, replica: int) -> None:
        """`replica` died: whatever the policy remembered of it is stale."""
        ...


def _up(up: Sequence[bool]) -> list[int]:
    cands = [r for r, ok in enumerate(up) if ok]
    if not cands:
        raise NoReplicaError("no replica is up")
    return cands


class RoundRobin:
    name = "round_robin"

    def __init__(self) -> None:
        self._next = 0

    def choose(self, key: Sequence[int], loads: Sequence[int],
               up: Sequence[bool]) -> tuple[int, str]:
        _up(up)
        n = len(up)
        for k in range(n):
            r = (self._next + k) % n
            if up[r]:
                self._next = r + 1
                return r, "round_robin"
        raise AssertionError("unreachable: _up found one")

    def routed(self, key: Sequence[int], replica: int) -> None:
        pass

    def replica_lost(self, replica: int) -> None:
        pass


class LeastLoad:
    """The replica with the fewest requests in flight; ties taken in turn, so an idle
    service still spreads its requests."""

    name = "least_load"

    def __init__(self) -> None:
        self._turn = itertools.count()

    def pick(self, loads: Sequence[int], up: Sequence[bool]) -> int:
        cands = _up(up)
        low = min(loads[r] for r in cands)
        ties = [r for r in cands if loads[r] == low]
        return ties[next(self._turn) % len(ties)]

    def choose(self, key: Sequence[int], loads: Sequence[int],
               up: Sequence[bool]) -> tuple[int, str]:
        return self.pick(loads, up), "least_load"

    def routed(self, key: Sequence[int], replica: int) -> None:
        pass

    def replica_lost(self, replica: int) -> None:
        pass


class CacheAware:
    """SGLang's cache-aware policy over token ids (see CacheAwareConfig)."""

    name = "cache_aware"

    def __init__(self, config: CacheAwareConfig | None = None) -> None:
        self.config = config or CacheAwareConfig()
        self.tree = PrefixTree()
        self._least = LeastLoad()

    def set_capacity(self, replica: int, kv_capacity_tokens: int) -> None:
        """Size `replica`'s share of the tree (the configured budget, else its KV cache)."""
        self.tree.budgets[replica] = self.config.max_tree_tokens or kv_capacity_tokens

    def choose(self, key: Sequence[int], loads: Sequence[int],
               up: Sequence[bool]) -> tuple[int, str]:
        cands = _up(up)
        c = self.config
        hi, lo = max(loads[r] for r in cands), min(loads[r] for r in cands)
        if hi - lo > c.balance_abs_threshold and hi > c.balance_rel_threshold * lo:
            return self._least.pick(loads, up), "load_override"
        if key:
            matched = self.tree.match(key)
            best = max(cands, key=lambda r: (matched.get(r, 0), -loads[r]))
            if matched.get(best, 0) > c.cache_threshold * len(key):
                return best, "prefix_match"
        return self._least.pick(loads, up), "least_load"

    def routed(self, key: Sequence[int], replica: int) -> None:
        if key:
            self.tree.insert(key, replica)

    def replica_lost(self, replica: int) -> None:
        self.tree.remove_replica(replica)


def make_policy(name: str, cache_aware: CacheAwareConfig | None = None) -> Policy:
    if name == "cache_aware":
        return CacheAware(cache_aware)
    if name == "least_load":
        return LeastLoad()
    if name == "round_robin":
        return RoundRobin()
    raise ValueError(f"unknown router policy {name!r}; choose one of {', '.join(POLICIES)}")


class StickyRoutes:
    """routing key -> the replica its requests went to, the most recent ``max_keys``
    keys (LRU): a key sticks while its replica is up, then moves with the next request."""

    def __init__(self, max_keys: int = 65536) -> None:
        self.max_keys = max_keys
        self._routes: OrderedDict[str, int] = OrderedDict()

    def get(self, key: str | None, up: Sequence[bool]) -> int | None:
        if key is None:
            return None
        r = self._routes.get(key)
        if r is None or not up[r]:
            return None
        self._routes.move_to_end(key)
        return r

    def set(self, key: str | None, replica: int) -> None:
        if key is None:
            return
        self._routes[key] = replica
        self._routes.move_to_end(key)
        while len(self._routes) > self.max_keys:
            self._routes.popitem(last=False)

    def __len__(self) -> int:
        return len(self._routes)


def route(policy: Policy, sticky: StickyRoutes, key: Sequence[int], routing_key: str | None,
          loads: Sequence[int], up: Sequence[bool]) -> tuple[int, str]:
    """Where one request goes: its sticky key's replica if that is up, else the policy's
    choice (which the key then sticks to). Raises NoReplicaError when none is up."""
    r = sticky.get(routing_key, up)
    decision = "sticky"
    if r is None:
        r, decision = policy.choose(key, loads, up)
        sticky.set(routing_key, r)
    policy.routed(key, r)
    return r, decision
