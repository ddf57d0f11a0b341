"""The watcher that removes a process's plan/transfer rings once the process is gone.

A ring's owner unlinks it on close, on garbage collection and at exit
(nvllm/common/transport/ring.py); a SIGKILLed owner runs none of those. Python's
``SharedMemory(create=True)`` would register the segment with multiprocessing's resource
tracker, a Python process of its own (15 MiB resident here, 2% of a served SmolLM2's
whole tree) that unlinks what a dead owner left. The rings are made with ``shm_open``
directly instead, and this module starts, once per owning process, a POSIX shell that
blocks reading a pipe whose only writer is the owner: the read ends when the owner is
gone, however it died (the kernel closes its descriptors), and the shell removes
``/dev/shm/nvllm-tr-<owner pid>-*`` and exits. The resource tracker's own mechanism, in
about 1.6 MiB. It runs in its own session, so a signal to the owner's process group (a
Ctrl-C, a supervisor's killpg) does not take it down first.

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

_lock = threading.Lock()
_watched_pid: int | None = None
_janitor: subprocess.Popen | None = None  # held: a dropped Popen warns that it still runs
_pipe_w: int | None = None  # the owner's end, open until the process is gone


def janitor_script(pattern: str) -> str:
    """The shell: wait for end of input (the owner gone), then remove its segments."""
    return f"read line; rm -f {SHM_DIR}/{pattern}"


def ensure_janitor() -> bool:
    """Start this process's watcher for its rings, ``nvllm-tr-PID-*`` (once per process:
    a forked child gets its own, and holds its parent's pipe too, so the parent's rings
    go once both are gone). True if one runs."""
    global _watched_pid, _janitor, _pipe_w
    pid = os.getpid()
    with _lock:
        if _watched_pid == pid:
            return True
        if not (os.path.isdir(SHM_DIR) and os.access(SHELL, os.X_OK)):
            return False
        r, w = os.pipe()  # both close-on-exec: no other child of ours holds the writer
        try:
            _janitor = subprocess.Popen(
                [SHELL, "-c", janitor_script(f"nvllm-tr-{pid}-*")],
                stdin=r, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                close_fds=True, start_new_session=True)
        except OSError:
            os.close(w)
            return False
        finally:
            os.close(r)
        _pipe_w, _watched_pid = w, pid
        return True
