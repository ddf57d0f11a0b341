"""nvllm-client against a real engine (nvllm-launch, tiny qwen3, CPU), started once."""

from __future__ import annotations

import json
import os
import re
import select
import signal
import socket
import subprocess
import sys

import pytest
from subproc import read_until, stop_process

pytestmark = pytest.mark.e2e

CLIENT = [sys.executable, "-m", "nvllm.launch.client_cli"]


@pytest.fixture(scope="module")
def endpoint(tiny, procs):
    proc = subprocess.Popen(
        [sys.executable, "-m", "nvllm.launch.cli", "--model", tiny("qwen3"), "--tp", "1",
         "--device", "cpu", "--port", "0", "--log-level", "WARNING"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"})
    workers: list[int] = []
    try:
        out = read_until(proc, r"serving on tcp://", 120)
        workers = [int(p) for p in re.search(r"workers=\[([\d, ]+)\]", out).group(1).split(",")]
        yield re.search(r"serving on (tcp://\S+);", out).group(1)
    finally:
        stop_process(proc, signal.SIGINT)
        for pid in [proc.pid, *workers]:
            assert not procs.pid_alive(pid), f"process {pid} outlived the test module"


def run_client(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    # Bytes, decoded by hand: text mode would turn a generated "\r" into "\n".
    out = subprocess.run([*CLIENT, *args], capture_output=True, timeout=timeout,
                         env={**os.environ, "PYTHONIOENCODING": "utf-8"})
    out.stdout, out.stderr = out.stdout.decode(), out.stderr.decode()
    return out


def test_streams_text_and_finish_reason(endpoint):
    from nvllm.common.client import Client

    with Client(endpoint, timeout_s=60) as c:
        want = c.generate("The capital of France is",
                          {"temperature": 0, "max_tokens": 8, "ignore_eos": True}).text
    out = run_client("--endpoint", endpoint, "--max-tokens", "8", "--ignore-eos",
                     "The capital of France is")
    assert out.returncode == 0, out.stderr
    assert out.stdout == f"{want}\n[finish_reason: length, 8 tokens]\n"


def test_text_arrives_before_the_end(endpoint):
    # ~1000 tokens take a while even on the tiny model: the first text must show up on the
    # pipe long before the process exits, i.e. the client flushes as it goes.
    proc = subprocess.Popen([*CLIENT, "--endpoint", endpoint, "--max-tokens", "1000",
                             "--ignore-eos", "hi"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    try:
        assert select.select([proc.stdout], [], [], 60)[0], "no output within 60 s"
        assert os.read(proc.stdout.fileno(), 1)
        assert proc.poll() is None, "all the output came only at exit"
        rest, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
        assert rest.decode(errors="replace").endswith("[finish_reason: length, 1000 tokens]\n")
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)


def test_info_prints_json(endpoint):
    out = run_client("--endpoint", endpoint, "--info")
    assert out.returncode == 0, out.stderr
    info = json.loads(out.stdout)
    assert info["ready"] is True and info["max_model_len"] == 1024
    assert info["model"].endswith("qwen3") and info["v"] == 1


def test_errors_exit_nonzero(endpoint):
    out = run_client("--endpoint", endpoint, "--max-tokens", "5000", "hi")
    assert out.returncode == 1 and "max_model_len" in out.stderr
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    out = run_client("--endpoint", dead, "--timeout", "1", "--info")
    assert out.returncode == 1 and "is the engine running" in out.stderr
    out = run_client("--endpoint", endpoint)
    assert out.returncode == 2 and "PROMPT" in out.stderr
