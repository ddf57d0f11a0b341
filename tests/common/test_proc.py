"""Process helpers: the stop-on-signal handler survives a second signal inside the first."""

from __future__ import annotations

import signal
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
