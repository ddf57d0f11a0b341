"""Scheduler output -> the step plan every worker executes.

Workers keep each sequence's state, so a plan carries only differences: a sequence the
workers do not hold yet (new, or resumed after preemption) travels whole as a ``NewSeq``;
a running one as a ``RunningSeq`` delta (tokens to compute, blocks added since the last
plan; no token ids, the workers append the tokens they sample themselves). A table slot
given back behind a sliding window (kv_cache_manager.FREED) travels as block 0: the
workers index tables by position and never read a block outside the window.
"""

from __future__ import annotations

import itertools

from nvllm.common import worker_protocol
from nvllm.common.sampling_params import SamplingParams
from nvllm.leader.scheduler import SchedulerOutput


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
        built."""
        new_seqs, running = [], []
        for seq, n in sched.scheduled:
            start = seq.num_computed_tokens - n
            if not seq.on_worker:
                new_seqs.append(worker_protocol.NewSeq(
                    seq.seq_id, list(seq.token_ids), seq.num_prompt_tokens, start, n,
                    [max(b, 0) for b in seq.block_table], to_worker_sampling(
                        seq.params, seq.grammar.key if seq.grammar is not None else None,
                        seq.wants_prompt_logprobs)))
            else:
                running.append(worker_protocol.RunningSeq(
                    seq.seq_id, n, seq.block_table[seq.num_sent_blocks:]))
        return worker_protocol.StepPlan(next(self._step_ids), new_seqs, running,
                                        finished_seq_ids)
