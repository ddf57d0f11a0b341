"""The leader's engine: one step plan per step, and the path of every token back out.

A step reads top to bottom:

    Scheduler.schedule -> PlanBuilder.build -> Executor.send
    -> Executor.recv_result (the oldest plan still owed a result)
    -> Scheduler.update_from_output (append tokens; finish on EOS / length)
    -> OutputProcessor.process (detokenize, stop strings, deltas, RequestOutputs)
    -> Scheduler.finish for the sequences a stop string ended

Requests come in through ``submit`` (``InputProcessor.process``: tokenize, check limits,
build the request; then admit it) and leave through ``abort_request`` / ``abort_all`` or
their final step; the engine alone owns its dicts (``requests`` is a read-only view).
With async scheduling the newest plan stays in flight while its predecessor's result is
applied, so the leader's work overlaps the workers'; synchronously the result taken is the
plan's own.
"""

from __future__ import annotations

import collections
import heapq
import logging
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from nvllm.common.config import EngineConfig
from nvllm.common.errors import EngineDeadError, Overloaded, RequestRejected
from nvllm.common.sampling_params import SamplingParams
from nvllm.common.structured_outputs import StructuredOutputsParams
from nvllm.leader.draft_proposer import DraftModelProposer
from nvllm.leader.executor import Executor
from nvllm.leader.grammar import CompiledGrammar, GrammarService, WorkerGrammars
from nvllm.leader.input_processor import InputProcessor
from nvllm.leader.kv_cache_manager import KVCacheManager
from nvllm.leader.metrics import EngineMetrics
from nvllm.leader.ngram_proposer import NgramProposer
from nvllm.leader.output_processor import EngineOutput, OutputProcessor
from nvllm.leader.plan_builder import PlanBuilder
from nvllm.leader.request import Request
from nvllm.leader.scheduler import Scheduler, SchedulerOutput
from nvllm.leader.sleep_mode import SleepMode
from nvllm.leader.spec_gate import SpecGate
from nvllm.leader.weight_sources import WeightSources
from nvllm.leader.weight_sync import WeightSync

logger = logging.getLogger(__name__)

# A request running through this many worker-group deaths is ended, not replayed again.
MAX_DEATHS_IN_FLIGHT = 2


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
    prompt_tokens: int  # prompt tokens it computes (chunks and recomputes included)
    plan_bytes: int
    generation: int = 0  # of the plan's arrays in the transport ring (0: none)


class LLMEngine(SleepMode, WeightSync, WeightSources):
    def __init__(self, config: EngineConfig, executor: Executor, tokenizer: Any) -> None:
        assert config.model_info is not None, "EngineConfig.finalize() first"
        self.config = config
        self.executor = executor
        self.tokenizer = tokenizer
        self.vocab_size = config.model_info.vocab_size
        self.num_blocks = executor.num_blocks
        self.capacity_tokens = self.num_blocks * config.block_size
        logger.info(
            "KV cache: %d blocks x %d tokens = %d tokens; maximum concurrency for "
            "%d-token requests: %.2fx", self.num_blocks, config.block_size,
            self.capacity_tokens, config.max_model_len,
            self.capacity_tokens / config.max_model_len)
        self.kv = KVCacheManager(self.num_blocks, config.block_size,
                                 config.enable_prefix_caching, config.model_info.kv_window)
        proposer: NgramProposer | DraftModelProposer | None = None
        # Speculation goes off by itself at batch sizes where it measurably lowers the
        # output rate (nvllm/leader/spec_gate.py).
        self.spec_gate: SpecGate | None = None
        self._step_tokens = 0  # output tokens of the results applied in this step
        if config.speculative_config is not None:
            proposer = (DraftModelProposer(config.speculative_config)
                        if config.speculative_config.uses_draft_model
                        else NgramProposer(config.speculative_config))
            if config.speculative_config.measure_throughput:
                self.spec_gate = SpecGate()
        self.scheduler = Scheduler(self.kv, config.max_num_seqs, config.max_num_batched_tokens,
                                   config.max_model_len, config.max_plan_bytes, proposer)
        spec = config.speculative_config
        self.metrics = EngineMetrics(config.model, config.log_stats_interval_s,
                                     spec.num_speculative_tokens if spec is not None else 0)
        self.input_processor = InputProcessor(config, tokenizer, self.capacity_tokens)
        self.plan_builder = PlanBuilder()
        self.output_processor = OutputProcessor(tokenizer, self.metrics)
        # Live requests by id: the output processor's dict, which only the engine changes.
        self._requests = self.output_processor.requests
        # Structured output: compiled off the step loop (a child process, started on the
        # first constrained request), sent once per grammar to rank 0.
        self.grammars = None if tokenizer is None else GrammarService(
            config.source.tokenizer, self.vocab_size, config.model_info.eos_token_ids,
            timeout_s=config.grammar_compile_timeout_s,
            cache_bytes=config.grammar_cache_mib << 20,
            max_spec_bytes=config.max_grammar_bytes,
            any_whitespace=config.json_any_whitespace)
        self.worker_grammars = WorkerGrammars(config.grammar_cache_mib << 20)
        # Plans in flight: with async scheduling one more than the step being applied.
        # Speculative decoding's leader-side proposer needs each step's token before it
        # builds the next plan: steps that may propose run synchronously (step();
        # nvllm/common/speculative.py).
        self._depth = 1 if config.async_scheduling else 0
        self._inflight: collections.deque[InFlight] = collections.deque()
        self._deadlines: list[tuple[float, str]] = []  # heap of (deadline, request id)
        self.last_step = StepStats()
        self.reset_step_totals()
        self._stats_seen = (0, 0, 0)  # prefix queries, hits, preemptions already exported
        self._spec_seen = (0, 0, 0, [])  # drafts, draft tokens, accepted, per position
        # The engine is single-threaded by contract: the thread that steps it owns it.
        # An EngineServer marks the engine as its own while it serves (the offline API
        # refuses then), and two overlapping steps fail loudly instead of corrupting the
        # scheduler and reading each other's results.
        self.served_by: str | None = None
        self._step_lock = threading.Lock()
        self._init_weight_sync()  # pause/resume, weight updates (leader/weight_sync.py)
        self._init_sleep_mode()  # sleep / wake_up (leader/sleep_mode.py)

    @property
    def requests(self) -> Mapping[str, Request]:
        """Live requests by id (finished ones leave with their RequestOutput), read-only:
        requests enter through ``submit`` and leave through the engine."""
        return MappingProxyType(self._requests)

    @property
    def workers(self) -> Any:
        """The current worker group's sockets."""
        return self.executor.workers

    # ---- requests -------------------------------------------------------------------

    def submit(self, prompt: str | list[int] | None = None,
               params: SamplingParams | None = None, *,
               prompt_token_ids: list[int] | None = None, request_id: str | None = None,
               priority: int = 0, ttl_ms: float | None = None,
               grammar: CompiledGrammar | Future | None = None,
               output_token_ids: list[int] | None = None,
               output_text_offset: int | None = None) -> Request:
        """Process a prompt (text, or token ids as `prompt` or `prompt_token_ids`) into a
        request and admit it; returns the admitted Request.

        Raises RequestRejected for a prompt or parameters the engine cannot serve (and for
        a `request_id` already in use), Overloaded past max_queued_requests. A constrained
        request brings its compiled `grammar` (``grammar_future``, or its result; a future
        is waited on after the prompt is checked); without one it is compiled here,
        blocking (the offline API), and GrammarError is its refusal. `output_token_ids`
        resumes a completion another engine started (InputProcessor.process)."""
        if self._weights_missing:  # a level-2 sleep's weights are not all back
            raise RequestRejected(self.sleep_refusal())
        req = self.input_processor.process(prompt, params, request_id=request_id,
                                           prompt_token_ids=prompt_token_ids,
                                           priority=priority, ttl_ms=ttl_ms,
                                           output_token_ids=output_token_ids,
                                           output_text_offset=output_text_offset)
        if isinstance(grammar, Future):
            grammar = grammar.result()
        return self._admit(req, grammar)

    def _admit(self, req: Request, grammar: CompiledGrammar | None) -> Request:
        """Admit a processed request: the queue limit, a unique id, its grammar, then the
        output processor, the scheduler's waiting queue and the TTL heap."""
        limit = self.config.max_queued_requests
        if limit is not None and self.scheduler.num_waiting_requests >= limit:
            raise Overloaded(f"overloaded: {self.scheduler.num_waiting_requests} requests are "
                             f"already waiting (max_queued_requests={limit}); retry later")
        if req.request_id in self._requests:
            raise RequestRejected("this request id is already in use")
        if req.params.structured_outputs is not None:
            grammar = grammar or self.grammar_future(req.params.structured_outputs).result()
        else:
            grammar = None
        self.output_processor.add_request(req)
        for seq in req.seqs:
            self.scheduler.add(seq, grammar)
        if req.deadline is not None:
            heapq.heappush(self._deadlines, (req.deadline, req.request_id))
        return req

    def grammar_future(self, spec: StructuredOutputsParams) -> Future:
        """The compiled grammar for a request's structured_outputs, as a future (done at
        once on a cache hit; GrammarError for a spec that cannot be compiled)."""
        if self.grammars is None:
            raise RequestRejected("structured output needs the model's tokenizer (the "
                                  "engine was started with skip_tokenizer_init)")
        return self.grammars.get(spec)

    def _live_grammar_keys(self) -> set[str]:
        return {s.grammar.key for req in self._requests.values() for s in req.seqs
                if s.grammar is not None and not s.is_finished}

    def abort_request(self, request_id: str, reason: str = "abort") -> EngineOutput:
        """End a request now (its KV blocks are freed); unknown ids are ignored."""
        req = self._requests.get(request_id)
        if req is None:
            return EngineOutput()
        for seq in req.seqs:
            if not seq.is_finished:
                self.scheduler.finish(seq, reason)
        return self.output_processor.abort(req, reason)

    def abort_all(self, reason: str = "abort") -> EngineOutput:
        """End every live request now (as ``abort_request`` each, in admission order);
        returns their final deltas and RequestOutputs."""
        out = EngineOutput()
        for rid in list(self._requests):
            out.extend(self.abort_request(rid, reason))
        return out

    def has_unfinished_requests(self) -> bool:
        """Requests to run, a plan still in flight whose result must be taken, or
        finished sequences the workers still hold (one more step lets them go)."""
        return (self.scheduler.num_unfinished > 0 or bool(self._inflight)
                or bool(self.scheduler.finished_seq_ids))

    # ---- the step -------------------------------------------------------------------

    def step(self, cancelled: Callable[[], bool] | None = None) -> EngineOutput:
        """Run one engine step: expire timed-out requests, schedule and send a plan, and
        apply the oldest result owed.

        ``cancelled`` is polled while waiting for a result: when it turns true the call
        raises KeyboardInterrupt with the plan still in flight and its result unread, so
        the engine stays consistent (the next step takes that result before it schedules).
        """
        if not self._step_lock.acquire(blocking=False):
            raise RuntimeError("LLMEngine.step was called while another thread was stepping "
                               "this engine; one thread must own it (send requests to a "
                               "served engine through nvllm.Client)")
        try:
            return self._step(cancelled)
        finally:
            self._step_lock.release()

    def _step(self, cancelled: Callable[[], bool] | None) -> EngineOutput:
        t0 = time.perf_counter()
        out = self._expire()
        try:
            # Speculative decoding: a step that may propose drafts runs synchronously, and
            # no plan is sent while one with drafts is in flight (the workers' count of a
            # verifying sequence's tokens is known only once its result is).
            num_running = len(self.scheduler.running)
            # The gate's answer also decides whether a draft model drafts after this
            # step: with speculation off here its drafts would be dropped unused.
            allowed = self.spec_gate is None or self.spec_gate.allow(num_running)
            speculate = allowed and self.scheduler.speculating()
            self._step_tokens = 0
            depth = 0 if speculate or any(f.sched.spec_tokens for f in self._inflight) \
                else self._depth
            keep = depth  # an interrupted step owes results: take those first
            if len(self._inflight) <= depth:
                sched = self.scheduler.schedule(speculate, ask_drafts=allowed)
                if sched.scheduled or (self.scheduler.finished_seq_ids and not self._inflight):
                    # (No sequences but drops: the workers free those sequences' state,
                    # their CPU K/V copies included, now rather than at the next request.)
                    self._send(sched)
                elif not self._inflight:
                    if self.scheduler.num_unfinished and not out.deltas and not sched.preempted \
                            and self.scheduler.paused is None:
                        raise RuntimeError("scheduler made no progress with requests pending")
                    return out
                keep = depth if sched.scheduled else 0  # nothing new: drain
            while len(self._inflight) > keep:
                self._apply_oldest_result(out, cancelled)
        except EngineDeadError as e:
            if not self._recover(str(e), out):
                self._fail_all()
                raise
        step_time = time.perf_counter() - t0
        if self.spec_gate is not None:
            self.spec_gate.record(num_running, allowed, self._step_tokens, step_time,
                                  speculated=speculate)
        self.last_step.step_time_s = step_time
        self.total_step_s += step_time
        return out

    def _send(self, sched: SchedulerOutput) -> None:
        now = time.monotonic()
        prompt_tokens = 0
        grammars = []  # of the sequences the workers do not hold yet
        for seq, n in sched.scheduled:
            if not seq.on_worker:
                if seq.num_preemptions == 0 and seq.index == 0:
                    self.metrics.queue_time.observe(
                        now - self._requests[seq.request_id].arrival_time)
                if seq.grammar is not None:
                    grammars.append(seq.grammar)
            start = seq.num_computed_tokens - n
            prompt_tokens += max(0, min(start + n, seq.num_prompt_tokens) - start)
        if grammars:  # rank 0 gets the grammars it lacks before the plan that needs them
            load = self.worker_grammars.load_for(grammars, self.grammars.tokenizer_info,
                                                 self._live_grammar_keys)
            if load is not None:
                self.executor.send_first(load)
        plan = self.plan_builder.build(sched, self.scheduler.take_finished_seq_ids())
        self.scheduler.mark_sent(sched)
        plan_bytes, generation = self.executor.send(plan)
        self._inflight.append(InFlight(plan.step_id, sched, prompt_tokens, plan_bytes,
                                       generation))

    def _apply_oldest_result(self, out: EngineOutput,
                             cancelled: Callable[[], bool] | None) -> None:
        """Take the oldest plan's result and stream its tokens. The plan leaves the queue
        only once its result is applied (an interrupted wait leaves it there)."""
        step = self._inflight[0]
        result = self.executor.recv_result(step.step_id, step.sched.sampling_seq_ids,
                                           step.generation, cancelled)
        first = len(out.deltas)
        if result.prompt_logprobs:  # before the tokens: a first token finds its prompt scored
            self.output_processor.add_prompt_logprobs(
                {seq.seq_id: seq for seq, _ in step.sched.scheduled}, result.prompt_logprobs, out)
        updates = self.scheduler.update_from_output(step.sched, result)
        for seq, num_tokens in self.output_processor.process(updates, out):
            self.scheduler.finish(seq, "stop", num_tokens)  # a stop string ended it
        out.steps.append((first, len(out.deltas), step.step_id))
        self._inflight.popleft()
        self.last_step = StepStats(step.step_id, step.sched.num_batched_tokens,
                                   step.plan_bytes, result.worker_time_s)
        self.total_worker_s += result.worker_time_s
        self._step_tokens += len(updates)
        self._export_stats(step.prompt_tokens, len(updates))

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
            req = self._requests.get(rid)  # None: finished (or its id reused) already
            if req is not None and req.deadline is not None and req.deadline <= now:
                out.extend(self.abort_request(rid, "timeout"))
        return out

    def _export_stats(self, prompt_tokens: int, num_sampled: int) -> None:
        st = self.kv.stats
        queries, hits, pre = st.queries, st.hits, self.scheduler.num_preemptions
        q0, h0, p0 = self._stats_seen
        self._stats_seen = (queries, hits, pre)
        m = self.metrics
        m.record_step(prompt_tokens=prompt_tokens, generation_tokens=num_sampled,
                      preemptions=pre - p0, queries=queries - q0, hits=hits - h0)
        sp = self.scheduler.spec_stats
        if sp.num_drafts != self._spec_seen[0]:
            d0, t0, a0, pp0 = self._spec_seen
            pp0 = pp0 or [0] * len(sp.accepted_per_pos)
            m.record_spec(sp.num_drafts - d0, sp.num_draft_tokens - t0,
                          sp.num_accepted_tokens - a0,
                          [x - y for x, y in zip(sp.accepted_per_pos, pp0)])
            self._spec_seen = (sp.num_drafts, sp.num_draft_tokens, sp.num_accepted_tokens,
                               list(sp.accepted_per_pos))
        running, waiting = len(self.scheduler.running), len(self.scheduler.waiting)
        m.set_state(running, waiting, self.kv.usage)
        m.maybe_log(running, waiting, self.kv.usage)

    # ---- worker failures ------------------------------------------------------------

    def check_workers(self) -> EngineOutput:
        """For an idle owner: notice a worker death now (recover, or raise EngineDeadError)
        rather than at the next step. Returns what the recovery ended."""
        out = EngineOutput()
        dead = self.executor.check_alive()
        if dead is None:
            return out
        if not self._recover(dead, out):
            self._fail_all()
            raise EngineDeadError(dead)
        return out

    def _recover(self, error: str, out: EngineOutput) -> bool:
        """Replace a failed worker group and requeue every sequence for recompute.

        The new workers' KV cache is empty, so every cached prefix is forgotten and every
        running sequence recomputes its prompt and the tokens it generated so far: greedy
        (and seeded) outputs continue exactly as if nothing had happened. Sequences that
        were on the workers rejoin one at a time (Scheduler, admission); a request one of
        whose sequences was on the workers through MAX_DEATHS_IN_FLIGHT deaths in a row
        ends with an error instead: it is what kills them, and would kill the next group.
        """
        if not self.executor.restart(error):
            return False
        self.worker_grammars.reset()  # the new rank 0 holds none
        dying = self.scheduler.count_worker_death(MAX_DEATHS_IN_FLIGHT)
        suspects = [rid for rid in self._requests if rid in dying]  # admission order
        self._inflight.clear()  # their tokens died with the workers
        self.scheduler.requeue_all()
        self.kv.pool.reset_prefix_cache()  # every block is free now: always succeeds
        self._forget_weight_updates()  # the new group loaded the checkpoint
        self._forget_sleep()  # ... and allocated its KV cache: awake
        self.metrics.worker_restarts.inc()
        for rid in suspects:
            logger.error("request %s was on the workers through %d worker-group deaths in "
                         "a row: ended with an error instead of replayed", rid,
                         MAX_DEATHS_IN_FLIGHT)
            out.extend(self.abort_request(rid, "error"))
        logger.warning("worker group restarted; %d request(s) requeued for recompute",
                       len(self._requests))
        return True

    def _fail_all(self) -> None:
        """The workers are gone: end every request with an error, free every block."""
        for req in self._requests.values():
            for seq in req.seqs:
                if not seq.is_finished:
                    self.scheduler.finish(seq, "error")
        self._requests.clear()
        self._deadlines.clear()

    def shutdown(self) -> None:
        if self.grammars is not None:
            self.grammars.close()
        self.executor.shutdown()
