"""Scheduler output -> the step plan every worker executes.

Workers keep each sequence's state, so a plan carries only differences: a sequence the
workers do not hold yet (new, or resumed after preemption) travels whole, in the
``NewSeqs`` columns; a running one as a delta in ``RunningSeqs`` (tokens to compute,
blocks added since the last plan; no token ids, the workers append the tokens they
sample themselves). A table slot
given back behind a sliding window (kv_cache_manager.FREED) travels as block 0: the
workers index tables by position and never read a block outside the window.
"""

from __future__ import annotations

import itertools

import numpy as np

from nvllm.common import worker_protocol
from nvllm.common.sampling_params import SamplingParams
from nvllm.common.worker_protocol import ID_DTYPE, INT_DTYPE, column, csr
from nvllm.leader.scheduler import SchedulerOutput
from nvllm.leader.sequence import Sequence


def to_worker_sampling(p: SamplingParams, grammar_key: str | None = None,
                       prompt_logprobs: bool = False) -> worker_protocol.WorkerSampling:
    """What the workers need of `p`; `grammar_key`: its compiled grammar's (structured
    output); `prompt_logprobs`: this sequence scores the prompt
    (Sequence.wants_prompt_logprobs), so the workers get p.prompt_logprobs."""
    return worker_protocol.WorkerSampling(
        temperature=float(p.temperature), top_p=float(p.top_p), top_k=p.top_k,
        min_p=float(p.min_p), seed=p.seed, min_tokens=p.min_tokens,
        stop_token_ids=sorted(p.all_stop_token_ids()),
        repetition_penalty=float(p.repetition_penalty),
        presence_penalty=float(p.presence_penalty),
        frequency_penalty=float(p.frequency_penalty), logprobs=p.logprobs,
        grammar_key=grammar_key,
        logit_bias_ids=list(p.logit_bias or ()),
        logit_bias_values=list((p.logit_bias or {}).values()),
        prompt_logprobs=p.prompt_logprobs if prompt_logprobs else None)


class PlanBuilder:
    def __init__(self) -> None:
        self._step_ids = itertools.count(1)

    def build(self, sched: SchedulerOutput, finished_seq_ids: list[int]
              ) -> worker_protocol.StepPlan:
        """The plan for `sched` (whose computed counts the scheduler already advanced).
        Pure: the caller marks the sequences as sent (Scheduler.mark_sent) once it is
        built. Writes the columns directly: one pass per column, token and block ids
        through np.fromiter."""
        new = [(seq, n) for seq, n in sched.scheduled if not seq.on_worker]
        run = [(seq, n) for seq, n in sched.scheduled if seq.on_worker]
        return worker_protocol.StepPlan(
            next(self._step_ids), _new_columns(new), _running_columns(run, sched.spec_tokens),
            list(finished_seq_ids), sched.num_draft_tokens, sched.draft_seq_ids)


def _new_columns(new: list[tuple[Sequence, int]]) -> worker_protocol.NewSeqs:
    if not new:
        return worker_protocol.NewSeqs()
    n = np.fromiter((k for _, k in new), np.int64, len(new))
    computed = np.fromiter((s.num_computed_tokens for s, _ in new), np.int64, len(new))
    tok, tok_off = csr([s.token_ids for s, _ in new])
    blk, blk_off = csr([s.block_table for s, _ in new])
    return worker_protocol.NewSeqs(
        column([s.seq_id for s, _ in new], ID_DTYPE),
        column([s.num_prompt_tokens for s, _ in new], INT_DTYPE),
        column(computed - n, INT_DTYPE), column(n, INT_DTYPE), tok, tok_off,
        np.maximum(np.frombuffer(blk, INT_DTYPE), 0).tobytes(), blk_off,  # FREED: block 0
        [to_worker_sampling(s.params, s.grammar.key if s.grammar is not None else None,
                            s.wants_prompt_logprobs) for s, _ in new])


def _running_columns(run: list[tuple[Sequence, int]], spec: dict[int, np.ndarray]
                     ) -> worker_protocol.RunningSeqs:
    if not run:
        return worker_protocol.RunningSeqs()
    blk, blk_off = csr([s.block_table[s.num_sent_blocks:] for s, _ in run])
    drafts: tuple[bytes, bytes] = (b"", worker_protocol.EMPTY_OFFSETS)
    if spec:  # a sequence scheduled new carries no drafts (the scheduler proposes to
        # running, decoding ones only)
        empty = np.zeros(0, np.int64)
        drafts = csr([spec.get(s.seq_id, empty) for s, _ in run])
    return worker_protocol.RunningSeqs(
        column([s.seq_id for s, _ in run], ID_DTYPE),
        column([k for _, k in run], INT_DTYPE), blk, blk_off, *drafts)
