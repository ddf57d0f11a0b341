"""nvllm-bench: throughput on the offline engine, serve against an in-process EngineServer,
and the argument checks. Small workloads: these check the tools, not the speed."""

from __future__ import annotations

import json
import subprocess
import sys
import threading

import pytest
from click.testing import CliRunner

from nvllm.launch.bench import bench, make_workload, percentile

BENCH = [sys.executable, "-m", "nvllm.launch.bench"]


def test_range_parser_rejects_bad_ranges():
    runner = CliRunner()
    for bad, why in (("10-5", "LO must not exceed HI"), ("abc", "not a range LO-HI"),
                     ("0-4", "lengths start at 1")):
        res = runner.invoke(bench, ["throughput", "--model", "unused", "--input-len", bad])
        assert res.exit_code == 2, res.output
        assert "Invalid value for '--input-len'" in res.output and why in res.output
    res = runner.invoke(bench, ["serve", "--endpoint", "tcp://127.0.0.1:1", "--output-len", "5-"])
    assert res.exit_code == 2 and "Invalid value for '--output-len'" in res.output


def test_max_model_len_below_the_longest_request_is_refused(tiny):
    res = CliRunner().invoke(bench, ["throughput", "--model", tiny("qwen3"), "--device", "cpu",
                                     "--input-len", "8-16", "--output-len", "4-8",
                                     "--max-model-len", "10"])
    assert res.exit_code == 2 and "below the longest request" in res.output


def test_workload_is_seeded_and_in_range():
    a = make_workload(20, (3, 9), (1, 4), 50, seed=7)
    assert a == make_workload(20, (3, 9), (1, 4), 50, seed=7)
    assert a != make_workload(20, (3, 9), (1, 4), 50, seed=8)
    assert all(3 <= len(p) <= 9 and all(0 <= t < 50 for t in p) for p in a.prompts)
    assert all(1 <= o <= 4 for o in a.output_lens)
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5 and percentile([], 99) is None


@pytest.mark.e2e
@pytest.mark.timeout(240)
def test_throughput_json(tiny):
    out = subprocess.run([*BENCH, "throughput", "--model", tiny("qwen3"), "--num-seqs", "4",
                          "--input-len", "8-16", "--output-len", "4-8", "--device", "cpu",
                          "--json"], capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr
    res = json.loads(out.stdout)
    wl = make_workload(4, (8, 16), (4, 8), 1024, seed=0)  # tiny qwen3 has vocab 1024
    assert res["num_seqs"] == 4 and res["failures"] == 0
    # ignore_eos: every request generates exactly what it asked for.
    assert res["output_tokens"] == res["requested_output_tokens"] == sum(wl.output_lens)
    assert res["prompt_tokens"] == sum(map(len, wl.prompts))
    assert res["max_model_len"] == 16 + 8
    assert res["elapsed_s"] > 0 and res["output_tok_s"] > 0
    assert res["total_tok_s"] > res["output_tok_s"] and res["requests_per_s"] > 0
    assert 0.0 <= res["worker_idle_share"] < 1.0


@pytest.fixture(scope="module")
def endpoint(tiny):
    from nvllm import LLM
    from nvllm.leader.server import EngineServer

    llm = LLM(tiny("qwen3"), device="cpu", dtype="float32", max_model_len=64)
    try:
        server = EngineServer(llm.engine)
        stop = threading.Event()
        thread = threading.Thread(target=server.serve, args=(stop,), daemon=True)
        thread.start()
        try:
            yield server.endpoint
        finally:
            stop.set()
            thread.join(30)
            server.close()
    finally:
        llm.shutdown()


def run_serve(endpoint: str, *args: str) -> dict:
    res = CliRunner().invoke(bench, ["serve", "--endpoint", endpoint, "--timeout", "60",
                                     "--json", *args])
    assert res.exit_code == 0, (res.output, res.exception)
    return json.loads(res.stdout)


def assert_sane(res: dict) -> None:
    for key in ("ttft_ms", "itl_ms", "e2e_ms"):
        s = res[key]
        assert 0 < s["p50"] <= s["p90"] <= s["p99"], (key, s)
    assert res["ttft_ms"]["p99"] <= res["e2e_ms"]["p99"]
    assert res["request_throughput"] > 0 and res["output_tok_s"] > 0


@pytest.mark.e2e
@pytest.mark.timeout(120)
def test_serve_fixed_concurrency(endpoint):
    res = run_serve(endpoint, "--num-prompts", "6", "--max-concurrency", "3",
                    "--input-len", "8-16", "--output-len", "4-8")
    assert (res["successes"], res["failures"], res["clamped"]) == (6, 0, 0), res["errors"]
    assert res["output_tokens"] == sum(make_workload(6, (8, 16), (4, 8), 1024, 0).output_lens)
    assert_sane(res)


@pytest.mark.e2e
@pytest.mark.timeout(120)
def test_serve_poisson_rate_clamps_to_max_model_len(endpoint):
    # Every request (100+ prompt tokens) is over the engine's max_model_len of 64.
    res = run_serve(endpoint, "--num-prompts", "4", "--request-rate", "20",
                    "--input-len", "100-120", "--output-len", "4-8")
    assert (res["successes"], res["failures"], res["clamped"]) == (4, 0, 4), res["errors"]
    assert res["max_model_len"] == 64 and res["request_rate"] == 20
    assert res["prompt_tokens"] + res["output_tokens"] == 4 * 64
    assert_sane(res)


@pytest.mark.timeout(60)
def test_serve_without_an_engine_fails_clearly():
    from subproc import free_port

    res = CliRunner().invoke(bench, ["serve", "--endpoint", f"tcp://127.0.0.1:{free_port()}",
                                     "--timeout", "2", "--num-prompts", "1"])
    assert res.exit_code == 1 and "no answer from" in res.output
