"""Scheduler: token budget, chunked prefill, preemption, max_num_seqs, finish and abort.

``Sim`` drives the real Scheduler and KVCacheManager the way ``LLMEngine.step`` does, with
a fake model that samples a deterministic token whenever a sequence's last token has been
computed. Every step it checks the scheduler's contract (budget, seq cap, decodes before
admissions, victims taken from the most recently admitted end) and that each sequence
reads only KV of its own prefix and writes only blocks it owns.
"""

from __future__ import annotations

import random

import pytest
from leader_sim import Sim, assert_no_leak, toks

from nvllm.leader.scheduler import SchedulerOutput
from nvllm.leader.sequence import Sequence, SequenceStatus

# ---- helpers ------------------------------------------------------------------------------


def scheduled(out: SchedulerOutput) -> list[tuple[int, int]]:
    return [(seq.seq_id, n) for seq, n in out.scheduled]


# ---- the token budget -----------------------------------------------------------------------


def test_decodes_come_first_then_a_prefill_chunk_gets_the_rest(make_sim):
    sim = make_sim(max_num_batched_tokens=8)
    a, b = sim.add(toks(0, 4), max_tokens=5), sim.add(toks(100, 4), max_tokens=5)
    assert scheduled(sim.step()) == [(a.seq_id, 4), (b.seq_id, 4)]
    c = sim.add(toks(200, 20))
    out = sim.step()
    assert scheduled(out) == [(a.seq_id, 1), (b.seq_id, 1), (c.seq_id, 6)]
    assert out.num_batched_tokens == 8


def test_decodes_can_use_up_the_whole_budget(make_sim):
    sim = make_sim(max_num_batched_tokens=3)
    seqs = [sim.add([i], max_tokens=4) for i in range(3)]
    sim.step()
    late = sim.add(toks(100, 5))
    out = sim.step()
    assert scheduled(out) == [(s.seq_id, 1) for s in seqs]
    assert list(sim.sched.waiting) == [late]


def test_waiting_prompts_are_admitted_in_arrival_order(make_sim):
    sim = make_sim(max_num_batched_tokens=10)
    a, b, c = sim.add(toks(0, 4)), sim.add(toks(100, 4)), sim.add(toks(200, 4))
    assert scheduled(sim.step()) == [(a.seq_id, 4), (b.seq_id, 4), (c.seq_id, 2)]


# ---- chunked prefill ------------------------------------------------------------------------


def test_long_prompt_is_computed_in_chunks_and_samples_after_the_last(make_sim):
    sim = make_sim(max_num_batched_tokens=8)
    a = sim.add(toks(0, 20), max_tokens=3)
    chunks, outputs = [], []
    while not a.is_finished:
        chunks.append(scheduled(sim.step()))
        outputs.append(a.num_output_tokens)
    assert chunks == [[(a.seq_id, n)] for n in (8, 8, 4, 1, 1)]
    assert outputs == [0, 0, 1, 2, 3]
    assert a.num_tokens == 23


def test_prefilling_seq_keeps_the_budget_before_new_arrivals(make_sim):
    sim = make_sim(max_num_batched_tokens=8)
    a = sim.add(toks(0, 20), max_tokens=2)
    sim.step()  # a: 8
    b = sim.add(toks(100, 6), max_tokens=2)
    assert scheduled(sim.step()) == [(a.seq_id, 8)]  # nothing left for b
    assert scheduled(sim.step()) == [(a.seq_id, 4), (b.seq_id, 4)]  # b: a first chunk
    assert b.num_output_tokens == 0
    assert scheduled(sim.step()) == [(a.seq_id, 1), (b.seq_id, 2)]
    assert a.is_finished and b.num_output_tokens == 1


def test_chunk_boundaries_do_not_change_the_result(make_sim):
    results = []
    for budget in (3, 7, 64):
        sim = make_sim(max_num_batched_tokens=budget)
        seqs = [sim.add(toks(100 * i, 9 + i), max_tokens=3) for i in range(3)]
        sim.run()
        results.append([s.token_ids for s in seqs])
    assert results[0] == results[1] == results[2]


# ---- preemption -----------------------------------------------------------------------------


def preemption_scenario(make_sim) -> tuple[Sim, list[Sequence], SchedulerOutput]:
    """7 blocks; a, b, c (8-token prompts) fill 6 of them; d arrives after the first step.

    In the second step a takes the last free block and b finds none: c, the most recently
    admitted, is preempted (its 2 cached blocks go to the free queue; b evicts one of them).
    """
    sim = make_sim(num_blocks=7, max_num_batched_tokens=64)
    a, b, c = (sim.add(toks(100 * i, 8), max_tokens=4) for i in range(3))
    sim.step()
    d = sim.add(toks(300, 4), max_tokens=4)
    out = sim.step()
    return sim, [a, b, c, d], out


def test_preemption_takes_the_most_recently_admitted(make_sim):
    sim, (a, b, c, d), out = preemption_scenario(make_sim)
    assert out.preempted == [c]
    assert scheduled(out) == [(a.seq_id, 1), (b.seq_id, 1)]
    assert sim.sched.running == [a, b]
    assert sim.sched.num_preemptions == 1 and c.num_preemptions == 1
    assert c.status is SequenceStatus.WAITING and c.block_table == []


def test_preempted_seq_waits_ahead_of_newer_arrivals(make_sim):
    sim, (a, b, c, d), out = preemption_scenario(make_sim)
    assert list(sim.sched.waiting) == [c, d]
    sim.run()
    admissions = [s for s, _ in sim.admitted]
    assert admissions.index(c, 3) < admissions.index(d)


def test_preempted_seq_resumes_from_its_cached_prefix(make_sim):
    sim, (a, b, c, d), out = preemption_scenario(make_sim)
    sim.run()
    assert sim.hits_of(c) == [0, 4]  # on resume, the block b did not evict is a hit
    # The stats count each prompt once (at first admission), not the recompute.
    assert sim.kv.stats.queries == 8 + 8 + 8 + 4
    assert sim.kv.stats.hits == 0


def test_every_seq_finishes_with_its_length_after_preemption(make_sim):
    sim, (a, b, c, d), out = preemption_scenario(make_sim)
    c_first = c.token_ids[8]  # sampled before the preemption: it is kept
    sim.run()
    assert [s.num_output_tokens for s in (a, b, c, d)] == [4, 4, 4, 4]
    assert all(s.finish_reason == "length" for s in (a, b, c, d))
    assert c.token_ids[:9] == toks(200, 8) + [c_first]
    assert c.output_token_ids == [50_000 + 100 * c.seq_id + i for i in range(4)]
    assert sim.sched.num_preemptions == 1


def test_seq_that_needs_a_block_may_preempt_itself(make_sim):
    sim = make_sim(num_blocks=4)
    a = sim.add(toks(0, 7), max_tokens=3)  # room for 1 more token in its 2nd block
    b = sim.add(toks(100, 8), max_tokens=3)  # its 2 blocks are full
    sim.step()
    out = sim.step()
    assert out.preempted == [b]
    assert scheduled(out) == [(a.seq_id, 1)]
    sim.run()
    assert a.num_output_tokens == b.num_output_tokens == 3


def test_preemption_under_pressure_finishes_everything(make_sim):
    sim = make_sim(num_blocks=8, max_num_batched_tokens=16)
    seqs = [sim.add(toks(0, 8) + toks(100 * (i + 1), 2 + i), max_tokens=6) for i in range(5)]
    sim.run()
    assert sim.sched.num_preemptions > 0
    assert sim.sched.num_preemptions == sum(s.num_preemptions for s in seqs)
    assert [s.num_output_tokens for s in seqs] == [6] * 5
    assert [s.num_tokens for s in seqs] == [8 + 2 + i + 6 for i in range(5)]


# ---- max_num_seqs ---------------------------------------------------------------------------


def test_max_num_seqs_caps_the_running_seqs(make_sim):
    sim = make_sim(max_num_seqs=2)
    seqs = [sim.add(toks(100 * i, 5), max_tokens=2 + i) for i in range(5)]
    out = sim.step()
    assert scheduled(out) == [(seqs[0].seq_id, 5), (seqs[1].seq_id, 5)]
    assert list(sim.sched.waiting) == seqs[2:]
    peak = 0
    while sim.sched.num_unfinished:
        assert len(sim.step().scheduled) <= 2
        peak = max(peak, len(sim.sched.running))
    assert peak == 2
    assert [s.num_output_tokens for s in seqs] == [2, 3, 4, 5, 6]


# ---- finish and abort -----------------------------------------------------------------------


def test_abort_waiting_seq(make_sim):
    sim = make_sim(max_num_seqs=1)
    a, b = sim.add(toks(0, 6), max_tokens=3), sim.add(toks(100, 6), max_tokens=3)
    sim.step()
    free = sim.kv.num_free_blocks
    sim.sched.finish(b, "abort")
    assert b.is_finished and b.finish_reason == "abort"
    assert b not in sim.sched.waiting and sim.sched.num_unfinished == 1
    assert sim.kv.num_free_blocks == free
    sim.run()
    assert b.num_output_tokens == 0 and a.num_output_tokens == 3


def test_abort_running_seq_frees_its_blocks(make_sim):
    sim = make_sim(num_blocks=16)
    a = sim.add(toks(0, 10), max_tokens=5)
    sim.step()
    assert len(a.block_table) == 3 and sim.kv.num_free_blocks == 13
    sim.sched.finish(a, "abort")
    assert a.is_finished and a.finish_reason == "abort" and sim.sched.running == []
    assert a.block_table == []
    assert_no_leak(sim.kv)
    assert sim.kv.pool.num_cached_blocks == 2  # what it computed stays reusable


def test_abort_seq_sharing_a_prefix_keeps_the_others_blocks(make_sim):
    sim = make_sim()
    a = sim.add(toks(0, 9), max_tokens=5)
    sim.step()
    b = sim.add(toks(0, 9), max_tokens=5)
    sim.step()
    shared = b.block_table[:2]
    assert a.block_table[:2] == shared
    sim.sched.finish(a, "abort")
    assert [sim.kv.pool.blocks[i].ref_cnt for i in shared] == [1, 1]
    sim.run()
    assert b.num_output_tokens == 5


def test_abort_preempted_seq(make_sim):
    sim, (a, b, c, d), out = preemption_scenario(make_sim)
    sim.sched.finish(c, "abort")
    assert list(sim.sched.waiting) == [d]
    sim.run()
    assert c.num_output_tokens == 1 and [s.num_output_tokens for s in (a, b, d)] == [4, 4, 4]


def test_finished_seqs_give_every_block_back(make_sim):
    sim = make_sim(num_blocks=12, max_num_batched_tokens=12, max_num_seqs=3)
    for i in range(6):
        sim.add(toks(0, 4 * (i % 3)) + toks(1000 * (i + 1), 3 + i), max_tokens=1 + i)
    sim.run()
    assert all(s.is_finished and s.finish_reason == "length" for s in sim.seqs)
    assert_no_leak(sim.kv)


@pytest.mark.parametrize("prompt_len", [1, 9, 15])
def test_sequence_ends_with_length_when_it_fills_max_model_len(make_sim, prompt_len):
    """The scheduler's own cap (the input processor rejects prompt + max_tokens past
    max_model_len, so only a Sequence made here can ask for more): a sequence ends with
    'length' holding exactly max_model_len tokens, its last one sampled, never computed."""
    sim = make_sim(max_model_len=16)
    seq = sim.add(toks(0, prompt_len), max_tokens=100)
    sim.run()
    assert seq.finish_reason == "length"
    assert seq.num_tokens == 16 and seq.num_output_tokens == 16 - prompt_len
    assert sum(n for out in sim.outs for s, n in out.scheduled if s is seq) == 15


# ---- random lifecycles ----------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(12))
def test_random_lifecycles(make_sim, seed):
    rng = random.Random(seed)
    prefix_caching = seed % 4 != 3
    sim = make_sim(num_blocks=rng.randint(8, 16), max_num_seqs=rng.randint(1, 6),
                   max_num_batched_tokens=rng.randint(4, 40),
                   enable_prefix_caching=prefix_caching)
    systems = [toks(10_000 * (k + 1), rng.randint(0, 12)) for k in range(3)]
    expected = {}
    for step in range(200):
        if step < 60 and rng.random() < 0.4:
            prompt = rng.choice(systems) + [rng.randrange(1000) for _ in range(rng.randint(1, 8))]
            seq = sim.add(prompt, max_tokens=rng.randint(1, 10))
            expected[seq.seq_id] = len(prompt) + seq.params.max_tokens
        if sim.sched.num_unfinished:
            assert not sim.step().is_empty
        if rng.random() < 0.03 and sim.sched.running:
            sim.sched.finish(rng.choice(sim.sched.running), "abort")
    sim.run()
    for seq in sim.seqs:
        if seq.finish_reason == "length":
            assert seq.num_tokens == expected[seq.seq_id]
            assert seq.output_token_ids == [
                50_000 + 100 * seq.seq_id + i for i in range(seq.params.max_tokens)]
    assert_no_leak(sim.kv)
    if not prefix_caching:
        assert sim.kv.stats.queries == 0 and sim.kv.pool.num_cached_blocks == 0
