"""What a finished (or failed) request returns to the user."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class CompletionOutput:
    index: int
    token_ids: list[int]
    text: str
    finish_reason: str | None  # "stop" | "length" | "abort" | "error"
    logprobs: list | None = None  # per token: {token_id: logprob} (sampled + top-N)


@dataclass(slots=True)
class RequestOutput:
    """vLLM-shaped: ``outputs`` holds the n completions; the flat fields mirror
    ``outputs[0]`` since n == 1 is the common case."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = True
    error: str | None = None
    num_cached_tokens: int = 0

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids if self.outputs else []

    @property
    def text(self) -> str:
        return self.outputs[0].text if self.outputs else ""

    @property
    def finish_reason(self) -> str | None:
        if self.error is not None:
            return "error"
        return self.outputs[0].finish_reason if self.outputs else None
