"""The leader's engine: admission, one step plan per step, applying the workers' results."""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass, field

from nvllm.common import protocol
from nvllm.common.config import EngineConfig
from nvllm.common.errors import EngineDeadError, RequestRejected
from nvllm.common.outputs import CompletionOutput, RequestOutput
from nvllm.common.sampling_params import SamplingParams
from nvllm.leader.executor import WorkerGroupClient
from nvllm.leader.kv_cache_manager import KVCacheManager
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

    @property
    def finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)


@dataclass(slots=True)
class StepStats:
    step_id: int = 0
    num_scheduled_tokens: int = 0
    plan_bytes: int = 0
    worker_time_s: float = 0.0
    step_time_s: float = 0.0


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
        num_blocks = self._init_workers()
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
        self.last_step = StepStats()

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

    def _init_workers(self) -> int:
        ready = self._gather_ready("loaded")
        fits = min(m.num_blocks for m in ready)
        num_blocks = self.config.num_kv_blocks or fits
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
                    prompt_token_ids: list[int] | None = None) -> Request:
        """Admit a request, or raise RequestRejected saying which limit it breaks."""
        params = params or SamplingParams()
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
        req = Request(request_id, text, ids, params)
        for i in range(params.n):
            p = params if params.n == 1 or params.seed is None else params.clone(
                seed=(params.seed + i) % 2**63)
            seq = Sequence(next(self._seq_ids), request_id, list(ids), len(ids), p, index=i)
            req.seqs.append(seq)
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

    def abort_request(self, request_id: str) -> RequestOutput | None:
        req = self.requests.get(request_id)
        if req is None:
            return None
        for seq in req.seqs:
            if not seq.is_finished:
                self._finish_seq(seq, "abort")
        return self._make_output(self.requests.pop(request_id))

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.num_unfinished > 0

    # ---- the step -------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one engine step; returns the requests that finished in it."""
        t0 = time.perf_counter()
        sched = self.scheduler.schedule()
        if sched.is_empty:
            if self.scheduler.num_unfinished:
                raise RuntimeError("scheduler made no progress with requests pending")
            return []
        plan = self._build_plan(sched)
        plan_bytes = self.workers.broadcast(plan)
        result = self._wait_result(plan.step_id)
        finished = self._apply_result(sched, result)
        self.last_step = StepStats(plan.step_id, sched.num_batched_tokens, plan_bytes,
                                   result.worker_time_s, time.perf_counter() - t0)
        return finished

    def _build_plan(self, sched: SchedulerOutput) -> protocol.StepPlan:
        drops = self._pending_drops
        self._pending_drops = []
        drops.extend(s.seq_id for s in sched.preempted)
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
                running.append(protocol.RunningSeq(
                    seq.seq_id, n, seq.token_ids[seq.num_sent_tokens:],
                    seq.block_table[seq.num_sent_blocks:]))
            seq.num_sent_tokens = seq.num_tokens
            seq.num_sent_blocks = len(seq.block_table)
        return protocol.StepPlan(next(self._step_ids), new_seqs, running, drops)

    def _wait_result(self, step_id: int) -> protocol.StepResult:
        try:
            while True:
                msg = self.workers.recv(self.config.step_timeout_s)
                if isinstance(msg, protocol.StepResult) and msg.step_id == step_id:
                    return msg
                logger.warning("ignoring %s while waiting for step %d",
                               type(msg).__name__, step_id)
        except EngineDeadError:
            self._fail_all()
            raise

    def _apply_result(self, sched: SchedulerOutput,
                      result: protocol.StepResult) -> list[RequestOutput]:
        sampled = dict(zip(result.seq_ids, result.token_ids))
        logprobs = dict(zip(result.seq_ids, result.logprobs)) if result.logprobs else {}
        done: list[Request] = []
        for seq, n in sched.scheduled:
            seq.num_computed_tokens += n
            self.kv.cache_computed_blocks(seq)
            token = sampled.get(seq.seq_id)
            if token is None:
                assert seq.num_computed_tokens < seq.num_tokens, "worker skipped a sample"
                continue
            seq.token_ids.append(token)
            if seq.seq_id in logprobs and logprobs[seq.seq_id] is not None:
                if seq.logprobs is None:
                    seq.logprobs = []
                lp, top = logprobs[seq.seq_id]
                entry = {int(t): float(v) for t, v in top}
                entry[token] = float(lp)
                seq.logprobs.append(entry)
            reason = self._check_stop(seq, token)
            if reason is not None:
                self._finish_seq(seq, reason)
                req = self.requests[seq.request_id]
                if req.finished:
                    done.append(req)
        return [self._make_output(self.requests.pop(r.request_id)) for r in done]

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

    def _make_output(self, req: Request, error: str | None = None) -> RequestOutput:
        outs = [CompletionOutput(s.index, s.output_token_ids, self._detokenize(s.output_token_ids),
                                 s.finish_reason, s.logprobs) for s in req.seqs]
        return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, outs,
                             finished=True, error=error,
                             num_cached_tokens=req.num_cached_tokens)

    def _detokenize(self, token_ids: list[int]) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def shutdown(self) -> None:
        try:
            if self.workers.dead is None:
                self.workers.broadcast(protocol.Shutdown())
        except Exception:  # shutting down anyway; the launcher kills what is left
            logger.debug("could not send shutdown to the workers", exc_info=True)
