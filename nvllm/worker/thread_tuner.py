"""How many torch threads a CPU step runs on, chosen by timing steps as they run.

On cores the worker has to itself, two threads beat one at every step size. On cores it
shares (the leader, the HTTP gateway and a benchmark client beside it on 2 cores, or a
neighbour's job), every parallel region waits for its slowest thread, and a thread that
lost its core waits a scheduler time slice: measured online (bfloat16, concurrency 16,
2 cores, another job running) two threads gave 37-57 output tok/s where one gave 303-357.
No fixed count is right on both, and which one a machine is can change by the minute, so
the worker measures: it runs steps on one count (the mode), now and then runs one step
on the other count, and compares it with what steps of the same size (tokens, in powers
of two) took on the mode. The faster count becomes the mode. Contention is a property of
the machine, not of a step's size, so one mode serves every size and a switch learnt on
decode steps applies to prefills at once.

The count changes how work is split between threads, not what is computed: the GEMMs,
the attention and the norms give bitwise the same results on 1 or 2 threads (checked in
tests/worker/test_thread_tuner.py), so outputs do not depend on the choice.

Exploring costs steps on the slower count: the other count is tried again after
``min_interval`` steps, and that wait doubles (up to ``max_interval``) every time it
loses, so a mode that stays right costs about ``TRY_STEPS`` slow steps in
``max_interval``. A try is a few steps, each compared with the mode's average for its
size, and wins only by a margin (``MARGIN``): single steps jitter too much to decide on.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

logger = logging.getLogger(__name__)

MIN_INTERVAL = 16
MAX_INTERVAL = 1024
ALPHA = 0.25  # weight of a new step's time in its count's running average
MAX_CLASS = 12  # steps of 2**12 tokens and more share one size class
# A try of the other count runs TRY_STEPS steps and wins when they took, on average, less
# than (1 - MARGIN) of what the mode's steps of the same sizes take. Step times jitter by
# tens of percent within a size class (other processes; prefills of different lengths):
# decided on one step with no margin, lucky steps flipped the count back and forth (online,
# float32, concurrency 16: 60 of 239 steps on the slower count in one run).
TRY_STEPS = 3
MARGIN = 0.1


class ThreadTuner:
    """Picks each step's thread count, `threads` or 1 (call ``begin`` before the step and
    ``end`` after it). `set_threads` and `clock` are torch's and perf_counter by default;
    tests pass their own."""

    def __init__(self, threads: int, *,
                 set_threads: Callable[[int], None] = torch.set_num_threads,
                 clock: Callable[[], float] = time.perf_counter,
                 min_interval: int = MIN_INTERVAL, max_interval: int = MAX_INTERVAL) -> None:
        if threads < 2:
            raise ValueError(f"nothing to choose with {threads} thread(s)")
        self.counts = (threads, 1)
        self.mode = threads
        self._set = set_threads
        self._clock = clock
        self.min_interval, self.max_interval = min_interval, max_interval
        self.interval = min_interval
        self.since = min_interval  # steps on the mode since the other count ran: try it soon
        self._avg: dict[int, dict[int, float]] = {}  # size class -> count -> seconds/step
        self._current = -1  # the count last set (-1: not set by the tuner yet)
        self._running: tuple[dict[int, float], int, float] | None = None
        self._try: list[float] = []  # a try in progress: its steps' time / the mode's
        self._seen: dict[tuple[int, int], int] = {}  # (size class, count) -> steps run
        self.steps_per_count = dict.fromkeys(self.counts, 0)

    @staticmethod
    def size_class(num_tokens: int) -> int:
        return min(max(num_tokens, 1).bit_length() - 1, MAX_CLASS)

    def other(self, n: int) -> int:
        return self.counts[n == self.counts[0]]

    def begin(self, num_tokens: int) -> int:
        """Set the thread count for a step of `num_tokens` tokens; returns it."""
        c = self.size_class(num_tokens)
        avg = self._avg.setdefault(c, {})
        # Try the other count only where the mode has a baseline of a few steps to
        # compare with.
        explore = self.since >= self.interval and self._seen.get((c, self.mode), 0) >= \
            TRY_STEPS
        n = self.other(self.mode) if explore else self.mode
        if n != self._current:
            self._set(n)
            self._current = n
        self.steps_per_count[n] += 1
        self._running = (avg, n, self._clock())
        self._seen[c, n] = self._seen.get((c, n), 0) + 1
        return n

    def end(self) -> None:
        """The step begun last is done: take its time into account."""
        if self._running is None:
            return
        avg, n, t0 = self._running
        self._running = None
        dt = self._clock() - t0
        other = self.other(n)
        if n != self.mode:  # a step of a try
            self._try.append(dt / avg[other])
            avg[n] = dt  # the count's baseline at this size, should it become the mode
            if len(self._try) < TRY_STEPS:
                return
            ratio = sum(self._try) / len(self._try)
            self._try = []
            if ratio < 1.0 - MARGIN:
                self._switch(n, ratio)
            else:
                self.interval = min(2 * self.interval, self.max_interval)
                self.since = 0
            return
        # Only tries switch: the other count's figures are single steps, too noisy to
        # compare the mode's average with (a machine that turns crowded is noticed at the
        # next try, within max_interval steps).
        avg[n] = dt if n not in avg else avg[n] + ALPHA * (dt - avg[n])
        self.since += 1

    def _switch(self, n: int, ratio: float) -> None:
        # Logged: a run's speed depends on the mode, and which one a run ended on is the
        # first thing to know when two runs of one benchmark disagree.
        logger.info("torch threads per step: %d -> %d (%.2fx the time; %s steps so far on "
                    "each count)", self.mode, n, ratio,
                    "/".join(map(str, self.steps_per_count.values())))
        self.mode, self.interval, self.since = n, self.min_interval, 0
        self._try = []

    def best(self, num_tokens: int | None = None) -> int:
        """The count steps run on now (the mode; one for every size)."""
        return self.mode
