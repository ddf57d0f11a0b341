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


def restarts(exposition: str) -> float:
    """The value of nvllm:worker_restarts_total in a Prometheus exposition."""
    from prometheus_client.parser import text_string_to_metric_families

    values = [s.value for f in text_string_to_metric_families(exposition) for s in f.samples
              if s.name == "nvllm:worker_restarts_total"]
    assert len(values) == 1, values
    return values[0]


def run_with_fault(llm: LLM, kill_at_step: int, sig=signal.SIGKILL) -> dict[str, list[int]]:
    engine = llm.engine
    ids = {engine.submit(p, PARAMS).request_id: p
           for p in PROMPTS}
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
        assert restarts(llm.engine.metrics.exposition()) == 0
        # Step 6: prompts are mid-prefill (chunked) and some are decoding; cached prefixes
        # exist; everything must be recomputed on the new workers.
        got = run_with_fault(llm, kill_at_step=6)
        assert got == expected
        new = llm.worker_pids
        assert set(new).isdisjoint(old) and not any(procs.pid_alive(p) for p in old)
        assert llm.engine.executor.restarts_left == 1
        assert restarts(llm.engine.metrics.exposition()) == 1
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


def _serve(tiny, *extra):
    import re
    import subprocess
    import sys

    from subproc import read_until

    proc = subprocess.Popen([sys.executable, "-m", "nvllm.launch.cli", "--model", tiny("qwen3"),
                             "--tp", "2", "--device", "cpu", *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    text = read_until(proc, r"serving on tcp://", 120)
    endpoint = re.search(r"serving on (tcp://\S+);", text).group(1)
    pids = [int(p) for p in re.search(r"workers=\[([\d, ]+)\]", text).group(1).split(",")]
    return proc, endpoint, pids


def _wait(cond, timeout_s: float) -> float:
    import time

    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout_s
        time.sleep(0.05)
    return time.monotonic() - t0


def test_served_streams_survive_a_worker_death_with_restart(tiny, procs):
    from subproc import stop_process

    from nvllm.common.client import Client

    proc, endpoint, pids = _serve(tiny, "--restart-workers")
    params = {"temperature": 0, "max_tokens": 200, "ignore_eos": True}
    try:
        with Client(endpoint, timeout_s=120) as c:
            expected = c.generate("Once upon a time", params).token_ids
            assert restarts(c.metrics()) == 0
            tokens = []
            for i, delta in enumerate(c.stream("Once upon a time", params)):
                tokens += delta.token_ids
                if i == 20:
                    os.kill(pids[1], signal.SIGKILL)
            assert tokens == expected  # no token lost, none repeated, none different
            assert c.health()["ready"] is True
            assert restarts(c.metrics()) == 1
            # Idle: a death is handled without waiting for the next request.
            new = procs.worker_pids_of(proc.pid)
            assert len(new) == 2 and set(new).isdisjoint(pids)
            os.kill(new[0], signal.SIGKILL)
            _wait(lambda: set(procs.worker_pids_of(proc.pid)).isdisjoint(new)
                  and len(procs.worker_pids_of(proc.pid)) == 2, 60)
            assert c.generate("Once upon a time", params).token_ids == expected
            assert restarts(c.metrics()) == 2
    finally:
        stop_process(proc, signal.SIGINT)


def test_an_idle_engine_reports_a_worker_death_at_once(tiny, procs):
    from subproc import stop_process

    from nvllm.common.client import Client

    proc, endpoint, pids = _serve(tiny)
    try:
        with Client(endpoint, timeout_s=30) as c:
            assert c.health()["ready"] is True
            os.kill(pids[0], signal.SIGKILL)
            took = _wait(lambda: c.health()["ready"] is False, 10)
            assert took < 5
            assert "worker rank 0" in c.health()["reason"]
            with pytest.raises(EngineDeadError, match="rank 0"):
                c.generate("Hi", {"max_tokens": 2})
    finally:
        stop_process(proc, signal.SIGINT)
