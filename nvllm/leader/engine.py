"""The leader's engine: admission, one step plan per step, applying the workers' results."""

from __future__ import annotations

import collections
import heapq
import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from nvllm.common import plan_arrays, protocol
from nvllm.common.config import EngineConfig
from nvllm.common.errors import EngineDeadError, Overloaded, RequestRejected
from nvllm.common.outputs import CompletionDelta, CompletionOutput, RequestOutput
from nvllm.common.sampling_params import SamplingParams
from nvllm.common.transport import ArrayWriter
from nvllm.leader.detokenizer import IncrementalDetokenizer
from nvllm.leader.executor import WorkerGroupClient
from nvllm.leader.kv_cache_manager import KVCacheManager
from nvllm.leader.metrics import EngineMetrics
from nvllm.leader.scheduler import Scheduler, SchedulerOutput
from nvllm.leader.sequence import Sequence

logger = logging.getLogger(__name__)


@dataclass(slots=True, eq=False)
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence] = field(default_factory=list)
    arrival_time: float = field(default_factory=time.monotonic)
    num_cached_tokens: int = 0
    priority: int = 0
    deadline: float | None = None  # monotonic time after which it ends with "timeout"
    detoks: list[IncrementalDetokenizer | None] = field(default_factory=list)
    first_token_time: float | None = None
    last_token_time: list[float] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)


@dataclass(slots=True)
class EngineOutput:
    deltas: list[CompletionDelta] = field(default_factory=list)
    finished: list[RequestOutput] = field(default_factory=list)  # whole requests


@dataclass(slots=True)
class StepStats:
    step_id: int = 0
    num_scheduled_tokens: int = 0
    plan_bytes: int = 0
    worker_time_s: float = 0.0
    step_time_s: float = 0.0


@dataclass(slots=True)
class InFlight:
    """A plan sent whose result has not been applied yet."""

    step_id: int
    sched: SchedulerOutput
    due: set[int]  # sequences that sample a token in this plan
    prompt_tokens: int
    plan_bytes: int
    generation: int = 0  # of the plan's arrays in the transport ring (0: none)


def to_worker_sampling(p: SamplingParams) -> protocol.WorkerSampling:
    return protocol.WorkerSampling(
        temperature=float(p.temperature), top_p=float(p.top_p), top_k=p.top_k,
        min_p=float(p.min_p), seed=p.seed, min_tokens=p.min_tokens,
        stop_token_ids=sorted(p.all_stop_token_ids()),
        repetition_penalty=float(p.repetition_penalty),
        presence_penalty=float(p.presence_penalty),
        frequency_penalty=float(p.frequency_penalty), logprobs=p.logprobs)


class LLMEngine:
    def __init__(self, config: EngineConfig, workers: WorkerGroupClient, tokenizer) -> None:
        self.config = config
        self.workers = workers
        self.tokenizer = tokenizer
        info = config.model_info
        assert info is not None, "EngineConfig.finalize() first"
        self.vocab_size = info.vocab_size
        self.eos_token_ids = list(info.eos_token_ids)
        num_blocks = self.num_blocks = self._init_workers()
        # Set by the owner to enable recovery: returns a fresh worker group's client.
        self.restart_workers: Callable[[], WorkerGroupClient] | None = None
        # Set by the owner when every worker shares this host: big plans' arrays travel
        # through this shared-memory ring (nvllm.common.plan_arrays).
        self.plan_writer: ArrayWriter | None = None
        self.restarts_left = config.max_worker_restarts if config.restart_workers else 0
        self.kv = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.kv, config.max_num_seqs, config.max_num_batched_tokens,
                                   config.max_model_len)
        self.capacity_tokens = num_blocks * config.block_size
        logger.info(
            "KV cache: %d blocks x %d tokens = %d tokens; maximum concurrency for "
            "%d-token requests: %.2fx", num_blocks, config.block_size, self.capacity_tokens,
            config.max_model_len, self.capacity_tokens / config.max_model_len)
        self.requests: dict[str, Request] = {}
        self._seq_ids = itertools.count()
        self._request_ids = itertools.count()
        self._step_ids = itertools.count(1)
        self._pending_drops: list[int] = []
        self._inflight: collections.deque[InFlight] = collections.deque()  # sent, no result
        self._deadlines: list[tuple[float, str]] = []  # heap of (deadline, request id)
        self.last_step = StepStats()
        # Wall time of steps, and the part rank 0 spent computing them (worker_idle_share).
        self.reset_step_totals()
        self.metrics = EngineMetrics(config.model, config.log_stats_interval_s)
        self._stats_seen = (0, 0, 0)  # prefix queries, hits, preemptions already exported

    # ---- start-up -------------------------------------------------------------------

    def _gather_ready(self, stage: str) -> list[protocol.WorkerReady]:
        got: dict[int, protocol.WorkerReady] = {}
        while len(got) < self.workers.num_workers:
            msg = self.workers.recv(self.config.worker_start_timeout_s)
            if isinstance(msg, protocol.WorkerReady) and msg.stage == stage:
                got[msg.rank] = msg
            else:
                logger.warning("unexpected %s while waiting for workers", type(msg).__name__)
        return [got[r] for r in sorted(got)]

    def _init_workers(self, num_blocks: int | None = None) -> int:
        ready = self._gather_ready("loaded")
        fits = min(m.num_blocks for m in ready)
        if num_blocks is not None and fits < num_blocks:
            raise EngineDeadError(f"the restarted workers fit {fits} KV blocks, fewer than "
                                  f"the {num_blocks} the engine schedules")
        num_blocks = num_blocks or self.config.num_kv_blocks or fits
        if num_blocks < 1:
            raise RuntimeError(
                "no memory left for the KV cache after loading the model: raise "
                "gpu_memory_utilization (CUDA) or cpu_kv_cache_gib (CPU), or set num_kv_blocks")
        self.workers.broadcast(protocol.InitKVCache(num_blocks))
        self._gather_ready("kv")
        return num_blocks

    # ---- requests -------------------------------------------------------------------

    def add_request(self, prompt: str | list[int] | None = None,
                    params: SamplingParams | None = None, request_id: str | None = None,
                    prompt_token_ids: list[int] | None = None, priority: int = 0,
                    ttl_ms: float | None = None) -> Request:
        """Admit a request, or raise RequestRejected saying which limit it breaks."""
        params = params or SamplingParams()
        limit = self.config.max_queued_requests
        if limit is not None:
            waiting = len({s.request_id for s in self.scheduler.waiting})
            if waiting >= limit:
                raise Overloaded(f"overloaded: {waiting} requests are already waiting "
                                 f"(max_queued_requests={limit}); retry later")
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise RequestRejected(f"priority must be an integer, got {priority!r}")
        if ttl_ms is not None and (not isinstance(ttl_ms, (int, float))
                                   or isinstance(ttl_ms, bool) or ttl_ms <= 0):
            raise RequestRejected(f"ttl_ms must be a positive number, got {ttl_ms!r}")
        if request_id is None:
            request_id = str(next(self._request_ids))
        if request_id in self.requests:
            raise RequestRejected(f"request id {request_id!r} is already in use")
        text = None
        if prompt_token_ids is None:
            if isinstance(prompt, str):
                if self.tokenizer is None:
                    raise RequestRejected("the engine was started without a tokenizer "
                                          "(skip_tokenizer_init): pass prompt token ids")
                text = prompt
                prompt_token_ids = self.tokenizer(prompt).input_ids
            else:
                prompt_token_ids = prompt
        ids = self._validate(prompt_token_ids, params)
        params = params.clone(eos_token_ids=self.eos_token_ids)
        if params.stop and self.tokenizer is None:
            raise RequestRejected("stop strings need a tokenizer (the engine has none)")
        req = Request(request_id, text, ids, params, priority=priority)
        if ttl_ms is not None:
            req.deadline = req.arrival_time + ttl_ms / 1000.0
            heapq.heappush(self._deadlines, (req.deadline, request_id))
        for i in range(params.n):
            p = params if params.n == 1 or params.seed is None else params.clone(
                seed=(params.seed + i) % 2**63)
            seq = Sequence(next(self._seq_ids), request_id, list(ids), len(ids), p, index=i,
                           priority=priority)
            req.seqs.append(seq)
            req.detoks.append(None if self.tokenizer is None else IncrementalDetokenizer(
                self.tokenizer, ids, stop=params.stop,
                include_stop_str_in_output=params.include_stop_str_in_output,
                skip_special_tokens=params.skip_special_tokens))
            req.last_token_time.append(0.0)
            self.scheduler.add(seq)
        self.requests[request_id] = req
        return req

    def _validate(self, ids, params: SamplingParams) -> list[int]:
        if not isinstance(ids, (list, tuple)) or not ids:
            raise RequestRejected("prompt is empty: give at least one token")
        for pos, t in enumerate(ids):
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < self.vocab_size:
                raise RequestRejected(
                    f"token id {t!r} at position {pos} is outside the vocabulary "
                    f"(valid ids are 0..{self.vocab_size - 1})")
        if params.n > self.config.max_num_seqs:
            # Its completions could never run together (and a huge n is a cheap way to
            # make the leader build millions of sequences).
            raise RequestRejected(f"n={params.n} exceeds max_num_seqs "
                                  f"{self.config.max_num_seqs}; ask for fewer completions")
        n, limit = len(ids), self.config.max_model_len
        if n > limit:
            raise RequestRejected(f"prompt has {n} tokens, max_model_len is {limit}")
        if n + params.max_tokens > limit:
            raise RequestRejected(
                f"prompt has {n} tokens and max_tokens is {params.max_tokens}: {n} + "
                f"{params.max_tokens} exceeds max_model_len {limit}; lower max_tokens to "
                f"{limit - n} or less")
        if n + params.max_tokens > self.capacity_tokens:
            raise RequestRejected(
                f"prompt has {n} tokens and max_tokens is {params.max_tokens}, but the KV "
                f"cache holds only {self.capacity_tokens} tokens in all; raise num_kv_blocks "
                "(or the KV memory budget) or shorten the request")
        return list(ids)

    def abort_request(self, request_id: str, reason: str = "abort") -> EngineOutput:
        """End a request now (its KV blocks are freed); unknown ids are ignored."""
        out = EngineOutput()
        req = self.requests.get(request_id)
        if req is None:
            return out
        for seq in req.seqs:
            if not seq.is_finished:
                self._finish_seq(seq, reason)
                out.deltas.append(self._final_delta(req, seq, [], None))
        out.finished.append(self._finish_request(req))
        return out

    def has_unfinished_requests(self) -> bool:
        """Requests to run, a plan still in flight whose result must be taken, or
        finished sequences the workers still hold (one more step lets them go)."""
        return (self.scheduler.num_unfinished > 0 or bool(self._inflight)
                or bool(self._pending_drops))

    # ---- the step -------------------------------------------------------------------

    def step(self, cancelled: Callable[[], bool] | None = None) -> EngineOutput:
        """Run one engine step: expire timed-out requests, schedule and send a plan, and
        apply a result.

        Synchronous, the result is the plan's own. With async scheduling the newest plan
        stays in flight: this call sends plan N+1 (sequences whose token from plan N is
        still out are scheduled with a placeholder the workers fill in), then applies
        plan N's result, so that detokenizing, streaming, admitting and scheduling all
        happen while the workers compute.

        ``cancelled`` is polled while waiting for a result: when it turns true the call
        raises KeyboardInterrupt with the plan still in flight and its result unread, so
        the engine stays consistent (the next step takes that result first).
        """
        t0 = time.perf_counter()
        out = self._expire()
        try:
            # After an interrupted step, the results still owed come first: scheduling
            # assumes at most one plan in flight.
            self._take_results(1 if self.config.async_scheduling else 0, out, cancelled)
            sched = self.scheduler.schedule()
            # Preempted sequences leave the workers with the next plan, whichever it is.
            self._pending_drops.extend(s.seq_id for s in sched.preempted)
            if not sched.is_empty or (self._pending_drops and not self._inflight):
                # (An empty schedule with drops: the workers free those sequences' state,
                # their CPU K/V copies included, now rather than at the next request.)
                self._dispatch(sched)
            elif not self._inflight:
                if self.scheduler.num_unfinished and not out.deltas and not sched.preempted:
                    raise RuntimeError("scheduler made no progress with requests pending")
                return out
            keep = 1 if self.config.async_scheduling and not sched.is_empty else 0
            self._take_results(keep, out, cancelled)
        except EngineDeadError as e:
            if self._recover(str(e)):
                return out
            self._fail_all()
            raise
        step_time = time.perf_counter() - t0
        self.last_step.step_time_s = step_time
        self.total_step_s += step_time
        return out

    def _dispatch(self, sched: SchedulerOutput) -> None:
        """Send the plan for `sched` and account for it as sent: computed counts advance,
        sampling sequences get a pending token, computed blocks enter the prefix cache."""
        now = time.monotonic()
        for seq, _ in sched.scheduled:
            if not seq.on_worker and seq.num_preemptions == 0 and seq.index == 0:
                self.metrics.queue_time.observe(now - self.requests[seq.request_id].arrival_time)
        # Prompt tokens computed this step (chunks and recomputes included).
        prompt_tokens = sum(max(0, min(seq.num_computed_tokens + n, seq.num_prompt_tokens)
                                - seq.num_computed_tokens) for seq, n in sched.scheduled)
        plan = self._build_plan(sched)
        due: set[int] = set()
        for seq, n in sched.scheduled:
            seq.num_computed_tokens += n
            if seq.num_computed_tokens == seq.num_tokens + seq.num_pending:
                seq.num_pending += 1
                due.add(seq.seq_id)
            self.kv.cache_computed_blocks(seq)
        generation = plan_arrays.pack(plan, self.plan_writer) if self.plan_writer else 0
        plan_bytes = self.workers.broadcast(plan)
        self._inflight.append(InFlight(plan.step_id, sched, due, prompt_tokens, plan_bytes,
                                       generation))

    def _take_results(self, keep: int, out: EngineOutput,
                      cancelled: Callable[[], bool] | None) -> None:
        """Apply results, oldest first, until `keep` plans are in flight. A plan leaves
        the queue only once its result is applied (an interrupted wait leaves it there)."""
        while len(self._inflight) > keep:
            self._complete(self._inflight[0], out, cancelled)
            self._inflight.popleft()

    def _complete(self, step: InFlight, out: EngineOutput,
                  cancelled: Callable[[], bool] | None = None) -> None:
        result = self._wait_result(step, cancelled)
        if step.generation:
            # Every rank copies a plan's arrays out before the step's first collective,
            # so rank 0's result means all of them are done with the region.
            self.plan_writer.acked_all(step.generation)
        num_applied = self._apply_result(step.sched, result, out)
        self.last_step = StepStats(step.step_id, step.sched.num_batched_tokens,
                                   step.plan_bytes, result.worker_time_s)
        self.total_worker_s += result.worker_time_s
        self._export_stats(step.prompt_tokens, num_applied)

    def reset_step_totals(self) -> None:
        self.total_step_s = self.total_worker_s = 0.0

    @property
    def worker_idle_share(self) -> float:
        """Share of step time since the last reset that rank 0 was not computing: the
        leader's own work plus transport, i.e. the workers waiting for the next plan."""
        return 1.0 - self.total_worker_s / self.total_step_s if self.total_step_s else 0.0

    def _expire(self) -> EngineOutput:
        """End requests whose TTL ran out; a heap keeps this off the per-step hot path."""
        out = EngineOutput()
        now = time.monotonic()
        while self._deadlines and self._deadlines[0][0] <= now:
            _, rid = heapq.heappop(self._deadlines)
            if rid in self.requests:  # else it finished (or its id was reused) already
                req = self.requests[rid]
                if req.deadline is not None and req.deadline <= now:
                    part = self.abort_request(rid, "timeout")
                    out.deltas += part.deltas
                    out.finished += part.finished
        return out

    def _export_stats(self, prompt_tokens: int, num_sampled: int) -> None:
        st = self.kv.stats
        queries, hits, pre = st.queries, st.hits, self.scheduler.num_preemptions
        q0, h0, p0 = self._stats_seen
        self._stats_seen = (queries, hits, pre)
        m = self.metrics
        m.record_step(prompt_tokens=prompt_tokens, generation_tokens=num_sampled,
                      preemptions=pre - p0, queries=queries - q0, hits=hits - h0)
        running, waiting = len(self.scheduler.running), len(self.scheduler.waiting)
        m.set_state(running, waiting, self.kv.usage)
        m.maybe_log(running, waiting, self.kv.usage)

    def _build_plan(self, sched: SchedulerOutput) -> protocol.StepPlan:
        drops = self._pending_drops
        self._pending_drops = []
        new_seqs, running = [], []
        for seq, n in sched.scheduled:
            if not seq.on_worker:
                new_seqs.append(protocol.NewSeq(
                    seq.seq_id, list(seq.token_ids), seq.num_prompt_tokens,
                    seq.num_computed_tokens, n, list(seq.block_table),
                    to_worker_sampling(seq.params)))
                seq.on_worker = True
                if seq.index == 0 and seq.num_preemptions == 0:
                    self.requests[seq.request_id].num_cached_tokens = seq.num_computed_tokens
            else:
                running.append(protocol.RunningSeq(seq.seq_id, n,
                                                   seq.block_table[seq.num_sent_blocks:]))
            seq.num_sent_blocks = len(seq.block_table)
        return protocol.StepPlan(next(self._step_ids), new_seqs, running, drops)

    def _wait_result(self, step: InFlight,
                     cancelled: Callable[[], bool] | None = None) -> protocol.StepResult:
        while True:
            msg = self.workers.recv(self.config.step_timeout_s, cancelled)
            if isinstance(msg, protocol.StepResult) and msg.step_id == step.step_id:
                problem = self._check_result(msg, step.due)
                if problem is None:
                    return msg
                logger.error("dropping a result for step %d: %s", step.step_id, problem)
                continue
            logger.warning("ignoring %s while waiting for step %d", type(msg).__name__,
                           step.step_id)

    def _check_result(self, r: protocol.StepResult, due: set[int]) -> str | None:
        """A result must sample exactly the sequences that finished their tokens this step,
        with token ids in the vocabulary; anything else is not our workers' answer."""
        if len(r.seq_ids) != len(r.token_ids) or set(r.seq_ids) != due \
                or len(r.seq_ids) != len(due):
            return "it does not sample the sequences the plan asked for"
        if any(not 0 <= t < self.vocab_size for t in r.token_ids):
            return "a token id is outside the vocabulary"
        if r.logprobs is not None and (not isinstance(r.logprobs, list)
                                       or len(r.logprobs) != len(r.seq_ids)):
            return "malformed logprobs"
        return None

    def check_workers(self) -> None:
        """For an idle owner: notice a worker death now (recover, or raise EngineDeadError)
        rather than at the next step."""
        if self.workers.check_alive() is None:
            return
        if not self._recover(self.workers.dead):
            self._fail_all()
            raise EngineDeadError(self.workers.dead)

    def _recover(self, error: str) -> bool:
        """Replace a failed worker group and requeue every in-flight sequence for recompute.

        The new workers' KV cache is empty, so every cached prefix is forgotten and every
        running sequence recomputes its prompt and the tokens it generated so far: greedy
        (and seeded) outputs continue exactly as if nothing had happened.
        """
        while self.restart_workers is not None and self.restarts_left > 0:
            self.restarts_left -= 1
            logger.error("worker group failed: %s; restarting it (%d restart(s) left after "
                         "this)", error.split("\n")[0], self.restarts_left)
            try:
                self.workers = self.restart_workers()
                self._init_workers(self.num_blocks)
            except Exception as e:  # a failed restart counts; the next one may work
                error = f"restart failed: {e}"
                continue
            # Tokens of plans in flight died with the workers: recompute without them.
            self._inflight.clear()
            if self.plan_writer is not None:
                self.plan_writer.reclaim_all()  # the old readers are gone
            for req in self.requests.values():
                for seq in req.seqs:
                    seq.num_pending = 0
            self.scheduler.requeue_all()
            self.kv.pool.reset_prefix_cache()  # every block is free now: always succeeds
            self._pending_drops.clear()
            self.metrics.worker_restarts.inc()
            logger.warning("worker group restarted; %d request(s) requeued for recompute",
                           len(self.requests))
            return True
        return False

    def _apply_result(self, sched: SchedulerOutput, result: protocol.StepResult,
                      out: EngineOutput) -> int:
        """Append the sampled tokens, stream them, finish what stopped; returns how many
        tokens were kept."""
        num_applied = 0
        sampled = dict(zip(result.seq_ids, result.token_ids))
        logprobs = dict(zip(result.seq_ids, result.logprobs)) if result.logprobs else {}
        now = time.monotonic()
        for seq, _ in sched.scheduled:
            token = sampled.get(seq.seq_id)
            # A sequence that finished (a stop token in the previous result, an abort, a
            # timeout) while this plan was in flight: its extra token is dropped unseen.
            if token is None or seq.is_finished:
                continue
            req = self.requests[seq.request_id]
            seq.token_ids.append(token)
            seq.num_pending -= 1
            num_applied += 1
            self.kv.cache_computed_blocks(seq)
            lp_entry = None
            if logprobs.get(seq.seq_id) is not None:
                lp, top = logprobs[seq.seq_id]
                lp_entry = {int(t): float(v) for t, v in top}
                lp_entry[token] = float(lp)
                if seq.logprobs is None:
                    seq.logprobs = []
                seq.logprobs.append(lp_entry)
            if req.first_token_time is None:
                req.first_token_time = now
                self.metrics.ttft.observe(now - req.arrival_time)
            elif req.last_token_time[seq.index]:
                self.metrics.itl.observe(now - req.last_token_time[seq.index])
            req.last_token_time[seq.index] = now
            reason = self._check_stop(seq, token)
            text = ""
            detok = req.detoks[seq.index]
            if detok is not None:
                text, hit_stop = detok.add([token], finished=reason is not None)
                if hit_stop and reason is None:
                    reason = "stop"
            lps = None if lp_entry is None else [lp_entry]
            if reason is None:
                out.deltas.append(CompletionDelta(req.request_id, seq.index, [token], text, lps,
                                                  None))
                continue
            self._finish_seq(seq, reason)
            out.deltas.append(self._final_delta(req, seq, [token], lps, text))
            if req.finished:
                out.finished.append(self._finish_request(req))
        return num_applied

    def _final_delta(self, req: Request, seq: Sequence, token_ids: list[int],
                     lps: list | None, text: str = "") -> CompletionDelta:
        detok = req.detoks[seq.index]
        if detok is not None:
            text += detok.flush()
        usage = {"prompt_tokens": seq.num_prompt_tokens,
                 "completion_tokens": seq.num_output_tokens,
                 "cached_tokens": req.num_cached_tokens}
        return CompletionDelta(req.request_id, seq.index, token_ids, text, lps,
                               seq.finish_reason, usage)

    def _finish_request(self, req: Request) -> RequestOutput:
        self.requests.pop(req.request_id, None)
        self.metrics.e2e.observe(time.monotonic() - req.arrival_time)
        reason = req.seqs[0].finish_reason or "error"
        self.metrics.finished[reason if reason in self.metrics.finished else "error"].inc()
        return self._make_output(req)

    def _check_stop(self, seq: Sequence, token: int) -> str | None:
        p = seq.params
        if seq.num_output_tokens >= p.min_tokens and token in p.all_stop_token_ids():
            return "stop"
        if seq.num_output_tokens >= p.max_tokens or seq.num_tokens >= self.config.max_model_len:
            return "length"
        return None

    def _finish_seq(self, seq: Sequence, reason: str) -> None:
        if seq.on_worker:
            self._pending_drops.append(seq.seq_id)
        self.scheduler.finish(seq, reason)

    def _fail_all(self) -> None:
        """The workers are gone: end every request with an error, free every block."""
        for req in self.requests.values():
            for seq in req.seqs:
                if not seq.is_finished:
                    self.scheduler.finish(seq, "error")
        self.requests.clear()
        self._deadlines.clear()

    def _make_output(self, req: Request) -> RequestOutput:
        outs = [CompletionOutput(s.index, s.output_token_ids,
                                 "" if d is None else d.text, s.finish_reason, s.logprobs)
                for s, d in zip(req.seqs, req.detoks)]
        return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, outs,
                             finished=True,
                             num_cached_tokens=req.num_cached_tokens)

    def shutdown(self) -> None:
        try:
            if self.workers.dead is None:
                self.workers.broadcast(protocol.Shutdown())
        except Exception:  # shutting down anyway; the launcher kills what is left
            logger.debug("could not send shutdown to the workers", exc_info=True)
