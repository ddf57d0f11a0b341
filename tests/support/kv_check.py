"""A check of the leader's KV accounting against what fake workers actually wrote, for
runs with speculative decoding (tests/leader/test_speculative.py), called after every step:

- every block is held by exactly the sequences whose tables name it (ref counts), the free
  count is the rest, and no block appears twice in one table;
- the prefix cache holds only verified tokens: each cached block's registered tokens are
  the ones the workers last computed into its slots (a block holding a rejected draft, or
  a slot not computed yet, would differ), and each running sequence's cached blocks are
  within its computed, known tokens.
"""

from __future__ import annotations

from nvllm.leader.engine import LLMEngine
from nvllm.leader.kv_cache_manager import FREED
from nvllm.leader.sequence import SequenceStatus


def check_kv(engine: LLMEngine, slot_tokens: dict[int, int]) -> None:
    kv, sched = engine.kv, engine.scheduler
    bs = kv.block_size
    users = [0] * kv.num_blocks
    for seq in list(sched.running) + list(sched.waiting):
        if seq.status is not SequenceStatus.RUNNING:
            assert seq.block_table == [], "a waiting sequence holds blocks"
            continue
        held = [b for b in seq.block_table if b != FREED]
        assert len(set(held)) == len(held), "a block twice in one table"
        for b in held:
            users[b] += 1
        known = min(seq.num_computed_tokens, seq.num_tokens)
        assert seq.blocks.num_cached * bs <= known, "a cached block beyond verified tokens"
    assert [b.ref_cnt for b in kv.pool.blocks] == users, "ref counts disagree with tables"
    assert kv.num_free_blocks == users.count(0), "leaked or double-freed blocks"
    for b in kv.pool.blocks:
        if b.block_hash is None:
            continue
        wrote = tuple(slot_tokens.get(b.block_id * bs + j) for j in range(bs))
        assert wrote == tuple(b.tokens), (
            f"block {b.block_id} is cached as {b.tokens} but holds {wrote}")
