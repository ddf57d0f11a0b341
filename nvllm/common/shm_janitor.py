"""The watcher that removes a process's plan/transfer rings once the process is gone.

A ring's owner unlinks it on close, on garbage collection and at exit
(nvllm/common/transport/ring.py); a SIGKILLed owner runs none of those. Python's
``SharedMemory(create=True)`` would register the segment with multiprocessing's resource
tracker, a Python process of its own (15 MiB resident here, 2% of a served SmolLM2's
whole tree) that unlinks what a dead owner left. The rings are made with ``shm_open``
directly instead, and this module starts, once per owning process, a POSIX shell that
polls the owner every second and then removes ``/dev/shm/nvllm-tr-<owner pid>-*``:
the same guarantee in about 1 MiB. It runs in its own session, so a signal to the
owner's process group (a Ctrl-C, a supervisor's killpg) does not take it down first.

Where there is no ``/dev/shm`` or no ``/bin/sh`` no watcher starts, and a killed owner's
rings stay until ``nvllm.common.shm_segments.sweep_orphan_segments`` runs (the data-
parallel supervisor does, for its replicas).
"""

from __future__ import annotations

import os
import subprocess
import threading

SHM_DIR = "/dev/shm"
SHELL = "/bin/sh"
POLL_S = 1

_lock = threading.Lock()
_watched_pid: int | None = None
_janitor: subprocess.Popen | None = None  # held: a dropped Popen warns that it still runs


def janitor_script(owner: int, pattern: str) -> str:
    """The shell loop: wait for `owner` to be gone, then remove its segments."""
    return (f"while kill -0 {owner} 2>/dev/null; do sleep {POLL_S}; done; "
            f"rm -f {SHM_DIR}/{pattern}")


def ensure_janitor(kind: str = "tr") -> bool:
    """Start this process's watcher for its ``nvllm-KIND-PID-*`` segments (once per
    process: a forked child gets its own). True if one runs."""
    global _watched_pid, _janitor
    pid = os.getpid()
    with _lock:
        if _watched_pid == pid:
            return True
        if not (os.path.isdir(SHM_DIR) and os.access(SHELL, os.X_OK)):
            return False
        try:
            _janitor = subprocess.Popen(
                [SHELL, "-c", janitor_script(pid, f"nvllm-{kind}-{pid}-*")],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL, close_fds=True, start_new_session=True)
        except OSError:
            return False
        _watched_pid = pid
        return True
