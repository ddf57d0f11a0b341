"""The waiting queue keeps line order and does O(log n) work per operation."""

from __future__ import annotations

import math
import random

from leader_sim import make_seq

from nvllm.leader import waiting_queue
from nvllm.leader.waiting_queue import WaitingQueue


def _seq(i: int, priority: int, request: str | None = None):
    s = make_seq(i, [1, 2])
    s.priority, s.order = priority, i
    if request is not None:
        s.request_id = request
    return s


def test_line_order_removal_and_request_count():
    q = WaitingQueue()
    seqs = [_seq(i, p, f"r{i // 2}") for i, p in enumerate([3, 1, 2, 1, 3, 0])]
    for s in seqs:
        q.add(s)
    assert [s.seq_id for s in q] == [5, 1, 3, 2, 0, 4]
    assert q.num_requests == 3 and len(q) == 6
    q.remove(seqs[1])
    assert seqs[1] not in q and seqs[3] in q
    assert q.num_requests == 3  # r0 still has seq 0
    q.remove(seqs[0])
    assert q.num_requests == 2
    assert [q.pop().seq_id for _ in range(len(q))] == [5, 3, 2, 4]
    assert q.peek() is None and q.num_requests == 0


def test_operations_are_logarithmic(monkeypatch):
    """Counted, not timed: heap comparisons per add, remove and pop stay O(log n)."""
    calls = [0]
    real_lt = waiting_queue._Entry.__lt__

    def counting_lt(a, b):
        calls[0] += 1
        return real_lt(a, b)

    monkeypatch.setattr(waiting_queue._Entry, "__lt__", counting_lt)
    rng = random.Random(0)
    for n in (1_000, 16_000):
        q = WaitingQueue()
        seqs = [_seq(i, rng.randrange(4)) for i in range(n)]
        calls[0] = 0
        for s in seqs:
            q.add(s)
        for s in rng.sample(seqs, n // 2):  # aborts and timeouts
            q.remove(s)
        while q:
            q.pop()
        per_op = calls[0] / (2 * n)
        assert per_op <= 4 * math.log2(n), (n, per_op)
