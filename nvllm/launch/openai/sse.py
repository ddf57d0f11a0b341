"""Streaming replies as server-sent events (``data: {...}`` ... ``data: [DONE]``): the
response class that aborts its leader requests however the response ends, and the one loop
both generation routes stream a fan-out with."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass
from typing import Any

from fastapi.responses import StreamingResponse

from nvllm.common.outputs import CompletionDelta
from nvllm.common.trace import Tracer
from nvllm.launch.openai.errors import from_leader
from nvllm.launch.openai.fanout import Fanout, usage


@dataclass(frozen=True)
class Envelope:
    """The fields every object of one reply starts with; ``envelope(choices, **extra)``
    is a whole reply object or chunk."""

    id: str
    object: str
    created: int
    model: str

    def __call__(self, choices: list[dict], **extra: Any) -> dict:
        return {"id": self.id, "object": self.object, "created": self.created,
                "model": self.model, "choices": choices, **extra}


def sse(obj: dict | str) -> str:
    """One event: a JSON object, or a literal such as ``[DONE]``."""
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n"


class EventStream(StreamingResponse):
    """Server-sent events whose leader requests end with the response, however it ends.

    When the HTTP client hangs up, Starlette cancels the send loop; the event generator may
    be parked at a ``yield`` then, and its ``finally`` would only run whenever the garbage
    collector gets to it. Cancelling the pumps here (synchronously, so it works inside a
    cancelled scope) aborts the leader requests at once."""

    def __init__(self, events: AsyncIterator[str], fan: Fanout) -> None:
        super().__init__(events, media_type="text/event-stream",
                         headers={"cache-control": "no-cache"})
        self._fan = fan

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._fan.cancel()  # a no-op for pumps that already finished


async def fanout_events(fan: Fanout, envelope: Envelope,
                        choice: Callable[[int, CompletionDelta], dict], *,
                        include_usage: bool, with_token_ids: bool,
                        first_choices: Iterable[dict] = (),
                        trace: Tracer | None = None) -> AsyncIterator[str]:
    """`fan`'s deltas as events: one chunk per ``first_choices`` entry, then one chunk per
    delta that says something (``choice(prompt index, delta)``; None: nothing to say yet,
    no chunk), then with `include_usage`
    a chunk with no choices and the usage, then ``[DONE]``. A delta with neither text nor
    a finish reason is skipped (text held back while it may be a stop string) unless
    `with_token_ids` (its tokens' logprobs are shown) and it has tokens. A leader error
    mid-stream becomes an error event: the status line is already sent. With `trace`,
    each delta's chunk is recorded (``sse_sent``) once the response has taken it."""
    finals: dict[tuple[int, int], CompletionDelta] = {}
    try:
        for c in first_choices:
            yield sse(envelope([c]))
        async for i, d in fan:
            n = 0
            if trace is not None:  # every delta counts, shown or not: n matches out_recv's
                n = trace.ordinal("sse_sent", d.request_id, d.index, d.finish_reason is not None)
            if not (d.text or d.finish_reason is not None or (with_token_ids and d.token_ids)):
                continue
            if d.finish_reason is not None:
                finals[(i, d.index)] = d
            c = choice(i, d)
            if c is None:
                continue
            yield sse(envelope([c]))
            if trace is not None:  # resumed: Starlette has sent the chunk
                trace.event("sse_sent", rid=d.request_id, i=d.index, n=n)
        if include_usage:
            yield sse(envelope([], usage=usage(finals)))
    except Exception as e:
        yield sse(from_leader(e).body())
    finally:
        fan.cancel()  # no-op when finished; aborts when the client went away
    yield sse("[DONE]")


def stream_fanout(fan: Fanout, envelope: Envelope, choice: Callable[[int, CompletionDelta], dict],
                  **kwargs: Any) -> EventStream:
    """The streaming reply for `fan` (see ``fanout_events`` for `kwargs`)."""
    return EventStream(fanout_events(fan, envelope, choice, **kwargs), fan)
