"""nvllm.launch.openai.tool_parsers: tool calls found in a model's free text (tool_choice
"auto"), whole and streamed; a streamed text says the same as the whole one, however it is
cut into deltas."""

from __future__ import annotations

import json

import pytest
from tool_streams import cuts, streamed, whole

from nvllm.launch.openai.tool_parsers import Hermes, Llama3Json, pick_parser

CALL_1 = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
CALL_2 = '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>'


def calls_of(message: dict) -> list[dict]:
    return [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
            for c in message.get("tool_calls", [])]


# ---- hermes ----------------------------------------------------------------------------------

HERMES_CASES = [
    # text, content, calls
    (CALL_1, None, [("get_weather", {"city": "Paris"})]),
    (f"Let me check.\n{CALL_1}\n{CALL_2}\n", "Let me check.",
     [("get_weather", {"city": "Paris"}), ("now", {})]),
    (f"{CALL_1}\nDone.", "Done.", [("get_weather", {"city": "Paris"})]),
    # no closing tag at the end: still a call when what follows the tag parses
    ('<tool_call>\n{"name": "now", "arguments": {}}', None, [("now", {})]),
    # arguments given as a JSON string, and "parameters" for "arguments"
    ('<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>', None,
     [("f", {"a": 1})]),
    ('<tool_call>{"name": "f", "parameters": {"b": [1, "é"]}}</tool_call>', None,
     [("f", {"b": [1, "é"]})]),
    ("just text, <b>not</b> a call", "just text, <b>not</b> a call", []),
    ("  spaced  \n", "  spaced  \n", []),
]


@pytest.mark.parametrize("text,content,calls", HERMES_CASES,
                         ids=[str(i) for i in range(len(HERMES_CASES))])
def test_hermes_whole_and_streamed(text, content, calls):
    msg = whole(Hermes(), text)
    assert msg["content"] == (content if content is not None or not calls else None)
    got = calls_of(msg)
    assert [(c["name"], json.loads(c["arguments"])) for c in got] == calls
    assert all(c["id"].startswith("call_") for c in msg.get("tool_calls", []))
    for seed in range(5):  # any cut of the text says the same
        s_content, s_calls, _ = streamed(Hermes(), cuts(text, seed))
        assert s_content == (msg["content"] or "")
        assert s_calls == got
    s_content, s_calls, _ = streamed(Hermes(), list(text))
    assert (s_content, s_calls) == (msg["content"] or "", got)


@pytest.mark.parametrize("text", [
    "<tool_call>{not json}</tool_call>",
    'a <tool_call>{"arguments": {}}</tool_call> b',  # no name
    '<tool_call>{"name": "f", "arguments": 5}</tool_call>',
    "<tool_call>" + "[" * 5000 + "</tool_call>",  # nesting past the recursion limit
    "<tool_call>",
    "x <tool_ca",
])
def test_hermes_malformed_calls_stay_content_verbatim(text):
    msg = whole(Hermes(), text)
    assert msg == {"role": "assistant", "content": text}
    assert streamed(Hermes(), list(text))[:2] == (text, [])


def test_hermes_streams_content_at_once_and_never_shows_a_tag():
    """Content goes out with the delta that brings it (only trailing whitespace and what may
    be the start of a tag wait); a call goes out whole once its block closes."""
    m = Hermes()
    assert m.feed("Sure").chunk() == {"content": "Sure"}
    assert m.feed(", one moment. ").chunk() == {"content": ", one moment."}
    assert m.feed("<tool").chunk() == {}
    assert m.feed('_call>\n{"name": "now", ').chunk() == {}
    d = m.feed('"arguments": {}}\n</tool_call>\n').chunk()
    assert [c["function"] for c in d["tool_calls"]] == [{"name": "now", "arguments": "{}"}]
    assert d.get("content") is None and m.calls == 1
    assert m.finish().chunk() == {}
    m = Hermes()
    assert m.feed("a <tool").chunk() == {"content": "a"}
    assert m.feed("box> b").chunk() == {"content": " <toolbox> b"}


def test_hermes_without_parallel_calls_keeps_the_first():
    text = f"{CALL_1}\n{CALL_2}"
    assert [c["name"] for c in calls_of(whole(Hermes(1), text))] == ["get_weather"]
    content, calls, _ = streamed(Hermes(1), list(text))
    assert (content, [c["name"] for c in calls]) == ("", ["get_weather"])


# ---- llama3_json -----------------------------------------------------------------------------

LLAMA_CASES = [
    ('{"name": "f", "parameters": {"a": 1}}', [("f", {"a": 1})]),
    ('<|python_tag|>{"name": "f", "parameters": {"a": 1}}', [("f", {"a": 1})]),
    (' {"name": "f", "arguments": {}} ; {"name": "g", "parameters": {"x": "y"}}\n',
     [("f", {}), ("g", {"x": "y"})]),
]


@pytest.mark.parametrize("text,calls", LLAMA_CASES, ids=[str(i) for i in range(len(LLAMA_CASES))])
def test_llama3_json_calls(text, calls):
    msg = whole(Llama3Json(), text)
    assert msg["content"] is None
    assert [(c["name"], json.loads(c["arguments"])) for c in calls_of(msg)] == calls
    content, s_calls, _ = streamed(Llama3Json(), cuts(text, 1))
    assert (content, s_calls) == ("", calls_of(msg))
    assert len(calls_of(whole(Llama3Json(1), text))) == 1


@pytest.mark.parametrize("text", [
    "Hello there", '{"name": "f", "parameters": {"a": 1}', '{"name": "f"} trailing',
    '{"name": 3, "parameters": {}}', '{"name": "f", "parameters": {}};', "",
    "<|python_tag|>print(1)",
])
def test_llama3_json_anything_else_is_content(text):
    assert whole(Llama3Json(), text) == {"role": "assistant", "content": text}
    assert streamed(Llama3Json(), list(text))[:2] == (text, [])


def test_llama3_json_streams_plain_text_at_once():
    m = Llama3Json()
    assert m.feed(" ").chunk() == {}  # undecided
    assert m.feed("Hi").chunk() == {"content": " Hi"}
    assert m.feed(" {").chunk() == {"content": " {"}
    m = Llama3Json()
    assert m.feed('{"name"').chunk() == {}  # a call, maybe: held to the end


# ---- choosing one ----------------------------------------------------------------------------


class FakeTok:
    def __init__(self, tokens: dict[str, int], template: str = "") -> None:
        self.tokens, self.chat_template, self.unk_token_id = tokens, template, None

    def convert_tokens_to_ids(self, t: str) -> int | None:
        return self.tokens.get(t)


def test_pick_parser(tiny):
    from transformers import AutoTokenizer

    assert pick_parser("auto", AutoTokenizer.from_pretrained(tiny("qwen3-tools"))) == "hermes"
    assert pick_parser("auto", FakeTok({"<|python_tag|>": 7})) == "llama3_json"
    assert pick_parser("auto", FakeTok({}, "... <|python_tag|> ...")) == "llama3_json"
    assert pick_parser("auto", FakeTok({}, "{{ '<tool_call>' }}")) == "hermes"
    assert pick_parser("auto", FakeTok({})) == "hermes"  # the default
    assert pick_parser("llama3_json", FakeTok({"<tool_call>": 3})) == "llama3_json"
