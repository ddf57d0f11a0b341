"""The leader's heartbeat answers (HeartbeatMonitor) on a bare WorkerGroupClient: they come
from libzmq, so a leader whose Python holds the GIL for seconds (a full garbage collection
on a loaded machine, a C extension call) still answers, and workers do not leave it."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import textwrap
import time

import msgpack
import zmq

from nvllm.leader.worker_client import WorkerGroupClient

# Connects, says "ready", waits for the parent to take the GIL, then prints the round trip
# of one ping (in seconds; "none" without an answer within 10 s).
PINGER = textwrap.dedent("""
    import sys, time, zmq, msgpack
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(sys.argv[1])
    print("ready", flush=True)
    time.sleep(0.3)
    t0 = time.monotonic()
    s.send(msgpack.packb([0, 1, "pinger"]))
    print(time.monotonic() - t0 if s.poll(10_000) else "none", flush=True)
""")


def hold_gil(seconds: float) -> None:
    """usleep through a PyDLL: a C call that keeps the GIL for its whole duration."""
    ctypes.PyDLL(None).usleep(int(seconds * 1e6))


def test_heartbeats_are_answered_while_the_leader_holds_the_gil():
    client = WorkerGroupClient(1, "127.0.0.1", heartbeat_timeout_s=4.0)
    pinger = subprocess.Popen([sys.executable, "-c", PINGER, client.heartbeat_endpoint],
                              stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    try:
        assert pinger.stdout.readline().strip() == "ready"
        hold_gil(2.5)
        out, _ = pinger.communicate(timeout=15)
        assert out.strip() != "none", "the heartbeat was never answered"
        assert float(out) < 1.5, f"answered only after {float(out):.2f} s, when the GIL came free"
        deadline = time.monotonic() + 5
        while 0 not in client.heartbeats.last_seen and time.monotonic() < deadline:
            time.sleep(0.02)
        assert client.heartbeats.where[0] == "pid 1 on pinger"
    finally:
        if pinger.poll() is None:
            pinger.kill()
        pinger.wait()
        client.close()


def test_malformed_heartbeats_are_echoed_but_never_counted_and_close_ends_the_threads():
    client = WorkerGroupClient(2, "127.0.0.1")
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(client.heartbeat_endpoint)
    try:
        for frame in (b"\xc1", msgpack.packb([7, 1, "h"]), msgpack.packb(["0", 1, "h"]),
                      msgpack.packb([1, 42, "host"])):
            sock.send(frame)
            assert sock.poll(5000) and sock.recv() == frame
        deadline = time.monotonic() + 5
        while 1 not in client.heartbeats.last_seen and time.monotonic() < deadline:
            time.sleep(0.02)
        assert client.heartbeats.where == {1: "pid 42 on host"}
    finally:
        sock.close(0)
        ctx.term()
        hb = client.heartbeats
        client.close()
    assert not hb._echo.is_alive() and not hb._thread.is_alive()
