"""A sequence: one completion being generated (a request with n > 1 has n of them)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from nvllm.common.sampling_params import SamplingParams
from nvllm.leader.seq_blocks import SeqBlocks


class SequenceStatus(enum.Enum):
    WAITING = 0
    RUNNING = 1
    FINISHED = 2


@dataclass(slots=True, eq=False)
class Sequence:
    """The scheduler's record of one completion: only the scheduler assigns its fields
    (tests/leader/test_state_owners.py checks), so every change to a sequence's progress
    is in one file. Its KV blocks (``blocks``) are the KVCacheManager's, which the
    scheduler asks for and gets counts back from; the engine asks the scheduler."""

    seq_id: int
    request_id: str
    token_ids: list[int]  # prompt + generated, append-only
    num_prompt_tokens: int
    params: SamplingParams
    index: int = 0  # which of the request's n completions
    priority: int = 0  # lower runs first
    order: int = 0  # arrival order: ties in priority are served first come, first served
    status: SequenceStatus = SequenceStatus.WAITING
    # Tokens whose KV is in the cache. The last sampled token is never computed yet.
    num_computed_tokens: int = 0
    # Its block table and prefix-cache chain: written by the KVCacheManager only.
    blocks: SeqBlocks = field(default_factory=SeqBlocks)
    # What the workers hold for this sequence (plans carry only the difference). Workers
    # append the tokens they sample themselves, so only block ids travel as deltas.
    on_worker: bool = False
    num_sent_blocks: int = 0
    # Tokens sampled by plans in flight whose ids the leader has not received yet (async
    # scheduling): the next plan already computes them, the workers hold their ids.
    num_pending: int = 0
    num_preemptions: int = 0
    # Worker-group deaths it was on the workers for since its last completed step.
    deaths_in_flight: int = 0
    # Prompt tokens served from the prefix cache at the first admission (usage).
    num_cached_tokens: int = 0
    finish_reason: str | None = None
    # params.all_stop_token_ids(), taken once by the scheduler's stop check (per token).
    stop_ids: frozenset[int] | None = None
    # Structured output: the leader's CompiledGrammar (nvllm/leader/grammar.py), whose key
    # the workers' copy of the sampling parameters names.
    grammar: Any = None
    # This sequence scores its request's prompt (SamplingParams.prompt_logprobs; one per
    # request) and has not been given a token yet: until then every admission computes the
    # prompt from its first token, bypassing the prefix cache, so the workers score every
    # position (the OutputProcessor takes each once). Its first sampled token clears it:
    # that result also carried the last prompt chunk's scores.
    wants_prompt_logprobs: bool = False

    @property
    def block_table(self) -> list[int]:
        """Block ids by position (read-only for all but the KVCacheManager)."""
        return self.blocks.table

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED
