"""Request priorities in the scheduler, and the engine's request lifecycle without workers.

Part 1 drives the real Scheduler + KVCacheManager through ``Sim`` (tests/support/leader_sim),
with a local subclass whose per-step contract check knows about priorities: a victim is
the lowest-priority running sequence (largest number), ties going to the most recently
admitted.

Part 2 runs ``LLMEngine`` against an in-process stand-in for ``WorkerGroupClient`` that
keeps per-sequence state from the plans the way ``ModelRunner._apply_plan`` does and
samples a scripted token for every sequence whose last token was computed: time-to-live
expiry, abort, the waiting-queue limit, stop strings, metrics and n > 1.
"""

from __future__ import annotations

import random
import time

import pytest
from fake_workers import (
    NUM_BLOCKS,
    deltas_of,
    finished_of,
    in_plan,
    metric,
    prompt_ids,
    run,
    scripted,
    submit,
)
from leader_sim import Sim, assert_no_leak, make_seq, toks

from nvllm.common.errors import Overloaded, RequestRejected
from nvllm.common.sampling_params import SamplingParams
from nvllm.leader import engine as engine_module
from nvllm.leader.scheduler import SchedulerOutput
from nvllm.leader.sequence import Sequence, SequenceStatus

# =============================================================================================
# Part 1: the scheduler
# =============================================================================================


class PrioSim(Sim):
    """Sim with sequences of any priority; the victim check follows the priority rule."""

    def add(self, prompt: list[int], max_tokens: int = 1, priority: int = 0) -> Sequence:
        seq = make_seq(next(self._ids), prompt, max_tokens)
        seq.priority = priority  # before Scheduler.add: the waiting queue is sorted there
        self.seqs.append(seq)
        self.sched.add(seq)
        return seq

    def _check_contract(self, out: SchedulerOutput, running_before: list[Sequence],
                        waiting_before: set[int]) -> None:
        # Sim's check that victims come off the most recently admitted end only holds
        # when all priorities are equal; here every victim must outrank (by priority,
        # then admission) every sequence still running, and victims go in that order.
        pos = {s.seq_id: i for i, s in enumerate(running_before)}

        def key(s: Sequence) -> tuple[int, int]:
            return s.priority, pos[s.seq_id]

        assert all(s.seq_id in pos for s in out.preempted)
        assert [key(v) for v in out.preempted] == sorted(
            (key(v) for v in out.preempted), reverse=True)
        still = [s for s in running_before if s not in out.preempted]
        for v in out.preempted:
            assert all(key(s) < key(v) for s in still), "victim is not the lowest priority"
        # Everything else as in Sim, with the victims moved to the end of running_before
        # (so the inherited check sees them come off the end, in the order taken).
        super()._check_contract(out, still + out.preempted[::-1], waiting_before)


@pytest.fixture
def make_psim(make_sim):
    return lambda *args, **kwargs: make_sim(*args, sim_class=PrioSim, **kwargs)


def scheduled(out: SchedulerOutput) -> list[tuple[int, int]]:
    return [(seq.seq_id, n) for seq, n in out.scheduled]


def ids(seqs) -> list[int]:
    return [s.seq_id for s in seqs]


def finish_all(sim: Sim) -> None:
    sim.run()
    assert all(s.finish_reason == "length" for s in sim.seqs)
    assert all(s.num_output_tokens == s.params.max_tokens for s in sim.seqs)
    sim.check_ref_counts()
    assert_no_leak(sim.kv)


# ---- admission order ------------------------------------------------------------------------


def test_lower_number_is_admitted_first_regardless_of_arrival(make_psim):
    sim = make_psim(max_num_batched_tokens=8)
    a = sim.add(toks(0, 4), priority=5)
    b = sim.add(toks(100, 4), priority=0)
    c = sim.add(toks(200, 4), priority=2)
    assert ids(sim.sched.waiting) == ids([b, c, a])
    out = sim.step()
    assert scheduled(out) == [(b.seq_id, 4), (c.seq_id, 4)]
    assert ids(sim.sched.waiting) == [a.seq_id]
    finish_all(sim)
    assert [s.seq_id for s, _ in sim.admitted] == ids([b, c, a])


def test_equal_priorities_are_first_come_first_served(make_psim):
    sim = make_psim(max_num_batched_tokens=10)
    a = sim.add(toks(0, 4), priority=1)
    b = sim.add(toks(100, 4), priority=0)
    c = sim.add(toks(200, 4), priority=1)
    d = sim.add(toks(300, 4), priority=0)
    e = sim.add(toks(400, 4), priority=-3)
    assert ids(sim.sched.waiting) == ids([e, b, d, a, c])
    out = sim.step()  # the budget cuts the third admission into a chunk
    assert scheduled(out) == [(e.seq_id, 4), (b.seq_id, 4), (d.seq_id, 2)]
    finish_all(sim)
    assert [s.seq_id for s, _ in sim.admitted] == ids([e, b, d, a, c])


def test_high_priority_arrival_does_not_jump_a_running_prefill(make_psim):
    """Priorities order the waiting queue; a seq already running keeps its chunks."""
    sim = make_psim(max_num_batched_tokens=4)
    a = sim.add(toks(0, 10), priority=9)
    assert scheduled(sim.step()) == [(a.seq_id, 4)]
    b = sim.add(toks(100, 2), priority=0)
    assert scheduled(sim.step()) == [(a.seq_id, 4)]
    assert scheduled(sim.step()) == [(a.seq_id, 2), (b.seq_id, 2)]
    finish_all(sim)


# ---- preemption -----------------------------------------------------------------------------


def test_preempted_seq_reenters_by_priority_then_arrival(make_psim):
    """4 blocks: a and b (priority 1) fill them; later arrivals c (1), d (0), e (2) wait.

    When a needs a third block, b (same priority, admitted later) is the victim; it
    waits behind d (higher priority) but ahead of c (same priority, arrived later)."""
    sim = make_psim(4)
    a = sim.add(toks(0, 4), 6, priority=1)
    b = sim.add(toks(100, 4), 6, priority=1)
    sim.step()
    c = sim.add(toks(200, 4), 2, priority=1)
    d = sim.add(toks(300, 4), 2, priority=0)
    e = sim.add(toks(400, 4), 2, priority=2)
    for _ in range(4):  # decodes; the two tables fill all 4 blocks, nobody is admitted
        out = sim.step()
        assert scheduled(out) == [(a.seq_id, 1), (b.seq_id, 1)] and not out.preempted
    assert ids(sim.sched.waiting) == ids([d, c, e])
    out = sim.step()
    assert out.preempted == [b] and scheduled(out) == [(a.seq_id, 1)]
    assert ids(sim.sched.waiting) == ids([d, b, c, e])
    finish_all(sim)
    assert [s.seq_id for s, _ in sim.admitted] == ids([a, b, d, b, c, e])


def test_victim_is_lowest_priority_even_if_admitted_first_and_already_scheduled(make_psim):
    """a (priority 9) is admitted alone, then b (0). With every block taken, a's decode is
    scheduled first in the step (it needs no block); b's decode needs one: a is the victim,
    taken back out of the step, and the step stays within its budget."""
    sim = make_psim(3, max_num_batched_tokens=8)
    a = sim.add(toks(0, 6), 3, priority=9)
    assert scheduled(sim.step()) == [(a.seq_id, 6)]  # 2 blocks
    b = sim.add(toks(100, 4), 4, priority=0)
    assert scheduled(sim.step()) == [(a.seq_id, 1), (b.seq_id, 4)]  # 3 blocks: all taken
    assert sim.kv.num_free_blocks == 0 and ids(sim.sched.running) == ids([a, b])
    out = sim.step()
    assert out.preempted == [a]
    assert scheduled(out) == [(b.seq_id, 1)]
    assert a not in [s for s, _ in out.scheduled]
    assert out.num_batched_tokens <= sim.sched.max_num_batched_tokens
    assert a.status is SequenceStatus.WAITING and a.block_table == [] and a.num_preemptions == 1
    assert b.num_preemptions == 0
    finish_all(sim)
    assert a.token_ids[6:8] == [50_000 + 100 * a.seq_id, 50_000 + 100 * a.seq_id + 1]


def test_victims_budget_is_refunded_to_later_seqs(make_psim):
    """Budget 6: a (priority 9) is scheduled for 1 token, then b's decode preempts it;
    the refunded token goes to c's prefill chunk, so the step uses the whole budget."""
    sim = make_psim(4, max_num_batched_tokens=6)
    a = sim.add(toks(0, 6), 5, priority=9)
    sim.step()
    b = sim.add(toks(100, 4), 4, priority=0)
    c = sim.add(toks(200, 9), 2, priority=0)
    assert scheduled(sim.step()) == [(a.seq_id, 1), (b.seq_id, 4), (c.seq_id, 1)]
    assert sim.kv.num_free_blocks == 0
    out = sim.step()
    assert out.preempted == [a]
    assert scheduled(out) == [(b.seq_id, 1), (c.seq_id, 5)]  # 4 without the refund
    assert out.num_batched_tokens == sim.sched.max_num_batched_tokens
    finish_all(sim)


def test_ties_in_priority_take_the_most_recently_admitted(make_psim):
    """Running [a (5), b (5), c (0)] in admission order: the victim is b, not c (the most
    recently admitted overall) nor a."""
    sim = make_psim(6)
    a = sim.add(toks(0, 4), 8, priority=5)
    b = sim.add(toks(100, 4), 8, priority=5)
    sim.step()
    c = sim.add(toks(200, 4), 8, priority=0)
    for _ in range(4):
        assert not sim.step().preempted
    assert ids(sim.sched.running) == ids([a, b, c]) and sim.kv.num_free_blocks == 0
    out = sim.step()
    assert out.preempted == [b]
    assert scheduled(out) == [(a.seq_id, 1), (c.seq_id, 1)]
    finish_all(sim)
    assert (a.num_preemptions, b.num_preemptions, c.num_preemptions) == (0, 1, 0)


def test_lowest_priority_seq_needing_a_block_preempts_itself(make_psim):
    sim = make_psim(4)
    a = sim.add(toks(0, 4), 6, priority=0)
    b = sim.add(toks(100, 4), 6, priority=3)
    c = sim.add(toks(200, 4), 6, priority=1)
    sim.step()
    assert ids(sim.sched.running) == ids([a, c, b])
    sim.step()  # a and c take a second block each; b cannot and preempts itself
    assert b.num_preemptions == 1 and ids(sim.sched.running) == ids([a, c])
    finish_all(sim)


@pytest.mark.parametrize("seed", range(4))
def test_random_priorities_under_kv_pressure_finish_without_leaks(make_psim, seed):
    rng = random.Random(seed)
    sim = make_psim(12, max_num_seqs=rng.choice([3, 6]),
                    max_num_batched_tokens=rng.choice([8, 16, 64]),
                    enable_prefix_caching=rng.random() < 0.5)
    shared = toks(10_000, 8)
    for step in range(60):
        if step < 30 and rng.random() < 0.6:
            prompt = (shared[:rng.randint(0, 8)] if rng.random() < 0.5 else []) + \
                toks(1000 * (step + 1), rng.randint(1, 10))
            sim.add(prompt, rng.randint(1, 12), priority=rng.randint(-1, 2))
        if sim.sched.num_unfinished:
            sim.step()
    sim.run()
    assert sim.sched.num_preemptions > 0
    assert sim.sched.num_preemptions == sum(s.num_preemptions for s in sim.seqs)
    assert all(s.num_output_tokens == s.params.max_tokens for s in sim.seqs)
    assert sim.kv.num_free_blocks == sim.kv.num_blocks


# =============================================================================================
# Part 2: the engine, with a fake worker group
# =============================================================================================

# ---- time to live ---------------------------------------------------------------------------

TTL_MS = 60_000  # far beyond any step's real duration: only `clock` makes a TTL run out


@pytest.fixture
def clock(monkeypatch):
    """advance(seconds): move the monotonic clock the engine reads (time.monotonic, seen
    as nvllm.leader.engine.time.monotonic) forward, so a TTL runs out exactly when the test
    says and never because the machine was slow. Readings stay real time plus an offset
    that only grows, so the clock never goes backwards."""
    real, offset = time.monotonic, [0.0]
    monkeypatch.setattr(engine_module.time, "monotonic", lambda: real() + offset[0])

    def advance(seconds: float) -> None:
        offset[0] += seconds

    return advance


def test_ttl_expires_while_waiting(make_engine, clock):
    engine, workers = make_engine(max_num_seqs=1)
    submit(engine, prompt_token_ids=prompt_ids(0, 5), params=SamplingParams(max_tokens=30),
                       request_id="long")
    short = submit(engine, prompt_token_ids=prompt_ids(10, 5),
                               params=SamplingParams(max_tokens=5), request_id="ttl",
                               ttl_ms=TTL_MS)
    engine.step()
    assert short.seqs[0].status is SequenceStatus.WAITING  # max_num_seqs=1 keeps it out
    clock(TTL_MS / 1000 - 5)
    out = engine.step()
    assert not [d for d in out.deltas if d.request_id == "ttl"], "expired before its TTL"
    assert "ttl" in engine.requests
    clock(10)
    out = engine.step()
    (delta,) = [d for d in out.deltas if d.request_id == "ttl"]
    assert delta.finish_reason == "timeout" and delta.token_ids == [] and delta.text == ""
    assert delta.usage["completion_tokens"] == 0
    assert finished_of([out], "ttl").finish_reason == "timeout"
    assert "ttl" not in engine.requests and short.seqs[0].is_finished
    assert short.seqs[0] not in engine.scheduler.waiting
    assert not any(in_plan(p, short.seqs[0].seq_id) for p in workers.plans)
    assert metric(engine, "nvllm:request_success_total", finished_reason="timeout") == 1
    run(engine)
    assert engine.kv.num_free_blocks == NUM_BLOCKS


# Sync only: it counts the steps (tokens and blocks held after two of them) and checks
# that the very plan of the expiring step drops the sequence.
@pytest.mark.parametrize("scheduling", ["sync"])
def test_ttl_expires_while_running_and_frees_blocks(make_engine, clock):
    engine, workers = make_engine()
    req = submit(engine, prompt_token_ids=prompt_ids(0, 9),
                             params=SamplingParams(max_tokens=50), request_id="ttl",
                             ttl_ms=TTL_MS)
    submit(engine, prompt_token_ids=prompt_ids(20, 5), params=SamplingParams(max_tokens=50),
                       request_id="other")
    engine.step()
    engine.step()
    seq = req.seqs[0]
    assert seq.status is SequenceStatus.RUNNING and len(seq.block_table) == 3
    assert seq.seq_id in workers.seqs
    free_before = engine.kv.num_free_blocks
    clock(TTL_MS / 1000 + 1)
    out = engine.step()
    (delta,) = [d for d in out.deltas if d.request_id == "ttl"]
    assert delta.finish_reason == "timeout"
    assert delta.usage == {"prompt_tokens": 9, "completion_tokens": 2, "cached_tokens": 0}
    res = finished_of([out], "ttl")
    assert res.finish_reason == "timeout" and res.outputs[0].token_ids == seq.output_token_ids
    assert seq.block_table == [] and engine.kv.num_free_blocks == free_before + 3
    # The same step's plan tells the workers to drop it, and no longer schedules it.
    plan = workers.plans[-1]
    assert seq.seq_id in plan.finished_ids and not in_plan(plan, seq.seq_id)
    assert seq.seq_id not in workers.seqs
    assert metric(engine, "nvllm:request_success_total", finished_reason="timeout") == 1


def test_ttl_is_validated(make_engine):
    engine, _ = make_engine()
    for bad in (0, -5, "1", True):
        with pytest.raises(RequestRejected):
            submit(engine, prompt_token_ids=[5], ttl_ms=bad)
    assert not engine.requests


# ---- abort ----------------------------------------------------------------------------------


# Sync only: it counts the tokens streamed and the blocks held after three steps.
@pytest.mark.parametrize("scheduling", ["sync"])
def test_abort_mid_generation(make_engine):
    engine, workers = make_engine()
    a = submit(engine, prompt_token_ids=prompt_ids(0, 6),
                           params=SamplingParams(max_tokens=20), request_id="a")
    submit(engine, prompt_token_ids=prompt_ids(20, 6), params=SamplingParams(max_tokens=20),
                       request_id="b")
    outs = [engine.step() for _ in range(3)]
    seq = a.seqs[0]
    streamed = "".join(d.text for d in deltas_of(outs, "a"))
    assert streamed == " the the the"
    free_before = engine.kv.num_free_blocks
    held = len(seq.block_table)
    assert held == 2

    out = engine.abort_request("a")
    (delta,) = out.deltas
    assert (delta.request_id, delta.finish_reason, delta.token_ids) == ("a", "abort", [])
    assert delta.usage["completion_tokens"] == 3
    (res,) = out.finished
    assert res.finish_reason == "abort" and res.outputs[0].token_ids == seq.output_token_ids
    assert res.text == " the the the"
    assert seq.block_table == [] and engine.kv.num_free_blocks == free_before + held
    assert "a" not in engine.requests
    assert engine.abort_request("a").deltas == []  # unknown ids are ignored

    engine.step()
    plan = workers.plans[-1]
    assert plan.finished_ids == [seq.seq_id] and not in_plan(plan, seq.seq_id)
    assert seq.seq_id not in workers.seqs
    assert metric(engine, "nvllm:request_success_total", finished_reason="abort") == 1
    run(engine)
    assert engine.kv.num_free_blocks == NUM_BLOCKS


def test_abort_releases_text_held_back_for_stop_strings(make_engine, tokenizer):
    engine, _ = make_engine()
    req = submit(engine, prompt_token_ids=prompt_ids(0, 4),
                             params=SamplingParams(max_tokens=20, stop=["never seen here"]),
                             request_id="a")
    outs = []
    while len(deltas_of(outs, "a")) < 4:  # four tokens streamed (async: one more in flight)
        outs.append(engine.step())
    streamed = "".join(d.text for d in deltas_of(outs, "a"))
    out = engine.abort_request("a")
    assert streamed + out.deltas[0].text == " the the the the" == out.finished[0].text
    assert req.seqs[0].is_finished


# ---- the waiting-queue limit ----------------------------------------------------------------


def test_max_queued_requests_overloads(make_engine):
    engine, _ = make_engine(max_queued_requests=1)
    submit(engine, prompt_token_ids=prompt_ids(0, 4), params=SamplingParams(max_tokens=3),
                       request_id="a")
    with pytest.raises(Overloaded) as e:
        submit(engine, prompt_token_ids=prompt_ids(10, 4), request_id="b")
    assert isinstance(e.value, RequestRejected) and "max_queued_requests=1" in str(e.value)
    assert "b" not in engine.requests
    engine.step()  # a runs: the queue is empty again
    submit(engine, prompt_token_ids=prompt_ids(10, 4), params=SamplingParams(max_tokens=3),
                       request_id="b")
    outs = run(engine)
    assert finished_of(outs, "a").finish_reason == "length"
    assert finished_of(outs, "b").finish_reason == "length"


def test_max_queued_requests_counts_requests_not_completions(make_engine):
    engine, _ = make_engine(max_queued_requests=2)
    submit(engine, prompt_token_ids=prompt_ids(0, 4),
                       params=SamplingParams(n=3, max_tokens=3), request_id="a")
    assert len(engine.scheduler.waiting) == 3  # three completions, one request
    submit(engine, prompt_token_ids=prompt_ids(10, 4), params=SamplingParams(max_tokens=3),
                       request_id="b")
    with pytest.raises(Overloaded, match="2 requests are already waiting"):
        submit(engine, prompt_token_ids=prompt_ids(20, 4), request_id="c")
    run(engine)


# ---- stop strings and EOS -------------------------------------------------------------------


def test_stop_string_ends_the_completion_and_cuts_the_text(make_engine, tokenizer):
    choose, script = scripted(tokenizer, "Hello world, and more text here")
    engine, _ = make_engine(choose)
    submit(engine, prompt_token_ids=prompt_ids(0, 4),
                       params=SamplingParams(max_tokens=30, stop=[", and"]), request_id="s")
    outs = run(engine)
    res = finished_of(outs, "s")
    assert res.finish_reason == "stop" and res.text == "Hello world"
    streamed = "".join(d.text for d in deltas_of(outs, "s"))
    assert streamed == "Hello world"
    # The tokens end with the one that completed the stop string.
    assert res.token_ids == script[:len(res.token_ids)]
    assert tokenizer.decode(res.token_ids).startswith("Hello world, and")
    assert not tokenizer.decode(res.token_ids[:-1]).startswith("Hello world, and")


def test_stop_string_included_when_asked(make_engine, tokenizer):
    choose, _ = scripted(tokenizer, "Hello world, and more text here")
    engine, _ = make_engine(choose)
    submit(engine, prompt_token_ids=prompt_ids(0, 4),
                       params=SamplingParams(max_tokens=30, stop=[", and"],
                                             include_stop_str_in_output=True),
                       request_id="s")
    res = finished_of(run(engine), "s")
    assert res.finish_reason == "stop" and res.text == "Hello world, and"


def test_stop_string_in_the_prompt_does_not_stop(make_engine, tokenizer):
    choose, _ = scripted(tokenizer, " and more")
    engine, _ = make_engine(choose)
    prompt = tokenizer("stop here STOP", add_special_tokens=False).input_ids
    submit(engine, prompt_token_ids=prompt,
                       params=SamplingParams(max_tokens=len(tokenizer(" and more").input_ids),
                                             stop=["STOP"]),
                       request_id="s")
    outs = run(engine)
    res = finished_of(outs, "s")
    assert res.finish_reason == "length" and res.text == " and more"


def test_eos_token_stops_without_showing_in_the_text(make_engine, tokenizer):
    choose, script = scripted(tokenizer, "Hello world<|endoftext|>")
    assert script[-1] == 0
    engine, _ = make_engine(choose)
    submit(engine, prompt_token_ids=prompt_ids(0, 4), params=SamplingParams(max_tokens=30),
                       request_id="e")
    outs = run(engine)
    res = finished_of(outs, "e")
    assert res.finish_reason == "stop" and res.text == "Hello world"
    assert res.token_ids == script


# ---- metrics --------------------------------------------------------------------------------


def test_metrics_count_a_known_workload(make_engine, tokenizer):
    choose, _ = scripted(tokenizer, "a b<|endoftext|>")  # EOS as the 3rd token
    engine, workers = make_engine(choose)
    p = SamplingParams
    submit(engine, prompt_token_ids=prompt_ids(0, 5), params=p(max_tokens=2), request_id="x")
    submit(engine, prompt_token_ids=prompt_ids(10, 7), params=p(max_tokens=10),
                       request_id="eos")
    submit(engine, prompt_token_ids=prompt_ids(20, 9), params=p(max_tokens=10),
                       request_id="ab")
    outs = []
    while not deltas_of(outs, "ab"):  # all three prefill and sample one token each
        outs.append(engine.step())
    assert all(len(deltas_of(outs, r)) == 1 for r in ("x", "eos", "ab"))
    engine.abort_request("ab")  # (async: its next token, in flight, is never counted)
    run(engine)
    assert metric(engine, "nvllm:prompt_tokens_total") == 5 + 7 + 9
    assert metric(engine, "nvllm:generation_tokens_total") == 2 + 3 + 1
    for reason, n in (("length", 1), ("stop", 1), ("abort", 1), ("timeout", 0), ("error", 0)):
        assert metric(engine, "nvllm:request_success_total", finished_reason=reason) == n
    assert metric(engine, "nvllm:num_preemptions_total") == 0
    assert metric(engine, "nvllm:prefix_cache_queries_total") == 5 + 7 + 9
    assert metric(engine, "nvllm:num_requests_running") == 0
    assert metric(engine, "nvllm:num_requests_waiting") == 0
    assert metric(engine, "nvllm:time_to_first_token_seconds_count") == 3
    assert metric(engine, "nvllm:e2e_request_latency_seconds_count") == 3


def test_metrics_count_preemptions_and_recomputed_prompts(make_engine):
    """4 blocks of 4 tokens, prefix caching off: a and b (4-token prompts, 6 new tokens)
    each take a second block at their first decode; when a needs a third one, b is
    preempted, and after a finishes b recomputes its 4 prompt tokens (and 5 outputs)."""
    engine, workers = make_engine(num_kv_blocks=4, enable_prefix_caching=False)
    assert workers.num_kv_blocks == 4 and engine.capacity_tokens == 16
    for rid, start in (("a", 0), ("b", 10)):
        submit(engine, prompt_token_ids=prompt_ids(start, 4),
                           params=SamplingParams(max_tokens=6), request_id=rid)
    outs = run(engine)
    assert engine.scheduler.num_preemptions == 1
    assert metric(engine, "nvllm:num_preemptions_total") == 1
    assert metric(engine, "nvllm:prompt_tokens_total") == 4 + 4 + 4
    assert metric(engine, "nvllm:generation_tokens_total") == 12
    assert metric(engine, "nvllm:request_success_total", finished_reason="length") == 2
    b_seq = 1
    drops = [p.finished_ids for p in workers.plans if b_seq in p.finished_ids]
    assert drops, "the preempted seq was never dropped on the workers"
    assert finished_of(outs, "b").outputs[0].token_ids == [
        d.token_ids[0] for d in deltas_of(outs, "b")]


# ---- n > 1 ----------------------------------------------------------------------------------


def test_n2_gives_two_completions(make_engine, tokenizer):
    words = [tokenizer(w, add_special_tokens=False).input_ids[0] for w in (" the", " fox")]
    engine, workers = make_engine(lambda sid, fs: words[sid % 2])
    req = submit(engine, prompt_token_ids=prompt_ids(0, 6),
                             params=SamplingParams(n=2, max_tokens=3), request_id="n2")
    assert [s.index for s in req.seqs] == [0, 1]
    outs = run(engine)
    res = finished_of(outs, "n2")
    assert [c.index for c in res.outputs] == [0, 1]
    for c, seq in zip(res.outputs, req.seqs):
        assert c.finish_reason == "length" and len(c.token_ids) == 3
        assert c.text == tokenizer.decode(c.token_ids) == tokenizer.decode(
            [words[seq.seq_id % 2]] * 3)
        deltas = deltas_of(outs, "n2", c.index)
        assert "".join(d.text for d in deltas) == c.text
        assert deltas[-1].finish_reason == "length" and deltas[-1].usage["completion_tokens"] == 3
    assert res.outputs[0].text != res.outputs[1].text
    assert len(workers.plans[0].new_seqs) == 2  # both completions prefill in the first step
    assert metric(engine, "nvllm:request_success_total", finished_reason="length") == 1
    assert metric(engine, "nvllm:generation_tokens_total") == 6
