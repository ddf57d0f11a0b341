"""Shared helpers for the leader tests: a Scheduler + KVCacheManager simulator (``Sim``).

``Sim`` drives the real Scheduler and KVCacheManager the way ``LLMEngine.step`` does
(``schedule``, then ``update_from_output`` with a result), with a fake model that
samples a deterministic token for every sequence the step samples. Every step it checks
the scheduler's contract (budget, seq cap, decodes before admissions, victims taken from
the most recently admitted end), that each sequence reads only KV of its own prefix and
writes only blocks it owns, and that every block's ref count matches the block tables
that hold it.

Importable as ``leader_sim`` because setup.cfg puts tests/support on pytest's pythonpath.
"""

from __future__ import annotations

import itertools

from nvllm.common.sampling_params import SamplingParams
from nvllm.common.worker_protocol import StepResult
from nvllm.leader.kv_cache_manager import FREED, KVCacheManager
from nvllm.leader.scheduler import Scheduler, SchedulerOutput
from nvllm.leader.sequence import Sequence, SequenceStatus

BS = 4  # block size used throughout


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def toks(start: int, n: int) -> list[int]:
    """n distinct token ids starting at start (prompts built from disjoint ranges differ)."""
    return list(range(start, start + n))


def make_seq(seq_id: int, prompt: list[int], max_tokens: int = 1) -> Sequence:
    return Sequence(seq_id, f"req-{seq_id}", list(prompt), len(prompt),
                    SamplingParams(max_tokens=max_tokens))


def fake_token(seq: Sequence) -> int:
    """What the fake model samples: deterministic, and never one of the prompt ids above."""
    return 50_000 + 100 * seq.seq_id + seq.num_output_tokens


def assert_no_leak(kv: KVCacheManager) -> None:
    assert kv.num_free_blocks == kv.num_blocks
    assert [b.block_id for b in kv.pool.blocks if b.ref_cnt != 0] == []


class Sim:
    """Scheduler + KVCacheManager driven like LLMEngine.step, without a model.

    ``kv_content`` is an oracle: block id -> the token prefix whose KV the block holds
    (what a real model would have written there).
    """

    def __init__(self, num_blocks: int = 64, *, max_num_seqs: int = 16,
                 max_num_batched_tokens: int = 256, enable_prefix_caching: bool = True,
                 window: int | None = None, max_model_len: int = 4096):
        """window: a fully sliding-window model's (blocks behind it are given back, and
        a sequence reads only the keys within it)."""
        self.window = window
        self.kv = KVCacheManager(num_blocks, BS, enable_prefix_caching, window)
        self.sched = Scheduler(self.kv, max_num_seqs, max_num_batched_tokens,
                               max_model_len=max_model_len)
        self.seqs: list[Sequence] = []
        self.kv_content: dict[int, tuple[int, ...]] = {}
        self.admitted: list[tuple[Sequence, int]] = []  # (seq, tokens hit) per admission
        self.outs: list[SchedulerOutput] = []  # every step's output, in order
        self.last_table: dict[int, list[int]] = {}  # seq id -> its block table at finish
        self._ids = itertools.count()

    def add(self, prompt: list[int], max_tokens: int = 1) -> Sequence:
        seq = make_seq(next(self._ids), prompt, max_tokens)
        self.seqs.append(seq)
        self.sched.add(seq)
        return seq

    def step(self) -> SchedulerOutput:
        sched = self.sched
        running_before = list(sched.running)
        waiting_before = {s.seq_id for s in sched.waiting}
        out = sched.schedule()
        self._check_contract(out, running_before, waiting_before)
        for seq, n in out.scheduled:
            if seq.seq_id in waiting_before:
                self.admitted.append((seq, seq.num_computed_tokens - n))
            self._check_reads_and_writes(seq, n)
        sampled = [(seq, fake_token(seq)) for seq, _ in out.scheduled
                   if seq.seq_id in out.sampling_seq_ids]
        tables = {seq.seq_id: list(seq.block_table) for seq, _ in sampled}
        result = StepResult(0, [s.seq_id for s, _ in sampled], [t for _, t in sampled], None,
                            0.0)
        for u in sched.update_from_output(out, result):
            if u.finish_reason is not None:
                self.last_table[u.seq.seq_id] = tables[u.seq.seq_id]
        self.check_ref_counts()
        self.outs.append(out)
        return out

    def run(self, max_steps: int = 2000) -> list[SchedulerOutput]:
        """Step until no request is left; returns this run's step outputs."""
        outs: list[SchedulerOutput] = []
        while self.sched.num_unfinished:
            assert len(outs) < max_steps, "did not finish"
            outs.append(self.step())
            assert not outs[-1].is_empty, "scheduler made no progress with requests pending"
        return outs

    def table_of(self, seq: Sequence) -> list[int]:
        """Block table of a running seq, or the one a finished seq had."""
        return seq.block_table if not seq.is_finished else self.last_table[seq.seq_id]

    def hits_of(self, seq: Sequence) -> list[int]:
        return [hit for s, hit in self.admitted if s is seq]

    def _check_contract(self, out: SchedulerOutput, running_before: list[Sequence],
                        waiting_before: set[int]) -> None:
        sched = self.sched
        ids = [s.seq_id for s, _ in out.scheduled]
        assert len(ids) == len(set(ids)), "a seq scheduled twice in one step"
        assert out.num_batched_tokens <= sched.max_num_batched_tokens
        assert len(sched.running) <= sched.max_num_seqs
        # Victims come off the most recently admitted end of the running list.
        assert out.preempted == running_before[::-1][:len(out.preempted)]
        for victim in out.preempted:
            assert victim.status is SequenceStatus.WAITING and victim.block_table == []
            assert victim.num_computed_tokens == 0
        # Running seqs are served first, in admission order; then new admissions.
        still = [s for s in running_before if s not in out.preempted]
        n_old = sum(1 for s, _ in out.scheduled if s.seq_id not in waiting_before)
        assert [s for s, _ in out.scheduled[:n_old]] == still[:n_old]
        if n_old < len(out.scheduled):  # admissions only after every running seq got a turn
            assert n_old == len(still) and not out.preempted
        assert sched.running == still + [s for s, _ in out.scheduled[n_old:]]

    def _check_reads_and_writes(self, seq: Sequence, n: int) -> None:
        # The scheduler already counts this step's tokens as computed.
        done, table = seq.num_computed_tokens - n, seq.block_table
        assert n >= 1 and done + n <= seq.num_tokens
        assert len(table) * BS >= done + n, "no slot for a scheduled token"
        first = max(0, done - self.window + 1) // BS if self.window else 0
        assert FREED not in table[first:], "a block inside the window was given back"
        for i in range(first, cdiv(done, BS)):  # reads: the KV of exactly our own prefix
            want = tuple(seq.token_ids[:min((i + 1) * BS, done)])
            assert self.kv_content.get(table[i]) == want, f"seq {seq.seq_id} reads wrong KV"
        for i in range(done // BS, cdiv(done + n, BS)):  # writes: only into our own blocks
            block = self.kv.pool.blocks[table[i]]
            # Cached already only by this step's own caching (of exactly these tokens).
            cached_ours = block.tokens == tuple(seq.token_ids[i * BS:(i + 1) * BS])
            assert block.ref_cnt == 1 and (block.block_hash is None or cached_ours), \
                "write into a shared block"
            self.kv_content[table[i]] = tuple(seq.token_ids[:min((i + 1) * BS, done + n)])

    def check_ref_counts(self) -> None:
        users = [0] * self.kv.num_blocks
        for seq in self.seqs:
            if seq.status is not SequenceStatus.RUNNING:
                assert seq.block_table == []
            held = [b for b in seq.block_table if b != FREED]
            assert len(set(held)) == len(held)
            for b in held:
                users[b] += 1
        assert [b.ref_cnt for b in self.kv.pool.blocks] == users
        assert self.kv.num_free_blocks == users.count(0)

    def drain(self) -> None:
        """Abort whatever is left (what a user's abort would do)."""
        for seq in list(self.sched.waiting) + list(self.sched.running):
            self.sched.finish(seq, "abort")
