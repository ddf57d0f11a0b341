"""Process helpers shared by the engine's child processes."""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time


def die_with_parent(parent_pid: int) -> None:
    """Exit when the process that started us is gone (even if it was SIGKILLed)."""
    if sys.platform.startswith("linux"):
        try:  # PR_SET_PDEATHSIG: the kernel kills us when the parent dies
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)
        except OSError:
            pass

    def watch() -> None:  # belt and braces (pdeathsig follows the parent *thread*)
        while True:
            if os.getppid() != parent_pid:
                os._exit(1)
            time.sleep(0.5)

    threading.Thread(target=watch, daemon=True, name="parent-watch").start()


def set_process_title(title: str) -> None:
    """Name this process for operators (`ps`, `top`): nvllm-leader, nvllm-worker-<rank>, ..."""
    try:
        import setproctitle

        setproctitle.setproctitle(title)
    except ImportError:  # optional nicety: without it the process keeps python's name
        pass
