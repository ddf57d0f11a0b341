"""The sweep of segments whose owner died: a SIGKILLed replica's are removed, a live
process's (and anything not named as nvllm names its segments) stay."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys

import pytest

from nvllm.common.shm_segments import sweep_orphan_segments, unlink_segment

_posixshmem = pytest.importorskip("_posixshmem")


def _create(name: str) -> None:
    fd = _posixshmem.shm_open("/" + name, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    os.close(fd)


def test_only_segments_of_dead_owners_are_removed():
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    dead_pid = int(dead.stdout)  # exited and reaped: gone (unless reused, then kept)
    orphan = f"nvllm-tr-{dead_pid}-{secrets.token_hex(6)}"
    live = f"nvllm-ar-{os.getpid()}-{secrets.token_hex(6)}"
    other = f"nvllm-test-{dead_pid}-{secrets.token_hex(3)}"  # not an engine segment name
    for name in (orphan, live, other):
        _create(name)
    try:
        removed = sweep_orphan_segments({dead_pid, os.getpid()})  # others' runs: untouched
        assert orphan in removed and live not in removed and other not in removed
        names = set(os.listdir("/dev/shm"))
        assert orphan not in names and live in names and other in names
    finally:
        for name in (orphan, live, other):
            unlink_segment(name)
