"""The engine's handle on its worker group: start it, size and allocate the KV cache, send
plans, take results, and replace the group when it fails.

The group itself is started by a factory the launcher passes in (``start_group``, see
nvllm/launch/engine_builder.py), so this package never imports the launcher or the
workers. A group is anything with ``client`` (a ``WorkerGroupClient``, or a stand-in in
tests), ``pids`` and ``stop()``.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from typing import Any, Protocol

from nvllm.common import plan_arrays, worker_protocol
from nvllm.common.config import EngineConfig
from nvllm.common.errors import EngineDeadError
from nvllm.common.transport import ArrayWriter

logger = logging.getLogger(__name__)


class WorkerGroupHandle(Protocol):
    client: Any
    pids: list[int]

    def stop(self) -> None: ...


class Executor:
    def __init__(self, config: EngineConfig, start_group: Callable[[], WorkerGroupHandle],
                 plan_writer: ArrayWriter | None = None) -> None:
        """`plan_writer`: a shared-memory ring for big plans' arrays, when every worker
        shares this host (nvllm.common.plan_arrays); None sends every plan as lists."""
        assert config.model_info is not None, "EngineConfig.finalize() first"
        self.config = config
        self.vocab_size = config.model_info.vocab_size
        self.plan_writer = plan_writer
        self._start_group = start_group
        self.restarts_left = config.max_worker_restarts if config.restart_workers else 0
        self.group = self._start()
        try:
            self.num_blocks = self._init_kv_cache()
        except BaseException:
            self.shutdown()
            raise

    def _start(self) -> WorkerGroupHandle:
        group = self._start_group()
        # Stop the workers even if the owner forgets shutdown() (or the interpreter exits).
        self._finalizer = weakref.finalize(self, group.stop)
        return group

    @property
    def workers(self) -> Any:
        """The current group's sockets (WorkerGroupClient)."""
        return self.group.client

    # ---- start-up -------------------------------------------------------------------

    def _gather_ready(self, stage: str) -> list[worker_protocol.WorkerReady]:
        got: dict[int, worker_protocol.WorkerReady] = {}
        while len(got) < self.workers.num_workers:
            msg = self.workers.recv(self.config.worker_start_timeout_s)
            if isinstance(msg, worker_protocol.WorkerReady) and msg.stage == stage:
                got[msg.rank] = msg
            else:
                logger.warning("unexpected %s while waiting for workers", type(msg).__name__)
        return [got[r] for r in sorted(got)]

    def _init_kv_cache(self, num_blocks: int | None = None) -> int:
        """Size the KV cache by what every rank fits (or `num_blocks`, which a restarted
        group must fit), allocate it, and return its block count."""
        loaded = self._gather_ready("loaded")
        logger.info("weights loaded in %.1fs (slowest rank); peak RSS per rank: %s MiB",
                    max(m.load_s for m in loaded),
                    ", ".join(f"{m.peak_rss_mib:.0f}" for m in loaded))
        fits = min(m.num_blocks for m in loaded)
        if num_blocks is not None and fits < num_blocks:
            raise EngineDeadError(f"the restarted workers fit {fits} KV blocks, fewer than "
                                  f"the {num_blocks} the engine schedules")
        num_blocks = num_blocks or self.config.num_kv_blocks or fits
        if num_blocks < 1:
            raise RuntimeError(
                "no memory left for the KV cache after loading the model: raise "
                "gpu_memory_utilization (CUDA) or cpu_kv_cache_gib (CPU), or set num_kv_blocks")
        self.workers.broadcast(worker_protocol.InitKVCache(num_blocks))
        self._gather_ready("kv")
        return num_blocks

    # ---- steps ----------------------------------------------------------------------

    def send(self, plan: worker_protocol.StepPlan) -> tuple[int, int]:
        """Broadcast a plan; returns (bytes sent, ring generation of its arrays or 0)."""
        generation = plan_arrays.pack(plan, self.plan_writer) if self.plan_writer else 0
        return self.workers.broadcast(plan), generation

    def send_first(self, msg: Any) -> None:
        """A message for rank 0 alone (compiled grammars), ahead of the next plan."""
        self.workers.broadcast(msg, ranks=[0])

    def recv_result(self, step_id: int, sampling_seq_ids: set[int], generation: int,
                    cancelled: Callable[[], bool] | None = None) -> worker_protocol.StepResult:
        """The result of plan `step_id`; anything that does not answer it is dropped.

        Raises EngineDeadError when the group dies or the watchdog fires, and
        KeyboardInterrupt (before taking a message) once `cancelled()` is true.
        """
        while True:
            msg = self.workers.recv(self.config.step_timeout_s, cancelled)
            if not isinstance(msg, worker_protocol.StepResult) or msg.step_id != step_id:
                logger.warning("ignoring %s while waiting for step %d", type(msg).__name__,
                               step_id)
                continue
            problem = self._check_result(msg, sampling_seq_ids)
            if problem is not None:
                logger.error("dropping a result for step %d: %s", step_id, problem)
                continue
            if generation:
                # Every rank copies a plan's arrays out before the step's first collective,
                # so rank 0's result means all of them are done with the region.
                self.plan_writer.acked_all(generation)
            return msg

    def _check_result(self, r: worker_protocol.StepResult, due: set[int]) -> str | None:
        """A result must sample exactly the sequences that finished their tokens this step,
        with token ids in the vocabulary; anything else is not our workers' answer."""
        counts = r.num_tokens
        if counts is not None and (len(counts) != len(r.seq_ids) or min(counts, default=1) < 1):
            return "malformed token counts"
        num = len(r.seq_ids) if counts is None else sum(counts)
        if num != len(r.token_ids) or set(r.seq_ids) != due or len(r.seq_ids) != len(due):
            return "it does not sample the sequences the plan asked for"
        if any(not 0 <= t < self.vocab_size for t in r.token_ids):
            return "a token id is outside the vocabulary"
        if r.logprobs is not None and (not isinstance(r.logprobs, list)
                                       or len(r.logprobs) != num):
            return "malformed logprobs"
        d = r.draft_token_ids
        if d is not None and (len(d) != len(r.seq_ids) or any(
                not 0 <= t < self.vocab_size for ts in d for t in ts)):
            return "malformed draft tokens"
        return None

    # ---- weight updates ---------------------------------------------------------------

    def stage_weights(self, update_id: int, chunk: int, names: list[str], dtypes: list[str],
                      refs: list[list], rows: list[int] | None = None) -> str | None:
        """Send one chunk of a weight update to every rank and wait until each has staged
        it (and stopped reading its memory); None, or the first rank's refusal."""
        self.workers.broadcast(worker_protocol.WeightChunk(update_id, chunk, names, dtypes,
                                                           refs, rows))
        return self._weight_acks(update_id, chunk)

    def commit_weights(self, update_id: int) -> str | None:
        """Every rank staged the whole update: apply it everywhere."""
        self.workers.broadcast(worker_protocol.CommitWeights(update_id))
        return self._weight_acks(update_id, -1)

    def abort_weights(self, update_id: int) -> None:
        """Every rank drops what it staged; the old weights stay."""
        if self.workers.dead is None:
            self.workers.broadcast(worker_protocol.AbortWeights(update_id))

    def weight_request(self, msg: Any, ident: int, chunk: int, timeout_s: float
                       ) -> str | None:
        """Send `msg` (a weight-source message) to every rank and wait, at most
        `timeout_s` per answer, until each answered chunk `chunk` of `ident`; None, or
        the first rank's refusal."""
        self.workers.broadcast(msg)
        return self._weight_acks(ident, chunk, timeout_s)

    def _weight_acks(self, update_id: int, chunk: int, timeout_s: float | None = None
                     ) -> str | None:
        errors: dict[int, str] = {}
        answered: set[int] = set()
        while len(answered) < self.workers.num_workers:
            msg = self.workers.recv(timeout_s or self.config.step_timeout_s)
            if isinstance(msg, worker_protocol.WeightsAck) and msg.update_id == update_id \
                    and msg.chunk == chunk:
                answered.add(msg.rank)
                if msg.error:
                    errors[msg.rank] = msg.error
            else:
                logger.warning("ignoring %s while waiting for weight update %d",
                               type(msg).__name__, update_id)
        return None if not errors else f"rank {min(errors)}: {errors[min(errors)]}"

    # ---- failures -------------------------------------------------------------------

    def check_alive(self) -> str | None:
        """None while every rank lives; else what died."""
        return self.workers.check_alive()

    def restart(self, error: str) -> bool:
        """Replace a failed group with a fresh one whose KV cache has the same size; False
        when restarts are off or used up. A failed restart counts; the next may work."""
        while self.restarts_left > 0:
            self.restarts_left -= 1
            logger.error("worker group failed: %s; restarting it (%d restart(s) left after "
                         "this)", error.split("\n")[0], self.restarts_left)
            try:
                self._finalizer()  # stop what is left of the old group
                self.group = self._start()
                self._init_kv_cache(self.num_blocks)
            except Exception as e:
                error = f"restart failed: {e}"
                continue
            if self.plan_writer is not None:
                self.plan_writer.reclaim_all()  # the old readers are gone
            logger.warning("started a new worker group: pids %s", self.group.pids)
            return True
        return False

    def shutdown(self) -> None:
        """Ask the workers to exit, stop their processes, then free the plan ring."""
        try:
            if self.workers.dead is None:
                self.workers.broadcast(worker_protocol.Shutdown())
        except Exception:  # shutting down anyway; stop() kills what is left
            logger.debug("could not send shutdown to the workers", exc_info=True)
        self._finalizer()
        if self.plan_writer is not None:  # after the workers stopped
            self.plan_writer.close()
            self.plan_writer = None
