"""Tool calls in a model's free text (tool_choice "auto"), as streaming machines (see
tool_calls.py): ``hermes`` (Hermes, Qwen2.5, Qwen3: ``<tool_call>{"name": ...,
"arguments": {...}}</tool_call>``, any number, text around them is content) and
``llama3_json`` (Llama 3.x: the whole output is ``{"name": ..., "parameters": {...}}``,
or several joined by ``;``, optionally after ``<|python_tag|>``).

Both stream content as it comes and hold back only what may still turn into a call: hermes
from a ``<tool_call>`` (or the start of one) to its ``</tool_call>``, then emits the call
whole (name and arguments in one delta); llama3_json, an output that starts like JSON, to
the end. A call that does not parse stays content, verbatim. Whitespace next to a call is
not content (the newlines around ``<tool_call>`` blocks)."""

from __future__ import annotations

import json
from typing import Any

from nvllm.launch.openai.tool_calls import CallMachine, Delta

PARSERS = ("hermes", "llama3_json")
PARSER_CHOICES = ("auto", *PARSERS)  # nvllm-serve --tool-call-parser


def _call(obj: Any) -> tuple[str, str] | None:
    """(name, arguments JSON text) of a parsed call object, or None if it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        return obj["name"], args
    if not isinstance(args, dict):
        return None
    return obj["name"], json.dumps(args, ensure_ascii=False)


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return None


class Hermes:
    """``<tool_call>`` blocks; max_calls (1 without parallel_tool_calls) drops the rest."""

    START, END = "<tool_call>", "</tool_call>"

    def __init__(self, max_calls: int | None = None) -> None:
        self.max_calls, self.calls = max_calls, 0
        self.buf = ""  # text not yet emitted; starts with START while inside a block
        self.inside = False
        self.held = ""  # content's trailing whitespace: dropped if a call follows
        self.after_call = False  # drop content's leading whitespace

    def feed(self, text: str) -> Delta:
        d = Delta()
        self.buf += text
        while True:
            if self.inside:
                j = self.buf.find(self.END, len(self.START))
                if j < 0:
                    break
                block, self.buf = self.buf[:j + len(self.END)], self.buf[j + len(self.END):]
                self._block(block, block[len(self.START):j], d)
                self.inside = False
                continue
            i = self.buf.find(self.START)
            if i >= 0:
                self._text(self.buf[:i], d)
                self.buf, self.inside = self.buf[i:], True
                continue
            keep = next((k for k in range(min(len(self.START) - 1, len(self.buf)), 0, -1)
                         if self.START.startswith(self.buf[-k:])), 0)
            self._text(self.buf[:len(self.buf) - keep], d)
            self.buf = self.buf[len(self.buf) - keep:]
            break
        return d

    def finish(self) -> Delta:
        d = Delta()
        if self.inside:  # an unclosed block: a call if what follows the tag parses
            self._block(self.buf, self.buf[len(self.START):], d)
        else:
            self._text(self.buf, d)
        d.text(self.held)
        self.buf = self.held = ""
        return d

    def _block(self, block: str, inner: str, d: Delta) -> None:
        call = _call(_loads(inner.strip()))
        if call is None:
            self._text(block, d)
            return
        self.held, self.after_call = "", True
        if self.max_calls is None or self.calls < self.max_calls:
            d.start(self.calls, *call)
            self.calls += 1

    def _text(self, s: str, d: Delta) -> None:
        if self.after_call:
            s = s.lstrip()
            self.after_call = not s
        s = self.held + s
        cut = len(s.rstrip())
        d.text(s[:cut])
        self.held = s[cut:]


class Llama3Json:
    """A JSON call (or several joined by ";") as the whole output; anything else is
    content. max_calls as for Hermes."""

    TAG = "<|python_tag|>"

    def __init__(self, max_calls: int | None = None) -> None:
        self.max_calls, self.calls = max_calls, 0
        self.buf = ""
        self.mode: str | None = None  # None: undecided, "text" or "json"

    def feed(self, text: str) -> Delta:
        d = Delta()
        self.buf += text
        if self.mode is None:
            head = self.buf.lstrip()
            if head and not self.TAG.startswith(head[:len(self.TAG)]) and head[0] != "{":
                self.mode = "text"
            elif head.startswith((self.TAG, "{")):
                self.mode = "json"
        if self.mode == "text":
            d.text(self.buf)
            self.buf = ""
        return d

    def finish(self) -> Delta:
        d = Delta()
        calls = self._parse(self.buf.lstrip().removeprefix(self.TAG))
        if calls is None:
            d.text(self.buf)
        else:
            for call in calls[:self.max_calls]:
                d.start(self.calls, *call)
                self.calls += 1
        self.buf = ""
        return d

    @staticmethod
    def _parse(text: str) -> list[tuple[str, str]] | None:
        dec, calls, pos = json.JSONDecoder(), [], 0
        try:
            while True:
                while pos < len(text) and text[pos].isspace():
                    pos += 1
                obj, pos = dec.raw_decode(text, pos)
                call = _call(obj)
                if call is None:
                    return None
                calls.append(call)
                rest = text[pos:].lstrip()
                if not rest:
                    return calls
                if rest[0] != ";":
                    return None
                pos = len(text) - len(rest) + 1
        except (ValueError, RecursionError):
            return None


def make_parser(name: str, max_calls: int | None) -> CallMachine:
    return Hermes(max_calls) if name == "hermes" else Llama3Json(max_calls)


def pick_parser(choice: str, tok: Any) -> str:
    """The parser for `choice` (--tool-call-parser): itself, or for "auto" the one the
    tokenizer and chat template speak: hermes when there is a ``<tool_call>`` token or the
    template writes one, llama3_json for Llama 3's ``<|python_tag|>``, else hermes."""
    if choice != "auto":
        return choice
    template = str(getattr(tok, "chat_template", None) or "")

    def has_token(t: str) -> bool:
        i = tok.convert_tokens_to_ids(t)
        return i is not None and i != getattr(tok, "unk_token_id", None)

    if has_token(Hermes.START) or Hermes.START in template:
        return "hermes"
    if has_token(Llama3Json.TAG) or Llama3Json.TAG in template:
        return "llama3_json"
    return "hermes"
