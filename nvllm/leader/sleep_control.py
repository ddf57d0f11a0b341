"""The served engine's sleep, wake_up and state messages (docs/protocol.md), on the
server's one thread.

A ``sleep`` pauses at once (as ``pause`` with its mode) and is answered once the pause
settled and every rank freed its memory: for ``wait``, after the running requests
finished, while the server keeps stepping them. Requests that arrive while the engine
sleeps wait for the wake, as in any pause. A refusal (already asleep, an update being
staged, a rank that cannot sleep) is a ``bad_state`` error and changes nothing else.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from nvllm.common import client_protocol as cp
from nvllm.common.errors import EngineDeadError

if TYPE_CHECKING:
    from nvllm.leader.server import EngineServer

logger = logging.getLogger(__name__)

MESSAGES = (cp.Sleep, cp.WakeUp, cp.StateRequest)


class SleepControl:
    def __init__(self, server: EngineServer) -> None:
        self.server = server
        self.engine = server.engine
        self.waiting: list[tuple[bytes, int]] = []  # sleeps whose pause has not settled

    def handle(self, client: bytes, msg: Any) -> None:
        try:
            self._handle(client, msg)
        except (ValueError, RuntimeError, EngineDeadError) as e:
            self._refuse(client, e)

    def _handle(self, client: bytes, msg: Any) -> None:
        eng, srv = self.engine, self.server
        if isinstance(msg, cp.StateRequest):
            report = eng.sleep_report()
            return srv._send(client, cp.EngineState(
                eng.is_sleeping, eng.is_paused, report.level, report.asleep,
                report.weights_missing, eng.weight_version))
        if isinstance(msg, cp.Sleep):
            srv._emit(eng.begin_sleep(msg.level, msg.mode))
            self.waiting.append((client, msg.level))
            return self.poll()
        if isinstance(msg, cp.WakeUp):
            return srv._send(client, cp.WokeUp.of(eng.wake_up(msg.tags)))
        raise AssertionError(f"not a sleep message: {type(msg).__name__}")

    def poll(self) -> None:
        """Put the engine to sleep once the pause settled, and answer every sleep that
        waited for it (a second one finds the engine asleep: it gets the state)."""
        if self.waiting and not self.engine.is_paused:  # a resume overtook the pause
            for client, _ in self.waiting:
                self.server._error(client, None, "resumed", "generation was resumed "
                                   "before the sleep's pause settled: not asleep")
            self.waiting = []
        if not self.waiting or not self.engine.pause_complete:
            return
        waiting, self.waiting = self.waiting, []
        for client, level in waiting:
            try:
                if self.engine.is_sleeping:
                    report = self.engine.sleep_report()
                else:
                    report = self.engine.finish_sleep(level)
            except (RuntimeError, EngineDeadError) as e:
                self._refuse(client, e)
                continue
            self.server._send(client, cp.Slept.of(report))

    def _refuse(self, client: bytes, e: Exception) -> None:
        if isinstance(e, EngineDeadError):
            self.server._error(client, None, "engine_unavailable", str(e).split("\n")[0])
        else:
            self.server._error(client, None, "bad_state", str(e))
