"""nvllm.launch.trace_report: joins hand-written trace files into the right per-hop
figures; a real run (nvllm-launch with its HTTP gateway, NVLLM_TRACE set) records every hop
and its records join; unset, nothing is written."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys

import httpx
import pytest
from subproc import free_port, read_until, stop_process, wait_healthy

from nvllm.launch import trace_report

T0 = 1000.0


def _write(path, records) -> None:
    with open(path, "w") as f:
        for r in records:
            f.write(json.dumps({**r, "t": T0 + r["t"] / 1e3}) + "\n")


@pytest.fixture
def traced(tmp_path):
    """Three steps and five messages, every hop with distinct durations (ms): a join on
    the wrong key gives other figures. Times below are ms after T0."""
    prefix = str(tmp_path / "run")
    _write(f"{prefix}.worker-11.jsonl", [
        {"ev": "result_sent", "step": 1, "t": 0}, {"ev": "result_sent", "step": 2, "t": 100},
        {"ev": "result_sent", "step": 3, "t": 200}])
    # (rid, i, n, step, out_sent, out_recv, sse_sent or None)
    msgs = [("a", 0, 1, 1, 3, 13, 14), ("a", 0, 2, 2, 107, 127, 130),
            ("b", 0, 1, 2, 109, 139, 144), ("b", 1, 1, 3, 213, 253, 260),
            ("a", 0, 3, 3, 215, 265, None)]  # a delta the gateway did not show
    _write(f"{prefix}.leader-12.jsonl", [
        {"ev": "result_recv", "step": 1, "t": 1}, {"ev": "result_recv", "step": 2, "t": 103},
        {"ev": "result_recv", "step": 3, "t": 205},
        *({"ev": "out_sent", "rid": r, "i": i, "n": n, "step": s, "t": t}
          for r, i, n, s, t, _, _ in msgs),
        {"ev": "out_sent", "rid": "c", "i": 0, "n": 1, "step": None, "t": 300}])  # an abort's
    _write(f"{prefix}.http-13.jsonl", [
        *({"ev": "out_recv", "rid": r, "i": i, "n": n, "t": t} for r, i, n, _, _, t, _ in msgs),
        *({"ev": "sse_sent", "rid": r, "i": i, "n": n, "t": t}
          for r, i, n, _, _, _, t in msgs if t is not None)])
    with open(f"{prefix}.http-13.jsonl", "a") as f:
        f.write('{"ev": "sse_sent", "rid": "a", "i"')  # torn by a kill: skipped
    _write(str(tmp_path / "other.leader-1.jsonl"), [{"ev": "result_recv", "step": 1, "t": 50}])
    return prefix


def test_report_joins_by_step_and_message(traced):
    s = trace_report.summarize(traced)
    assert list(s) == list(trace_report.HOPS)
    approx = pytest.approx
    assert s["worker->leader"] == {"count": 3, "median_ms": approx(3), "p90_ms": approx(5),
                                   "max_ms": approx(5)}
    assert s["leader"] == {"count": 5, "median_ms": approx(6), "p90_ms": approx(10),
                           "max_ms": approx(10)}
    assert s["leader->gateway"] == {"count": 5, "median_ms": approx(30), "p90_ms": approx(50),
                                    "max_ms": approx(50)}
    assert s["gateway"] == {"count": 4, "median_ms": approx(4), "p90_ms": approx(7),
                            "max_ms": approx(7)}
    assert s["total"] == {"count": 4, "median_ms": approx(37), "p90_ms": approx(60),
                          "max_ms": approx(60)}


def test_report_command(traced, tmp_path, capsys):
    assert trace_report.main([traced]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split()[:2] == ["hop", "count"]
    rows = {line.split()[0]: line.split()[1:] for line in out[1:]}
    assert rows["total"] == ["4", "37.000", "60.000", "60.000"]
    line = trace_report.one_line(trace_report.summarize(traced))
    assert line.startswith("worker->leader 3.00/5.00/5.00 ms (3); leader 6.00/")
    assert line.endswith("; total 37.00/60.00/60.00 ms (4)")
    assert trace_report.main([str(tmp_path / "nothing")]) == 1
    empty = trace_report.summarize(str(tmp_path / "nothing"))
    assert empty["total"] == {"count": 0}
    assert trace_report.one_line(empty).endswith("; total - (0)")


def _stream(base: str, body: dict) -> list[dict]:
    with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        return [json.loads(line[6:]) for line in r.iter_lines()
                if line.startswith("data: {")]


@pytest.mark.e2e
def test_trace_of_a_served_stream(tiny, procs, tmp_path):
    """nvllm-launch with its gateway and NVLLM_TRACE: one streamed completion leaves
    every hop in the trace, each sse_sent joins all the way back to its worker step, and
    every duration is non-negative."""
    prefix = str(tmp_path / "trace")
    port = free_port()
    with open(tmp_path / "engine.log", "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "nvllm.launch.cli", "--model", tiny("qwen3"), "--tp", "1",
             "--device", "cpu", "--dtype", "float32", "--port", "0", "--http-port",
             str(port), "--log-level", "WARNING"],
            stdout=subprocess.PIPE, stderr=log, text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1", "NVLLM_TRACE": prefix})
    pids = [proc.pid]
    try:
        out = read_until(proc, r"HTTP gateway on", 120)
        pids += [int(p) for p in re.search(r"workers=\[([\d, ]+)\]", out).group(1).split(",")]
        pids.append(int(re.search(r"\(pid (\d+)\)", out).group(1)))
        base = f"http://127.0.0.1:{port}"
        wait_healthy(base, proc, 60)
        chunks = _stream(base, {"prompt": "Once upon a time", "max_tokens": 5,
                                "temperature": 0, "ignore_eos": True, "stream": True})
    finally:
        stop_process(proc, signal.SIGINT)
    for pid in pids:
        assert not procs.pid_alive(pid), f"process {pid} outlived the test"
    assert len(chunks) == 5 and chunks[-1]["choices"][0]["finish_reason"] == "length"

    roles = sorted(re.sub(r"-\d+\.jsonl$", "", p.name.split(".", 1)[1])
                   for p in tmp_path.glob("trace.*.jsonl"))
    assert roles == ["http", "leader", "worker"]
    recs = trace_report.read_records(prefix)
    by = {}
    for r in recs:
        by.setdefault(r["ev"], []).append(r)
    assert set(by) == {"result_sent", "result_recv", "out_sent", "out_recv", "sse_sent"}
    key = lambda r: (r["rid"], r["i"], r["n"])
    sent = {r["step"]: r["t"] for r in by["result_sent"]}
    recv = {r["step"]: r["t"] for r in by["result_recv"]}
    out_sent = {key(r): r for r in by["out_sent"]}
    out_recv = {key(r): r["t"] for r in by["out_recv"]}
    assert len(by["sse_sent"]) == 5
    assert sorted(r["n"] for r in by["sse_sent"]) == [1, 2, 3, 4, 5]
    for r in by["sse_sent"]:
        o = out_sent[key(r)]
        step = o["step"]
        chain = [sent[step], recv[step], o["t"], out_recv[key(r)], r["t"]]
        assert chain == sorted(chain), chain
    s = trace_report.summarize(prefix)
    for hop, figures in s.items():
        assert figures["count"] >= (5 if hop in ("gateway", "total") else 1), (hop, s)
        assert 0 <= figures["median_ms"] <= figures["p90_ms"] <= figures["max_ms"], (hop, s)


def test_nothing_written_when_off(tiny, monkeypatch, tmp_path):
    """Unset, no process of an engine writes a trace: an offline run (leader in this
    process, a worker process) in an empty working directory leaves it empty."""
    from nvllm import LLM, SamplingParams

    monkeypatch.delenv("NVLLM_TRACE", raising=False)
    monkeypatch.chdir(tmp_path)
    with LLM(tiny("qwen3"), device="cpu", dtype="float32") as llm:
        assert llm.engine.workers._trace is None
        out = llm.generate(["hello"], SamplingParams(max_tokens=3, ignore_eos=True),
                           use_tqdm=False)
    assert len(out[0].token_ids) == 3
    assert list(tmp_path.iterdir()) == []
