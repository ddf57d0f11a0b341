"""The janitor that removes a killed owner's rings (nvllm/common/shm_janitor.py): its
script, one watcher per process, and a watcher that outlives a SIGKILL of the owner's whole
process group. (The ring itself under a killed owner: tests/common/test_transport.py.)"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import time

import pytest

from nvllm.common import shm_janitor
from nvllm.common.shm_segments import unlink_segment

_posixshmem = pytest.importorskip("_posixshmem")
pytestmark = pytest.mark.skipif(not os.path.isdir(shm_janitor.SHM_DIR),
                                reason="no /dev/shm")


def test_the_script_waits_for_end_of_input_then_removes_only_its_segments():
    script = shm_janitor.janitor_script("nvllm-tr-1234-*")
    assert script == f"read line; rm -f {shm_janitor.SHM_DIR}/nvllm-tr-1234-*"


def test_one_watcher_per_process(monkeypatch):
    started = []
    monkeypatch.setattr(shm_janitor, "_watched_pid", None)
    monkeypatch.setattr(shm_janitor, "_janitor", shm_janitor._janitor)  # restored after
    monkeypatch.setattr(shm_janitor, "_pipe_w", shm_janitor._pipe_w)
    monkeypatch.setattr(shm_janitor.subprocess, "Popen",
                        lambda args, **kw: started.append((args, kw)))
    assert shm_janitor.ensure_janitor() and shm_janitor.ensure_janitor()
    assert len(started) == 1
    args, kw = started[0]
    assert args[:2] == [shm_janitor.SHELL, "-c"] and f"nvllm-tr-{os.getpid()}-*" in args[2]
    assert isinstance(kw["stdin"], int)  # the pipe's read end; this process holds the writer
    assert kw["start_new_session"]  # a killpg of the owner's group spares it
    os.close(shm_janitor._pipe_w)
    monkeypatch.setattr(shm_janitor, "_watched_pid", os.getpid() + 1)  # as in a fork
    assert shm_janitor.ensure_janitor() and len(started) == 2
    os.close(shm_janitor._pipe_w)


GROUP_OWNER = r"""
import os, sys, time
from nvllm.common.transport import ArrayWriter
os.setpgrp()  # its own process group, which the test then kills whole
w = ArrayWriter()
print(w.name, flush=True)
time.sleep(60)
"""


def test_a_killed_process_groups_rings_are_removed():
    proc = subprocess.Popen([sys.executable, "-c", GROUP_OWNER], stdout=subprocess.PIPE,
                            text=True)
    name = ""
    try:
        name = proc.stdout.readline().strip()
        assert name.startswith(f"nvllm-tr-{proc.pid}-")
        assert os.path.exists(os.path.join(shm_janitor.SHM_DIR, name))
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        deadline = time.monotonic() + 10
        while (os.path.exists(os.path.join(shm_janitor.SHM_DIR, name))
               and time.monotonic() < deadline):
            time.sleep(0.05)
        assert not os.path.exists(os.path.join(shm_janitor.SHM_DIR, name))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
        proc.stdout.close()
        if name:
            unlink_segment(name)


def test_segments_of_others_are_left_alone():
    """The pattern names one owner: another process's ring survives its janitor."""
    other = f"nvllm-tr-{os.getpid()}-{secrets.token_hex(6)}"
    fd = _posixshmem.shm_open("/" + other, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    os.close(fd)
    try:
        dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                              capture_output=True, text=True, check=True)
        pid = int(dead.stdout)
        subprocess.run([shm_janitor.SHELL, "-c", shm_janitor.janitor_script(
            f"nvllm-tr-{pid}-*")], stdin=subprocess.DEVNULL, check=True, timeout=30)
        assert os.path.exists(os.path.join(shm_janitor.SHM_DIR, other))
    finally:
        unlink_segment(other)
