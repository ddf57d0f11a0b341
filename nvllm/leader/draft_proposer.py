"""The draft-model proposer's leader side: it hands out the drafts rank 0 sent back.

The draft model runs on rank 0 (nvllm/worker/draft_runner.py): after each step it drafts
up to ``StepPlan.num_draft_tokens`` tokens for every sequence that sampled among those the
plan lists (``draft_seq_ids``: those given lookahead slots), and the step's
result carries them (``StepResult.draft_token_ids``). The scheduler gives them to
``receive`` as it appends the step's tokens; the next plan takes them through ``propose``,
exactly where the n-gram proposer's drafts go, so lookahead, verification, rollback, the
prefix-cache rules and stop handling are the same for both.

A draft belongs to the sequence's state it was drafted from: it is kept with the
sequence's length after that step and proposed only while the length is still that (a
sequence that finished, was preempted, or advanced without it drops it). Drafts from a
result whose sequence already has another plan in flight are stale by then; the
scheduler proposes only to sequences with nothing in flight.

``needs_lookahead``: the scheduler reserves k slots after each sampling sequence's step
tokens (vLLM's lookahead slots), because the draft decode steps write the draft model's
KV at those positions before the leader has scheduled them.
"""

from __future__ import annotations

import numpy as np

from nvllm.common.speculative import SpeculativeConfig
from nvllm.leader.ngram_proposer import GatedProposer
from nvllm.leader.sequence import Sequence


class DraftModelProposer(GatedProposer):
    needs_lookahead = True

    def __init__(self, config: SpeculativeConfig) -> None:
        super().__init__(config)
        # seq id -> (its length when drafted, the drafts)
        self._drafts: dict[int, tuple[int, np.ndarray]] = {}

    def receive(self, seq: Sequence, drafts: list[int]) -> None:
        """Rank 0's drafts for `seq`, drafted after the tokens it has now."""
        if drafts:
            self._drafts[seq.seq_id] = (seq.num_tokens, np.asarray(drafts, np.int64))
        else:
            self._drafts.pop(seq.seq_id, None)

    def propose(self, seqs: list[Sequence], k: int) -> dict[int, np.ndarray]:
        """Up to k drafts per sequence id, for those whose drafts match their state."""
        out: dict[int, np.ndarray] = {}
        if k < 1:
            return out
        for seq in seqs:
            got = self._drafts.pop(seq.seq_id, None)  # used once: the next step redrafts
            if got is not None and got[0] == seq.num_tokens:
                out[seq.seq_id] = got[1][:k]
        return out

    def _forget(self, seq_id: int) -> None:
        self._drafts.pop(seq_id, None)
