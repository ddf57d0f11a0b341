"""nvllm/common/trace.py: off without $NVLLM_TRACE, one buffered file per role and process
when on, ordinals per completion, flushed in the background and on close."""

from __future__ import annotations

import json
import os
import time

import pytest

from nvllm.common import trace


@pytest.fixture
def fresh(monkeypatch):
    """No tracer left over from another test; closes the ones this test makes."""
    monkeypatch.setattr(trace, "_tracers", {})
    yield
    for t in trace._tracers.values():
        t.close()


def _lines(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f]


def test_off_without_the_variable(monkeypatch, fresh, tmp_path):
    monkeypatch.delenv(trace.ENV, raising=False)
    assert trace.tracer("leader") is None
    monkeypatch.setenv(trace.ENV, "")
    assert trace.tracer("leader") is None
    assert list(tmp_path.iterdir()) == []


def test_records_one_file_per_role_and_process(monkeypatch, fresh, tmp_path):
    prefix = str(tmp_path / "t")
    monkeypatch.setenv(trace.ENV, prefix)
    leader = trace.tracer("leader")
    assert trace.tracer("leader") is leader  # once per process and role
    http = trace.tracer("http")
    assert http is not leader
    leader.event("result_recv", step=7)
    for last in (False, False, True):
        leader.message("out_sent", "r1", 0, last, step=7)
    leader.message("out_sent", "r1", 0, False, step=8)  # ended above: counts anew
    leader.message("out_sent", 5, 1, False)  # ids are recorded as strings
    http.message("out_recv", "r1", 0, False)
    assert not os.path.getsize(leader.path)  # buffered
    leader.close()
    http.close()
    leader.close()  # idempotent
    assert leader.path == f"{prefix}.leader-{os.getpid()}.jsonl"
    recs = _lines(leader.path)
    assert [r["ev"] for r in recs] == ["result_recv"] + ["out_sent"] * 5
    assert recs[0]["step"] == 7 and isinstance(recs[0]["t"], float)
    assert [(r["rid"], r["i"], r["n"]) for r in recs[1:]] == [
        ("r1", 0, 1), ("r1", 0, 2), ("r1", 0, 3), ("r1", 0, 1), ("5", 1, 1)]
    assert all(a["t"] <= b["t"] for a, b in zip(recs, recs[1:]))
    assert _lines(http.path)[0]["ev"] == "out_recv"
    assert trace.tracer("leader") is not leader  # a closed tracer is replaced


def test_flushes_in_the_background(monkeypatch, fresh, tmp_path):
    monkeypatch.setattr(trace, "FLUSH_INTERVAL_S", 0.05)
    monkeypatch.setenv(trace.ENV, str(tmp_path / "t"))
    w = trace.tracer("worker")
    w.event("result_sent", step=1)
    deadline = time.monotonic() + 5
    while not os.path.getsize(w.path) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert _lines(w.path) == [{"step": 1, "ev": "result_sent", "t": pytest.approx(time.time(),
                                                                                  abs=5)}]
