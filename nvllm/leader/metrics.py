"""Engine metrics (Prometheus, vLLM-like names under ``nvllm:``) and the periodic log line.

Each engine owns its own registry, so two engines in one process never share counters.
"""

from __future__ import annotations

import logging
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

logger = logging.getLogger("nvllm.leader.stats")

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
FINISH_REASONS = ("stop", "length", "abort", "timeout", "error")


class EngineMetrics:
    def __init__(self, model_name: str, log_interval_s: float = 5.0,
                 num_speculative_tokens: int = 0) -> None:
        self.registry = CollectorRegistry()
        r, labels = self.registry, {"model_name": model_name}

        def hist(name: str, doc: str) -> Histogram:
            return Histogram(name, doc, labelnames=["model_name"], registry=r,
                             buckets=_LATENCY_BUCKETS).labels(**labels)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, labelnames=["model_name"], registry=r).labels(**labels)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, labelnames=["model_name"], registry=r).labels(**labels)

        self.ttft = hist("nvllm:time_to_first_token_seconds", "Time to first token.")
        self.itl = hist("nvllm:inter_token_latency_seconds", "Time between output tokens.")
        self.e2e = hist("nvllm:e2e_request_latency_seconds", "Request latency, end to end.")
        self.queue_time = hist("nvllm:request_queue_time_seconds",
                               "Time from arrival to first scheduling.")
        self.running = gauge("nvllm:num_requests_running", "Requests running.")
        self.waiting = gauge("nvllm:num_requests_waiting", "Requests waiting.")
        self.kv_usage = gauge("nvllm:kv_cache_usage_perc", "Fraction of KV blocks in use.")
        self.prefix_queries = counter("nvllm:prefix_cache_queries",
                                      "Prompt tokens looked up in the prefix cache.")
        self.prefix_hits = counter("nvllm:prefix_cache_hits",
                                   "Prompt tokens served from the prefix cache.")
        self.prompt_tokens = counter("nvllm:prompt_tokens", "Prompt tokens computed.")
        self.generation_tokens = counter("nvllm:generation_tokens", "Tokens generated.")
        self.preemptions = counter("nvllm:num_preemptions", "Preemptions.")
        self.clients_evicted = counter("nvllm:clients_evicted",
                                       "Clients evicted for not reading their messages.")
        self.worker_restarts = counter("nvllm:worker_restarts",
                                       "Worker groups replaced after a failure.")
        finished = Counter("nvllm:request_success", "Finished requests by finish reason.",
                           labelnames=["model_name", "finished_reason"], registry=r)
        self.finished = {reason: finished.labels(model_name=model_name, finished_reason=reason)
                         for reason in FINISH_REASONS}
        # Speculative decoding (vLLM's spec_decode counters; registered while it is on).
        self.spec_drafts = self.spec_draft_tokens = self.spec_accepted = None
        self.spec_per_pos: list = []
        if num_speculative_tokens:
            self.spec_drafts = counter("nvllm:spec_decode_num_drafts",
                                       "Verify steps of sequences that had draft tokens.")
            self.spec_draft_tokens = counter("nvllm:spec_decode_num_draft_tokens",
                                             "Draft tokens proposed.")
            self.spec_accepted = counter("nvllm:spec_decode_num_accepted_tokens",
                                         "Draft tokens accepted.")
            per_pos = Counter("nvllm:spec_decode_num_accepted_tokens_per_pos",
                              "Draft tokens accepted, by position in the draft.",
                              labelnames=["model_name", "position"], registry=r)
            self.spec_per_pos = [per_pos.labels(model_name=model_name, position=str(j))
                                 for j in range(num_speculative_tokens)]
        # For the periodic log line.
        self.log_interval_s = log_interval_s
        self._last_log = time.monotonic()
        self._since = {"prompt": 0, "gen": 0, "preempt": 0, "queries": 0, "hits": 0,
                       "drafts": 0, "draft_tokens": 0, "accepted": 0}

    def record_step(self, *, prompt_tokens: int, generation_tokens: int, preemptions: int,
                    queries: int, hits: int) -> None:
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(generation_tokens)
        self.preemptions.inc(preemptions)
        self.prefix_queries.inc(queries)
        self.prefix_hits.inc(hits)
        for key, v in (("prompt", prompt_tokens), ("gen", generation_tokens),
                       ("preempt", preemptions), ("queries", queries), ("hits", hits)):
            self._since[key] += v

    def record_spec(self, drafts: int, draft_tokens: int, accepted: int,
                    accepted_per_pos: list[int]) -> None:
        """One step's speculative decoding counts (deltas)."""
        if self.spec_drafts is None:
            return
        self.spec_drafts.inc(drafts)
        self.spec_draft_tokens.inc(draft_tokens)
        self.spec_accepted.inc(accepted)
        for c, v in zip(self.spec_per_pos, accepted_per_pos):
            if v:
                c.inc(v)
        s = self._since
        s["drafts"] += drafts
        s["draft_tokens"] += draft_tokens
        s["accepted"] += accepted

    def set_state(self, running: int, waiting: int, kv_usage: float) -> None:
        self.running.set(running)
        self.waiting.set(waiting)
        self.kv_usage.set(kv_usage)

    def maybe_log(self, running: int, waiting: int, kv_usage: float) -> None:
        """One vLLM-like line every log_interval_s while the engine is busy."""
        now = time.monotonic()
        dt = now - self._last_log
        if dt < self.log_interval_s:
            return
        s = self._since
        hit_rate = 100.0 * s["hits"] / s["queries"] if s["queries"] else 0.0
        logger.info(
            "Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f tokens/s, "
            "Running: %d reqs, Waiting: %d reqs, KV cache usage: %.1f%%, Prefix cache hit "
            "rate: %.1f%%, Preemptions: %d", s["prompt"] / dt, s["gen"] / dt, running, waiting,
            100.0 * kv_usage, hit_rate, s["preempt"])
        if self.spec_drafts is not None and s["drafts"]:
            logger.info(
                "Speculative decoding: mean accepted length %.2f (1 + accepted drafts per "
                "verify step), draft acceptance rate %.1f%%, drafts %d, draft tokens %d, "
                "accepted %d", 1 + s["accepted"] / s["drafts"],
                100.0 * s["accepted"] / max(1, s["draft_tokens"]), s["drafts"],
                s["draft_tokens"], s["accepted"])
        self._last_log = now
        self._since = dict.fromkeys(s, 0)

    def exposition(self) -> str:
        return generate_latest(self.registry).decode()
