"""The served engine's RL operations: pause, resume and weight updates from ZMQ clients
(docs/protocol.md), on the server's one thread.

A weight update belongs to the client that sent its chunk 0; its other chunks and its
commit must come from that client, and a chunk 0 from anyone starts a new update (the old
one is dropped on every rank). An owner that goes silent for ``client_timeout_s`` (a
trainer killed mid-update) has its update dropped: the old weights stay. A ``wait``-mode
pause is answered once the running requests finished; until then the server keeps
stepping them.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from nvllm.common import client_protocol as cp
from nvllm.common.errors import EngineDeadError
from nvllm.common.weight_transfer import WeightUpdateError

if TYPE_CHECKING:
    from nvllm.leader.server import EngineServer

logger = logging.getLogger(__name__)

MESSAGES = (cp.PauseGeneration, cp.ResumeGeneration, cp.WeightsChunk, cp.WeightsCommit,
            cp.WeightsAbort, cp.InitWeightUpdateGroup, cp.WeightsFromDistributed,
            cp.UpdateWeightsFromPath)


class RolloutControl:
    def __init__(self, server: EngineServer) -> None:
        self.server = server
        self.engine = server.engine
        self.owner: bytes | None = None  # the client whose update is being staged
        self.update_id: int | None = None
        self.pause_waiters: list[bytes] = []
        self.owner_heard = 0.0  # when the owner last sent a weight message

    @property
    def settled(self) -> bool:
        """Paused with nothing left to step: the server waits on its socket."""
        return self.engine.is_paused and self.engine.pause_complete

    def handle(self, client: bytes, msg: Any) -> None:
        try:
            self._handle(client, msg)
        except WeightUpdateError as e:
            self.update_id = self.owner = None
            self.server._error(client, None, "weights_refused", str(e))
        except EngineDeadError as e:
            self.update_id = self.owner = None
            self.server._error(client, None, "engine_unavailable", str(e).split("\n")[0])
        except RuntimeError as e:  # not now (asleep, weights missing): the state is kept
            self.server._error(client, None, "bad_state", str(e))

    def _handle(self, client: bytes, msg: Any) -> None:
        eng, srv = self.engine, self.server
        if client == self.owner:
            self.owner_heard = time.monotonic()
        if isinstance(msg, cp.PauseGeneration):
            srv._emit(eng.pause_generation(msg.mode, msg.clear_cache))
            self.pause_waiters.append(client)
            return self.poll()
        if isinstance(msg, cp.ResumeGeneration):
            self._drop_update()
            for waiter in self.pause_waiters:  # a wait-mode pause that never settled
                srv._error(waiter, None, "resumed", "generation was resumed before the "
                                                    "pause settled")
            self.pause_waiters.clear()
            eng.resume_generation()
            return srv._send(client, cp.Resumed())
        if isinstance(msg, cp.InitWeightUpdateGroup | cp.UpdateWeightsFromPath):
            return self._weight_source(client, msg)
        if isinstance(msg, cp.WeightsChunk | cp.WeightsFromDistributed):
            if msg.chunk == 0:
                self._drop_update()
                try:
                    self.update_id = eng.begin_weight_update()
                except RuntimeError as e:
                    return srv._error(client, None, "bad_state", str(e))
                self.owner, self.owner_heard = client, time.monotonic()
            elif not self._owns(client):
                return srv._error(client, None, "bad_state", "no weight update of this "
                                  "client is being staged: send its chunk 0 first")
            if isinstance(msg, cp.WeightsFromDistributed):  # the trainer broadcasts
                eng.stage_from_group(self.update_id, msg.chunk, msg.names, msg.dtypes,
                                     msg.shapes)
                return srv._send(client, cp.DistributedStaged(msg.chunk))
            eng.stage_weights(self.update_id, msg.chunk, msg.names, msg.dtypes, msg.refs,
                              msg.rows)
            return srv._send(client, cp.WeightsStaged(msg.chunk))
        if isinstance(msg, cp.WeightsCommit):
            if not self._owns(client):
                return srv._error(client, None, "bad_state", "no weight update of this "
                                  "client is being staged")
            update_id, self.update_id, self.owner = self.update_id, None, None
            version = eng.commit_weight_update(update_id, msg.weight_version)
            return srv._send(client, cp.WeightsCommitted(version))
        if isinstance(msg, cp.WeightsAbort):
            if self._owns(client):
                self._drop_update()
            return srv._send(client, cp.WeightsAborted())
        raise AssertionError(f"not an RL message: {type(msg).__name__}")

    def _weight_source(self, client: bytes, msg: Any) -> None:
        """Join a trainer's group, or load a path: one call each, answered when done (the
        engine waits meanwhile, bounded by the group's timeout or step_timeout_s)."""
        eng, srv = self.engine, self.server
        self._drop_update()
        try:
            if isinstance(msg, cp.InitWeightUpdateGroup):
                eng.init_weight_update_group(msg.master_address, msg.master_port,
                                             msg.rank_offset, msg.world_size, msg.group_name,
                                             msg.backend, msg.timeout_s)
                return srv._send(client, cp.WeightUpdateGroupReady())
            version = eng.update_weights_from_path(msg.path, msg.weight_version)
        except RuntimeError as e:
            if isinstance(e, EngineDeadError):
                raise
            return srv._error(client, None, "bad_state", str(e))
        return srv._send(client, cp.WeightsFromPathLoaded(version))

    def _owns(self, client: bytes) -> bool:
        return self.update_id is not None and self.owner == client

    def _drop_update(self) -> None:
        if self.update_id is not None:
            self.engine.abort_weight_update(self.update_id)
        self.update_id = self.owner = None

    def poll(self) -> None:
        """Answer the pause requests once the pause settled."""
        if self.pause_waiters and self.settled:
            self.engine.settle_pause()
            for client in self.pause_waiters:
                self.server._send(client, cp.Paused(self.engine._pause_mode or "abort"))
            self.pause_waiters.clear()

    def sweep(self, limit_s: float) -> None:
        """An update whose owner sent nothing for `limit_s` (killed mid-update) is
        dropped on every rank."""
        if self.owner is not None and time.monotonic() - self.owner_heard > limit_s:
            logger.warning("the client staging weight update %s went silent: dropped, the "
                           "old weights stay", self.update_id)
            self._drop_update()
