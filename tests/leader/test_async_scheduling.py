"""Async scheduling: the leader sends plan N+1 before it applies plan N's result.

The same workload runs through the synchronous and the async engine (against the fake
worker group, which samples a scripted, position-dependent token, end-of-sequence
included); everything a user sees must be identical: tokens, text, finish reasons,
usage, what was streamed, and the metrics. Only the plans differ.
"""

from __future__ import annotations

import pytest
import xxhash
from fake_workers import (
    NUM_BLOCKS,
    deltas_of,
    finished_of,
    in_plan,
    metric,
    prompt_ids,
    run,
    submit,
)

from nvllm.common.sampling_params import SamplingParams

# Every test here builds its engines with an explicit async_scheduling (most compare
# both modes side by side), so make_engine's own sync/async parametrization is off.
pytestmark = pytest.mark.parametrize("scheduling", ["explicit"])


def hashed_choice(eos: int, vocab_lo: int = 200, vocab_span: int = 400, eos_every: int = 9):
    """A model whose next token depends on the whole sequence so far (like a real one);
    about one position in `eos_every` yields end-of-sequence."""

    def choose(sid, fs) -> int:
        h = xxhash.xxh64_intdigest(str(fs.token_ids).encode())
        return eos if h % eos_every == 0 else vocab_lo + h % vocab_span

    return choose


def workload(engine) -> None:
    shared = prompt_ids(0, 13)  # several prompts share a prefix: prefix-cache hits
    specs = [
        (shared + prompt_ids(50, 3), SamplingParams(max_tokens=17)),
        (shared + prompt_ids(60, 6), SamplingParams(max_tokens=9, ignore_eos=True)),
        (prompt_ids(80, 29), SamplingParams(max_tokens=12, min_tokens=4)),
        (shared, SamplingParams(max_tokens=20, n=2, seed=3)),
        (prompt_ids(120, 5), SamplingParams(max_tokens=1)),
        (prompt_ids(130, 7), SamplingParams(max_tokens=25, ignore_eos=True, stop=["never"])),
        (shared + prompt_ids(140, 2), SamplingParams(max_tokens=6)),
    ]
    for i, (ids, params) in enumerate(specs):
        submit(engine, prompt_token_ids=ids, params=params, request_id=f"r{i}",
                           priority=i % 2)


def observe(engine, workers, interrupt_at: set[int] = frozenset()) -> dict:
    outs = run(engine, interrupt_at=interrupt_at)
    seen = {}
    for rid in sorted({r.request_id for o in outs for r in o.finished}):
        res = finished_of(outs, rid)
        for comp in res.outputs:
            deltas = deltas_of(outs, rid, comp.index)
            assert [d.finish_reason for d in deltas[:-1]] == [None] * (len(deltas) - 1)
            assert sum((d.token_ids for d in deltas), []) == comp.token_ids
            assert "".join(d.text for d in deltas) == comp.text
            seen[rid, comp.index] = (comp.token_ids, comp.text, comp.finish_reason,
                                     deltas[-1].usage)
    assert engine.kv.num_free_blocks == engine.kv.num_blocks, "leaked KV blocks"
    assert not engine.requests and not engine._inflight
    seen["metrics"] = (metric(engine, "nvllm:generation_tokens_total"),
                       metric(engine, "nvllm:prompt_tokens_total"))
    return seen


STRESS = dict(max_num_batched_tokens=16, num_kv_blocks=14)  # chunked prefill, preemption


def both(make_engine, tokenizer, **kw):
    eos = tokenizer.eos_token_id
    results, engines = [], []
    for mode in (False, True):
        engine, workers = make_engine(hashed_choice(eos), async_scheduling=mode, **kw)
        workload(engine)
        results.append(observe(engine, workers))
        engines.append((engine, workers))
    return results, engines


def test_async_outputs_equal_synchronous(make_engine, tokenizer):
    (sync, async_), _ = both(make_engine, tokenizer)
    assert sync == async_
    reasons = {v[2] for k, v in sync.items() if k != "metrics"}
    assert reasons == {"stop", "length"}, "the workload must stop at EOS and at max_tokens"


def test_async_outputs_equal_synchronous_under_chunking_and_preemption(make_engine,
                                                                       tokenizer):
    (sync, async_), engines = both(make_engine, tokenizer, **STRESS)
    assert sync == async_
    (_, _), (async_engine, _) = engines
    # Preemption hits sequences whose token is still in flight.
    assert async_engine.scheduler.num_preemptions > 0
    assert async_engine.kv.stats.hits > 0


def test_plans_go_out_before_the_previous_result_is_applied(make_engine, tokenizer):
    engine, workers = make_engine(async_scheduling=True)
    submit(engine, prompt_token_ids=prompt_ids(0, 5),
                       params=SamplingParams(max_tokens=8, ignore_eos=True))
    req = engine.requests[next(iter(engine.requests))]
    run(engine)
    # 1 prefill + 7 decodes (the last token is never fed back, so no wasted plan), then
    # a plan with no work that lets the workers drop the finished sequence.
    *compute, last = workers.plans
    assert len(compute) == 8 and all(p.new_seqs or p.running for p in compute)
    assert not (last.new_seqs or last.running) and last.finished_ids == [req.seqs[0].seq_id]
    assert not workers.seqs
    # Plan k (1-based) went out with k-2 results received: one plan always in flight.
    # (The first receives are the two ready messages at start-up.)
    got = [n - 2 for n in workers.recvs_before_plan[:8]]
    assert got == [max(0, k - 1) for k in range(8)]


def test_no_token_is_computed_past_max_tokens(make_engine, tokenizer):
    """A sequence whose last token is in flight is not scheduled again: length-limited
    work costs exactly what it costs synchronously."""
    computed = []
    for mode in (False, True):
        engine, workers = make_engine(async_scheduling=mode)
        for i in range(5):
            submit(engine, prompt_token_ids=prompt_ids(10 * i, 3 + i),
                               params=SamplingParams(max_tokens=2 + 3 * i, ignore_eos=True))
        run(engine)
        computed.append(sum(r.num_new_tokens for p in workers.plans for r in p.running)
                        + sum(s.num_new_tokens for p in workers.plans for s in p.new_seqs))
    assert computed[0] == computed[1]


def test_eos_costs_one_discarded_decode_and_no_extra_token(make_engine, tokenizer):
    eos = tokenizer.eos_token_id
    engine, workers = make_engine(lambda sid, fs: eos if len(fs.token_ids) == 8 else 300,
                                  async_scheduling=True)
    req = submit(engine, prompt_token_ids=prompt_ids(0, 5),
                             params=SamplingParams(max_tokens=30))
    outs = run(engine)
    res = finished_of(outs, req.request_id)
    assert res.token_ids == [300, 300, 300, eos] and res.finish_reason == "stop"
    sid = req.seqs[0].seq_id
    # The plan after the one that sampled EOS was already out and computed one more
    # token; the next plan (with no work left) drops the sequence.
    assert sum(in_plan(p, sid) for p in workers.plans) == 5
    assert metric(engine, "nvllm:generation_tokens_total") == 4
    assert workers.plans[-1].finished_ids == [sid] and sid not in workers.seqs


def test_abort_with_a_token_in_flight(make_engine, tokenizer):
    engine, workers = make_engine(async_scheduling=True)
    req = submit(engine, prompt_token_ids=prompt_ids(0, 6),
                             params=SamplingParams(max_tokens=20, ignore_eos=True),
                             request_id="a")
    other = submit(engine, prompt_token_ids=prompt_ids(20, 6),
                               params=SamplingParams(max_tokens=20, ignore_eos=True))
    outs = [engine.step() for _ in range(3)]
    seq = req.seqs[0]
    assert seq.num_pending == 1 and len(engine._inflight) == 1
    streamed = [t for d in deltas_of(outs, "a") for t in d.token_ids]
    out = engine.abort_request("a")
    (delta,) = out.deltas
    assert delta.finish_reason == "abort" and delta.token_ids == []
    assert out.finished[0].outputs[0].token_ids == streamed  # the in-flight one never shows
    later = run(engine)
    assert deltas_of(later, "a") == []
    assert any(seq.seq_id in p.finished_ids for p in workers.plans)
    assert len(finished_of(later, other.request_id).token_ids) == 20
    assert engine.kv.num_free_blocks == NUM_BLOCKS


def test_an_interrupted_wait_changes_nothing(make_engine, tokenizer):
    """Ctrl-C while waiting for a result (LLM.generate cancels the wait) leaves the plan
    in flight with its result unread; stepping on gives exactly the uninterrupted run,
    wherever the interruptions fall, synchronous or async, under chunking and
    preemption."""
    eos = tokenizer.eos_token_id
    for kw in ({}, STRESS):
        for mode in (False, True):
            engine, workers = make_engine(hashed_choice(eos), async_scheduling=mode, **kw)
            workload(engine)
            want = observe(engine, workers)
            for every in (2, 3, 7):
                engine, workers = make_engine(hashed_choice(eos), async_scheduling=mode,
                                              **kw)
                workload(engine)
                got = observe(engine, workers, interrupt_at=set(range(0, 500, every)))
                assert got == want, (kw, mode, every)
