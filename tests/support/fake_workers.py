"""An in-process stand-in for the worker group, to run ``LLMEngine`` without workers.

``FakeWorkers`` keeps per-sequence state in the workers' own batch state
(``nvllm.worker.input_batch.InputBatch``: the same validation, rows and sampling rule as
``ModelRunner``) and samples a scripted token for every sequence whose last token was
computed (verifying drafts greedily against the same script: a draft is accepted while
it is the token the script gives at its position), with fake logprobs (``fake_logprobs``)
for sequences that ask for them, and fake prompt logprobs (``fake_prompt_logprobs``)
for the prompt positions a plan computes for a sequence that asks.
Plans and results go through the wire codec, like the real client's; ``corrupt`` can slip
malformed results in first.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from nvllm.common import worker_protocol as protocol
from nvllm.common.errors import EngineDeadError
from nvllm.leader.engine import LLMEngine
from nvllm.worker.input_batch import InputBatch

BLOCK = 4
NUM_BLOCKS = 64
# The fake model knows no vocabulary: any id the leader lets through is a token.
FAKE_VOCAB = 1 << 31


@dataclass(slots=True)
class FakeSeq:
    """What choose() and tests see of a held sequence: a copy of its batch row."""

    token_ids: list[int]
    num_prompt_tokens: int
    num_computed_tokens: int
    block_table: list[int]
    sampling: protocol.WorkerSampling | None = None

    @classmethod
    def of(cls, batch: InputBatch, row: int) -> FakeSeq:
        return cls(batch.tokens(row).tolist(), int(batch.num_prompt_tokens[row]),
                   int(batch.num_computed_tokens[row]), batch.blocks(row).tolist(),
                   batch.sampling[row])


def fake_logprobs(n_out: int, token: int, k: int) -> list:
    """The deterministic logprobs FakeWorkers reports for the `n_out`-th output token
    (0-based) of a sequence that asked for top-`k`, shaped as one StepResult.logprobs
    entry: [logprob of the sampled token, [[token id, logprob], ...k pairs]]. The sampled
    token is among the top k at even positions (k > 0) and not at odd ones; every value is
    a binary fraction, so it survives msgpack exactly."""
    lp = -(n_out + 1) / 8
    others = [t for t in range(900, 900 + k + 1) if t != token]
    if n_out % 2 == 0 and k > 0:
        top = [[token, lp]] + [[t, lp - (j + 1) / 16] for j, t in enumerate(others[:k - 1])]
    else:
        top = [[t, -(j + 1) / 16] for j, t in enumerate(others[:k])]
    return [lp, top]


def fake_prompt_logprobs(pos: int, token: int, k: int) -> list:
    """What FakeWorkers reports for prompt token `pos` (>= 1) being `token`, for top-`k`:
    one StepResult.prompt_logprobs item, [logprob, [[id, logprob], ...k pairs]]. Values
    depend on the position only (binary fractions, exact through msgpack), so a test can
    tell each position's entry from the others'."""
    lp = -pos / 4
    return [lp, [[800 + j, -(j + 1) / 32] for j in range(k)]]


class FakeWorkers:
    """Stands in for WorkerGroupClient: one rank that 'computes' every plan at once.

    choose(seq_id, fake_seq) -> the token sampled for a seq whose last token was computed
    (the default samples " the" forever). Plans go through the wire codec, like the real
    client, and are kept in ``plans``.

    corrupt(plan, good_result) -> messages the engine receives before the plan's good
    result (malformed or stale results it must drop); they are kept in ``injected``.
    """

    num_workers = 1
    pids: list[int] = []

    def __init__(self, choose) -> None:
        self.dead = None
        self.choose = choose
        self.plans: list[protocol.StepPlan] = []
        self.other: list = []
        self.batch = InputBatch(16, 64, 16, BLOCK, FAKE_VOCAB, NUM_BLOCKS)
        self.inbox: deque = deque([protocol.WorkerReady(0, "loaded", NUM_BLOCKS)])
        self.num_recvs = 0
        # Per plan: how many messages the engine had received when it sent the plan.
        self.recvs_before_plan: list[int] = []
        self.corrupt: Callable[[protocol.StepPlan, protocol.StepResult], list] | None = None
        self.injected: list = []
        # die_on(plan) -> True: the group dies executing that plan (no result comes back).
        self.die_on: Callable[[protocol.StepPlan], bool] | None = None
        # (seq id, drafts, accepted) per verify row executed (speculative decoding).
        self.accepted: list[tuple[int, int, int]] = []
        self.slot_tokens: dict[int, int] = {}
        # Draft-model speculative decoding (plans with num_draft_tokens): a fake draft
        # model drafts the script's continuation, wrong at every draft_wrong-th draft;
        # draft_writes: each step's (seq id, position, slot) the draft's KV went to, as
        # DraftRunner.run writes them (within the row's blocks only).
        self.draft_wrong = 3
        self.num_drafted = 0
        self.draft_writes: list[list[tuple[int, int, int]]] = []
        self.drafts: list[dict[int, list[int]]] = []  # per plan executed: seq id -> drafts
        self.short_drafts = 0  # draft runs cut short by the row's blocks

    @property
    def client(self) -> FakeWorkers:
        """As a worker group handle (Executor's start_group): its own client."""
        return self

    def stop(self) -> None:
        pass

    def check_alive(self):
        return self.dead

    def broadcast(self, msg, ranks=None) -> int:
        if self.dead is not None:  # as the real client
            raise EngineDeadError(self.dead)
        data = protocol.encode(msg)
        msg = protocol.decode(data)
        if isinstance(msg, protocol.InitKVCache):
            self.num_kv_blocks = msg.num_blocks
            self.batch.num_blocks = msg.num_blocks
            self.inbox.append(protocol.WorkerReady(0, "kv", NUM_BLOCKS))
        elif isinstance(msg, protocol.StepPlan):
            self.plans.append(msg)
            if self.die_on is not None and self.die_on(msg):
                self.dead = f"fake worker group died at step {msg.step_id}"
                return len(data)
            self.recvs_before_plan.append(self.num_recvs)
            good = self._execute(msg)
            bad = self.corrupt(msg, good) if self.corrupt is not None else []
            self.injected += bad
            for m in (*bad, good):  # as the real client: decoded from the wire
                self.inbox.append(protocol.decode(protocol.encode(m)))
        else:
            self.other.append(msg)
        return len(data)

    def recv(self, timeout_s: float, cancelled=None):
        if cancelled is not None and cancelled():  # as the real client: before taking one
            raise KeyboardInterrupt
        self.num_recvs += 1
        if self.dead is not None and not self.inbox:
            raise EngineDeadError(self.dead)
        return self.inbox.popleft()

    @property
    def seqs(self) -> dict[int, FakeSeq]:
        """The held sequences by id (copies: changing them changes nothing)."""
        return {sid: FakeSeq.of(self.batch, row) for sid, row in self.batch.row_of.items()}

    def _execute(self, plan: protocol.StepPlan) -> protocol.StepResult:
        """What ModelRunner.execute does with a plan, minus the model."""
        b = self.batch
        step = b.apply(plan)
        # What a model would write into the KV cache: slot -> the token computed there.
        self.slot_tokens.update(zip(step.slot_mapping.tolist(), step.input_ids.tolist()))
        prompt_lps = []
        for i in range(step.num_seqs):  # as ModelRunner._prompt_logprobs
            row, start = int(step.rows[i]), int(step.start[i])
            k = b.sampling[row].prompt_logprobs
            first, last = start + 1, min(start + int(step.query_lens[i]),
                                         int(b.num_prompt_tokens[row]) - 1)
            if k is not None and last >= first:
                toks = b.token_ids[row]
                prompt_lps.append([int(step.seq_ids[i]), first, [
                    fake_prompt_logprobs(p, int(toks[p]), k) for p in range(first, last + 1)]])
        seq_ids = step.seq_ids[step.sample_idx].tolist()
        rows = step.rows[step.sample_idx].tolist()
        spec = step.spec_lens.tolist()
        tokens, logprobs, counts = [], [], []
        for sid, row, d in zip(seq_ids, rows, spec):
            fs = FakeSeq.of(b, row)
            drafts = b.token_ids[row, len(fs.token_ids):len(fs.token_ids) + d].tolist()
            # Greedy verification against the fake model: each position's token is
            # choose() given the tokens before it (the drafts accepted so far included);
            # drafts are accepted while they equal it, then its own token ends the run.
            n = 0
            while True:
                t = self.choose(sid, fs)
                tokens.append(t)
                n += 1
                k = fs.sampling.logprobs
                logprobs.append(None if k is None else fake_logprobs(
                    len(fs.token_ids) - fs.num_prompt_tokens, t, k))
                if n > d or t != drafts[n - 1]:
                    break
                fs.token_ids.append(t)
            counts.append(n)
        b.append_verified(np.asarray(rows, np.int64), np.asarray(counts, np.int64),
                          np.asarray(tokens, np.int64), np.asarray(spec, np.int64))
        self.accepted += [(sid, d, n - 1) for sid, d, n in zip(seq_ids, spec, counts) if d]
        # As the sampler: a list (None for rows that did not ask) when any row asked.
        lps = logprobs if any(x is not None for x in logprobs) else None
        drafts = (self._draft(seq_ids, rows, plan.num_draft_tokens, plan.draft_seq_ids)
                  if plan.num_draft_tokens else None)
        self.drafts.append(dict(zip(seq_ids, drafts or [])))
        return protocol.StepResult(plan.step_id, seq_ids, tokens, lps, 0.001,
                                   prompt_lps or None,
                                   counts if any(c != 1 for c in counts) else None, drafts)

    def _draft(self, seq_ids: list[int], rows: list[int], k: int, asked: list[int]
               ) -> list[list[int]]:
        """As DraftRunner.run: for the rows of the `asked` sequences, up to k
        drafts from its newest token, at positions p.. (p: the newest token's), cut where
        the row's blocks end; none for the others."""
        b, writes, out = self.batch, [], []
        for sid, row in zip(seq_ids, rows):
            if sid not in asked:
                out.append([])
                continue
            fs = FakeSeq.of(b, row)
            p = len(fs.token_ids) - 1
            kk = max(0, min(k, len(fs.block_table) * BLOCK - p))
            self.short_drafts += kk < k
            d = []
            for i in range(kk):
                writes.append((sid, p + i, fs.block_table[(p + i) // BLOCK] * BLOCK
                               + (p + i) % BLOCK))
                t = self.choose(sid, fs)
                self.num_drafted += 1
                if self.draft_wrong and self.num_drafted % self.draft_wrong == 0:
                    t += 1  # a wrong draft: the rest of the run is rejected
                d.append(t)
                fs.token_ids.append(t)
            out.append(d)
        self.draft_writes.append(writes)
        return out


def submit(engine: LLMEngine, prompt=None, params=None, **kwargs):
    """Process and admit a request, as LLM.generate does."""
    return engine.submit(prompt, params, **kwargs)


def prompt_ids(start: int, n: int) -> list[int]:
    """Distinct ordinary token ids (the tokenizer's specials are 0..2)."""
    return list(range(100 + start, 100 + start + n))


def run(engine: LLMEngine, max_steps: int = 500, interrupt_at: set[int] = frozenset()
        ) -> list:
    """Step until done; at the step numbers in interrupt_at, first a step whose wait for
    a result is cancelled at once (as Ctrl-C in LLM.generate), if it waits at all."""
    outs = []
    n = 0
    while engine.has_unfinished_requests():
        assert n < max_steps
        if n in interrupt_at:
            try:
                outs.append(engine.step(lambda: True))
            except KeyboardInterrupt:
                pass
            n += 1
            continue
        outs.append(engine.step())
        n += 1
    return outs


def deltas_of(outs, request_id: str, index: int = 0) -> list:
    return [d for o in outs for d in o.deltas if d.request_id == request_id and d.index == index]


def finished_of(outs, request_id: str):
    got = [r for o in outs for r in o.finished if r.request_id == request_id]
    assert len(got) == 1
    return got[0]


def metric(engine: LLMEngine, sample: str, **labels) -> float:
    total, seen = 0.0, False
    for family in text_string_to_metric_families(engine.metrics.exposition()):
        for s in family.samples:
            if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items()):
                total, seen = total + s.value, True
    assert seen, f"no sample {sample} {labels}"
    return total


def in_plan(plan: protocol.StepPlan, seq_id: int) -> bool:
    return any(s.seq_id == seq_id for s in (*plan.new_seqs, *plan.running))


def scripted(tokenizer, text: str):
    """A fake model that generates `text` (then repeats its last token): (choose, ids)."""
    script = tokenizer(text, add_special_tokens=False).input_ids

    def choose(sid, fs) -> int:
        n_out = len(fs.token_ids) - fs.num_prompt_tokens
        return script[min(n_out, len(script) - 1)]

    return choose, script
