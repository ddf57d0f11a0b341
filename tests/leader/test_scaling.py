"""The leader's work per request does not grow with the number of live requests (issue
22: the 20,000-stream load run). Work is counted, not timed (tests/support/
work_counter.py): the same steps, submits and aborts run with SMALL and then LARGE
requests queued behind them, through the real EngineServer and LLMEngine over the fake
worker group, and the Python lines they execute must stay within a few percent. A scan
over every live request per step or per message makes the large run execute far more
(one pass per step: twice the lines; test_the_check_sees_a_scan_over_live_requests).

How it holds at the load test's sizes in wall-clock time: scripts/bench_load_scaling.py.
"""

from __future__ import annotations

import msgpack
import pytest
from fake_workers import prompt_ids
from work_counter import LineCounter

SMALL, LARGE = 100, 1000
STEPS = 12
TOLERANCE = 1.05  # heaps are O(log n): a deeper heap runs the same Python lines
WAIT_MS = 5000


def _submit(i: int) -> bytes:
    return msgpack.packb({"op": "submit", "id": f"r{i}", "prompt_token_ids": prompt_ids(i % 50, 3),
                          "params": {"max_tokens": 3, "ignore_eos": True}})


def _measure(serve_engine, live: int) -> dict[str, LineCounter]:
    """Queue `live` requests, then count the leader's lines for: STEPS steps (with their
    outputs streamed), 40 more submits, 5 pings and the aborts of 20 queued and 5 running
    requests, and the step after those."""
    engine, server, dealer = serve_engine(max_num_seqs=8)
    for i in range(live):
        dealer.send(_submit(i))
    while len(engine.requests) < live:
        server._drain(WAIT_MS)
    counters = {k: LineCounter() for k in ("steps", "submits", "aborts", "after")}
    with counters["steps"]:
        for _ in range(STEPS):
            server._step()
    for i in range(live, live + 40):
        dealer.send(_submit(i))
    before = len(engine.requests)
    with counters["submits"]:  # (frames may still be on their way: drain until all came)
        while len(engine.requests) < before + 40:
            server._drain(WAIT_MS)
    running = [s.request_id for s in engine.scheduler.running][:5]
    rids = [f"r{i}" for i in range(live - 20, live)] + [
        next(k for k, v in server._by_client[server_client(server)].items() if v == r)
        for r in running]
    for _ in range(5):  # (first: frames are taken in order)
        dealer.send(msgpack.packb({"op": "ping"}))
    for rid in rids:
        dealer.send(msgpack.packb({"op": "abort", "id": rid}))
    before = len(engine.requests)
    with counters["aborts"]:
        while len(engine.requests) > before - len(rids):
            server._drain(WAIT_MS)
    with counters["after"]:
        server._step()  # the next step, with the flush of what the aborts and pings sent
    # The same work at both sizes: as many outputs and finished requests.
    msgs = []
    while dealer.poll(300):  # (all sent already: this only waits for the last to arrive)
        msgs.append(msgpack.unpackb(dealer.recv(), raw=False))
    counters["outputs"] = sum(m["op"] == "output" for m in msgs)  # type: ignore[assignment]
    counters["live"] = len(engine.requests)  # type: ignore[assignment]
    return counters


def server_client(server) -> bytes:
    (client,) = [c for c, live in server._by_client.items() if live]
    return client


def test_leader_work_per_request_does_not_grow_with_live_requests(serve_engine):
    small, large = _measure(serve_engine, SMALL), _measure(serve_engine, LARGE)
    assert small["outputs"] == large["outputs"] > 0
    assert large["live"] - small["live"] == LARGE - SMALL
    for what in ("steps", "submits", "aborts", "after"):
        a, b = small[what], large[what]
        print(f"{what}: {a.lines} lines with {SMALL} live requests, {b.lines} with {LARGE}")
        assert a.lines > 0
        assert b.lines <= TOLERANCE * a.lines, (
            f"{what}: {b.lines} lines with {LARGE} live requests, {a.lines} with {SMALL}; "
            f"grown: {b.grown(a, TOLERANCE)}")


@pytest.mark.parametrize("scheduling", ["async"])  # (the check itself: one mode will do)
def test_the_check_sees_a_scan_over_live_requests(serve_engine, monkeypatch):
    """What the test above guards against: one pass over the live requests per step
    (here engine._live_grammar_keys, a set comprehension over them) makes the steps run
    half again the lines and more with LARGE requests live (the 1.05
    tolerance above is far below)."""
    from nvllm.leader.engine import LLMEngine

    step = LLMEngine.step

    def scanning_step(self, *args, **kwargs):
        self._live_grammar_keys()
        return step(self, *args, **kwargs)

    monkeypatch.setattr(LLMEngine, "step", scanning_step)
    small, large = _measure(serve_engine, SMALL), _measure(serve_engine, LARGE)
    assert large["steps"].lines > 1.5 * small["steps"].lines
    assert "engine.py:LLMEngine._live_grammar_keys.<locals>.<setcomp>" in \
        large["steps"].grown(small["steps"], TOLERANCE)
