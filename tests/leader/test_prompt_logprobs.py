"""Prompt logprobs on the leader: one sequence per request asks the workers, chunks are
assembled in order, a recompute's repeats are dropped, every completion's first delta
carries the whole list (held back until it is complete), an abort gives none."""

from __future__ import annotations

import fake_workers as fw
from fake_workers import FakeWorkers, fake_prompt_logprobs, finished_of, run, submit

from nvllm.common.sampling_params import SamplingParams
from nvllm.leader.engine import LLMEngine
from nvllm.leader.executor import Executor
from nvllm.leader.output_processor import EngineOutput
from nvllm.leader.scheduler import SeqUpdate

CHUNKY = dict(max_num_batched_tokens=8, max_num_seqs=8)  # a 20-token prompt takes 3 steps


def expected(ids: list[int], k: int) -> list:
    """RequestOutput.prompt_logprobs for FakeWorkers' scores of prompt `ids`."""
    out: list = [None]
    for p in range(1, len(ids)):
        lp, top = fake_prompt_logprobs(p, ids[p], k)
        out.append({**dict(top), ids[p]: lp})
    return out


def asked(workers: FakeWorkers, seq_id: int) -> list:
    """(computed count, prompt_logprobs) of every NewSeq the workers got for seq_id."""
    return [(ns.num_computed_tokens, ns.sampling.prompt_logprobs) for p in workers.plans
            for ns in p.new_seqs if ns.seq_id == seq_id]


def test_chunks_assembled_once_per_request_on_every_first_delta(make_engine):
    engine, workers = make_engine(**CHUNKY)
    ids = fw.prompt_ids(0, 20)
    req = submit(engine, prompt_token_ids=ids, params=SamplingParams(
        temperature=0, max_tokens=3, ignore_eos=True, n=3, prompt_logprobs=2))
    outs = run(engine)
    want = expected(ids, 2)
    assert finished_of(outs, req.request_id).prompt_logprobs == want
    for i in range(3):
        ds = fw.deltas_of(outs, req.request_id, i)
        assert [d.prompt_logprobs for d in ds] == [want] + [None] * (len(ds) - 1)
    # Only the first sequence asks; the others do not score the prompt again.
    assert asked(workers, req.seqs[0].seq_id) == [(0, 2)]
    assert all(k is None for s in req.seqs[1:] for _, k in asked(workers, s.seq_id))
    assert sum(1 for p in workers.plans if fw.in_plan(p, req.seqs[0].seq_id)
               and any(ns.seq_id == req.seqs[0].seq_id and ns.num_new_tokens < 20
                       for ns in p.new_seqs)) == 1, "the prompt must span several chunks"


def test_deltas_before_the_scores_are_held_and_repeats_dropped(make_engine):
    """A completion whose first token comes before the prompt is scored whole (possible
    only for a sequence other than the scoring one) has its deltas held, then sent in
    order, the first carrying the list; chunks that overlap what is held (a recompute)
    add only positions not yet taken."""
    engine, _ = make_engine()
    ids = fw.prompt_ids(0, 6)
    req = engine.input_processor.process(prompt_token_ids=ids, params=SamplingParams(
        max_tokens=4, ignore_eos=True, n=2, prompt_logprobs=1))
    op, s0, s1 = engine.output_processor, *req.seqs
    op.add_request(req)
    seqs = {s0.seq_id: s0}

    def chunk(first: int, last: int) -> list:
        return [[s0.seq_id, first, [fake_prompt_logprobs(p, ids[p], 1)
                                    for p in range(first, last + 1)]]]

    out = EngineOutput()
    op.process([SeqUpdate(s1, 7, None, None)], out)
    op.add_prompt_logprobs(seqs, chunk(1, 3), out)
    assert out.deltas == [] and len(req.held) == 1
    # A recompute from the start, then a chunk past what is held: nothing is doubled.
    bogus = [[s0.seq_id, 1, [[-99.0, [[5, -99.0]]]] * 2]]  # positions 1, 2: taken already
    op.add_prompt_logprobs(seqs, bogus + chunk(3, 5), out)
    want = expected(ids, 1)
    assert [(d.index, d.token_ids, d.prompt_logprobs) for d in out.deltas] == [(1, [7], want)]
    op.process([SeqUpdate(s1, 8, None, None), SeqUpdate(s0, 9, None, None)], out)
    assert [(d.index, d.prompt_logprobs) for d in out.deltas[1:]] == [(1, None), (0, want)]


def test_a_recompute_takes_each_position_once(tiny, tokenizer):
    """The group dies mid-prompt (the recompute scores the prompt from its start again:
    repeats are dropped), then again while the sequence decodes (its prompt is scored:
    the new group is not asked)."""
    the = tokenizer(" the", add_special_tokens=False).input_ids[0]
    groups: list[FakeWorkers] = []
    sid: list[int] = []

    def start() -> FakeWorkers:
        w = FakeWorkers(lambda s, fs: the)
        if len(groups) == 0:  # dies at the prompt's second chunk
            w.die_on = lambda plan: any(r.seq_id in sid for r in plan.running)
        elif len(groups) == 1:  # dies at the sequence's second decode
            w.die_on = lambda plan: any(
                r.seq_id in sid and w.seqs[r.seq_id].num_computed_tokens > 21
                for r in plan.running if r.seq_id in w.seqs)
        groups.append(w)
        return w

    from nvllm.common.config import EngineConfig

    config = EngineConfig(tiny("qwen3"), device="cpu", block_size=4, num_kv_blocks=64,
                          log_stats_interval_s=3600.0, restart_workers=True,
                          async_scheduling=False, **CHUNKY).finalize()
    engine = LLMEngine(config, Executor(config, start), tokenizer)
    ids = fw.prompt_ids(0, 20)
    req = submit(engine, prompt_token_ids=ids, params=SamplingParams(
        temperature=0, max_tokens=6, ignore_eos=True, prompt_logprobs=3))
    sid.append(req.seqs[0].seq_id)
    outs = run(engine)
    assert len(groups) == 3
    assert finished_of(outs, req.request_id).prompt_logprobs == expected(ids, 3)
    assert [d.prompt_logprobs is not None for d in fw.deltas_of(outs, req.request_id)] == \
        [True] + [False] * 5
    assert asked(groups[1], sid[0]) == [(0, 3)]  # from the start, scoring
    assert [k for _, k in asked(groups[2], sid[0])] == [None]  # scored already
    engine.shutdown()


def test_an_abort_before_the_prompt_is_scored_gives_none(make_engine):
    engine, _ = make_engine(**CHUNKY)
    req = submit(engine, prompt_token_ids=fw.prompt_ids(0, 20), params=SamplingParams(
        temperature=0, max_tokens=2, prompt_logprobs=1))
    engine.step()
    out = engine.abort_request(req.request_id)
    (ro,) = out.finished
    assert ro.prompt_logprobs is None and ro.finish_reason == "abort"
    assert all(d.prompt_logprobs is None for d in out.deltas)
