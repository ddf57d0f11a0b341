"""nvllm-launch: generate-and-exit, and serve-until-interrupted with a clean shutdown."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.e2e

LAUNCH = [sys.executable, "-m", "nvllm.launch.cli"]


def test_launch_generates_and_exits(tiny, procs):
    out = subprocess.run(
        [*LAUNCH, "--model", tiny("qwen3"), "--tp", "2", "--device", "cpu", "--prompt", "Hello",
         "--prompt", "The capital of France is", "--max-tokens", "8"],
        capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr
    assert "--- 'Hello'" in out.stdout and "--- 'The capital of France is'" in out.stdout
    assert re.search(r"2 requests, \d+ prompt \+ \d+ generated tokens", out.stdout)
    assert "output tok/s" in out.stdout
    assert "KV cache:" in out.stderr and "maximum concurrency" in out.stderr
    pids = [int(p) for p in re.search(r"workers=\[([\d, ]+)\]", out.stdout).group(1).split(",")]
    assert not any(procs.pid_alive(p) for p in pids)


def test_launch_serves_until_sigint(tiny, procs):
    proc = subprocess.Popen([*LAUNCH, "--model", tiny("qwen3"), "--tp", "2", "--device", "cpu"],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        lines = []
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            lines.append(line)
            if "serving" in line or not line:
                break
        text = "".join(lines)
        assert "serving" in text, text
        pids = [int(p) for p in re.search(r"workers=\[([\d, ]+)\]", text).group(1).split(",")]
        assert all(procs.pid_alive(p) for p in pids)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0
        assert not any(procs.pid_alive(p) for p in pids)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
