"""Whether speculative decoding pays at the current batch size, decided by measuring.

Speculating costs twice over: a step that may propose runs synchronously (the leader's
work between steps is no longer hidden behind the workers' forward), and every drafted
token is a row in the forward whether or not it is accepted. Where the forward is bound
by reading the weights (one sequence, or a GPU at small batch) extra rows are nearly
free and accepted drafts are pure gain. Where it is bound by arithmetic (a CPU at 16
sequences: the GEMMs grow with the rows) a rejected draft costs as much as a token, and
on the 2-core bench (scripts/bench_spec.py, SmolLM2-135M, text with nothing to copy)
speculating at concurrency 16 gave 0.81-0.89x of not speculating, while one copying
sequence gained 2.6x. Which case a deployment is in depends on the machine, the model
and what its users ask, so no batch-size threshold is right everywhere
(``disable_by_batch_size`` stays for those who know theirs).

The gate measures instead, per batch-size class (running sequences, in powers of two):
output tokens per second of engine step time, over windows of ``window`` steps, with
speculation on and off. It runs windows in the class's mode (on at first: the user asked
for speculation; a class first met next to one that has measured both modes starts in
that one's mode), tries the other mode for one window now and then, and switches when
the other mode's rate is higher. The wait between tries doubles each time the try loses
(``min_interval`` to ``max_interval`` windows), so a right mode costs about one window in
``max_interval``; a switch won by one lucky window is undone as soon as the mode's
average falls below the other's (the first window after a switch replaces the try's
figure rather than averaging with it). Output tokens count accepted drafts, so the rate is
what a user sees, whatever the acceptance and the cost of a row are.

Per-sequence pauses (AcceptanceGate: a sequence whose drafts are mostly rejected stops
proposing for a while) are part of the on mode: a step allowed to speculate counts in an
on-window even when every sequence was paused in it. Were such steps left out, a useless
draft would keep its sequences paused and the on-window would never fill, so the gate
would never reach the verdict that turns it off. And a whole on-window in which no
sequence could propose is that verdict itself: the class goes off, and tries on again
with the usual backoff.

Exactness does not depend on it: with speculation off a sequence decodes one token per
step, with it on the verify step gives the same tokens (greedy) or the same distribution
(sampling); the gate changes only how fast.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)

WINDOW = 8  # steps per measured window
MIN_INTERVAL = 4  # windows in the mode before the other mode is tried again, at first
MAX_INTERVAL = 128
ALPHA = 0.3  # weight of a new window's rate in its mode's running average
MAX_CLASS = 10  # 1024 running sequences and more share a class


@dataclass(slots=True)
class _Class:
    mode: bool = True  # speculate?
    interval: int = MIN_INTERVAL
    since: int = MIN_INTERVAL  # windows in the mode since the other ran: try it soon
    rate: dict[bool, float] = field(default_factory=dict)  # mode -> output tokens/s
    fresh: bool = False  # switched on one try's window: the next one in the mode decides
    # The window being measured: its mode, steps, output tokens, seconds.
    w_mode: bool = True
    w_steps: int = 0
    w_tokens: int = 0
    w_time: float = 0.0
    w_active: int = 0  # of its steps, those in which a sequence could propose


class SpecGate:
    """``allow(num_running)`` before a step: whether it may speculate. ``record(...)``
    after it: what it produced and how long it took."""

    def __init__(self, window: int = WINDOW, min_interval: int = MIN_INTERVAL,
                 max_interval: int = MAX_INTERVAL) -> None:
        if window < 1 or not 1 <= min_interval <= max_interval:
            raise ValueError("SpecGate: window >= 1 and 1 <= min_interval <= max_interval")
        self.window, self.min_interval, self.max_interval = window, min_interval, max_interval
        self._classes: dict[int, _Class] = {}
        self.num_switches = 0

    @staticmethod
    def size_class(num_running: int) -> int:
        return min(max(num_running, 1).bit_length() - 1, MAX_CLASS)

    def _cls(self, num_running: int) -> _Class:
        c = self.size_class(num_running)
        st = self._classes.get(c)
        if st is None:
            st = self._classes[c] = _Class(interval=self.min_interval,
                                           since=self.min_interval)
            near = [n for n in (self._classes.get(c + 1), self._classes.get(c - 1))
                    if n is not None and len(n.rate) == 2]
            if near:  # neighbours' costs are alike: start as the nearest decided one
                st.mode = st.w_mode = near[0].mode
                st.since = 0  # and try the other mode only after the usual wait
        return st

    def allow(self, num_running: int) -> bool:
        """Whether the next step at this batch size may speculate: the mode of its class,
        or the other mode while a window tries it."""
        st = self._cls(num_running)
        if st.w_steps == 0:  # a new window starts: the mode, or a try of the other
            explore = st.since >= st.interval and st.mode in st.rate
            st.w_mode = (not st.mode) if explore else st.mode
        return st.w_mode

    def record(self, num_running: int, allowed: bool, tokens: int, seconds: float,
               speculated: bool = True) -> None:
        """One step's outcome: whether it was allowed to speculate (``allow``'s answer),
        the output tokens it produced, its engine time, and whether any sequence could
        propose in it (false: every one paused for low acceptance).

        A step counts in its window's mode whether or not it speculated: pauses are part
        of what speculating delivers (with a draft model a paused step costs nothing
        extra), and a window of on-steps then always fills. A window allowed to speculate
        in which no step could is a verdict for off: speculation helped none of the
        class's sequences for a whole window."""
        st = self._cls(num_running)
        if allowed != st.w_mode or seconds <= 0:
            return
        st.w_steps += 1
        st.w_tokens += tokens
        st.w_time += seconds
        st.w_active += speculated
        if st.w_steps >= self.window:
            self._close_window(st)

    def _close_window(self, st: _Class) -> None:
        mode, rate = st.w_mode, st.w_tokens / st.w_time
        idle = mode and not st.w_active
        st.w_steps, st.w_tokens, st.w_time, st.w_active = 0, 0, 0.0, 0
        other = not mode
        if idle:  # nobody could speculate: on lost, whatever the rate says
            self._on_idle(st, rate)
            return
        if mode == st.mode:
            old = st.rate.get(mode)
            st.rate[mode] = rate if old is None or st.fresh else old + ALPHA * (rate - old)
            st.fresh = False
            st.since += 1
            if other in st.rate and st.rate[mode] < st.rate[other]:  # a lucky switch
                self._switch(st, other)
            return
        st.rate[mode] = rate  # a try stands for its mode as measured now
        if rate > st.rate[other]:
            self._switch(st, mode)
        else:
            st.interval = min(2 * st.interval, self.max_interval)
            st.since = 0

    def _on_idle(self, st: _Class, rate: float) -> None:
        """An on-window in which no sequence could propose: the class goes off, or a try
        of on counts as lost. On's rate is forgotten (the window measured off's, in
        effect; an older on figure could win the class straight back), so on is next
        judged by its next try; the window's rate stands for off's until off's first
        window replaces it."""
        if st.mode:
            st.rate.pop(True, None)
            st.rate.setdefault(False, rate)
            logger.info("speculative decoding off at this batch size: no sequence could "
                        "propose through a window (paused for low acceptance)")
            st.mode, st.interval, st.since, st.fresh = False, self.min_interval, 0, True
            self.num_switches += 1
        else:
            st.interval = min(2 * st.interval, self.max_interval)
            st.since = 0

    def _switch(self, st: _Class, mode: bool) -> None:
        logger.info("speculative decoding %s at this batch size: %.0f vs %.0f output tok/s",
                    "on" if mode else "off", st.rate[mode], st.rate[not mode])
        st.mode, st.interval, st.since = mode, self.min_interval, 0
        st.fresh = True
        self.num_switches += 1

    def modes(self) -> dict[int, bool]:
        """Each batch-size class's mode (class k: 2**k to 2**(k+1) - 1 sequences)."""
        return {c: st.mode for c, st in sorted(self._classes.items())}
