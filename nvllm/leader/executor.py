"""The leader's handle on the worker group: send plans, receive results, watch liveness.

One PUSH socket per worker (every rank gets every plan; one serialization, N sends) and
one PULL socket that all ranks push to (rank 0's results, every rank's ready and error
messages). The leader never blocks on a receive for long: between short polls it asks
the launcher whether every worker process is still alive.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import zmq

from nvllm.common import protocol
from nvllm.common.errors import EngineDeadError, ProtocolError
from nvllm.common.zmq_utils import bind_random, make_socket

logger = logging.getLogger(__name__)

POLL_MS = 100


class WorkerGroupClient:
    def __init__(self, num_workers: int, host: str = "127.0.0.1") -> None:
        self.ctx = zmq.Context()
        self.num_workers = num_workers
        self.plan_socks = [make_socket(self.ctx, zmq.PUSH) for _ in range(num_workers)]
        self.plan_endpoints = [bind_random(s, host) for s in self.plan_socks]
        self.result_sock = make_socket(self.ctx, zmq.PULL)
        self.result_endpoint = bind_random(self.result_sock, host)
        # Returns None while all workers live, else a description of what died.
        self.liveness_check: Callable[[], str | None] = lambda: None
        self.dead: str | None = None

    def broadcast(self, msg: Any) -> int:
        self._check_dead()
        data = protocol.encode(msg)
        for sock in self.plan_socks:
            sock.send(data, copy=False)
        return len(data)

    def recv(self, timeout_s: float) -> Any:
        """Next message from any worker; raises EngineDeadError on death or timeout."""
        self._check_dead()
        deadline = time.monotonic() + timeout_s
        while True:
            if self.result_sock.poll(POLL_MS):
                data = self.result_sock.recv()
                try:
                    msg = protocol.decode(data)
                except ProtocolError as e:
                    logger.error("dropping malformed frame from a worker: %s", e)
                    continue
                if isinstance(msg, protocol.WorkerError):
                    error = (f"worker rank {msg.rank} failed at step {msg.step_id}: "
                             f"{msg.message}\n{msg.traceback}")
                    # A peer's death surfaces on the survivors as a collective error;
                    # name the root cause first.
                    died = self._death_within(0.5)
                    self.dead = error if died is None else f"{died}; then {error}"
                    raise EngineDeadError(self.dead)
                return msg
            dead = self.liveness_check()
            if dead is not None:
                self.dead = dead
                raise EngineDeadError(dead)
            if time.monotonic() > deadline:
                self.dead = f"no answer from the workers within {timeout_s:.0f} s"
                raise EngineDeadError(self.dead)

    def _death_within(self, grace_s: float) -> str | None:
        deadline = time.monotonic() + grace_s
        while (died := self.liveness_check()) is None and time.monotonic() < deadline:
            time.sleep(0.05)
        return died

    def _check_dead(self) -> None:
        if self.dead is not None:
            raise EngineDeadError(self.dead)

    def close(self) -> None:
        for s in (*self.plan_socks, self.result_sock):
            s.close(0)
        self.ctx.term()
