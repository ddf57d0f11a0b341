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


def stop_on_signals(stop: threading.Event,
                    signals: tuple[int, ...] = (signal.SIGINT, signal.SIGTERM)) -> None:
    """Set `stop` on any of `signals`, from a handler safe against a second signal.

    Python runs a handler between two bytecodes of the main thread, so a second signal
    (Ctrl-C pressed twice, a SIGTERM to the process group and then to the process) can
    run a handler inside the first one's ``Event.set``, which holds a non-reentrant lock:
    calling ``set`` again there deadlocks the process for good. Only the first handler
    call gets as far as ``set``.
    """
    seen = []

    def handler(*_: object) -> None:
        if seen:
            return
        seen.append(True)
        stop.set()

    for sig in signals:
        signal.signal(sig, handler)


def freeze_startup_objects() -> None:
    """Collect once, then move every object alive now into the interpreter's permanent
    generation (``gc.freeze``), as vLLM's engine does after start-up.

    Why: a long-running engine process holds its imports' objects for good (a worker with
    torch and a model: ~220,000 objects), and each full collection of the cyclic GC walks
    all of them: measured 192 ms in a SmolLM2-135M worker, a stall of every stream whenever
    the survivors of serving trigger one. Frozen objects are skipped by collections
    (0.01 ms after freezing); what serving allocates later is collected as before. Only for
    processes nvllm owns: it would pin a user's garbage in their own process."""
    import gc

    gc.collect()
    gc.freeze()


def set_process_title(title: str) -> None:
    """Name this process for operators (`ps`, `top`): nvllm-leader, nvllm-worker-<rank>, ..."""
    try:
        import setproctitle

        setproctitle.setproctitle(title)
    except ImportError:  # optional nicety: without it the process keeps python's name
        pass


class DeferredInterrupt:
    """Ctrl-C inside an engine loop, delivered only where the loop can stop cleanly.

    While active (main thread, Python's own SIGINT handler in place), SIGINT sets
    ``pending`` instead of raising wherever the interpreter happens to be, which could be
    halfway through applying a step's result. The loop calls ``check()`` at safe points
    (waits poll ``is_pending``). A second Ctrl-C while one is pending raises at once: the
    escape hatch if the loop stops answering.
    """

    def __init__(self) -> None:
        self.pending = False
        self._previous = None

    def is_pending(self) -> bool:
        return self.pending

    def check(self) -> None:
        if self.pending:
            self.pending = False
            raise KeyboardInterrupt

    def _handler(self, signum, frame) -> None:
        if self.pending:
            raise KeyboardInterrupt
        self.pending = True

    def __enter__(self) -> DeferredInterrupt:
        if (threading.current_thread() is threading.main_thread()
                and signal.getsignal(signal.SIGINT) is signal.default_int_handler):
            self._previous = signal.signal(signal.SIGINT, self._handler)
        return self

    def __exit__(self, *exc) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
            self._previous = None
