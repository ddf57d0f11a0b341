"""A request: one prompt, its n sequences, and what its outputs need so far."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from nvllm.common.sampling_params import SamplingParams
from nvllm.leader.detokenizer import IncrementalDetokenizer
from nvllm.leader.sequence import Sequence


@dataclass(slots=True, eq=False)
class Request:
    """Built by the InputProcessor; its sequences belong to the Scheduler, the per-completion
    output state (detokenizers, logprobs, finish reasons) to the OutputProcessor."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence] = field(default_factory=list)
    priority: int = 0
    arrival_time: float = field(default_factory=time.monotonic)
    deadline: float | None = None  # monotonic time after which it ends with "timeout"
    # A resumed completion (Submit.output_token_ids): characters of its produced tokens'
    # text the client already has (None: as much as a leader would have streamed).
    resume_text_offset: int | None = None
    # Per completion (index = Sequence.index), written by the OutputProcessor.
    detoks: list[IncrementalDetokenizer | None] = field(default_factory=list)
    logprobs: list[list | None] = field(default_factory=list)
    finish_reasons: list[str | None] = field(default_factory=list)
    last_token_time: list[float] = field(default_factory=list)
    first_token_time: float | None = None
    # SamplingParams.prompt_logprobs: the prompt's entries so far, in order ([None] for the
    # first token, then one {id: logprob} map per scored token), the completions whose first
    # delta has carried them, and deltas held back until the whole prompt is scored.
    prompt_logprobs: list | None = None
    prompt_logprobs_sent: list[bool] = field(default_factory=list)
    held: list = field(default_factory=list)
    # Completion index -> its sequence's length at the token that ended it, when later
    # tokens of the same step (accepted drafts) came after it and are not output.
    final_lens: dict[int, int] = field(default_factory=dict)

    @property
    def prompt_scored(self) -> bool:
        """Every prompt token has its entry (always true when none were asked for)."""
        return (self.prompt_logprobs is None
                or len(self.prompt_logprobs) == len(self.prompt_token_ids))

    @property
    def finished(self) -> bool:
        """Every completion has sent its final delta."""
        return all(r is not None for r in self.finish_reasons)

    @property
    def num_cached_tokens(self) -> int:
        return self.seqs[0].num_cached_tokens if self.seqs else 0
