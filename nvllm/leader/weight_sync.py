"""Serving RL rollouts: pause and resume generation, and weight updates from a trainer,
with vLLM's names and semantics (``pause_generation(mode=...)``, ``resume_generation``,
``update_weights``, ``weight_version``). A mixin of LLMEngine: these change the engine's
scheduler, KV-cache index and outputs, which only the engine may write.

An update is atomic across ranks: every chunk goes to every rank, which stages its shard
(nvllm/worker/weight_update.py) and answers; only when every rank staged every chunk does
a commit apply it everywhere. A refusal (a wrong name or shape on any rank, a quantized
layer) or an exception in the trainer's tensor iterator aborts the staging on all ranks:
the old weights stay and the engine keeps serving. A committed update drops the prefix
cache (no hit may serve KV computed on the old weights) and sets the ``weight_version``
every output produced after it carries.
"""

from __future__ import annotations

import itertools
import logging
from typing import TYPE_CHECKING

from nvllm.common.cuda_ipc import push_ipc, wants_ipc
from nvllm.common.sleep_mode import PAUSE_MODES
from nvllm.common.weight_transfer import (
    DEFAULT_CHUNK_BYTES,
    NamedTensors,
    WeightUpdateError,
    check_weight_version,
    push_weights,
)
from nvllm.leader.output_processor import EngineOutput

if TYPE_CHECKING:
    from nvllm.leader.engine import LLMEngine

logger = logging.getLogger(__name__)


class WeightSync:
    """LLMEngine's pause/resume and weight-update operations (mixed into LLMEngine)."""

    def _init_weight_sync(self: LLMEngine) -> None:
        self._pause_mode: str | None = None
        self._pause_clear_cache = True
        self._update_ids = itertools.count(1)
        self._staging: int | None = None  # the update id being staged, if any
        self.num_weight_updates = 0

    # ---- pause / resume -------------------------------------------------------------

    @property
    def is_paused(self: LLMEngine) -> bool:
        return self._pause_mode is not None

    @property
    def weight_version(self: LLMEngine) -> int | str | None:
        """The version of the weights in force (None: the checkpoint's, never updated)."""
        return self.output_processor.weight_version

    def pause_generation(self: LLMEngine, mode: str = "abort", clear_cache: bool = True
                         ) -> EngineOutput:
        """Stop scheduling, as vLLM's: ``abort`` ends every request now (finish_reason
        "abort"); ``wait`` lets the running requests finish (step the engine until
        ``pause_complete``) and admits no new ones; ``keep`` holds the running requests
        where they are, to go on after ``resume_generation``, recomputing their KV on the
        new weights if an update comes in between and `clear_cache` is set (else they
        keep the KV computed on the old weights). Requests that arrive while paused wait.
        `clear_cache` also empties the prefix cache now (abort, keep) or once the
        running requests finished (wait). Returns the outputs this ended or drained."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode must be one of {PAUSE_MODES}, got {mode!r}")
        out = EngineOutput()
        if mode == "abort":
            out.extend(self.abort_all("abort"))
        self._pause_mode, self._pause_clear_cache = mode, clear_cache
        self.scheduler.paused = "wait" if mode == "wait" else "keep"
        if mode != "wait":
            self._drain(out)
            if clear_cache:
                self.kv.drop_prefix_cache()
        logger.info("generation paused (%s): %d running, %d waiting", mode,
                    len(self.scheduler.running), len(self.scheduler.waiting))
        return out

    @property
    def pause_complete(self: LLMEngine) -> bool:
        """Paused and settled: no plan in flight, and (wait) no request running."""
        if self._pause_mode is None or self._inflight:
            return False
        return self._pause_mode != "wait" or not self.scheduler.running

    def settle_pause(self: LLMEngine) -> None:
        """A wait-mode pause whose running requests finished: clear the prefix cache if
        asked (callers step the engine until ``pause_complete``, then call this)."""
        if self._pause_mode == "wait" and self._pause_clear_cache and self.pause_complete:
            self.kv.drop_prefix_cache()

    def resume_generation(self: LLMEngine) -> None:
        """Schedule again: held requests go on, waiting ones are admitted."""
        if self._staging is not None:
            self.abort_weight_update(self._staging)
        self._pause_mode = None
        self.scheduler.paused = None

    def _drain(self: LLMEngine, out: EngineOutput) -> None:
        while self._inflight:
            self._apply_oldest_result(out, None)

    # ---- weight updates -------------------------------------------------------------

    def update_weights(self: LLMEngine, named_tensors: NamedTensors,
                       weight_version: int | str | None = None,
                       chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> int | str:
        """Replace some or all weights with `named_tensors` (HF names -> full CPU
        tensors: a dict or an iterable of pairs, consumed lazily), sent in chunks of at
        most `chunk_bytes` through shared memory. Needs the engine idle or paused.
        Returns the new weight_version (`weight_version`, or the count of updates).
        Raises WeightUpdateError when any rank refuses: nothing changed then."""
        version = check_weight_version(weight_version)
        update_id = self.begin_weight_update()
        try:
            def stage(k: int, names: list[str], dtypes: list[str], refs: list[list],
                      rows: list[int] | None) -> None:
                self.stage_weights(update_id, k, names, dtypes, refs, rows)

            ipc, named_tensors = wants_ipc(named_tensors)
            if ipc:  # CUDA tensors: each rank copies from them by IPC handle
                push_ipc(named_tensors, stage, chunk_bytes)
            else:
                push_weights(named_tensors, stage, chunk_bytes,
                             shared_memory=self.executor.plan_writer is not None)
        except BaseException:
            self.abort_weight_update(update_id)
            raise
        return self.commit_weight_update(update_id, version)

    def begin_weight_update(self: LLMEngine) -> int:
        """Start an update (aborting one left unfinished); returns its id."""
        running = len(self.scheduler.running)
        if not running and self._inflight:
            # An idle engine's last plan (sequences that ended meanwhile): its result
            # streams nothing, but must be taken before the workers see weight messages.
            self._drain(EngineOutput())
        if self._inflight or (running and self._pause_mode != "keep"):
            raise RuntimeError(
                f"cannot update weights while {running} request(s) are running: call "
                "pause_generation(mode='abort' | 'wait' | 'keep') first (and, for 'wait', "
                "step until pause_complete)")
        if self._staging is not None:
            logger.warning("weight update %d was never committed: dropped", self._staging)
            self.abort_weight_update(self._staging)
        self._staging = next(self._update_ids)
        return self._staging

    def stage_weights(self: LLMEngine, update_id: int, chunk: int, names: list[str],
                      dtypes: list[str], refs: list[list],
                      rows: list[int] | None = None) -> None:
        """Have every rank stage one chunk; WeightUpdateError (and the update aborted on
        every rank) when any refuses."""
        if update_id != self._staging:
            raise WeightUpdateError(f"weight update {update_id} is not being staged "
                                    f"(now: {self._staging})")
        error = self.executor.stage_weights(update_id, chunk, names, dtypes, refs, rows)
        if error is not None:
            self.abort_weight_update(update_id)
            raise WeightUpdateError(f"weight update refused, the old weights stay: {error}")

    def abort_weight_update(self: LLMEngine, update_id: int) -> None:
        if update_id == self._staging:
            self._staging = None
            self.executor.abort_weights(update_id)

    def commit_weight_update(self: LLMEngine, update_id: int,
                             weight_version: int | str | None = None) -> int | str:
        """Apply a fully staged update on every rank, drop the prefix cache (held
        requests of a keep-mode pause with clear_cache recompute their KV), and set the
        weight_version outputs carry from now on; returns it."""
        if update_id != self._staging:
            raise WeightUpdateError(f"weight update {update_id} is not being staged")
        self._staging = None
        error = self.executor.commit_weights(update_id)
        if error is not None:  # ranks disagree on what is staged: a bug, not an input
            raise RuntimeError(f"weight update {update_id} failed to commit: {error}")
        held = list(self.scheduler.running)
        if held and self._pause_clear_cache:
            self.scheduler.recompute_running()
            held = []
        self.kv.drop_prefix_cache(held)
        self.num_weight_updates += 1
        version = self.num_weight_updates if weight_version is None else weight_version
        self.output_processor.weight_version = version
        logger.info("weights updated (version %r); %d held request(s) keep their old KV",
                    version, len(held))
        return version

    def _forget_weight_updates(self: LLMEngine) -> None:
        """A restarted worker group loaded the checkpoint again: updates are lost."""
        self._staging = None
        if self.output_processor.weight_version is not None:
            logger.error("the worker group restarted from the checkpoint: weight version %r "
                         "is lost; outputs carry weight_version None until the next update",
                         self.output_processor.weight_version)
            self.output_processor.weight_version = None
