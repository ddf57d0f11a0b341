"""Poison containment: plans stay bounded, and a request that keeps killing worker groups
is ended instead of replayed into every new one."""

from __future__ import annotations

from fake_workers import BLOCK, NUM_BLOCKS, FakeWorkers, prompt_ids, run, submit

from nvllm.common import worker_protocol as protocol
from nvllm.common.config import EngineConfig
from nvllm.common.sampling_params import SamplingParams
from nvllm.leader.engine import MAX_DEATHS_IN_FLIGHT, LLMEngine
from nvllm.leader.executor import Executor
from nvllm.leader.scheduler import new_seq_plan_bytes

PARAMS = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def _engine(tiny, tokenizer, start, **kw) -> LLMEngine:
    config = EngineConfig(tiny("qwen3"), device="cpu", block_size=BLOCK,
                          num_kv_blocks=NUM_BLOCKS, log_stats_interval_s=3600.0,
                          **kw).finalize()
    return LLMEngine(config, Executor(config, start), tokenizer)


def _tokens(outs) -> dict[str, list]:
    return {r.request_id: (r.token_ids, r.finish_reason) for o in outs for r in o.finished}


def test_a_request_in_flight_through_two_deaths_ends_with_an_error(tiny, tokenizer):
    the = tokenizer(" the", add_special_tokens=False).input_ids[0]
    poison: set[int] = set()
    groups: list[FakeWorkers] = []

    def start() -> FakeWorkers:
        w = FakeWorkers(lambda sid, fs: the)
        w.die_on = lambda plan: any(s.seq_id in poison for s in plan.new_seqs)
        groups.append(w)
        return w

    engine = _engine(tiny, tokenizer, start, restart_workers=True, max_worker_restarts=5)
    for i in range(3):
        submit(engine, prompt_token_ids=prompt_ids(10 * i, 5), params=PARAMS,
               request_id=f"ok{i}")
    req = submit(engine, prompt_token_ids=prompt_ids(50, 5), params=PARAMS, request_id="bad")
    poison.update(s.seq_id for s in req.seqs)
    outs = run(engine)
    got = _tokens(outs)
    assert got["bad"] == ([], "error")
    assert all(got[f"ok{i}"] == ([the] * 6, "length") for i in range(3))
    assert len(groups) == 1 + MAX_DEATHS_IN_FLIGHT  # no third group was fed the request
    assert engine.executor.restarts_left == 5 - MAX_DEATHS_IN_FLIGHT
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
    engine.shutdown()


def test_plans_stay_within_max_plan_bytes(tiny, tokenizer):
    the = tokenizer(" the", add_special_tokens=False).input_ids[0]
    workers = FakeWorkers(lambda sid, fs: the)
    engine = _engine(tiny, tokenizer, lambda: workers, max_plan_bytes=2_000)
    reqs = [submit(engine, prompt_token_ids=prompt_ids(40 * i, 30), params=PARAMS)
            for i in range(10)]
    cost = new_seq_plan_bytes(reqs[0].seqs[0], BLOCK)
    assert 3 * cost <= 2_000 < 5 * cost
    outs = run(engine)
    assert len(_tokens(outs)) == 10
    firsts = [len(p.new_seqs) for p in workers.plans if p.new_seqs]
    assert max(firsts) == 2_000 // cost and sum(firsts) >= 10  # (+ resumed preemptions)
    for plan in workers.plans:  # the bound is an upper bound on the real encoding
        for ns in plan.new_seqs:
            assert len(protocol.encode(protocol.StepPlan(0, [ns], [], []))) < cost
    engine.shutdown()


def test_a_send_to_a_worker_that_takes_nothing_times_out():
    """No worker ever connects to the plan socket: the send gives up after the heartbeat
    timeout with the group dead, instead of blocking the leader for good."""
    import time

    import pytest

    from nvllm.common.errors import EngineDeadError
    from nvllm.leader.worker_client import WorkerGroupClient

    client = WorkerGroupClient(1, heartbeat_timeout_s=0.5)
    try:
        t0 = time.monotonic()
        with pytest.raises(EngineDeadError, match="took no plan"):
            client.broadcast(protocol.Shutdown())
        assert time.monotonic() - t0 < 5
        assert client.dead is not None
    finally:
        client.close()
