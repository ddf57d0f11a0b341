"""Sleep and wake, with vLLM's names and semantics (``sleep(level, mode)``,
``wake_up(tags)``, ``is_sleeping``): a mixin of LLMEngine, placed before WeightSync so it
can guard generation and weight updates while memory is asleep.

``sleep`` first pauses generation as ``pause_generation(mode, clear_cache=True)`` does
(abort ends every request, wait lets the running ones finish, keep holds them and they
recompute their KV after the wake: it is gone), then has every rank free its KV cache and
weights (nvllm/worker/sleep.py). Requests that arrive while asleep wait, as in any pause
(vLLM queues them too); the offline ``LLM.generate`` refuses instead, as no one could
wake the engine while it waits. ``wake_up`` allocates the memory again and, with the
"scheduling" tag (or no tags), resumes generation.

After a level-2 sleep the weights' contents are gone: the woken parameters are zeros until
``update_weights`` has written every checkpoint tensor again. Until then new requests are
refused (RequestRejected, naming how many tensors are missing), and resuming generation
is too; a wake_up that asked to resume does so by itself once the last tensor arrives.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from nvllm.common import worker_protocol as wp
from nvllm.common.sleep_mode import MEMORY_TAGS, SleepReport, check_level, check_tags
from nvllm.leader.output_processor import EngineOutput

if TYPE_CHECKING:
    from nvllm.leader.engine import LLMEngine

logger = logging.getLogger(__name__)


class SleepMode:
    """LLMEngine's sleep / wake_up (mixed into LLMEngine, before WeightSync)."""

    def _init_sleep_mode(self: LLMEngine) -> None:
        self.sleep_level = 0  # the level slept at, until everything is back
        self._asleep: set[str] = set()  # of MEMORY_TAGS
        self._weights_missing: set[str] = set()  # checkpoint tensors a level-2 wake lacks
        self._update_names: set[str] = set()  # staged by the update in progress
        self._resume_when_whole = False

    @property
    def is_sleeping(self: LLMEngine) -> bool:
        return bool(self._asleep)

    @property
    def weights_missing(self: LLMEngine) -> int:
        return len(self._weights_missing)

    def sleep_refusal(self: LLMEngine) -> str | None:
        """Why the engine cannot generate now because of sleep, or None."""
        if self._asleep:
            return (f"the engine is asleep (sleep level {self.sleep_level}; "
                    f"{' and '.join(sorted(self._asleep))} freed): call wake_up() first")
        if self._weights_missing:
            return (f"the weights were discarded by sleep(level=2) and "
                    f"{len(self._weights_missing)} checkpoint tensors are not written yet "
                    f"(e.g. {min(self._weights_missing)}): push every tensor with "
                    "update_weights, or restart the engine")
        return None

    # ---- sleep ----------------------------------------------------------------------

    def begin_sleep(self: LLMEngine, level: int = 1, mode: str = "abort") -> EngineOutput:
        """Check the call and pause generation (`mode` as pause_generation's, the prefix
        cache cleared); callers step the engine until ``pause_complete`` (wait mode),
        then call ``finish_sleep``. Returns what the pause ended."""
        check_level(level)
        if self._asleep:
            raise RuntimeError(f"already asleep (level {self.sleep_level}): wake_up first")
        if self._staging is not None:
            raise RuntimeError("a weight update is being staged: commit or abort it before "
                               "sleep")
        return self.pause_generation(mode, clear_cache=True)

    def finish_sleep(self: LLMEngine, level: int) -> SleepReport:
        """Every rank frees its KV cache and weights (the pause has settled). Requests a
        keep-mode pause holds go back to waiting, to recompute their KV after the wake."""
        if not self.pause_complete:
            raise RuntimeError("finish_sleep before the pause settled (step the engine "
                               "until pause_complete)")
        self.settle_pause()
        if self.scheduler.running:
            self.scheduler.recompute_running()
        self.kv.drop_prefix_cache()
        acks = self._sleep_acks(wp.SleepWorker(level), "sleep")
        errors = [a for a in acks if a.error]
        if errors:
            # Ranks answer alike, but never leave some asleep: wake any that slept.
            self._sleep_acks(wp.WakeWorker(list(MEMORY_TAGS)), "wake")
            raise RuntimeError(f"sleep(level={level}) refused on rank {errors[0].rank}: "
                               f"{errors[0].error}; generation stays paused "
                               "(resume_generation to go on)")
        self.sleep_level, self._asleep = level, set(MEMORY_TAGS)
        report = self._report(level, acks)
        logger.info("asleep (level %d): freed %.1f MiB of weights and %.1f MiB of KV cache "
                    "over %d rank(s)", level, report.weights_bytes / 2**20,
                    report.kv_cache_bytes / 2**20, len(acks))
        return report

    # ---- wake -----------------------------------------------------------------------

    def wake_up(self: LLMEngine, tags: list[str] | None = None) -> SleepReport:
        """Allocate again what sleep freed, of `tags` ("weights", "kv_cache"), and with
        "scheduling" (or no tags) resume generation, which needs everything awake (and,
        after level 2, deferred until update_weights wrote every tensor)."""
        tags = check_tags(tags)
        level = self.sleep_level
        mem = [t for t in MEMORY_TAGS if t in tags and t in self._asleep]
        still = self._asleep.difference(mem)
        if "scheduling" in tags and still:
            raise ValueError(f"cannot resume scheduling while the {' and '.join(sorted(still))} "
                             "still sleep: wake them too (wake_up() wakes everything)")
        acks = self._sleep_acks(wp.WakeWorker(mem), "wake") if mem else []
        errors = [a for a in acks if a.error]
        if errors:
            raise RuntimeError(f"wake_up refused on rank {errors[0].rank}: {errors[0].error}")
        self._asleep = still
        if "weights" in mem and level == 2:
            self._weights_missing = set(acks[0].missing)
        report = self._report(level, acks)
        if "scheduling" in tags:
            if self._weights_missing:
                self._resume_when_whole = True
                logger.warning("awake, but generation resumes only once update_weights "
                               "has written the %d checkpoint tensors level 2 discarded",
                               len(self._weights_missing))
            else:
                self.resume_generation()
        if not self._asleep and not self._weights_missing:
            self.sleep_level = 0
        logger.info("wake_up %s: allocated %.1f MiB of weights and %.1f MiB of KV cache",
                    mem, report.weights_bytes / 2**20, report.kv_cache_bytes / 2**20)
        return report

    def _sleep_acks(self: LLMEngine, msg: wp.SleepWorker | wp.WakeWorker, op: str
                    ) -> list[wp.SleepAck]:
        workers = self.executor.workers
        workers.broadcast(msg)
        acks: dict[int, wp.SleepAck] = {}
        while len(acks) < workers.num_workers:
            ans = workers.recv(self.config.step_timeout_s)
            if isinstance(ans, wp.SleepAck) and ans.op == op:
                acks[ans.rank] = ans
            else:
                logger.warning("ignoring %s while waiting for %s", type(ans).__name__, op)
        return [acks[r] for r in sorted(acks)]

    def _report(self: LLMEngine, level: int, acks: list[wp.SleepAck]) -> SleepReport:
        return SleepReport(level, sorted(self._asleep),
                           sum(a.weights_bytes for a in acks),
                           sum(a.kv_cache_bytes for a in acks),
                           sum(a.device_bytes for a in acks),
                           sum(a.rss_bytes for a in acks), len(self._weights_missing))

    def sleep_report(self: LLMEngine) -> SleepReport:
        """The state now, without asking the workers (is_sleeping's answer)."""
        return SleepReport(self.sleep_level, sorted(self._asleep),
                           weights_missing=len(self._weights_missing))

    def _forget_sleep(self: LLMEngine) -> None:
        """A restarted worker group loaded the checkpoint and allocated its cache."""
        if self._asleep or self._weights_missing:
            logger.warning("the worker group restarted: the engine is awake again, on the "
                           "checkpoint's weights")
        self._init_sleep_mode()

    # ---- guards on WeightSync -------------------------------------------------------

    def resume_generation(self: LLMEngine) -> None:
        why = self.sleep_refusal()
        if why is not None:
            raise RuntimeError(f"cannot resume generation: {why}")
        super().resume_generation()  # type: ignore[misc]

    def begin_weight_update(self: LLMEngine) -> int:
        if "weights" in self._asleep:
            raise RuntimeError(f"the weights are asleep (sleep level {self.sleep_level}): "
                               "wake_up(tags=['weights']) (or wake_up()) before "
                               "update_weights")
        self._update_names = set()
        return super().begin_weight_update()  # type: ignore[misc]

    def stage_weights(self: LLMEngine, update_id: int, chunk: int, names: list[str],
                      dtypes: list[str], refs: list[list], rows: list[int] | None = None
                      ) -> None:
        super().stage_weights(update_id, chunk, names, dtypes, refs,  # type: ignore[misc]
                              rows)
        if self._weights_missing:
            self._update_names.update(names)

    def _stage_request(self: LLMEngine, update_id: int, msg: object, chunk: int,
                       timeout_s: float) -> None:
        """Updates from a trainer's group or a path count toward the tensors a level-2
        wake lacks, as update_weights' chunks do (a checkpoint path rewrites every tensor
        the loader finds for the model, so it makes the weights whole)."""
        super()._stage_request(update_id, msg, chunk, timeout_s)  # type: ignore[misc]
        if self._weights_missing:
            if isinstance(msg, wp.WeightsFromGroup):
                self._update_names.update(msg.names)
            elif isinstance(msg, wp.WeightsFromPath):
                self._update_names.update(self._weights_missing)

    def commit_weight_update(self: LLMEngine, update_id: int,
                             weight_version: int | str | None = None) -> int | str:
        version = super().commit_weight_update(update_id, weight_version)  # type: ignore[misc]
        if self._weights_missing:
            self._weights_missing.difference_update(self._update_names)
            if self._weights_missing:
                logger.warning("%d checkpoint tensors are still missing since the level-2 "
                               "sleep: generation stays refused", len(self._weights_missing))
            else:
                logger.info("every tensor level 2 discarded is written again")
                if not self._asleep:
                    self.sleep_level = 0
                if self._resume_when_whole:
                    self._resume_when_whole = False
                    self.resume_generation()
        self._update_names = set()
        return version
