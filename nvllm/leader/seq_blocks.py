"""One sequence's share of the KV cache, owned and written by the KVCacheManager alone.

The scheduler owns a ``Sequence``'s progress (tokens, computed counts, status); the
block table and the prefix-cache chain behind it are the KV-cache manager's state, kept
in this object so that each piece of state has exactly one writer. Everyone else reads
them (``Sequence.block_table``, the plan builder).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True, eq=False)
class SeqBlocks:
    # Block ids by position; a slot given back behind a sliding window holds FREED.
    table: list[int] = field(default_factory=list)
    # Chained hashes of the sequence's full blocks, memoized (tokens are append-only).
    hashes: list[bytes] = field(default_factory=list)
    # The prefix-cache entry each leading full block of the table is known as.
    chain: list[int] = field(default_factory=list)
    # How many leading blocks of the table are in the prefix cache.
    num_cached: int = 0
    # Leading table slots given back to the pool, behind a sliding window (FREED).
    num_freed: int = 0
    # Its KV was computed (in part) on weights since replaced (a request kept across a
    # weight update without recompute): none of its blocks may enter the prefix cache.
    stale: bool = False
