"""The scheduler's waiting queue: sequences by (priority, arrival order).

A heap with lazy removal, so adding, removing (an abort, a timeout) and taking the next
sequence are O(log n) however long the queue grows; it also counts the distinct
requests waiting in O(1) (the max_queued_requests check runs on every submission).
"""

from __future__ import annotations

import heapq
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

from nvllm.leader.sequence import Sequence

_COMPACT_MIN = 64  # rebuild the heap when dead entries outnumber live ones past this


@dataclass(slots=True, order=True)
class _Entry:
    priority: int
    order: int
    seq: Sequence | None = field(compare=False)  # None once removed


class WaitingQueue:
    def __init__(self) -> None:
        self._heap: list[_Entry] = []
        self._live: dict[int, _Entry] = {}  # seq id -> its entry
        self._requests: Counter[str] = Counter()

    def add(self, seq: Sequence) -> None:
        entry = _Entry(seq.priority, seq.order, seq)
        heapq.heappush(self._heap, entry)
        self._live[seq.seq_id] = entry
        self._requests[seq.request_id] += 1

    def remove(self, seq: Sequence) -> None:
        entry = self._live.pop(seq.seq_id)
        entry.seq = None
        self._uncount(seq)
        if len(self._heap) > max(_COMPACT_MIN, 2 * len(self._live)):
            self._heap = [e for e in self._heap if e.seq is not None]
            heapq.heapify(self._heap)

    def peek(self) -> Sequence | None:
        """The next sequence in line (None when empty)."""
        while self._heap and self._heap[0].seq is None:
            heapq.heappop(self._heap)
        return self._heap[0].seq if self._heap else None

    def pop(self) -> Sequence:
        seq = self.peek()
        assert seq is not None, "pop from an empty waiting queue"
        heapq.heappop(self._heap)
        del self._live[seq.seq_id]
        self._uncount(seq)
        return seq

    def _uncount(self, seq: Sequence) -> None:
        self._requests[seq.request_id] -= 1
        if not self._requests[seq.request_id]:
            del self._requests[seq.request_id]

    @property
    def num_requests(self) -> int:
        """Distinct requests with a sequence waiting."""
        return len(self._requests)

    def __len__(self) -> int:
        return len(self._live)

    def __contains__(self, seq: Sequence) -> bool:
        return self._live.get(seq.seq_id) is not None and self._live[seq.seq_id].seq is seq

    def __iter__(self) -> Iterator[Sequence]:
        """In line order (sorts a copy: for inspection, not the hot path)."""
        return iter([e.seq for e in sorted(self._live.values())])
