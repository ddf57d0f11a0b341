"""Per-hop timestamps of the online path, written when ``NVLLM_TRACE=<path prefix>`` is set.

Each process appends JSON lines to its own file ``<prefix>.<role>-<pid>.jsonl`` (roles:
``worker``, ``leader``, ``http``); ``python -m nvllm.launch.trace_report <prefix>`` joins
them into per-hop latencies. The records, one short object per line:

- worker rank 0: ``{"ev": "result_sent", "step", "t"}`` just before it sends a StepResult;
- leader: ``{"ev": "result_recv", "step", "t"}`` when that StepResult is read off the
  socket, and ``{"ev": "out_sent", "rid", "i", "n", "step", "t"}`` when an ``output``
  message has been handed to ZMQ (``step``: the step whose result produced it; null for
  messages no step produced, such as an abort's);
- gateway (``http``): ``{"ev": "out_recv", "rid", "i", "n", "t"}`` when an ``output``
  frame is decoded, and ``{"ev": "sse_sent", "rid", "i", "n", "t"}`` once its SSE chunk
  was handed to the HTTP response.

``rid`` is the client's request id (what the gateway's AsyncClient sent and the leader
echoes), ``i`` the completion index, and ``n`` the message's ordinal within that completion
(1, 2, ...): both sides count the same messages, so (rid, i, n) joins them. ``t`` is
``time.time()``: every process is on one machine, so wall clocks compare; do not join
records of processes on different hosts.

Off (the variable unset), ``tracer(role)`` returns None and each hop costs one ``if``.
On, records are buffered in memory and written by a background thread every second and
at exit (``close`` or the interpreter's exit), never one write per token.
"""

from __future__ import annotations

import atexit
import collections
import json
import os
import threading
import time
from typing import Any

ENV = "NVLLM_TRACE"
FLUSH_INTERVAL_S = 1.0


class Tracer:
    """One process's trace file for one role."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._buf: collections.deque[str] = collections.deque()
        self._counts: dict[tuple, int] = {}
        self._lock = threading.Lock()
        self._file = open(path, "a", encoding="utf-8")  # closed by close()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="nvllm-trace")
        self._thread.start()
        atexit.register(self.close)

    def event(self, ev: str, **fields: Any) -> None:
        """Record `ev` now with `fields` (JSON-serializable values)."""
        fields["ev"] = ev
        fields["t"] = time.time()
        self._buf.append(json.dumps(fields, separators=(",", ":")))

    def ordinal(self, ev: str, rid: Any, index: int, last: bool) -> int:
        """The ordinal (1, 2, ...) of this `ev` message of completion (rid, index); `last`
        (its final message) forgets the completion."""
        key = (ev, rid, index)
        n = self._counts.pop(key, 0) + 1
        if not last:
            self._counts[key] = n
        return n

    def message(self, ev: str, rid: Any, index: int, last: bool, **fields: Any) -> None:
        """Record one output message of completion (rid, index) with its ordinal."""
        rid = str(rid)
        self.event(ev, rid=rid, i=index, n=self.ordinal(ev, rid, index, last), **fields)

    def flush(self) -> None:
        with self._lock:
            if self._file.closed:
                return
            lines = []
            while self._buf:
                lines.append(self._buf.popleft())
            if lines:
                self._file.write("\n".join(lines) + "\n")
                self._file.flush()

    def _run(self) -> None:
        while not self._stop.wait(FLUSH_INTERVAL_S):
            self.flush()

    def close(self) -> None:
        """Write what is buffered and close the file (idempotent; also runs at exit)."""
        self._stop.set()
        self.flush()
        with self._lock:
            self._file.close()


_tracers: dict[str, Tracer] = {}
_lock = threading.Lock()


def tracer(role: str) -> Tracer | None:
    """This process's tracer for `role` when $NVLLM_TRACE is set, else None. Call it once
    at start-up and keep the result: one file per (role, process)."""
    prefix = os.environ.get(ENV)
    if not prefix:
        return None
    with _lock:
        t = _tracers.get(role)
        if t is None or t._file.closed:
            t = _tracers[role] = Tracer(f"{prefix}.{role}-{os.getpid()}.jsonl")
        return t
