"""Sampled tokens -> what callers see: text deltas, stop strings, finished requests.

The scheduler has already appended each token and ended sequences at a stop token or a
length limit (``SeqUpdate``). Here each token is detokenized incrementally; a stop string
found in the text ends its completion too, and ``process`` returns those sequences so the
engine finishes them in the scheduler before the next plan is built. Every completion
gets exactly one final delta (with ``finish_reason`` and usage), every request one
``RequestOutput``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from nvllm.common.outputs import CompletionDelta, CompletionOutput, RequestOutput
from nvllm.leader.detokenizer import IncrementalDetokenizer
from nvllm.leader.metrics import EngineMetrics
from nvllm.leader.request import Request
from nvllm.leader.scheduler import SeqUpdate
from nvllm.leader.sequence import Sequence


@dataclass(slots=True)
class EngineOutput:
    deltas: list[CompletionDelta] = field(default_factory=list)
    finished: list[RequestOutput] = field(default_factory=list)  # whole requests
    # (first, end, step id) per worker result applied into this output: deltas[first:end]
    # are that step's (for the trace, nvllm/common/trace.py).
    steps: list[tuple[int, int, int]] = field(default_factory=list)

    def extend(self, other: EngineOutput) -> None:
        base = len(self.deltas)
        self.steps += [(a + base, b + base, s) for a, b, s in other.steps]
        self.deltas += other.deltas
        self.finished += other.finished

    def step_of(self, k: int) -> int | None:
        """The step whose result produced delta `k`; None for one no result made (an
        abort's, a timeout's)."""
        for first, end, step in self.steps:
            if first <= k < end:
                return step
        return None


class OutputProcessor:
    """Owns the live requests (``requests``) and their per-completion output state."""

    def __init__(self, tokenizer: Any, metrics: EngineMetrics) -> None:
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.requests: dict[str, Request] = {}

    def add_request(self, req: Request) -> None:
        p = req.params
        for seq in req.seqs:
            req.detoks.append(None if self.tokenizer is None else IncrementalDetokenizer(
                self.tokenizer, req.prompt_token_ids, stop=p.stop,
                include_stop_str_in_output=p.include_stop_str_in_output,
                skip_special_tokens=p.skip_special_tokens))
            req.logprobs.append(None)
            req.finish_reasons.append(None)
            req.last_token_time.append(0.0)
            assert seq.index == len(req.detoks) - 1
        self.requests[req.request_id] = req

    def process(self, updates: list[SeqUpdate], out: EngineOutput) -> list[Sequence]:
        """Turn one step's tokens into deltas; returns the sequences a stop string ended
        (still running in the scheduler)."""
        stopped = []
        now = time.monotonic()
        for u in updates:
            seq = u.seq
            req = self.requests[seq.request_id]
            self._observe_latency(req, seq.index, now)
            lps = None
            if u.logprobs is not None:
                lp, top = u.logprobs
                entry = {int(t): float(v) for t, v in top}
                entry[u.token] = float(lp)  # the sampled token, top-k or not
                if req.logprobs[seq.index] is None:
                    req.logprobs[seq.index] = []
                req.logprobs[seq.index].append(entry)
                lps = [entry]
            reason = u.finish_reason
            text = ""
            detok = req.detoks[seq.index]
            if detok is not None:
                text, hit_stop = detok.add([u.token], finished=reason is not None)
                if hit_stop and reason is None:
                    reason = "stop"
                    stopped.append(seq)
            if reason is None:
                out.deltas.append(CompletionDelta(req.request_id, seq.index, [u.token], text,
                                                  lps))
            else:
                self._finish_completion(req, seq, reason, [u.token], lps, text, out)
        return stopped

    def abort(self, req: Request, reason: str) -> EngineOutput:
        """End every completion still open with `reason`, and the request."""
        out = EngineOutput()
        for seq in req.seqs:
            if req.finish_reasons[seq.index] is None:
                self._finish_completion(req, seq, reason, [], None, "", out)
        if req.request_id in self.requests:  # not finished by the loop above
            out.finished.append(self._finish_request(req))
        return out

    def _observe_latency(self, req: Request, index: int, now: float) -> None:
        if req.first_token_time is None:
            req.first_token_time = now
            self.metrics.ttft.observe(now - req.arrival_time)
        elif req.last_token_time[index]:
            self.metrics.itl.observe(now - req.last_token_time[index])
        req.last_token_time[index] = now

    def _finish_completion(self, req: Request, seq: Sequence, reason: str,
                           token_ids: list[int], lps: list | None, text: str,
                           out: EngineOutput) -> None:
        req.finish_reasons[seq.index] = reason
        detok = req.detoks[seq.index]
        if detok is not None:
            text += detok.flush()
        usage = {"prompt_tokens": seq.num_prompt_tokens,
                 "completion_tokens": seq.num_output_tokens,
                 "cached_tokens": req.num_cached_tokens}
        out.deltas.append(CompletionDelta(req.request_id, seq.index, token_ids, text, lps,
                                          reason, usage))
        if req.finished:
            out.finished.append(self._finish_request(req))

    def _finish_request(self, req: Request) -> RequestOutput:
        self.requests.pop(req.request_id, None)
        self.metrics.e2e.observe(time.monotonic() - req.arrival_time)
        reason = req.finish_reasons[0] or "error"
        self.metrics.finished[reason if reason in self.metrics.finished else "error"].inc()
        outs = [CompletionOutput(s.index, s.output_token_ids,
                                 "" if d is None else d.text, req.finish_reasons[s.index],
                                 req.logprobs[s.index])
                for s, d in zip(req.seqs, req.detoks)]
        return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, outs,
                             finished=True, num_cached_tokens=req.num_cached_tokens)
