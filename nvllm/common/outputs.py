"""What the engine returns: per-step deltas, and whole requests once they finish.

One delta type travels every hop: the engine's output processor makes ``CompletionDelta``s,
the ZMQ server sends them as ``output`` messages (nvllm/common/client_protocol.py), and
``Client``/``AsyncClient`` hand the same type back to the caller. ``CompletionAccumulator``
and ``RequestAccumulator`` are the one way deltas are summed up (the server's
non-streaming replies, the clients' ``generate``, the HTTP gateway's responses).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class CompletionOutput:
    index: int
    token_ids: list[int]
    text: str
    finish_reason: str | None  # "stop" | "length" | "abort" | "timeout" | "error"
    logprobs: list | None = None  # per token: {token_id: logprob} (sampled + top-N)
    # The weights it was generated with (vLLM's weight_version: set by update_weights;
    # None: the checkpoint's, never updated). A request kept across an update carries
    # the version in force when it finished.
    weight_version: int | str | None = None


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
    # SamplingParams.prompt_logprobs: one entry per prompt token, None for the first, then
    # {token_id: logprob} (the prompt token's and the top-k); None when not asked, or when
    # the request ended (abort, timeout, error) before its whole prompt was scored.
    prompt_logprobs: list | None = None
    weight_version: int | str | None = None  # see CompletionOutput

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


@dataclass(slots=True)
class CompletionDelta:
    """What one step added to one completion: only the new tokens and text.

    ``finish_reason`` is set on the completion's last delta, which also carries ``usage``
    (``prompt_tokens``, ``completion_tokens``, ``cached_tokens``). With
    SamplingParams.prompt_logprobs, the first delta of every completion carries the whole
    prompt's (``RequestOutput.prompt_logprobs``' shape): each completion is a stream a
    client may read alone (an HTTP choice echoes the prompt with them), and the leader
    holds a completion's deltas back until the prompt is scored, so it never has to send
    them twice or in pieces."""

    request_id: str
    index: int
    token_ids: list[int]
    text: str
    logprobs: list | None = None  # one {token_id: logprob} map per new token, or None
    finish_reason: str | None = None
    usage: dict | None = None
    prompt_logprobs: list | None = None  # on a completion's first delta: see above
    weight_version: int | str | None = None  # the weights in force when it was made


@dataclass(slots=True)
class CompletionAccumulator:
    """One completion's output so far, summed from its deltas in order."""

    index: int = 0
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list = field(default_factory=list)
    finish_reason: str | None = None
    usage: dict | None = None
    prompt_logprobs: list | None = None
    weight_version: int | str | None = None

    def add(self, d: CompletionDelta) -> None:
        self.weight_version = d.weight_version
        if d.prompt_logprobs is not None:
            self.prompt_logprobs = d.prompt_logprobs
        self.token_ids.extend(d.token_ids)
        self.text += d.text
        if d.logprobs:
            self.logprobs.extend(d.logprobs)
        if d.finish_reason is not None:
            self.finish_reason = d.finish_reason
            self.usage = d.usage or {}

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def to_delta(self, request_id: str) -> CompletionDelta:
        """Everything as one delta (a non-streaming reply)."""
        return CompletionDelta(request_id, self.index, self.token_ids, self.text,
                               self.logprobs or None, self.finish_reason, self.usage,
                               self.prompt_logprobs, self.weight_version)

    def to_output(self) -> CompletionOutput:
        return CompletionOutput(self.index, self.token_ids, self.text, self.finish_reason,
                                self.logprobs or None, self.weight_version)


class RequestAccumulator:
    """The n completions of one request, summed from their deltas."""

    def __init__(self, n: int, prompt: str | None = None) -> None:
        self.prompt = prompt
        self.completions = [CompletionAccumulator(i) for i in range(n)]

    def add(self, d: CompletionDelta) -> None:
        if 0 <= d.index < len(self.completions):
            self.completions[d.index].add(d)

    @property
    def done(self) -> bool:
        return all(c.finished for c in self.completions)

    def to_output(self, request_id: str, prompt_token_ids: list[int] | None = None
                  ) -> RequestOutput:
        usage = self.completions[0].usage or {}
        return RequestOutput(request_id, self.prompt, list(prompt_token_ids or []),
                             [c.to_output() for c in self.completions], finished=True,
                             num_cached_tokens=usage.get("cached_tokens", 0),
                             prompt_logprobs=next((c.prompt_logprobs for c in self.completions
                                                   if c.prompt_logprobs is not None), None),
                             weight_version=self.completions[0].weight_version)
