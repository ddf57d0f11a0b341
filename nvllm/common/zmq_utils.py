"""Small ZMQ helpers: sockets bound to ephemeral loopback ports, never fixed ones."""

from __future__ import annotations

import zmq


def bind_random(sock: zmq.Socket, host: str = "127.0.0.1") -> str:
    """Bind to an OS-chosen port so two engines can run side by side; returns endpoint."""
    port = sock.bind_to_random_port(f"tcp://{host}")
    return f"tcp://{host}:{port}"


def make_socket(ctx: zmq.Context, kind: int, *, max_msg_bytes: int = -1) -> zmq.Socket:
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    if max_msg_bytes > 0:
        # Oversized frames are dropped by ZMQ itself before they reach Python.
        sock.setsockopt(zmq.MAXMSGSIZE, max_msg_bytes)
    return sock
