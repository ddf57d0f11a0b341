"""The data-parallel launcher's Supervisor without engines: a child that exits is started
again on its port after a growing backoff (never sooner than its own minimum), one that
keeps dying is given up after MAX_RESTARTS, and one that served long enough before it
died has its count reset."""

from __future__ import annotations

import logging
import subprocess
import sys
import threading
import time

import pytest

from nvllm.launch import supervisor as sv


def _proc(code: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code])


@pytest.fixture
def fast(monkeypatch):
    monkeypatch.setattr(sv, "RESTART_BACKOFF_S", 0.01)
    monkeypatch.setattr(sv, "MAX_RESTARTS", 2)
    monkeypatch.setattr(sv, "POLL_S", 0.02)
    monkeypatch.setattr(sv, "WORKERS_EXIT_S", 0.02)


def supervise(sup: sv.Supervisor, until, timeout_s: float = 30) -> None:
    stop = threading.Event()
    thread = threading.Thread(target=sup.run, args=(stop,), daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout_s
    try:
        while not until():
            assert time.monotonic() < deadline, "timed out"
            time.sleep(0.05)
    finally:
        stop.set()
        thread.join(10)
        sv.stop_processes(list(sup.procs().values()))


def test_a_replica_that_keeps_dying_is_restarted_on_its_port_then_given_up(fast, tmp_path,
                                                                          caplog):
    caplog.set_level(logging.WARNING, logger=sv.__name__)
    starts = []

    def start(port: int):
        starts.append(port)
        return _proc("raise SystemExit(3)"), str(tmp_path / "never-written")

    sup = sv.Supervisor(start_timeout_s=5)
    sup.add("replica 0", _proc("raise SystemExit(9)"), "tcp://127.0.0.1:4321", start)
    supervise(sup, lambda: sup.children[0].given_up)
    assert starts == [4321, 4321] and sup.restarted == 0
    assert [r.getMessage() for r in caplog.records if "restarting" in r.getMessage()] == [
        "restarting replica 0 on port 4321 in 0.01 s (attempt 1 of 2)",
        "restarting replica 0 on port 4321 in 0.02 s (attempt 2 of 2)"]
    assert "exited 3 times in a row: not restarted again" in caplog.text


def test_a_replica_that_served_long_enough_is_restarted_every_time(fast, tmp_path,
                                                                   monkeypatch):
    monkeypatch.setattr(sv, "STABLE_AFTER_S", 0.0)  # every exit comes after a stable run
    path = tmp_path / "replica-0.endpoint"

    def start(port: int):
        path.write_text(f"tcp://127.0.0.1:{port}")
        return _proc("import time; time.sleep(0.1)"), str(path)  # serves, then dies

    sup = sv.Supervisor(start_timeout_s=5)
    sup.add("router", _proc("pass"), "tcp://127.0.0.1:4322", start)
    supervise(sup, lambda: sup.restarted > sv.MAX_RESTARTS)
    assert not sup.children[0].given_up


def test_a_child_waits_its_minimum_delay(fast, tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger=sv.__name__)
    path = tmp_path / "router.endpoint"

    def start(port: int):
        path.write_text(f"tcp://127.0.0.1:{port}")
        return _proc("import time; time.sleep(30)"), str(path)

    sup = sv.Supervisor(start_timeout_s=5)
    sup.add("router", _proc("pass"), "tcp://127.0.0.1:4323", start, min_delay_s=0.2)
    t0 = time.monotonic()
    supervise(sup, lambda: sup.restarted == 1)
    assert time.monotonic() - t0 >= 0.2
    assert "restarting router on port 4323 in 0.2 s (attempt 1 of 2)" in caplog.text
