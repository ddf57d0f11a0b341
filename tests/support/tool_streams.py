"""Driving a tool-call machine (nvllm/launch/openai/tool_calls.py) the way the chat route
does: with the whole text, or piece by piece and reassembled as a client does."""

from __future__ import annotations

import random


def whole(machine, text: str) -> dict:
    return machine.feed(text).merge(machine.finish()).message()


def streamed(machine, pieces: list[str]) -> tuple[str, list[dict], list[dict]]:
    """(the content, the calls reassembled as a client does, the chunks' deltas)."""
    chunks = [machine.feed(p).chunk() for p in pieces] + [machine.finish().chunk()]
    content, calls = "", {}
    for c in chunks:
        content += c.get("content", "")
        for tc in c.get("tool_calls", []):
            if "id" in tc:
                assert tc["index"] not in calls, "a call started twice"
                assert tc["type"] == "function" and tc["id"].startswith("call_")
                calls[tc["index"]] = {"name": tc["function"]["name"], "arguments": ""}
            calls[tc["index"]]["arguments"] += tc["function"]["arguments"]
    assert sorted(calls) == list(range(len(calls)))
    return content, [calls[i] for i in sorted(calls)], [c for c in chunks if c]


def cuts(text: str, seed: int) -> list[str]:
    """text cut at random places (single characters included)."""
    rng = random.Random(seed)
    at = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, len(text) // 3)))
    return [text[a:b] for a, b in zip([0, *at], [*at, len(text)])]
