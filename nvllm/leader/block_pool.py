"""The pool of physical KV blocks and the prefix cache's hash table.

Free blocks live in two places: never-cached blocks (handed out first) and an LRU queue
of blocks that still hold a cached prefix (an OrderedDict gives O(1) removal when a
cached block is hit again). A cached block is evicted only when no uncached block is
left, oldest first.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import xxhash


def hash_block_tokens(parent_hash: bytes | None, token_ids: Sequence[int]) -> bytes:
    """Chained 128-bit hash of one full block: H(parent hash, token ids)."""
    h = xxhash.xxh3_128()
    if parent_hash is not None:
        h.update(parent_hash)
    h.update(array("q", token_ids).tobytes())
    return h.digest()


@dataclass(slots=True, eq=False)
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    # Set while the block is in the prefix cache. A lookup is confirmed by comparing the
    # token ids and the parent's entry id, so a hash collision can never serve wrong KV
    # (entry ids are never reused, unlike block ids).
    block_hash: bytes | None = None
    tokens: tuple[int, ...] | None = None
    entry_id: int = 0
    parent_entry_id: int = 0


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        # Popped from the end: block 0 first, which keeps tests readable.
        self._free_uncached: list[int] = list(range(num_blocks - 1, -1, -1))
        self._free_cached: OrderedDict[int, None] = OrderedDict()
        self._cached: dict[bytes, KVBlock] = {}
        self._live_entries: set[int] = set()
        self._next_entry_id = 1

    @property
    def num_free_blocks(self) -> int:
        return len(self._free_uncached) + len(self._free_cached)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def lookup(self, block_hash: bytes, token_ids: Sequence[int],
               parent_entry_id: int) -> KVBlock | None:
        block = self._cached.get(block_hash)
        if (block is None or block.parent_entry_id != parent_entry_id
                or block.tokens != tuple(token_ids)):
            return None
        return block

    def hash_taken(self, block_hash: bytes) -> bool:
        """True if another content holds this hash (drops it first if it is an orphan).

        Evicting a block does not walk its children; a child whose parent entry is gone
        can never be hit again, so it must not keep the hash from a fresh copy.
        """
        block = self._cached.get(block_hash)
        if block is None:
            return False
        if block.parent_entry_id and block.parent_entry_id not in self._live_entries:
            self._evict(block)
            if block.ref_cnt == 0:
                del self._free_cached[block.block_id]
                self._free_uncached.append(block.block_id)
            return False
        return True

    def register(self, block_id: int, block_hash: bytes, token_ids: Sequence[int],
                 parent_entry_id: int) -> int:
        """Put a block whose KV is computed into the cache; returns its entry id."""
        block = self.blocks[block_id]
        assert block.block_hash is None and block_hash not in self._cached
        block.block_hash = block_hash
        block.tokens = tuple(token_ids)
        block.parent_entry_id = parent_entry_id
        block.entry_id = self._next_entry_id
        self._next_entry_id += 1
        self._live_entries.add(block.entry_id)
        self._cached[block_hash] = block
        return block.entry_id

    def get_new_blocks(self, n: int) -> list[KVBlock]:
        if n > self.num_free_blocks:
            raise RuntimeError(f"asked for {n} KV blocks, {self.num_free_blocks} free")
        out = []
        for _ in range(n):
            if self._free_uncached:
                block = self.blocks[self._free_uncached.pop()]
            else:
                block_id, _ = self._free_cached.popitem(last=False)
                block = self.blocks[block_id]
                self._evict(block)
            assert block.ref_cnt == 0
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take a reference on cache hits, pulling free ones out of the LRU queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free_cached[block.block_id]
            block.ref_cnt += 1

    def free_blocks(self, blocks: Iterable[KVBlock]) -> None:
        """Drop one reference each, in the given order: the first freed is evicted first."""
        for block in blocks:
            assert block.ref_cnt > 0, f"double free of block {block.block_id}"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is not None:
                    self._free_cached[block.block_id] = None
                else:
                    self._free_uncached.append(block.block_id)

    def _evict(self, block: KVBlock) -> None:
        if block.block_hash is not None:
            del self._cached[block.block_hash]
            self._live_entries.discard(block.entry_id)
        block.block_hash = None
        block.tokens = None
        block.entry_id = block.parent_entry_id = 0

    def drop_all_cached(self) -> int:
        """Forget every cached prefix, blocks in use included (their holders keep them,
        uncached); returns how many entries were dropped."""
        n = len(self._cached)
        for block in list(self._cached.values()):
            self._evict(block)
        self._free_uncached.extend(self._free_cached)
        self._free_cached.clear()
        return n

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix; only possible when no block is in use."""
        if self.num_free_blocks != self.num_blocks:
            return False
        for block_id in list(self._free_cached):
            self._evict(self.blocks[block_id])
            self._free_uncached.append(block_id)
        self._free_cached.clear()
        return True
