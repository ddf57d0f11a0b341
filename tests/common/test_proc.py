"""Process helpers: the stop-on-signal handler survives a second signal inside the first;
freezing start-up objects out of the cyclic GC's way."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading

from nvllm.common.proc import stop_on_signals


def test_a_second_signal_inside_the_first_handler_does_not_deadlock():
    """Ctrl-C twice, or a SIGTERM to the group and then to the leader: Python can run the
    second handler call inside the first one's Event.set, which holds the event's lock."""
    stop = threading.Event()
    previous = signal.getsignal(signal.SIGUSR1)
    stop_on_signals(stop, (signal.SIGUSR1,))
    handler = signal.getsignal(signal.SIGUSR1)
    real_set = stop.set

    def set_interrupted_by_a_signal() -> None:
        with stop._cond:  # what Event.set holds when the second signal lands
            handler(signal.SIGUSR1, None)
        real_set()

    stop.set = set_interrupted_by_a_signal
    try:
        t = threading.Thread(target=handler, args=(signal.SIGUSR1, None), daemon=True)
        t.start()
        t.join(5)
        assert not t.is_alive(), "the second signal deadlocked the first handler"
        assert stop.is_set()
    finally:
        signal.signal(signal.SIGUSR1, previous)


def test_freeze_startup_objects_freezes_what_lives_and_still_collects_later_garbage():
    """In a child process (freezing would pin this test process's objects): objects alive
    at the call move to the permanent generation; cycles made afterwards are collected."""
    code = (
        "import gc\n"
        "from nvllm.common.proc import freeze_startup_objects\n"
        "held = [[i] for i in range(10000)]\n"
        "freeze_startup_objects()\n"
        "frozen = gc.get_freeze_count()\n"
        "class Node: pass\n"
        "for _ in range(100):\n"
        "    a, b = Node(), Node(); a.b, b.a = b, a\n"
        "del a, b\n"
        "print(frozen, gc.collect())\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, check=True)
    frozen, collected = map(int, out.stdout.split())
    assert frozen >= 10000 and collected >= 200
