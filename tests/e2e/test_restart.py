"""--restart-workers: a worker dies mid-generation, the leader replaces the whole group,
recomputes the in-flight requests, and every greedy output equals the fault-free run."""

from __future__ import annotations

import os
import signal

import pytest

from nvllm import LLM, SamplingParams
from nvllm.common.errors import EngineDeadError

pytestmark = pytest.mark.e2e

PROMPTS = ["The capital of France is", "Once upon a time", "The capital of France is a city",
           "List three prime numbers:", "Tensor parallel"]
PARAMS = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def engine(tiny, **kw) -> LLM:
    return LLM(tiny("qwen3"), device="cpu", tensor_parallel_size=2, block_size=4,
               max_num_batched_tokens=16, num_kv_blocks=64, **kw)


def run_with_fault(llm: LLM, kill_at_step: int, sig=signal.SIGKILL) -> dict[str, list[int]]:
    ids = {llm.engine.add_request(p, PARAMS).request_id: p for p in PROMPTS}
    done, steps = {}, 0
    while llm.engine.has_unfinished_requests():
        if steps == kill_at_step:
            os.kill(llm.worker_pids[1], sig)
        for out in llm.engine.step().finished:
            done[ids[out.request_id]] = out.outputs[0].token_ids
        steps += 1
    return done


def test_restart_recomputes_in_flight_requests_exactly(tiny, procs):
    with engine(tiny) as llm:
        expected = {o.prompt: o.outputs[0].token_ids
                    for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)}
    with engine(tiny, restart_workers=True, max_worker_restarts=2) as llm:
        old = llm.worker_pids
        # Step 6: prompts are mid-prefill (chunked) and some are decoding; cached prefixes
        # exist; everything must be recomputed on the new workers.
        got = run_with_fault(llm, kill_at_step=6)
        assert got == expected
        new = llm.worker_pids
        assert set(new).isdisjoint(old) and not any(procs.pid_alive(p) for p in old)
        assert llm.engine.restarts_left == 1
        assert "nvllm:worker_restarts_total" in llm.engine.metrics.exposition()
        kv = llm.engine.kv
        assert kv.num_free_blocks == kv.num_blocks
        # A second fault, then the budget is spent: the third fails requests cleanly.
        assert run_with_fault(llm, kill_at_step=3) == expected
        with pytest.raises(EngineDeadError, match="rank 1"):
            run_with_fault(llm, kill_at_step=2)
        assert kv.num_free_blocks == kv.num_blocks and not llm.engine.requests
        pids = llm.worker_pids
    assert not any(procs.pid_alive(p) for p in pids)


def test_restart_is_refused_across_nodes(tiny):
    from nvllm.common.config import DistConfig

    with pytest.raises(ValueError, match="every worker on this node"):
        LLM(tiny("qwen3"), device="cpu", tensor_parallel_size=2, restart_workers=True,
            dist=DistConfig(nnodes=2, master_port=1))
