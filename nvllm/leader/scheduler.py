"""Continuous batching with chunked prefill and preemption by recompute.

Each step shares one token budget (max_num_batched_tokens) between running sequences
first (decodes, and the next chunk of prompts already being prefilled) and then
waiting sequences, whose prompts are cut into chunks when they do not fit the rest of
the budget. When KV blocks run out, the most recently admitted running sequence is
preempted: its blocks are freed (their computed prefix stays in the prefix cache) and
it goes back to the front of the waiting queue.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from nvllm.leader.kv_cache_manager import KVCacheManager
from nvllm.leader.sequence import Sequence, SequenceStatus


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[tuple[Sequence, int]] = field(default_factory=list)  # (seq, num tokens)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int) -> None:
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        scheduled_ids: set[int] = set()

        # 1. Running sequences: decodes and continuing prefill chunks.
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if n <= 0:
                i += 1
                continue
            while not self.kv.allocate_slots(seq, n):
                victim = self.running.pop()
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            else:
                out.scheduled.append((seq, n))
                scheduled_ids.add(seq.seq_id)
                budget -= n
                i += 1
                continue
            break  # seq preempted itself: nothing after it is left running
        if out.preempted:
            # A victim may have been scheduled earlier in this loop only if it came
            # before seq; victims are taken from the tail, so that cannot happen.
            assert not any(s.seq_id in scheduled_ids for s in out.preempted)
            return out

        # 2. Waiting sequences (preempted ones are at the front), FCFS.
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            hits = self.kv.get_computed_blocks(seq)
            num_cached = len(hits) * self.kv.block_size
            n = min(seq.num_tokens - num_cached, budget)
            if not self.kv.allocate_slots(seq, n, hits):
                break
            self.kv.record_lookup(seq)
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.scheduled.append((seq, n))
            budget -= n
        return out

    def _preempt(self, seq: Sequence) -> None:
        self.kv.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.on_worker = False
        seq.num_sent_tokens = seq.num_sent_blocks = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Take a sequence out (finished or aborted) and give its blocks back."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        self.kv.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
