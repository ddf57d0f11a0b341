"""Turning a completion's text into an assistant message's content and ``tool_calls``, as
it streams: ``Delta`` (what one chunk says) and the machines for the forced tool choices,
whose text the leader constrains to JSON (tools.py builds the constraint).

Every machine has ``feed(text) -> Delta`` for each new piece of text and
``finish() -> Delta`` at the end; ``calls`` counts the calls it has started. A
non-streaming reply is the same machine fed the whole text, so both say the same. The
auto-mode parsers (tool_parsers.py) are machines of the same shape."""

from __future__ import annotations

import json
import uuid
from typing import Any, Protocol


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class Delta:
    """One chunk's message delta: content, and tool-call pieces by call index. A call's
    first piece carries its id, type and name (OpenAI's streaming shape); later pieces
    only more of its arguments."""

    def __init__(self) -> None:
        self.content = ""
        self.calls: dict[int, dict[str, Any]] = {}

    def text(self, s: str) -> None:
        self.content += s

    def start(self, index: int, name: str, arguments: str = "") -> None:
        self.calls[index] = {"index": index, "id": new_call_id(), "type": "function",
                             "function": {"name": name, "arguments": arguments}}

    def args(self, index: int, piece: str) -> None:
        call = self.calls.setdefault(index, {"index": index, "function": {"arguments": ""}})
        call["function"]["arguments"] += piece

    def merge(self, other: Delta) -> Delta:
        self.content += other.content
        for i, c in other.calls.items():
            if i in self.calls:
                self.calls[i]["function"]["arguments"] += c["function"]["arguments"]
            else:
                self.calls[i] = c
        return self

    def chunk(self) -> dict[str, Any]:
        """The ``delta`` object of a streamed chunk (empty when there is nothing to say)."""
        d: dict[str, Any] = {}
        if self.content:
            d["content"] = self.content
        if self.calls:
            d["tool_calls"] = list(self.calls.values())
        return d

    def message(self) -> dict[str, Any]:
        """A whole reply's assistant message (content null when there are calls and no
        text)."""
        msg: dict[str, Any] = {"role": "assistant", "content": self.content or None}
        if self.calls:
            msg["tool_calls"] = [{k: v for k, v in c.items() if k != "index"}
                                 for c in self.calls.values()]
        elif msg["content"] is None:
            msg["content"] = ""
        return msg


class CallMachine(Protocol):
    calls: int

    def feed(self, text: str) -> Delta: ...

    def finish(self) -> Delta: ...


class NamedCall:
    """tool_choice naming a function: the whole text is that call's arguments (the leader
    holds it to the function's parameters schema); each piece is passed on as it comes."""

    def __init__(self, name: str) -> None:
        self.name, self.calls = name, 0

    def feed(self, text: str) -> Delta:
        d = Delta()
        if self.calls:
            d.args(0, text)
        else:
            d.start(0, self.name, text)
            self.calls = 1
        return d

    def finish(self) -> Delta:
        return self.feed("") if not self.calls else Delta()


class RequiredCalls:
    """tool_choice "required": the text is a JSON array of {"name": ..., "parameters": ...}
    (tools.required_schema). A character scanner finds each element's name and passes its
    parameters' text on as it comes (held until the name is known, should it come second);
    whitespace around the parameters value is dropped."""

    def __init__(self) -> None:
        self.calls = 0
        self.depth = 0  # containers open: the array is 1, an element 2
        self.in_str = self.esc = False
        self.key: str | None = None  # the element's key being read or whose value follows
        self.in_value = False  # after the key's colon
        self.strbuf: list[str] = []
        self.in_args = self.args_began = False
        self.ws = ""  # whitespace inside the parameters value, held until more follows
        self.name: str | None = None
        self.pending = ""  # parameters text read before the name

    def feed(self, text: str) -> Delta:
        d = Delta()
        for c in text:
            self._char(c, d)
        return d

    def finish(self) -> Delta:
        return Delta()

    def _char(self, c: str, d: Delta) -> None:
        if self.in_args:
            if self.in_str or self.depth > 2 or c not in ",}":
                self._args(c, d)
                self._track(c)
                return
            self.in_args = False  # the value ended; c is the element's own
        if self.in_str:
            if self._string_ends(c):
                self._string(d)
                return
            self.strbuf.append(c)
        elif c == '"':
            self.in_str, self.strbuf = True, []
        elif c in "{[":
            self.depth += 1
            if self.depth == 2:  # a new element
                self.key, self.in_value, self.name, self.pending = None, False, None, ""
        elif c in "}]":
            self.depth -= 1
        elif c == ":" and self.depth == 2:
            self.in_value = True
            if self.key == "parameters":
                self.in_args, self.args_began, self.ws = True, False, ""
        elif c == "," and self.depth == 2:
            self.key, self.in_value = None, False

    def _string(self, d: Delta) -> None:
        if self.depth != 2:
            return
        try:
            s = json.loads('"' + "".join(self.strbuf) + '"')
        except ValueError:
            return
        if not self.in_value:
            self.key = s
        elif self.key == "name" and self.name is None:
            self.name = s
            d.start(self.calls, s, self.pending)
            self.calls += 1

    def _args(self, c: str, d: Delta) -> None:
        if c.isspace() and not self.in_str:
            if self.args_began:
                self.ws += c
            return
        piece, self.ws, self.args_began = self.ws + c, "", True
        if self.name is None:
            self.pending += piece
        else:
            d.args(self.calls - 1, piece)

    def _track(self, c: str) -> None:
        """Inside the parameters value: only nesting and strings matter."""
        if self.in_str:
            self._string_ends(c)
        elif c == '"':
            self.in_str = True
        elif c in "{[":
            self.depth += 1
        elif c in "}]":
            self.depth -= 1

    def _string_ends(self, c: str) -> bool:
        """One character inside a JSON string: whether it closes it (escapes tracked)."""
        if self.esc:
            self.esc = False
        elif c == "\\":
            self.esc = True
        elif c == '"':
            self.in_str = False
            return True
        return False
