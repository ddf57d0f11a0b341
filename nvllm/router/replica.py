"""The router's connection to one replica's leader: a DEALER speaking the client
protocol, whether the replica is up, and the control answers it owes.

A replica is up once it answered ``health`` ready, and down when its connection drops
(the ZMQ monitor sees a leader that died at once: its socket closes) or when it has not
answered ``health`` for ``replica_timeout_s``. Only a dropped connection fails the
requests the router has in flight there: a slow leader may still finish them.

With a CURVE key folder the link is a keyed client of the leader, as any client is
(DIR/server.key, DIR/client.key_secret; common/zmq_utils.py): a replica on another host
admits the router and nobody without a key in its DIR/clients/.
"""

from __future__ import annotations

import os
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import msgspec
import zmq
from zmq.utils.monitor import parse_monitor_message

from nvllm.common import client_protocol as cp
from nvllm.common.zmq_utils import curve_client

HEALTH_INTERVAL_S = 0.5  # also the router's keep-alive: a leader aborts silent clients
_EVENTS = zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_CLOSED


@dataclass(slots=True)
class ReplicaLink:
    index: int
    endpoint: str
    sock: zmq.Socket
    monitor: zmq.Socket
    connected: bool = False
    ready: bool = False  # its last health answer
    reason: str | None = "not answered yet"  # why it is not up
    info: dict[str, Any] | None = None
    last_answer: float = field(default_factory=time.monotonic)
    last_health_sent: float = 0.0
    load: int = 0  # requests the router has in flight here
    # Control requests sent and not answered yet, in order (answers come in order).
    pending: deque[str] = field(default_factory=deque)

    @classmethod
    def connect(cls, ctx: zmq.Context, index: int, endpoint: str,
                max_frame_bytes: int, curve_key_dir: str | os.PathLike | None = None
                ) -> ReplicaLink:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, max_frame_bytes)
        if curve_key_dir is not None:  # keys must be set before connect
            curve_client(sock, curve_key_dir)
        monitor = sock.get_monitor_socket(_EVENTS)
        sock.connect(endpoint)
        return cls(index, endpoint, sock, monitor)

    @property
    def up(self) -> bool:
        return self.connected and self.ready and self.info is not None

    def send(self, msg: dict[str, Any] | cp.ClientMessage) -> bool:
        """Send without blocking; False when ZMQ cannot take it now (no connection)."""
        frame = cp.encode(msg) if isinstance(msg, cp.ClientMessage) else \
            msgspec.msgpack.encode(msg)
        try:
            self.sock.send(frame, flags=zmq.NOBLOCK)
            return True
        except zmq.Again:
            return False

    def ask(self, request: cp.ClientMessage) -> bool:
        if self.send(request):
            self.pending.append(request.OP)
            return True
        return False

    def poll_health(self, now: float, timeout_s: float) -> None:
        """Ask for health every HEALTH_INTERVAL_S (and info until it has one); a replica
        silent past `timeout_s` is not up."""
        if now - self.last_health_sent >= HEALTH_INTERVAL_S:
            self.last_health_sent = now
            if self.info is None and "info" not in self.pending:
                self.ask(cp.InfoRequest())
            if len(self.pending) < 8:  # a stalled leader is not sent an endless queue
                self.ask(cp.HealthRequest())
        if self.ready and now - self.last_answer > timeout_s:
            self.ready = False
            self.reason = f"no answer for {timeout_s:g} s"

    def link_events(self) -> bool:
        """Read the monitor; True when the connection dropped since the last call."""
        dropped = False
        while self.monitor.poll(0):
            event = parse_monitor_message(self.monitor.recv_multipart())["event"]
            if event == zmq.EVENT_CONNECTED:
                self.connected = True
            elif self.connected:
                self.connected, self.ready, dropped = False, False, True
                self.reason = "its connection closed (the leader exited?)"
                self.pending.clear()
                self.info = None  # a restarted leader may differ
        return dropped

    def answered(self, op: str) -> None:
        self.last_answer = time.monotonic()
        if self.pending and self.pending[0] == op:
            self.pending.popleft()
        elif op in self.pending:
            self.pending.remove(op)

    def close(self) -> None:
        self.sock.disable_monitor()
        self.monitor.close(0)
        self.sock.close(0)
