"""The data-parallel launcher's children kept alive: each replica and the router.

A child that exits while the launch serves is started again on the port it served on,
so whoever connects to it (the router to a replica, clients and the gateway to the
router) reconnects by itself. Before a replica starts again the shared-memory segments
its leader and workers left are removed (a SIGKILLed leader unlinks nothing, and its
workers die with it). Restarts are bounded: at most ``MAX_RESTARTS`` in a row, the k-th
after ``RESTART_BACKOFF_S * 2**k`` (and never sooner than the child's own
``min_delay_s``); a child that served ``STABLE_AFTER_S`` since its last start has its
count reset, so a crash a day is restarted every time and a crash loop is not.
"""

from __future__ import annotations

import logging
import os
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from nvllm.common.shm_segments import sweep_orphan_segments

logger = logging.getLogger(__name__)

STOP_TIMEOUT_S = 15.0  # a child's own shutdown (a replica's workers too) after SIGTERM
MAX_RESTARTS = 3
RESTART_BACKOFF_S = 1.0
STABLE_AFTER_S = 60.0
POLL_S = 0.5  # how often the supervisor looks at its children
WORKERS_EXIT_S = 1.0  # a dead leader's workers notice within this (their parent watch)

# (port) -> the child process serving on it and the file its endpoint will be in.
Start = Callable[[int], tuple[subprocess.Popen, str]]


def stop_processes(procs: list[subprocess.Popen], timeout_s: float = STOP_TIMEOUT_S) -> None:
    """SIGTERM (each drains and stops its own children), then SIGKILL what is left."""
    for p in procs:
        if p.poll() is None:
            p.terminate()
    deadline = time.monotonic() + timeout_s
    for p in procs:
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def child_pids(pid: int) -> set[int]:
    """The live processes whose parent is `pid` (from /proc; empty where there is none)."""
    out = set()
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else ():
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            if ppid == pid:
                out.add(int(entry))
    return out


@dataclass(slots=True)
class Child:
    name: str  # for the log: "replica 0", "router"
    proc: subprocess.Popen
    port: int
    start: Start
    min_delay_s: float = 0.0
    # Its processes' pids (a replica's leader and workers), whose segments die with them.
    owners: set[int] = field(default_factory=set)
    started: float = field(default_factory=time.monotonic)
    restarts: int = 0  # in a row (reset once it served STABLE_AFTER_S)
    given_up: bool = False


class Supervisor:
    """Restarts the children that exit (``run``, a loop until `stop`)."""

    def __init__(self, start_timeout_s: float) -> None:
        self.start_timeout_s = start_timeout_s
        self.children: list[Child] = []
        self.restarted = 0  # children that came back and serve
        self._lock = threading.Lock()  # procs are replaced here and stopped by the launcher

    def add(self, name: str, proc: subprocess.Popen, endpoint: str, start: Start, *,
            min_delay_s: float = 0.0, sweep_segments: bool = False) -> Child:
        """Supervise `proc`, serving on `endpoint`; `sweep_segments`: it and its children
        (started by now) own /dev/shm segments to remove when they die."""
        owners = {proc.pid} | child_pids(proc.pid) if sweep_segments else set()
        child = Child(name, proc, int(endpoint.rsplit(":", 1)[1]), start, min_delay_s,
                      owners)
        self.children.append(child)
        return child

    def procs(self) -> dict[str, subprocess.Popen]:
        """Each child's current process, by name."""
        with self._lock:
            return {c.name: c.proc for c in self.children}

    def owners(self) -> set[int]:
        return set().union(*(c.owners for c in self.children))

    def run(self, stop: threading.Event) -> None:
        while not stop.wait(POLL_S):
            for c in self.children:
                if not c.given_up and c.proc.poll() is not None:
                    self._replace(c, stop)

    def _replace(self, c: Child, stop: threading.Event) -> None:
        logger.error("%s (pid %d) exited with code %s", c.name, c.proc.pid,
                     c.proc.returncode)
        if c.owners:
            stop.wait(WORKERS_EXIT_S)  # before its segments go: its workers may hold them
            swept = sweep_orphan_segments(c.owners)
            if swept:
                logger.info("removed %d shared-memory segment(s) of exited processes: %s",
                            len(swept), swept)
        if time.monotonic() - c.started > STABLE_AFTER_S:
            c.restarts = 0
        if c.restarts >= MAX_RESTARTS:
            c.given_up = True
            logger.error("%s exited %d times in a row: not restarted again (restart the "
                         "launch to bring it back)", c.name, c.restarts + 1)
            return
        delay = max(c.min_delay_s, RESTART_BACKOFF_S * 2 ** c.restarts)
        c.restarts += 1
        logger.warning("restarting %s on port %d in %g s (attempt %d of %d)", c.name,
                       c.port, delay, c.restarts, MAX_RESTARTS)
        if stop.wait(delay):
            return
        with self._lock:
            if stop.is_set():
                return
            c.proc, path = c.start(c.port)
            c.started = time.monotonic()
        if c.owners:
            c.owners.add(c.proc.pid)
        if self._wait_serving(c, path, stop):
            if c.owners:
                c.owners = {c.proc.pid} | child_pids(c.proc.pid)
            self.restarted += 1
            logger.warning("%s is back (pid %d, port %d)", c.name, c.proc.pid, c.port)

    def _wait_serving(self, c: Child, path: str, stop: threading.Event) -> bool:
        """Until the new process wrote its endpoint; False if it exited first (the next
        turn counts that attempt), or was stopped for taking too long."""
        deadline = time.monotonic() + self.start_timeout_s
        while not os.path.exists(path):
            if c.proc.poll() is not None or stop.is_set():
                return False
            if time.monotonic() > deadline:
                logger.error("%s did not serve within %.0f s: stopping it", c.name,
                             self.start_timeout_s)
                stop_processes([c.proc])
                return False
            stop.wait(0.1)
        return True
