"""Continuous batching with chunked prefill and preemption by recompute.

Each step shares one token budget (max_num_batched_tokens) between running sequences
first (decodes, and the next chunk of prompts already being prefilled) and then
waiting sequences, whose prompts are cut into chunks when they do not fit the rest of
the budget. When KV blocks run out, the most recently admitted running sequence is
preempted: its blocks are freed (their computed prefix stays in the prefix cache) and
it goes back to the waiting queue, ahead of everything that arrived after it.

Priorities (lower runs first, ties first come first served) order the waiting queue and
pick victims: the victim is the lowest-priority running sequence, and among equals the
most recently admitted.

``schedule`` also accounts for the plan it describes as sent (as vLLM's scheduler does):
computed counts advance, sequences whose last token is computed owe a sampled token
(``num_pending``), and full computed blocks enter the prefix cache. ``update_from_output``
takes a step's sampled tokens back: it appends them and finishes sequences that hit a stop
token or their length limit. Sequences that leave the workers (finished, aborted,
preempted) are listed in ``finished_seq_ids`` until the next plan carries them.

Speculative decoding (a ``proposer``: nvllm/leader/ngram_proposer.py, or
nvllm/leader/draft_proposer.py, whose drafts rank 0 makes after each step and which needs
lookahead slots reserved, ``_lookahead``): a running sequence
that is decoding (exactly one known token left to compute, none in flight) may get d draft
tokens (d <= k, cut so its output never passes max_tokens / max_model_len, and to the
token budget). It is then scheduled for 1 + d tokens with slots for all of them, and its
drafts travel in ``SchedulerOutput.spec_tokens``; they are never appended to its tokens and
never count as known. Its computed count advances by 1 when the plan is accounted (so
``samples_after_step`` holds as for any decode, and the prefix cache, which registers only
computed blocks of known tokens, never sees a draft) and by the accepted drafts when the
result comes. Rejected drafts' slots stay with the sequence: its block table only grows,
and the next tokens overwrite those slots (its blocks are freed with it, as ever).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from nvllm.common.step_rule import samples_after_step
from nvllm.common.utils import cdiv
from nvllm.common.worker_protocol import StepResult
from nvllm.leader.kv_cache_manager import KVCacheManager
from nvllm.leader.sequence import Sequence, SequenceStatus
from nvllm.leader.waiting_queue import WaitingQueue


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[tuple[Sequence, int]] = field(default_factory=list)  # (seq, num tokens)
    preempted: list[Sequence] = field(default_factory=list)
    # Sequences that sample a token in this step (their last known token is computed).
    sampling_seq_ids: set[int] = field(default_factory=set)
    # Speculative decoding: draft tokens per sequence id (each scheduled for 1 + drafts).
    spec_tokens: dict[int, np.ndarray] = field(default_factory=dict)
    # Draft-model proposer: drafts rank 0 makes after this step for each sequence of
    # draft_seq_ids that samples (StepPlan.num_draft_tokens); 0: none.
    num_draft_tokens: int = 0
    draft_seq_ids: list[int] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass(slots=True)
class SeqUpdate:
    """One sampled token taken into a sequence; ``finish_reason`` when it ended it. A
    step that accepted drafts gives a sequence one update per token, in order."""

    seq: Sequence
    token: int
    logprobs: list | None  # the worker's [logprob of token, [[id, logprob], ...]]
    finish_reason: str | None
    num_tokens: int = 0  # the sequence's length with this token (0: its length now)


@dataclass(slots=True)
class SpecStats:
    """Speculative decoding's totals since start (vLLM's spec_decode counters)."""

    num_drafts: int = 0  # verify steps (sequences that had drafts)
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int, max_plan_bytes: int = 64 << 20,
                 proposer: Any = None) -> None:
        """`proposer`: speculative decoding's (NgramProposer), or None."""
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.max_plan_bytes = max_plan_bytes
        self.waiting = WaitingQueue()  # by (priority, arrival order)
        self.running: list[Sequence] = []  # in admission order
        self.num_preemptions = 0
        self._arrivals = itertools.count()
        # Left the workers since the last plan: the next plan tells them to drop these.
        self.finished_seq_ids: list[int] = []
        # Running sequences that were on the workers when a group died and have not
        # completed a step since (see admission): at most one at a time.
        self._quarantined: set[int] = set()
        self.proposer = proposer
        # pause_generation: "wait" runs the running sequences but admits none; "keep"
        # schedules nothing (they stay held); None: normal.
        self.paused: str | None = None
        self.spec_stats = SpecStats()
        if proposer is not None:
            self.spec_stats.accepted_per_pos = [0] * proposer.k

    def add(self, seq: Sequence, grammar: Any = None) -> None:
        """Queue a new sequence; `grammar`: its request's CompiledGrammar (structured
        output), which its plans name to rank 0."""
        if grammar is not None:
            seq.grammar = grammar
        seq.status = SequenceStatus.WAITING
        seq.order = next(self._arrivals)
        self.waiting.add(seq)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    @property
    def num_waiting_requests(self) -> int:
        return self.waiting.num_requests

    def take_finished_seq_ids(self) -> list[int]:
        ids, self.finished_seq_ids = self.finished_seq_ids, []
        return ids

    def schedule(self, propose: bool = True, ask_drafts: bool = True) -> SchedulerOutput:
        """The next step; `propose`: speculative drafts allowed (the engine passes
        ``speculating()``, which also made this step synchronous); `ask_drafts`: a draft
        model may draft after this step for the next (false where speculation is off at
        this batch size: drafts made then would be dropped unused)."""
        out = self._schedule(propose, ask_drafts)
        self._update_after_schedule(out)
        return out

    def _schedule(self, propose: bool, ask_drafts: bool = True) -> SchedulerOutput:
        out = SchedulerOutput()
        if self.paused == "keep":
            return out
        budget = self.max_num_batched_tokens
        scheduled_ids: set[int] = set()
        drafts = self._propose() if propose else {}
        la = self._draft_k() if ask_drafts else 0

        # 1. Running sequences: decodes and continuing prefill chunks.
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(self._computable(seq) - seq.num_computed_tokens, budget)
            if n <= 0:
                i += 1
                continue
            d = drafts.get(seq.seq_id)
            if d is not None:
                # Never past max_tokens / max_model_len (the 1 + d tokens a step can emit),
                # nor the budget.
                limit = min(seq.num_prompt_tokens + seq.params.max_tokens, self.max_model_len)
                d = d[:max(0, min(limit - seq.num_tokens - 1, budget - 1))]
                if len(d):
                    n = 1 + len(d)
                    out.spec_tokens[seq.seq_id] = d
            extra = self._lookahead(seq, seq.num_computed_tokens, n, la)
            while not self._allocate(seq, n, extra):
                victim = self._pick_victim()
                j = self.running.index(victim)
                self.running.pop(j)
                out.spec_tokens.pop(victim.seq_id, None)  # a preempted one loses its drafts
                if victim.seq_id in scheduled_ids:  # scheduled earlier in this step: undo
                    k = next(k for k, (s, _) in enumerate(out.scheduled) if s is victim)
                    budget += out.scheduled.pop(k)[1]
                    scheduled_ids.discard(victim.seq_id)
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
                if j < i:
                    i -= 1
            else:
                out.scheduled.append((seq, n))
                scheduled_ids.add(seq.seq_id)
                budget -= n
                i += 1
                if extra:  # it will draft: the plan asks rank 0 for its drafts
                    out.num_draft_tokens = la
                    out.draft_seq_ids.append(seq.seq_id)
                continue
            # seq preempted itself; sequences after it may still fit in what is left
        if out.preempted:
            return out

        # 2. Waiting sequences, by priority then arrival (a preempted one keeps its place).
        plan_bytes = 0
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting.peek()
            if self.paused is not None and not seq.num_preemptions:
                break  # paused ("wait"): only sequences that were running go on
            if seq.num_pending:  # preempted with a token in flight: resume once it lands
                break
            # The plan carries a new sequence whole: bound the plan (far below the workers'
            # frame limit) by deferring admissions; one sequence always goes.
            cost = new_seq_plan_bytes(seq, self.kv.block_size)
            if plan_bytes and plan_bytes + cost > self.max_plan_bytes:
                break
            # A sequence that was running when a worker group died may be what killed it:
            # such sequences rejoin one at a time, so a second death names its culprit
            # (the engine ends a sequence that was on the workers through two deaths).
            if seq.deaths_in_flight and self._quarantined:
                break
            # A sequence scoring its prompt computes all of it (no prefix-cache lookup).
            hits = [] if seq.wants_prompt_logprobs else self.kv.get_computed_blocks(seq)
            num_cached = len(hits) * self.kv.block_size
            n = min(seq.num_tokens - num_cached, budget)
            extra = self._lookahead(seq, self.kv.hit_tokens(hits), n, la)
            if not self._allocate(seq, n, extra, hits):
                break
            if extra:
                out.num_draft_tokens = la
                out.draft_seq_ids.append(seq.seq_id)
            seq.num_computed_tokens = self.kv.hit_tokens(hits)
            if not seq.wants_prompt_logprobs:
                self.kv.record_lookup(seq)
            if seq.num_preemptions == 0:
                seq.num_cached_tokens = seq.num_computed_tokens
            self.waiting.pop()
            plan_bytes += cost
            if seq.deaths_in_flight:
                self._quarantined.add(seq.seq_id)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.scheduled.append((seq, n))
            budget -= n
        return out

    def _update_after_schedule(self, out: SchedulerOutput) -> None:
        """The plan is as good as sent: workers execute plans in order, so its tokens
        count as computed and its full blocks may serve later prefix hits."""
        for seq, n in out.scheduled:
            # A verify step counts only the known token as computed; the accepted drafts
            # are added when the result comes (update_from_output).
            seq.num_computed_tokens += 1 if seq.seq_id in out.spec_tokens else n
            if samples_after_step(seq.num_computed_tokens, seq.num_tokens + seq.num_pending):
                seq.num_pending += 1
                out.sampling_seq_ids.add(seq.seq_id)
            self.kv.cache_computed_blocks(seq)

    def update_from_output(self, sched: SchedulerOutput, result: StepResult
                           ) -> list[SeqUpdate]:
        """Append the step's sampled tokens (several for a sequence that accepted drafts:
        one at a time, each checked); finish sequences at a stop token (once min_tokens are
        out) or at max_tokens / max_model_len, dropping any later tokens of the step, so
        the output ends exactly where it would without speculation."""
        per_seq = result.per_seq()
        # Draft-model proposals for the next step (drafted after this step's tokens).
        new_drafts = (dict(zip(result.seq_ids, result.draft_token_ids))
                      if result.draft_token_ids is not None else None)
        updates = []
        for seq, _ in sched.scheduled:
            got = per_seq.get(seq.seq_id)
            # A sequence that finished (a stop token in the previous result, an abort, a
            # timeout) while this plan was in flight: its extra token is dropped unseen.
            if got is None or seq.is_finished:
                continue
            tokens, lps = got
            drafts = sched.spec_tokens.get(seq.seq_id)
            if drafts is not None:
                self._count_verify(seq, len(drafts), len(tokens) - 1)
                seq.num_computed_tokens += len(tokens) - 1  # the accepted drafts' KV
            seq.num_pending -= 1
            seq.wants_prompt_logprobs = False  # its prompt's scores came before this token
            if seq.deaths_in_flight:  # a step went through: it is no suspect any more
                seq.deaths_in_flight = 0
                self._quarantined.discard(seq.seq_id)
            for j, token in enumerate(tokens):
                seq.token_ids.append(token)
                reason = self._check_stop(seq, token)
                updates.append(SeqUpdate(seq, token, None if lps is None else lps[j], reason,
                                         seq.num_tokens))
                if reason is not None:
                    self.finish(seq, reason)
                    break
            else:
                self.kv.cache_computed_blocks(seq)
                if new_drafts is not None:
                    self.proposer.receive(seq, new_drafts[seq.seq_id])
        return updates

    def speculating(self) -> bool:
        """Whether a running sequence may propose drafts now (a proposer, k > 0 at this
        batch size, one not paused for low acceptance): the engine then runs this step
        synchronously."""
        p = self.proposer
        return (p is not None and p.config.k_for(len(self.running)) > 0
                and any(p.eligible(s) for s in self.running))

    def _propose(self) -> dict[int, np.ndarray]:
        """Draft tokens for the running sequences that are decoding (one known token left
        to compute, none in flight), by the proposer's adaptive rules."""
        p = self.proposer
        if p is None:
            return {}
        k = p.config.k_for(len(self.running))
        if k < 1:
            return {}
        cands = [s for s in self.running
                 if s.num_tokens - s.num_computed_tokens == 1 and not s.num_pending
                 and p.eligible(s)]
        return p.propose(cands, k) if cands else {}

    def _draft_k(self) -> int:
        """Drafts per sampling sequence a draft-model proposer makes after this step (its
        k at this batch size), 0 for other proposers."""
        p = self.proposer
        if p is None or not getattr(p, "needs_lookahead", False):
            return 0
        return p.config.k_for(max(len(self.running), 1))

    def _lookahead(self, seq: Sequence, start: int, n: int, la: int) -> int:
        """Slots to reserve past a step's n tokens (computed from `start`) for the draft
        model's decode steps after it (vLLM's lookahead slots): the draft writes its KV at
        the sampled token's position and the next la - 1, before the leader schedules
        them. Only for a sequence that samples after the step and may propose, and never
        past its length limit (its drafts are cut there anyway). The reserved slots hold
        no known token: they are never cached, and the next steps' tokens overwrite them."""
        if not la or start + n < seq.num_tokens + seq.num_pending \
                or not self.proposer.eligible(seq):
            return 0
        limit = min(seq.num_prompt_tokens + seq.params.max_tokens, self.max_model_len)
        return max(0, min(la, limit - start - n))

    def _allocate(self, seq: Sequence, n: int, extra: int, hits: list | None = None
                  ) -> bool:
        """Slots for n tokens and, where blocks allow, `extra` lookahead slots (without
        them the draft model drafts fewer tokens: rank 0 drafts within the sequence's
        blocks only)."""
        return (self.kv.allocate_slots(seq, n + extra, hits)
                or (extra > 0 and self.kv.allocate_slots(seq, n, hits)))

    def _count_verify(self, seq: Sequence, num_drafts: int, num_accepted: int) -> None:
        st = self.spec_stats
        st.num_drafts += 1
        st.num_draft_tokens += num_drafts
        st.num_accepted_tokens += num_accepted
        for j in range(num_accepted):
            st.accepted_per_pos[j] += 1
        self.proposer.observe(seq.seq_id, num_drafts, num_accepted,
                              seq.num_tokens + num_accepted + 1)

    def _check_stop(self, seq: Sequence, token: int) -> str | None:
        p = seq.params
        # A constrained sequence samples a stop token before min_tokens only when its
        # grammar allows nothing else (nvllm/worker/sampler.py): it ends there.
        stop_ids = seq.stop_ids
        if stop_ids is None:
            stop_ids = seq.stop_ids = frozenset(p.all_stop_token_ids())
        if ((seq.num_output_tokens >= p.min_tokens or p.structured_outputs is not None)
                and token in stop_ids):
            return "stop"
        if seq.num_output_tokens >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    def _computable(self, seq: Sequence) -> int:
        """How many of the sequence's tokens (placeholders for tokens in flight included)
        may ever be computed: its last token is sampled but never fed back, so a sequence
        whose final token is in flight gets no more work."""
        last = min(seq.num_prompt_tokens + seq.params.max_tokens, self.max_model_len)
        return min(seq.num_tokens + seq.num_pending, last - 1)

    def _pick_victim(self) -> Sequence:
        """Lowest priority (largest number) first; among equals the latest admitted."""
        return max(enumerate(self.running), key=lambda e: (e[1].priority, e[0]))[1]

    def _preempt(self, seq: Sequence) -> None:
        self.finished_seq_ids.append(seq.seq_id)
        self._quarantined.discard(seq.seq_id)
        self.kv.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.on_worker = False
        seq.num_sent_blocks = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.add(seq)

    def count_worker_death(self, limit: int) -> set[str]:
        """A worker group died: every live sequence it held (or owed a token) counts one
        more death in flight. Returns the ids of the requests one of whose sequences has
        now been on the workers through `limit` deaths in a row. Call before
        ``requeue_all``, which forgets what the workers held."""
        suspects = set()
        for seq in itertools.chain(self.running, self.waiting):
            if seq.on_worker or seq.num_pending:
                seq.deaths_in_flight += 1
                if seq.deaths_in_flight >= limit:
                    suspects.add(seq.request_id)
        return suspects

    def recompute_running(self) -> None:
        """The weights changed under held sequences (a keep-mode pause): each goes back to
        waiting, to be recomputed from its tokens so far on the new weights, keeping its
        place in line; the workers drop what they hold of it with the next plan."""
        for seq in reversed(self.running):
            self._preempt(seq)
        self.running.clear()

    def requeue_all(self) -> None:
        """The workers (and the KV cache) were replaced: every running sequence goes back
        to waiting, to be recomputed from its tokens so far, keeping its place in line."""
        for seq in reversed(self.running):
            self._preempt(seq)
        self.running.clear()
        self.finished_seq_ids.clear()  # the new workers hold nothing
        for seq in self.waiting:
            seq.num_pending = 0  # tokens in flight died with the old workers

    def finish(self, seq: Sequence, reason: str, num_tokens: int | None = None) -> None:
        """Take a sequence out (finished or aborted) and give its blocks back.
        `num_tokens`: keep only its first so many tokens (a stop string ended it inside a
        step's accepted drafts: the tokens after it are not output)."""
        if num_tokens is not None:
            del seq.token_ids[num_tokens:]
        if self.proposer is not None:
            self.proposer.drop(seq.seq_id)
        if seq.on_worker:
            self.finished_seq_ids.append(seq.seq_id)
        self._quarantined.discard(seq.seq_id)
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING and seq in self.waiting:
            self.waiting.remove(seq)
        self.kv.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

    def mark_sent(self, out: SchedulerOutput) -> None:
        """The plan for `out` is built: its sequences are held by the workers, with every
        block of their tables (the next plan sends only blocks added after these). Kept
        apart from the plan builder so building a plan changes no state."""
        for seq, _ in out.scheduled:
            seq.on_worker = True
            seq.num_sent_blocks = len(seq.block_table)


def new_seq_plan_bytes(seq: Sequence, block_size: int) -> int:
    """An upper bound on a NewSeq's msgpack size: at most 9 bytes per integer or float
    (token ids, block ids, stop token ids, logit_bias ids and values) plus the fixed
    fields."""
    num_ints = (seq.num_tokens + cdiv(seq.num_tokens, block_size)
                + len(seq.params.stop_token_ids or ()) + len(seq.params.eos_token_ids)
                + 2 * len(seq.params.logit_bias or ()))
    return 9 * num_ints + 128
