"""nvllm.launch.openai.sse: the one SSE loop both generation routes stream with, driven by a
fake fan-out (no leader, no HTTP)."""

from __future__ import annotations

import asyncio
import json

from nvllm.common.client import ClientError
from nvllm.common.outputs import CompletionDelta
from nvllm.launch.openai.sse import Envelope, fanout_events, sse


class FakeFan:
    """What fanout_events needs of a Fanout: (prompt index, delta) pairs, then maybe an
    error, and cancel()."""

    def __init__(self, items: list, error: Exception | None = None) -> None:
        self.items, self.error, self.cancelled = list(items), error, 0

    def __aiter__(self):
        return self

    async def __anext__(self):
        if self.items:
            return self.items.pop(0)
        if self.error is not None:
            raise self.error
        raise StopAsyncIteration

    def cancel(self) -> None:
        self.cancelled += 1


def run(fan: FakeFan, **kwargs) -> list[str]:
    async def go() -> list[str]:
        env = Envelope("id-1", "chunk", 7, "m")
        choice = lambda i, d: {"i": i, "k": d.index, "text": d.text, "end": d.finish_reason}
        return [e async for e in fanout_events(fan, env, choice, **kwargs)]

    return asyncio.run(go())


def delta(index: int, text: str, ids: list[int], finish: str | None = None,
          usage: dict | None = None) -> CompletionDelta:
    return CompletionDelta("r", index, ids, text, None, finish, usage)


def test_sse_framing():
    assert sse("[DONE]") == "data: [DONE]\n\n"
    assert sse({"a": [1, None]}) == 'data: {"a": [1, null]}\n\n'


def test_events_first_choices_deltas_usage_done():
    fan = FakeFan([(0, delta(0, "Hi", [1])),
                   (0, delta(0, "", [2])),  # held-back text: nothing to say
                   (1, delta(0, "", [], "stop", {"prompt_tokens": 3, "completion_tokens": 2})),
                   (0, delta(0, "!", [3], "length", {"prompt_tokens": 5,
                                                     "completion_tokens": 4,
                                                     "cached_tokens": 2}))])
    events = run(fan, include_usage=True, with_token_ids=False, first_choices=[{"role": 1}])
    assert events[-1] == "data: [DONE]\n\n"
    objs = [json.loads(e[len("data: "):]) for e in events[:-1]]
    assert all(e.startswith("data: ") and e.endswith("\n\n") for e in events)
    head = {"id": "id-1", "object": "chunk", "created": 7, "model": "m"}
    assert objs[0] == {**head, "choices": [{"role": 1}]}
    assert [o["choices"][0]["text"] for o in objs[1:4]] == ["Hi", "", "!"]
    assert objs[2]["choices"][0] == {"i": 1, "k": 0, "text": "", "end": "stop"}
    assert objs[4] == {**head, "choices": [], "usage": {
        "prompt_tokens": 8, "completion_tokens": 6, "total_tokens": 14,
        "prompt_tokens_details": {"cached_tokens": 2}}}
    assert list(objs[4]) == ["id", "object", "created", "model", "choices", "usage"]
    assert fan.cancelled == 1


def test_events_keep_token_only_deltas_when_logprobs_are_shown():
    fan = FakeFan([(0, delta(0, "", [2])), (0, delta(0, "", []))])
    events = run(fan, include_usage=False, with_token_ids=True)
    assert len(events) == 2 and json.loads(events[0][6:])["choices"][0]["text"] == ""


def test_leader_error_mid_stream_is_an_error_event_then_done():
    fan = FakeFan([(0, delta(0, "a", [1]))], ClientError("overloaded", "busy"))
    events = run(fan, include_usage=True, with_token_ids=False)
    assert json.loads(events[1][6:]) == {"error": {
        "message": "busy", "type": "server_error", "param": None, "code": "overloaded"}}
    assert events[2:] == ["data: [DONE]\n\n"] and fan.cancelled == 1


def test_trace_records_shown_chunks_with_the_leaders_ordinals(tmp_path, monkeypatch):
    """With a tracer, each chunk sent records sse_sent with (rid, i, n), n counting every
    delta of that completion, shown or held back, as out_recv and out_sent count them."""
    from nvllm.common import trace

    monkeypatch.setattr(trace, "_tracers", {})
    monkeypatch.setenv(trace.ENV, str(tmp_path / "t"))
    tr = trace.tracer("http")
    fan = FakeFan([(0, CompletionDelta("a", 0, [1], "", None)),  # held back: n=1, no chunk
                   (0, CompletionDelta("a", 1, [2], "x", None)),
                   (1, CompletionDelta("b", 0, [3], "y", None)),
                   (0, CompletionDelta("a", 0, [4], "z", None, "length"))])
    events = run(fan, include_usage=False, with_token_ids=False, trace=tr)
    assert len(events) == 4  # three chunks and [DONE]
    tr.close()
    recs = [json.loads(line) for line in open(tr.path)]
    assert [(r["ev"], r["rid"], r["i"], r["n"]) for r in recs] == [
        ("sse_sent", "a", 1, 1), ("sse_sent", "b", 0, 1), ("sse_sent", "a", 0, 2)]
    assert run(FakeFan([(0, delta(0, "Hi", [1]))]), include_usage=False,
               with_token_ids=False) == [sse({"id": "id-1", "object": "chunk", "created": 7,
                                              "model": "m", "choices": [
                                                  {"i": 0, "k": 0, "text": "Hi",
                                                   "end": None}]}), sse("[DONE]")]
