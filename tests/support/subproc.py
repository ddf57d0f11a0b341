"""Subprocess helpers for tests that start engines and gateways as separate processes."""

from __future__ import annotations

import os
import re
import select
import signal
import socket
import subprocess
import time


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def read_until(proc: subprocess.Popen, pattern: str, timeout_s: float) -> str:
    """Read the process's stdout until a line matches; fails (not hangs) past timeout_s."""
    seen = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stdout], [], [], 0.5)
        if not ready:
            if proc.poll() is not None:
                break
            continue
        line = proc.stdout.readline()
        if not line:
            break
        seen.append(line)
        if re.search(pattern, line):
            return "".join(seen)
    raise AssertionError(f"no line matching {pattern!r} in {timeout_s:.0f} s; got {seen!r}")


def stop_process(proc: subprocess.Popen, sig: int) -> None:
    """Signal by pid, wait; SIGKILL what does not exit in time."""
    if proc.poll() is None:
        os.kill(proc.pid, sig)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
    if proc.stdout:
        proc.stdout.close()


def wait_healthy(base: str, proc: subprocess.Popen, timeout_s: float) -> None:
    """Poll base/health until it answers 200, failing if `proc` (the gateway, or the
    launcher that owns it) exits first or the time runs out."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"the gateway exited with {proc.returncode}"
        try:
            if httpx.get(f"{base}/health", timeout=3).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"{base}/health never answered 200 in {timeout_s:.0f} s")
