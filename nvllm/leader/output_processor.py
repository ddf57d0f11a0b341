"""Sampled tokens -> what callers see: text deltas, stop strings, finished requests.

The scheduler has already appended each token and ended sequences at a stop token or a
length limit (``SeqUpdate``). Here each token is detokenized incrementally; a stop string
found in the text ends its completion too, and ``process`` returns those sequences so the
engine finishes them in the scheduler before the next plan is built. Every completion
gets exactly one final delta (with ``finish_reason`` and usage), every request one
``RequestOutput``.

Prompt logprobs (``SamplingParams.prompt_logprobs``) arrive per prefill chunk from the one
sequence of the request that scores the prompt (``add_prompt_logprobs``), in order; a
recompute after a preemption or a worker restart scores positions again, and each is taken
once. Every completion's first delta carries the whole list, so a completion whose first
token comes before the prompt is scored (another sequence of the request, served from the
prefix cache) has its deltas held until it is.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from nvllm.common.errors import RequestRejected
from nvllm.common.outputs import CompletionDelta, CompletionOutput, RequestOutput
from nvllm.leader.detokenizer import IncrementalDetokenizer, fast_decoder
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


def resume_detokenizer(detok: IncrementalDetokenizer, produced: list[int],
                       text_offset: int | None) -> None:
    """Bring a fresh detokenizer to where a completion that produced `produced` was, its
    client holding the first `text_offset` characters (None: as much as the stream
    would have shown): the text after them streams next, none of it twice."""
    _, hit_stop = detok.add(produced)
    if hit_stop:
        raise RequestRejected("the text of output_token_ids already holds a stop string: "
                              "that completion has finished")
    shown = max(0, len(detok.text) - detok.holdback) if text_offset is None else text_offset
    if shown > len(detok.text):
        raise RequestRejected(f"output_text_offset {text_offset} is past the "
                              f"{len(detok.text)} characters output_token_ids decode to")
    detok.sent = shown


class OutputProcessor:
    """Owns the live requests (``requests``) and their per-completion output state."""

    def __init__(self, tokenizer: Any, metrics: EngineMetrics) -> None:
        self.tokenizer = tokenizer
        self.decode = None if tokenizer is None else fast_decoder(tokenizer)
        self.metrics = metrics
        self.requests: dict[str, Request] = {}
        # Stamped on every delta and output from now on (the engine's update_weights).
        self.weight_version: int | str | None = None

    def add_request(self, req: Request) -> None:
        """Take a new request; RequestRejected (nothing kept) for a resumed one whose
        produced text already ends it or is shorter than its text offset."""
        p = req.params
        detoks = [None if self.tokenizer is None else IncrementalDetokenizer(
            self.tokenizer, req.prompt_token_ids, stop=p.stop,
            include_stop_str_in_output=p.include_stop_str_in_output,
            skip_special_tokens=p.skip_special_tokens, decode=self.decode)
            for _ in req.seqs]
        for seq, detok in zip(req.seqs, detoks):
            if detok is not None and seq.num_output_tokens:
                resume_detokenizer(detok, seq.output_token_ids, req.resume_text_offset)
        for seq, detok in zip(req.seqs, detoks):
            req.detoks.append(detok)
            req.logprobs.append(None)
            req.finish_reasons.append(None)
            req.last_token_time.append(0.0)
            assert seq.index == len(req.detoks) - 1
        if p.prompt_logprobs is not None:
            req.prompt_logprobs = [None]  # the first prompt token has no logprob
            req.prompt_logprobs_sent = [False] * len(req.seqs)
        self.requests[req.request_id] = req

    def add_prompt_logprobs(self, seqs: dict[int, Sequence], entries: list,
                            out: EngineOutput) -> None:
        """Take one step's prompt scores (StepResult.prompt_logprobs; `seqs`: the step's
        sequences by id). Chunks come in order and every (re)computation of a sequence that
        scores its prompt starts at its first token, so entries either extend the list or
        repeat what it holds: repeats are dropped. Releases held deltas once complete."""
        for sid, first, items in entries:
            seq = seqs.get(sid)
            req = None if seq is None else self.requests.get(seq.request_id)
            if req is None or req.prompt_logprobs is None or req.seqs[seq.index] is not seq:
                continue  # ended meanwhile (aborted, timed out)
            lps, ids = req.prompt_logprobs, req.prompt_token_ids
            for pos in range(max(first, len(lps)), min(first + len(items), len(ids))):
                if pos != len(lps):
                    break  # a gap: never made by the scheduler; nothing is guessed
                lp, top = items[pos - first]
                entry = {int(t): float(v) for t, v in top}
                entry[ids[pos]] = float(lp)  # the prompt token's own, top-k or not
                lps.append(entry)
            if req.held and req.prompt_scored:
                self._release(req, out)

    def process(self, updates: list[SeqUpdate], out: EngineOutput
                ) -> list[tuple[Sequence, int]]:
        """Turn one step's tokens into deltas; returns the sequences a stop string ended
        (still running in the scheduler), each with its length at the token that ended it.
        A sequence that accepted drafts has several updates: a stop string in the first
        ends it there, and its later tokens are dropped (as without speculation)."""
        stopped = []
        now = time.monotonic()
        for u in updates:
            seq = u.seq
            req = self.requests.get(seq.request_id)
            if req is None or req.finish_reasons[seq.index] is not None:
                continue  # ended by an earlier token of this step (a stop string)
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
                    stopped.append((seq, u.num_tokens or seq.num_tokens))
            if reason is None:
                self._emit(req, CompletionDelta(req.request_id, seq.index, [u.token], text, lps),
                           out)
            else:
                if u.num_tokens:
                    req.final_lens[seq.index] = u.num_tokens
                self._finish_completion(req, seq, reason, [u.token], lps, text, out)
        return stopped

    def abort(self, req: Request, reason: str) -> EngineOutput:
        """End every completion still open with `reason`, and the request."""
        out = EngineOutput()
        if not req.prompt_scored:
            req.prompt_logprobs = None  # never scored whole: none are given
        self._release(req, out)
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
        n_out = req.final_lens.get(seq.index, seq.num_tokens) - seq.num_prompt_tokens
        usage = {"prompt_tokens": seq.num_prompt_tokens,
                 "completion_tokens": n_out,
                 "cached_tokens": req.num_cached_tokens}
        self._emit(req, CompletionDelta(req.request_id, seq.index, token_ids, text, lps, reason,
                                        usage), out)
        if req.finished:
            if req.held:  # (the scoring sequence ended, so it cannot be: never leave any)
                req.prompt_logprobs = None
                self._release(req, out)
            out.finished.append(self._finish_request(req))

    def _emit(self, req: Request, d: CompletionDelta, out: EngineOutput) -> None:
        """Send `d`, or hold it while the prompt is being scored; a completion's first
        delta out carries the prompt logprobs."""
        d.weight_version = self.weight_version
        if req.prompt_logprobs is not None:
            if not req.prompt_scored:
                req.held.append(d)
                return
            if not req.prompt_logprobs_sent[d.index]:
                req.prompt_logprobs_sent[d.index] = True
                d.prompt_logprobs = req.prompt_logprobs
        out.deltas.append(d)

    def _release(self, req: Request, out: EngineOutput) -> None:
        held, req.held = req.held, []
        for d in held:
            self._emit(req, d, out)

    def _finish_request(self, req: Request) -> RequestOutput:
        self.requests.pop(req.request_id, None)
        self.metrics.e2e.observe(time.monotonic() - req.arrival_time)
        reason = req.finish_reasons[0] or "error"
        self.metrics.finished[reason if reason in self.metrics.finished else "error"].inc()
        outs = [CompletionOutput(s.index, s.token_ids[s.num_prompt_tokens:
                                                      req.final_lens.get(s.index, None)],
                                 "" if d is None else d.text, req.finish_reasons[s.index],
                                 req.logprobs[s.index], self.weight_version)
                for s, d in zip(req.seqs, req.detoks)]
        return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, outs,
                             finished=True, num_cached_tokens=req.num_cached_tokens,
                             prompt_logprobs=req.prompt_logprobs if req.prompt_scored
                             else None, weight_version=self.weight_version)
