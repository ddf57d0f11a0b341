"""Per-sequence view of the KV cache: block tables, prefix-cache lookups and caching.

The scheduler asks three things of it: what prefix of a sequence is already cached
(``get_computed_blocks``), room for the next tokens (``allocate_slots``), and to give a
sequence's blocks back (``free``). It writes only each sequence's ``SeqBlocks`` (block
table, prefix-cache chain) and reads the sequence's progress; the scheduler, the one
writer of a ``Sequence``, applies what a prefix hit covers (``hit_tokens``) and zeroes
the computed count of a sequence it frees. The scheduler calls ``cache_computed_blocks`` as it
accounts for each plan (and again as sampled tokens arrive): a block enters the prefix
cache once the plan that computes it is on its way, which is safe because workers
execute plans in order, so any later plan that reads the block runs after it was
written (and a failed worker group takes the whole prefix cache with it).

Sliding windows: when every layer slides (``window``: the largest; None when any layer
attends in full), a block wholly behind the window of the next query the sequence computes
goes back to the pool as ``allocate_slots`` makes room, so a sequence holds at most
cdiv(window + max_num_batched_tokens, block_size) + 1 blocks. Its table slot becomes
``FREED`` (sent to the workers as block 0, which no kernel reads: it is outside the
window), so the table is still indexed by position. A given-back block that is in the
prefix cache stays there like any free cached block: its content is intact until the
pool hands it out again, which evicts it first, so a hit never serves overwritten KV.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from nvllm.common.utils import cdiv
from nvllm.leader import block_pool  # one import: tests swap block_pool.hash_block_tokens
from nvllm.leader.seq_blocks import SeqBlocks
from nvllm.leader.sequence import Sequence

FREED = -1  # a block_table slot whose block went back to the pool (behind the window)


@dataclass(slots=True)
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # of those, tokens served from the cache

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool,
                 window: int | None = None) -> None:
        """window: the model's sliding window when every layer slides (blocks behind it
        are given back), else None."""
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.window = window
        self.pool = block_pool.BlockPool(num_blocks)
        self.stats = PrefixCacheStats()

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        return 1.0 - self.pool.num_free_blocks / self.pool.num_blocks

    def _block_hash(self, seq: Sequence, i: int) -> bytes:
        bs = self.block_size
        hashes = seq.blocks.hashes
        while len(hashes) <= i:
            j = len(hashes)
            parent = hashes[j - 1] if j else None
            hashes.append(
                block_pool.hash_block_tokens(parent, seq.token_ids[j * bs:(j + 1) * bs]))
        return hashes[i]

    def hit_tokens(self, computed_blocks: list[block_pool.KVBlock]) -> int:
        """How many tokens a prefix hit (``get_computed_blocks``) covers: the computed
        count of a sequence admitted with it."""
        return len(computed_blocks) * self.block_size

    def get_computed_blocks(self, seq: Sequence) -> list[block_pool.KVBlock]:
        """Longest cached prefix of a sequence that holds no blocks, in full blocks.

        At most num_tokens - 1 tokens can hit: the last token is always computed so
        that the step produces logits to sample from.
        """
        if not self.enable_prefix_caching:
            return []
        bs = self.block_size
        hits: list[block_pool.KVBlock] = []
        parent_entry = 0
        for i in range((seq.num_tokens - 1) // bs):
            block = self.pool.lookup(self._block_hash(seq, i),
                                     seq.token_ids[i * bs:(i + 1) * bs], parent_entry)
            if block is None:
                break
            hits.append(block)
            parent_entry = block.entry_id
        return hits

    def allocate_slots(self, seq: Sequence, num_new_tokens: int,
                       computed_blocks: list[block_pool.KVBlock] | None = None) -> bool:
        """Make room for num_new_tokens more tokens after the computed ones.

        With computed_blocks (a new or resumed sequence, which holds no blocks), those
        cache hits become the start of its block table; the scheduler then sets its
        computed count to ``hit_tokens(computed_blocks)``. Returns False, changing nothing
        but giving back the blocks the window has left behind, if blocks run short.
        """
        blocks = seq.blocks
        if not computed_blocks and self.window is None and (
                cdiv(seq.num_computed_tokens + num_new_tokens, self.block_size)
                <= len(blocks.table)):
            return True  # the common decode: its last block has room
        computed_blocks = computed_blocks or []
        if computed_blocks:
            assert not blocks.table and seq.num_computed_tokens == 0
            num_computed = self.hit_tokens(computed_blocks)
        else:
            num_computed = seq.num_computed_tokens
            self._free_behind_window(blocks, num_computed)
        num_needed = (cdiv(num_computed + num_new_tokens, self.block_size)
                      - len(blocks.table) - len(computed_blocks))
        num_hits_free = sum(1 for b in computed_blocks if b.ref_cnt == 0)
        if max(num_needed, 0) + num_hits_free > self.pool.num_free_blocks:
            return False
        if computed_blocks:
            self.pool.touch(computed_blocks)
            blocks.table.extend(b.block_id for b in computed_blocks)
            blocks.chain[:] = [b.entry_id for b in computed_blocks]
            blocks.num_cached = len(computed_blocks)
            self._free_behind_window(blocks, num_computed)
        if num_needed > 0:
            blocks.table.extend(b.block_id for b in self.pool.get_new_blocks(num_needed))
        return True

    def _free_behind_window(self, blocks: SeqBlocks, num_computed: int) -> None:
        """Give back the blocks wholly before the first key the sequence's next query (at
        position num_computed) sees, oldest first (so they are evicted first)."""
        if self.window is None:
            return
        end = max(0, num_computed - self.window + 1) // self.block_size
        if end <= blocks.num_freed:
            return
        table = blocks.table
        behind = [self.pool.blocks[b] for b in table[blocks.num_freed:end]]
        table[blocks.num_freed:end] = [FREED] * len(behind)
        blocks.num_freed = end
        self.pool.free_blocks(behind)

    def blocks_held(self, seq: Sequence) -> int:
        """The blocks the sequence holds (its table less the slots given back)."""
        return len(seq.blocks.table) - seq.blocks.num_freed

    def record_lookup(self, seq: Sequence) -> None:
        """Count a prompt's lookup (tokens queried, tokens hit) at its first admission;
        re-admissions after preemption would count generated tokens as prompt. Call it
        once the sequence's computed count holds its prefix hit."""
        if self.enable_prefix_caching and seq.num_preemptions == 0:
            self.stats.queries += seq.num_tokens
            self.stats.hits += seq.num_computed_tokens

    def cache_computed_blocks(self, seq: Sequence) -> None:
        """Register the sequence's full, computed blocks in the prefix cache."""
        if not self.enable_prefix_caching or seq.blocks.stale:
            return
        bs = self.block_size
        blocks = seq.blocks
        # Only blocks whose token ids are all known: a token still in flight (async
        # scheduling) may already be computed by a plan but cannot be hashed yet.
        num_full = min(min(seq.num_computed_tokens, seq.num_tokens) // bs,
                       len(blocks.table))
        # The chain can stop short of num_cached's goal after a collision: past a block
        # whose hash belongs to different content, nothing is cached.
        while blocks.num_cached < num_full and len(blocks.chain) == blocks.num_cached:
            i = blocks.num_cached
            if blocks.table[i] == FREED:
                break  # given back before its tokens were known: the chain ends here
            h = self._block_hash(seq, i)
            tokens = seq.token_ids[i * bs:(i + 1) * bs]
            parent = blocks.chain[i - 1] if i else 0
            existing = self.pool.lookup(h, tokens, parent)
            if existing is not None:
                # Same content computed twice (e.g. two prompts admitted together):
                # keep the cached copy, ours stays an ordinary block.
                blocks.chain.append(existing.entry_id)
            elif self.pool.hash_taken(h):
                break  # a true collision with other content: stop caching this sequence
            else:
                blocks.chain.append(self.pool.register(blocks.table[i], h, tokens, parent))
            blocks.num_cached += 1

    def drop_prefix_cache(self, held: Iterable[Sequence] = ()) -> int:
        """The weights changed: forget every cached prefix, in use or not, so no hit ever
        serves KV computed on the old weights; `held` sequences keep their blocks (and the
        old KV in them) but never enter the cache again. Returns the entries dropped."""
        dropped = self.pool.drop_all_cached()
        for seq in held:
            seq.blocks.stale = True
        return dropped

    def free(self, seq: Sequence) -> None:
        """Release a sequence's blocks tail-first, so its prefix outlives its suffix. Its
        computed count is the scheduler's to zero (nothing of it is cached any more)."""
        blocks = seq.blocks
        self.pool.free_blocks(self.pool.blocks[b] for b in reversed(blocks.table)
                              if b != FREED)
        blocks.table.clear()
        blocks.num_freed = 0
        blocks.chain.clear()
        blocks.num_cached = 0
        blocks.stale = False  # recomputed from its tokens if it comes back
