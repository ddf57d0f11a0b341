"""An approximate radix tree of the prompts each replica was sent (SGLang's cache-aware
router keeps one of request text; this one holds token ids).

"Approximate" because the router cannot see a replica's KV cache: a prompt is inserted
for the replica it was routed to, as if that replica now held its prefix, and each
replica's share of the tree is trimmed by LRU to a token budget about its KV capacity, as
the replica's own prefix cache evicts. One tree is shared by all replicas: each node
records which replicas hold it and when each last used it, so a lookup walks the prompt
once and reads every replica's match.

Invariant: a replica on a node is on all its ancestors (an insert marks the whole path,
eviction takes a replica off a node only when no child of it holds that replica).
"""

from __future__ import annotations

import heapq
import itertools
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field

# Eviction trims a replica to this share of its budget, so a replica at its budget does
# not walk its nodes on every insert.
EVICT_TO = 0.9


@dataclass(slots=True, eq=False)
class _Node:
    key: list[int]  # the edge from the parent: these tokens
    parent: _Node | None
    children: dict[int, _Node] = field(default_factory=dict)  # first token -> child
    replicas: dict[int, int] = field(default_factory=dict)  # replica -> last use (a tick)


def _common(edge: list[int], tokens: Sequence[int], start: int) -> int:
    """How many of `edge`'s tokens equal tokens[start:]'s first ones."""
    n = min(len(edge), len(tokens) - start)
    i = 0
    while i < n and edge[i] == tokens[start + i]:
        i += 1
    return i


class PrefixTree:
    """Token-id prefixes per replica, each replica's share bounded by LRU."""

    def __init__(self, default_budget: int = 1 << 22) -> None:
        self.root = _Node([], None)
        self.default_budget = default_budget
        self.budgets: dict[int, int] = {}  # replica -> most tokens held (else the default)
        self.size: dict[int, int] = defaultdict(int)  # replica -> tokens it holds
        self._tick = itertools.count(1)

    def budget(self, replica: int) -> int:
        return self.budgets.get(replica, self.default_budget)

    def match(self, tokens: Sequence[int]) -> dict[int, int]:
        """replica -> how many leading tokens of `tokens` it holds (absent: none)."""
        out: dict[int, int] = {}
        node, i = self.root, 0
        while i < len(tokens):
            child = node.children.get(tokens[i])
            if child is None:
                break
            n = _common(child.key, tokens, i)
            for r in child.replicas:  # deeper nodes hold fewer replicas: overwrite
                out[r] = i + n
            if n < len(child.key):
                break
            node, i = child, i + n
        return out

    def insert(self, tokens: Sequence[int], replica: int) -> None:
        """Record that `replica` now holds `tokens` (and so all its prefixes)."""
        tick = next(self._tick)
        node, i = self.root, 0
        while i < len(tokens):
            child = node.children.get(tokens[i])
            if child is None:
                leaf = _Node(list(tokens[i:]), node, replicas={replica: tick})
                node.children[tokens[i]] = leaf
                self.size[replica] += len(leaf.key)
                break
            n = _common(child.key, tokens, i)
            if n < len(child.key):
                child = self._split(child, n)
            if replica not in child.replicas:
                self.size[replica] += len(child.key)
            child.replicas[replica] = tick
            node, i = child, i + n
        if self.size[replica] > self.budget(replica):
            self.evict(replica, int(self.budget(replica) * EVICT_TO))

    @staticmethod
    def _split(child: _Node, n: int) -> _Node:
        """Cut `child`'s edge after n tokens: the first n become a new node in between,
        held by the same replicas (so every replica's size stays the same)."""
        parent = child.parent
        assert parent is not None
        mid = _Node(child.key[:n], parent, {child.key[n]: child}, dict(child.replicas))
        parent.children[child.key[0]] = mid
        child.key = child.key[n:]
        child.parent = mid
        return mid

    def evict(self, replica: int, budget: int) -> None:
        """Take `replica` off its least recently used leaves until it holds at most
        `budget` tokens; nodes no replica holds any more leave the tree."""
        heap = [(n.replicas[replica], id(n), n) for n in self._nodes_of(replica)
                if not any(replica in c.replicas for c in n.children.values())]
        heapq.heapify(heap)
        while self.size[replica] > budget and heap:
            _, _, node = heapq.heappop(heap)
            del node.replicas[replica]
            self.size[replica] -= len(node.key)
            parent = node.parent
            assert parent is not None
            if not node.replicas:  # no child holds a replica either (the invariant)
                del parent.children[node.key[0]]
            if parent is not self.root and replica in parent.replicas and not any(
                    replica in c.replicas for c in parent.children.values()):
                heapq.heappush(heap, (parent.replicas[replica], id(parent), parent))

    def remove_replica(self, replica: int) -> None:
        """Forget everything `replica` held (it died: a new leader starts with an empty
        cache)."""
        self.evict(replica, 0)
        self.size.pop(replica, None)

    def _nodes_of(self, replica: int) -> list[_Node]:
        out, stack = [], [self.root]
        while stack:
            for c in stack.pop().children.values():
                if replica in c.replicas:
                    out.append(c)
                    stack.append(c)
        return out

    def num_nodes(self) -> int:
        count, stack = 0, [self.root]
        while stack:
            children = stack.pop().children.values()
            count += len(children)
            stack.extend(children)
        return count
