"""KVCacheManager / BlockPool: prefix-cache hits and stats, ref counts, eviction, collisions.

Whole lifecycles run through the real Scheduler and a fake model (``Sim``), which applies
each step the way ``Scheduler.update_from_output`` does and checks, every step, that a sequence
only reads blocks holding the KV of exactly its own prefix and only writes blocks it owns.
"""

from __future__ import annotations

import pytest
from leader_sim import BS, Sim, assert_no_leak, cdiv, make_seq, toks

from nvllm.leader import block_pool
from nvllm.leader.kv_cache_manager import FREED, KVCacheManager
from nvllm.leader.sequence import Sequence

# ---- helpers ------------------------------------------------------------------------------


def compute(kv: KVCacheManager, seq: Sequence, n: int) -> None:
    """Allocate and 'compute' n more tokens of seq, outside any scheduler."""
    hits = kv.get_computed_blocks(seq) if not seq.block_table else None
    assert kv.allocate_slots(seq, n, hits)
    seq.num_computed_tokens += kv.hit_tokens(hits or []) + n  # as the scheduler applies it
    kv.cache_computed_blocks(seq)


def finish_prompt(sim: Sim, prompt: list[int]) -> Sequence:
    """Run one prompt to completion (max_tokens=1) on its own."""
    seq = sim.add(prompt)
    sim.run()
    return seq


# ---- hit / miss accounting ----------------------------------------------------------------


def test_cold_prompt_is_queried_and_misses(make_sim):
    sim = make_sim()
    sim.add(toks(0, 10))
    out = sim.step()
    assert out.scheduled[0][1] == 10
    assert (sim.kv.stats.queries, sim.kv.stats.hits) == (10, 0)
    assert sim.kv.stats.hit_rate == 0.0


def test_identical_second_prompt_hits_its_full_blocks(make_sim):
    sim = make_sim()
    finish_prompt(sim, toks(0, 10))
    b = sim.add(toks(0, 10))
    out = sim.step()
    assert (sim.kv.stats.queries, sim.kv.stats.hits) == (20, 8)  # 2 full blocks of 4
    assert out.scheduled == [(b, 2)]  # only the partial block is computed
    assert sim.kv.stats.hit_rate == pytest.approx(8 / 20)


@pytest.mark.parametrize("k", [0, 1, 2, 3])
def test_prompt_sharing_first_k_blocks_hits_k_blocks(make_sim, k):
    sim = make_sim()
    a = toks(0, 4 * BS)
    finish_prompt(sim, a)
    b = sim.add(a[:k * BS] + toks(1000, (4 - k) * BS))
    sim.run()
    assert sim.hits_of(b) == [k * BS]
    assert (sim.kv.stats.queries, sim.kv.stats.hits) == (8 * BS, k * BS)


@pytest.mark.parametrize("n", [1, BS - 1, BS])
def test_prompt_of_at_most_one_block_never_hits(make_sim, n):
    sim = make_sim()
    first = finish_prompt(sim, toks(0, n))
    again = finish_prompt(sim, toks(0, n))
    assert sim.hits_of(first) == sim.hits_of(again) == [0]
    assert (sim.kv.stats.queries, sim.kv.stats.hits) == (2 * n, 0)


def test_stats_count_every_admission_of_several_prompts(make_sim):
    sim = make_sim()
    finish_prompt(sim, toks(0, 12))
    b = sim.add(toks(0, 8) + toks(500, 5))  # shares 2 blocks
    c = sim.add(toks(900, 6))  # cold
    sim.run()
    assert sim.hits_of(b) == [8] and sim.hits_of(c) == [0]
    assert (sim.kv.stats.queries, sim.kv.stats.hits) == (12 + 13 + 6, 8)


def test_block_hash_depends_on_every_token_before_it():
    """hash_block_tokens chains: the same block under a different parent (or at the root)
    hashes differently, so a block's hash names its whole prefix, not only its tokens."""
    x, y = toks(0, BS), toks(10, BS)
    hx = block_pool.hash_block_tokens(None, x)
    hy = block_pool.hash_block_tokens(None, y)
    assert block_pool.hash_block_tokens(hx, x) != hx  # X after X is not X at the root
    assert block_pool.hash_block_tokens(hx, y) != hy
    assert block_pool.hash_block_tokens(hx, y) != block_pool.hash_block_tokens(hy, y)
    # Through the manager: the chained hashes of X,X,X,X are four different values.
    kv = KVCacheManager(8, BS, enable_prefix_caching=True)
    seq = make_seq(0, x * 4 + [1])
    assert len({kv._block_hash(seq, i) for i in range(4)}) == 4


def test_resubmitted_prompt_of_repeated_blocks_hits_every_full_block(make_sim):
    """A prompt whose full blocks repeat each other (X,X,X,X + 1 token) caches all four
    blocks, and the same prompt again hits all four. With hashes that ignore the parent,
    blocks 1-3 collide with block 0's hash, are never cached, and only 1 block hits."""
    sim = make_sim()
    prompt = toks(0, BS) * 4 + [1]
    first = finish_prompt(sim, prompt)
    assert sim.kv.pool.num_cached_blocks == 4
    again = finish_prompt(sim, prompt)
    assert sim.hits_of(first) == [0] and sim.hits_of(again) == [4 * BS]
    assert sim.table_of(again)[:4] == sim.table_of(first)[:4]


def test_blocks_computed_after_a_hit_are_cached_too(make_sim):
    sim = make_sim()
    finish_prompt(sim, toks(0, 5))  # caches block 0 only
    b = finish_prompt(sim, toks(0, 13))
    c = finish_prompt(sim, toks(0, 13))
    assert sim.hits_of(b) == [4] and sim.hits_of(c) == [12]


def test_follow_up_prompt_hits_the_generated_tokens(make_sim):
    """A chat's next turn (previous prompt + answer + more) hits the answer's full blocks."""
    sim = make_sim()
    a = sim.add(toks(0, 10), max_tokens=6)
    sim.run()
    assert a.num_tokens == 16  # 15 computed: blocks 0-2 are full, block 3 is not
    b = finish_prompt(sim, a.token_ids + toks(100, 4))
    assert sim.hits_of(b) == [12]


# ---- reference counts -----------------------------------------------------------------------


def test_running_seqs_sharing_a_prefix_hold_one_ref_each(make_sim):
    sim = make_sim()
    a = sim.add(toks(0, 12), max_tokens=3)
    sim.step()  # a's prompt is computed and cached; a keeps running
    b = sim.add(toks(0, 8) + toks(100, 4), max_tokens=3)
    sim.step()
    shared = a.block_table[:2]
    assert b.block_table[:2] == shared
    assert [sim.kv.pool.blocks[i].ref_cnt for i in shared] == [2, 2]
    assert sim.kv.pool.blocks[a.block_table[2]].ref_cnt == 1
    assert sim.kv.pool.blocks[b.block_table[2]].ref_cnt == 1
    sim.run()
    assert a.is_finished and b.is_finished
    assert [sim.kv.pool.blocks[i].ref_cnt for i in shared] == [0, 0]
    assert all(sim.kv.pool.blocks[i].block_hash is not None for i in shared)  # still cached
    c = finish_prompt(sim, toks(0, 8) + toks(200, 1))
    assert sim.hits_of(c) == [8]


def test_two_hits_in_one_step_share_blocks(make_sim):
    sim = make_sim()
    a = finish_prompt(sim, toks(0, 9))
    cached = sim.table_of(a)[:2]  # freed now, but cached
    b, c = sim.add(toks(0, 9), max_tokens=2), sim.add(toks(0, 9), max_tokens=2)
    sim.step()
    assert b.block_table[:2] == c.block_table[:2] == cached
    assert [sim.kv.pool.blocks[i].ref_cnt for i in cached] == [2, 2]
    sim.run()
    assert [sim.kv.pool.blocks[i].ref_cnt for i in cached] == [0, 0]


# ---- eviction -------------------------------------------------------------------------------


def test_never_cached_blocks_are_used_before_evicting_cached_ones(make_sim):
    sim = make_sim(num_blocks=8)
    finish_prompt(sim, toks(0, 8))  # 2 cached blocks, 6 never-cached free blocks
    assert sim.kv.pool.num_cached_blocks == 2
    other = make_seq(99, toks(500, 7 * BS))
    assert sim.kv.allocate_slots(other, 6 * BS)
    assert sim.kv.pool.num_cached_blocks == 2
    assert len(sim.kv.get_computed_blocks(make_seq(98, toks(0, 9)))) == 2
    assert sim.kv.allocate_slots(other, 6 * BS + 1)  # a 7th block has to evict one
    assert sim.kv.pool.num_cached_blocks == 1
    sim.kv.free(other)


def test_free_cached_hits_count_against_the_free_blocks(make_sim):
    sim = make_sim(num_blocks=4)
    finish_prompt(sim, toks(0, 8))  # 2 cached free blocks, 2 never-cached
    other = make_seq(99, toks(500, 8))
    assert sim.kv.allocate_slots(other, 8)  # takes the 2 never-cached blocks
    b = make_seq(98, toks(0, 9))
    hits = sim.kv.get_computed_blocks(b)
    assert len(hits) == 2
    assert not sim.kv.allocate_slots(b, 1, hits)  # 2 hits + 1 new block > 2 free blocks
    assert b.block_table == [] and b.num_computed_tokens == 0
    assert [blk.ref_cnt for blk in hits] == [0, 0] and sim.kv.num_free_blocks == 2
    sim.kv.free(other)
    assert sim.kv.allocate_slots(b, 1, hits)
    assert sim.kv.hit_tokens(hits) == 8 and len(b.block_table) == 3
    sim.kv.free(b)


def test_finished_prompt_is_evicted_suffix_first(make_sim):
    sim = make_sim(num_blocks=3)
    finish_prompt(sim, toks(0, 12))  # 3 full blocks, all cached, all free
    query = make_seq(99, toks(0, 12) + [7])
    assert len(sim.kv.get_computed_blocks(query)) == 3
    other = make_seq(98, toks(500, 12))
    for left in (2, 1, 0):
        assert sim.kv.allocate_slots(other, BS)  # one more block each time
        other.num_computed_tokens += BS  # (never cached: cache_computed_blocks not called)
        assert len(sim.kv.get_computed_blocks(query)) == left  # the prefix outlives the tail
    sim.kv.free(other)


def test_least_recently_freed_prompt_is_evicted_first(make_sim):
    sim = make_sim(num_blocks=4)
    finish_prompt(sim, toks(0, 8))
    finish_prompt(sim, toks(100, 8))
    other = make_seq(99, toks(500, 8))
    assert sim.kv.allocate_slots(other, 8)  # evicts two blocks: all of the older prompt
    assert sim.kv.get_computed_blocks(make_seq(98, toks(0, 9))) == []
    assert len(sim.kv.get_computed_blocks(make_seq(97, toks(100, 9)))) == 2
    sim.kv.free(other)


def test_hit_block_is_not_evicted_while_in_use(make_sim):
    sim = make_sim(num_blocks=8)
    finish_prompt(sim, toks(0, 8))
    finish_prompt(sim, toks(100, 8))  # LRU queue: P1, P0, Q1, Q0
    hit = sim.kv.get_computed_blocks(make_seq(97, toks(0, 5)))[0].block_id  # P0
    b = sim.add(toks(0, 4) + [1], max_tokens=5)
    sim.step()
    assert b.block_table[0] == hit and sim.kv.pool.blocks[hit].ref_cnt == 1
    assert sim.kv.num_free_blocks == 6  # the hit block no longer counts as free
    hog = make_seq(99, toks(500, 100))
    assert sim.kv.allocate_slots(hog, 6 * BS)  # 3 never-cached blocks, then evicts 3
    assert sim.kv.pool.num_cached_blocks == 1
    assert sim.kv.pool.blocks[hit].block_hash is not None
    assert [blk.block_id for blk in sim.kv.get_computed_blocks(make_seq(98, toks(0, 5)))] == [hit]
    assert not sim.kv.allocate_slots(hog, 6 * BS + 1)  # nothing left to evict
    with pytest.raises(RuntimeError):
        sim.kv.pool.get_new_blocks(1)
    sim.kv.free(hog)


def test_hit_again_moves_prompt_to_most_recently_used(make_sim):
    sim = make_sim(num_blocks=5)
    finish_prompt(sim, toks(0, 8))  # older: P0, P1
    finish_prompt(sim, toks(100, 8))  # newer: Q0, Q1; LRU queue: P1, P0, Q1, Q0
    finish_prompt(sim, toks(0, 5))  # hits P0 again; LRU queue: P1, Q1, Q0, P0
    other = make_seq(99, toks(500, 12))
    assert sim.kv.allocate_slots(other, 12)  # 1 never-cached block, then evicts P1, Q1
    assert len(sim.kv.get_computed_blocks(make_seq(98, toks(0, 9)))) == 1
    assert len(sim.kv.get_computed_blocks(make_seq(97, toks(100, 9)))) == 1
    sim.kv.free(other)


# ---- hash collisions ------------------------------------------------------------------------


@pytest.fixture
def constant_hash(monkeypatch):
    """Every block hashes to the same value: every lookup is a collision."""
    monkeypatch.setattr(block_pool, "hash_block_tokens", lambda parent, tokens: b"x" * 16)


@pytest.fixture
def parentless_hash(monkeypatch):
    """Blocks hash by their own tokens only: equal blocks under different parents collide."""
    real = block_pool.hash_block_tokens
    monkeypatch.setattr(block_pool, "hash_block_tokens", lambda parent, tokens: real(None, tokens))


def test_collision_never_serves_a_different_block(make_sim, constant_hash):
    sim = make_sim()
    a = finish_prompt(sim, toks(0, 12))
    x = sim.table_of(a)[0]
    kv = sim.kv
    assert kv.get_computed_blocks(make_seq(90, toks(100, 12))) == []  # other tokens
    assert kv.get_computed_blocks(make_seq(91, toks(4, 4) + toks(0, 8))) == []
    same_first = kv.get_computed_blocks(make_seq(92, toks(0, 4) + toks(200, 8)))
    assert [blk.block_id for blk in same_first] == [x]
    # Block X's tokens again, but under parent X instead of at the root: no hit.
    x_under_x = kv.get_computed_blocks(make_seq(93, toks(0, 4) + toks(0, 4) + [1]))
    assert [blk.block_id for blk in x_under_x] == [x]


def test_collision_lifecycles_only_read_their_own_prefix(make_sim, constant_hash):
    sim = make_sim(num_blocks=32)
    prompts = [toks(0, 12), toks(100, 12), toks(0, 4) + toks(0, 8), toks(0, 12) + [3],
               toks(0, 8) + toks(100, 4), toks(100, 12)]
    for p in prompts:
        sim.add(p, max_tokens=3)
        sim.step()  # Sim checks every read against the oracle
    sim.run()
    assert all(s.num_output_tokens == 3 for s in sim.seqs)
    # Only the first block ever computed can be cached; only equal prefixes hit it.
    assert [hit for _, hit in sim.admitted] == [0, 0, 4, 4, 4, 0]


def test_constant_hash_same_block_under_other_parent_does_not_hit(make_sim, constant_hash):
    """A=(X,Y) and C=(Z,Y) ran; B=(X,Y) gets only blocks genuinely equal to its prefix."""
    sim = make_sim()
    X, Y, Z = toks(0, 4), toks(10, 4), toks(20, 4)
    a = finish_prompt(sim, X + Y + [1])
    c = finish_prompt(sim, Z + Y + [1])
    b = finish_prompt(sim, X + Y + [2])
    assert sim.hits_of(c) == [0] and sim.hits_of(b) == [4]  # X only: one hash, one entry
    assert sim.table_of(b)[0] == sim.table_of(a)[0]  # (Sim checked b read only its own KV)


def test_same_block_under_other_parent_does_not_hit(make_sim, parentless_hash):
    """A=(X,Y) and C=(Z,Y) are cached; B=(X,Y) may hit A's X and A's Y, never C's Y."""
    sim = make_sim()
    X, Y, Z = toks(0, 4), toks(10, 4), toks(20, 4)
    a = finish_prompt(sim, X + Y + [1])
    finish_prompt(sim, Z + Y + [1])
    hits = sim.kv.get_computed_blocks(make_seq(99, X + Y + [2]))
    assert [h.block_id for h in hits] == sim.table_of(a)[:2]


def test_same_block_under_other_parent_does_not_hit_when_only_it_is_cached(
        make_sim, parentless_hash):
    """A=(X,W) and C=(Z,Y) are cached; B=(X,Y) hits X, not C's Y (whose KV follows Z)."""
    sim = make_sim()
    X, Y, Z, W = toks(0, 4), toks(10, 4), toks(20, 4), toks(30, 4)
    a = finish_prompt(sim, X + W + [1])
    c = finish_prompt(sim, Z + Y + [1])
    assert sim.kv.pool.blocks[sim.table_of(c)[1]].block_hash is not None  # C's Y is cached
    b = sim.add(X + Y + [2])
    sim.step()
    assert sim.hits_of(b) == [4]
    assert sim.table_of(b)[0] == sim.table_of(a)[0]
    assert sim.table_of(b)[1] != sim.table_of(c)[1]


# ---- what enters the cache, and when --------------------------------------------------------


def test_partial_last_block_is_never_cached(make_sim):
    sim = make_sim()
    a = sim.add(toks(0, 10), max_tokens=4)
    sim.step()  # 10 tokens computed: 2 full blocks + 2 tokens in the third
    assert sim.kv.pool.num_cached_blocks == 2
    assert sim.kv.pool.blocks[a.block_table[2]].block_hash is None
    assert len(sim.kv.get_computed_blocks(make_seq(99, toks(0, 10) + [5]))) == 2
    sim.step()
    sim.step()  # 12 tokens computed: the third block is full now (with 2 generated tokens)
    assert a.num_computed_tokens == 12
    assert sim.kv.pool.num_cached_blocks == 3
    assert len(sim.kv.get_computed_blocks(make_seq(98, a.token_ids[:12] + [5]))) == 3
    assert len(sim.kv.get_computed_blocks(make_seq(97, toks(0, 10) + [7, 7, 5]))) == 2


def test_blocks_enter_the_cache_only_once_computed():
    kv = KVCacheManager(16, BS, enable_prefix_caching=True)
    a, b = make_seq(0, toks(0, 12)), make_seq(1, toks(0, 12))
    assert kv.allocate_slots(a, 12)  # allocated, KV not computed yet
    kv.cache_computed_blocks(a)
    assert kv.get_computed_blocks(b) == []
    a.num_computed_tokens = 6  # a first chunk of 6 tokens is computed
    kv.cache_computed_blocks(a)
    assert [blk.block_id for blk in kv.get_computed_blocks(b)] == a.block_table[:1]
    a.num_computed_tokens = 12
    kv.cache_computed_blocks(a)
    assert [blk.block_id for blk in kv.get_computed_blocks(b)] == a.block_table[:2]
    kv.free(a)
    assert_no_leak(kv)


def test_identical_prompts_admitted_together_do_not_hit_each_other(make_sim):
    sim = make_sim()
    a, b = sim.add(toks(0, 12)), sim.add(toks(0, 12))
    sim.step()
    assert sim.hits_of(a) == sim.hits_of(b) == [0]
    assert set(sim.table_of(a)).isdisjoint(sim.table_of(b))
    assert sim.kv.pool.num_cached_blocks == 3  # one copy cached, the other stays plain
    c = finish_prompt(sim, toks(0, 12) + [1])
    assert sim.hits_of(c) == [12]


def test_chunked_prompt_caches_each_chunk_once_computed(make_sim):
    sim = make_sim(max_num_batched_tokens=6)
    sim.add(toks(0, 16))
    sim.step()  # 6 tokens: 1 full block
    assert sim.kv.pool.num_cached_blocks == 1
    sim.step()  # 12 tokens: 3 full blocks
    assert sim.kv.pool.num_cached_blocks == 3
    sim.run()
    b = finish_prompt(sim, toks(0, 16) + [9])
    assert sim.hits_of(b) == [16]


@pytest.mark.parametrize("n, hit", [(8, 4), (9, 8), (16, 12)])
def test_fully_cached_prompt_still_computes_its_last_token(make_sim, n, hit):
    sim = make_sim()
    finish_prompt(sim, toks(0, n))
    b = sim.add(toks(0, n), max_tokens=2)
    out = sim.step()
    assert sim.hits_of(b) == [hit]
    assert out.scheduled == [(b, n - hit)] and n - hit >= 1
    assert b.num_output_tokens == 1  # the step sampled
    sim.run()
    assert b.num_output_tokens == 2


def test_prefix_caching_disabled_never_hits(make_sim):
    sim = make_sim(enable_prefix_caching=False)
    finish_prompt(sim, toks(0, 12))
    b = sim.add(toks(0, 12))
    out = sim.step()
    assert out.scheduled == [(b, 12)]
    assert sim.kv.get_computed_blocks(make_seq(99, toks(0, 12))) == []
    assert (sim.kv.stats.queries, sim.kv.stats.hits) == (0, 0)
    assert sim.kv.pool.num_cached_blocks == 0
    assert all(blk.block_hash is None for blk in sim.kv.pool.blocks)


def test_recomputed_prefix_is_cached_again_after_its_parent_was_evicted(make_sim):
    sim = make_sim(num_blocks=6)
    X, Y, W = toks(0, 4), toks(10, 4), toks(20, 4)
    # Admitted together: a caches X; s finds X already cached (its own copy stays
    # plain) and caches its Y under a's X.
    sim.add(X + W + [1])
    sim.add(X + Y + [1])
    sim.step()
    hog = make_seq(99, toks(500, 20))
    assert sim.kv.allocate_slots(hog, 5 * BS)  # evicts a's W and X, not s's Y
    sim.kv.free(hog)
    finish_prompt(sim, X + Y + [2])  # computes X and Y again
    q = finish_prompt(sim, X + Y + [3])
    assert sim.hits_of(q) == [8]


def test_reset_prefix_cache_only_when_no_block_is_in_use(make_sim):
    sim = make_sim()
    finish_prompt(sim, toks(0, 9))
    b = sim.add(toks(100, 9), max_tokens=3)
    sim.step()
    assert not sim.kv.pool.reset_prefix_cache()  # b holds blocks
    assert len(sim.kv.get_computed_blocks(make_seq(99, toks(0, 9)))) == 2
    sim.run()
    assert b.is_finished
    assert sim.kv.pool.reset_prefix_cache()
    assert sim.kv.pool.num_cached_blocks == 0
    assert sim.kv.get_computed_blocks(make_seq(98, toks(0, 9))) == []
    assert sim.kv.num_free_blocks == sim.kv.num_blocks


# ---- no leaks -------------------------------------------------------------------------------


def test_lifecycle_with_shared_prefixes_leaks_nothing(make_sim):
    sim = make_sim(num_blocks=10, max_num_batched_tokens=10, max_num_seqs=3)
    system = toks(0, 8)
    for i in range(8):
        sim.add(system + toks(100 * (i + 1), i + 1), max_tokens=1 + i % 4)
    sim.run()
    assert [s.num_output_tokens for s in sim.seqs] == [1 + i % 4 for i in range(8)]
    assert sim.kv.stats.hits > 0
    assert_no_leak(sim.kv)  # (the make_sim fixture checks this too)


def test_abort_mid_prefill_leaks_nothing(make_sim):
    sim = make_sim(max_num_batched_tokens=5)
    a = sim.add(toks(0, 20))
    sim.step()
    sim.step()  # 10 of 20 tokens computed
    sim.sched.finish(a, "abort")
    assert_no_leak(sim.kv)
    assert sim.kv.pool.num_cached_blocks == 2  # its computed full blocks stay cached


# ---- sliding windows: blocks behind the window go back to the pool --------------------------


@pytest.mark.parametrize("window,budget", [(8, 4), (5, 256), (1, 3)])
def test_window_bounds_the_blocks_a_sequence_holds(make_sim, window, budget):
    """Chunked prompts and long decodes of a fully windowed model: every step reads only
    blocks of its own prefix (Sim checks it) and a sequence never holds more than
    cdiv(window + budget, block size) + 1 blocks; its table keeps one slot per position."""
    sim = make_sim(num_blocks=40, max_num_batched_tokens=budget, window=window)
    seqs = [sim.add(toks(0, 30), max_tokens=60), sim.add(toks(100, 7), max_tokens=80)]
    bound = cdiv(window + budget, BS) + 1
    most = 0
    while sim.sched.num_unfinished:
        sim.step()
        for s in sim.sched.running:
            assert sim.kv.blocks_held(s) <= bound
            assert len(s.block_table) == cdiv(s.num_computed_tokens, BS)
            most = max(most, sim.kv.blocks_held(s))
    assert most > 1 and all(s.is_finished for s in seqs)
    # 90 and 87 tokens would hold 23 and 22 blocks without the window.
    assert sim.kv.num_blocks == 40 and not sim.sched.num_preemptions


def test_full_attention_keeps_every_block(make_sim):
    sim = make_sim(num_blocks=40)
    seq = sim.add(toks(0, 10), max_tokens=30)
    for _ in range(20):
        sim.step()
    assert sim.kv.blocks_held(seq) == len(seq.block_table) == cdiv(seq.num_computed_tokens, BS)


def test_given_back_blocks_still_serve_prefix_hits(make_sim):
    """A block behind the window stays cached (its KV is intact until the pool hands it
    out again, which evicts it): an identical prompt hits it and reads the right KV."""
    sim = make_sim(num_blocks=12, max_num_batched_tokens=4, window=4)
    a = sim.add(toks(0, 21), max_tokens=4)
    sim.run()
    assert sim.last_table[a.seq_id][:3] == [FREED] * 3  # given back, but still cached:
    assert sim.kv.pool.num_cached_blocks >= 5
    b = sim.add(toks(0, 21), max_tokens=4)
    sim.run()
    assert sim.hits_of(b) == [20]  # Sim checked every block it read holds its own prefix
    # Blocks handed out again leave the cache first: other prompts evict the old ones.
    for i in range(4):
        sim.add(toks(1000 * (i + 1), 40), max_tokens=2)
    sim.run()
    c = sim.add(toks(0, 21), max_tokens=2)
    sim.run()
    assert sim.hits_of(c) == [0]
