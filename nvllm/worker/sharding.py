"""The one rule that splits a dimension over the tensor-parallel ranks, and the attention
heads' partition built on it.

Every sharded dimension (a linear layer's rows or columns, the vocabulary, the experts'
intermediate size, the experts themselves) is cut by :func:`shard_sizes`: `total` in
units of `granule`, as evenly as possible, the first ranks taking one unit more. Nothing
has to divide: 1031 vocabulary rows on 2 ranks are 516 + 515.

Attention heads are cut by KV group (:func:`head_partition`): a rank holds whole KV heads
and exactly the query heads that read them, so each local KV head serves the same number
of local query heads and every attention kernel runs unchanged. With fewer KV heads than
ranks the ranks are dealt out to the KV heads by the same rule, each rank holding its KV
head (a replica) and a share of that head's query heads.
"""

from __future__ import annotations

from dataclasses import dataclass


def shard_sizes(total: int, world: int, granule: int = 1) -> list[int]:
    """Each rank's share of `total`: total / granule units split as evenly as possible,
    the first (units % world) ranks taking one more, times granule. Ranks past the unit
    count get 0."""
    if world < 1 or granule < 1 or total < 0:
        raise ValueError(f"cannot shard {total} over {world} ranks in granules of {granule}")
    if total % granule:
        raise ValueError(f"cannot shard {total} in granules of {granule}: {total} is not a "
                         f"multiple of {granule}")
    base, extra = divmod(total // granule, world)
    return [(base + (r < extra)) * granule for r in range(world)]


def shard_starts(total: int, world: int, granule: int = 1) -> list[int]:
    """Where each rank's share starts (a prefix sum of shard_sizes)."""
    starts, at = [], 0
    for n in shard_sizes(total, world, granule):
        starts.append(at)
        at += n
    return starts


def shard_span(total: int, world: int, rank: int, granule: int = 1) -> tuple[int, int]:
    """[start, end) of `rank`'s share of `total` (see shard_sizes)."""
    sizes = shard_sizes(total, world, granule)
    start = sum(sizes[:rank])
    return start, start + sizes[rank]


@dataclass(frozen=True, slots=True)
class HeadShard:
    """One rank's attention heads: query heads [q_head_start, + num_q_heads) and KV heads
    [kv_head_start, + num_kv_heads); num_q_heads is a multiple of num_kv_heads."""

    q_head_start: int
    num_q_heads: int
    kv_head_start: int
    num_kv_heads: int

    @property
    def group(self) -> int:
        """Query heads per local KV head."""
        return self.num_q_heads // self.num_kv_heads


def head_partition(num_heads: int, num_kv_heads: int, world: int) -> list[HeadShard]:
    """Every rank's heads, by KV group.

    KV heads >= ranks: the KV heads are split by shard_sizes and each rank takes the query
    heads of its KV heads (9 query / 3 KV heads on 2 ranks: 6 + 3 query, 2 + 1 KV).
    KV heads < ranks: the ranks are split over the KV heads by shard_sizes(world, kv), and
    each KV head's query heads over its ranks by shard_sizes (14 / 2 on 3 ranks: KV head 0
    on ranks 0 and 1 with 4 + 3 query heads, KV head 1 on rank 2 with 7).
    """
    if num_kv_heads < 1 or num_heads % num_kv_heads:
        raise ValueError(f"num_attention_heads={num_heads} is not a multiple of "
                         f"num_key_value_heads={num_kv_heads}")
    if world > num_heads:
        raise ValueError(f"tensor_parallel_size={world} is larger than "
                         f"num_attention_heads={num_heads}: a rank would hold no head")
    group = num_heads // num_kv_heads
    if num_kv_heads >= world:
        return [HeadShard(kv * group, n * group, kv, n) for kv, n in
                zip(shard_starts(num_kv_heads, world), shard_sizes(num_kv_heads, world))]
    out = []
    for kv, ranks in enumerate(shard_sizes(world, num_kv_heads)):
        for q0, nq in zip(shard_starts(group, ranks), shard_sizes(group, ranks)):
            out.append(HeadShard(kv * group + q0, nq, kv, 1))
    return out


def window_2d(index, shape: tuple[int, int], name: str
              ) -> tuple[tuple[int, int], tuple[int, int]]:
    """((r0, r1), (c0, c1)) of a plain slice `index` into a 2-D packed checkpoint tensor
    (the loader slices shards; a packed tensor can only serve whole row/column windows,
    so a stride is refused)."""
    if not isinstance(index, tuple):
        index = (index,)
    index = (*index, *[slice(None)] * (2 - len(index)))
    (r0, r1, rs), (c0, c1, cs) = (i.indices(n) for i, n in zip(index, shape))
    if rs != 1 or cs != 1:
        raise ValueError(f"{name}: strided reads unsupported")
    return (r0, max(r0, r1)), (c0, max(c0, c1))
