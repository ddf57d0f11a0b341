"""nvllm.launch.openai.tool_calls: the forced tool choices' text as tool calls, streamed
piece by piece in OpenAI's delta shape, and the Delta that carries them."""

from __future__ import annotations

import json

import pytest
from tool_streams import cuts, streamed, whole

from nvllm.launch.openai.tool_calls import Delta, NamedCall, RequiredCalls

REQUIRED = [
    '[{"name": "get_weather", "parameters": {"city": "Paris", "days": [1, 2]}}]',
    # whitespace anywhere, escapes and brackets inside strings, two calls
    '[ {\n "name" : "a\\"b" ,\n "parameters" : { "s": "}]\\\\\\"{[", "t": {"u": []} } \n},'
    '{"name": "now", "parameters": {}} ]',
    # parameters before the name: held until the name comes
    '[{"parameters": {"x": 1}, "name": "f"}]',
    # a parameters value that is not an object
    '[{"name": "f", "parameters": "text, with } and ]"}, {"name": "g", "parameters": 12}]',
]


@pytest.mark.parametrize("text", REQUIRED, ids=[str(i) for i in range(len(REQUIRED))])
def test_required_calls_are_the_array_elements(text):
    want = [(e["name"], e["parameters"]) for e in json.loads(text)]
    msg = whole(RequiredCalls(), text)
    assert msg["content"] is None
    got = [(c["function"]["name"], json.loads(c["function"]["arguments"]))
           for c in msg["tool_calls"]]
    assert got == want
    for pieces in (list(text), cuts(text, 0), cuts(text, 1), [text]):
        content, calls, _ = streamed(RequiredCalls(), pieces)
        assert content == ""
        assert [(c["name"], json.loads(c["arguments"])) for c in calls] == want
        # whitespace around a value is not part of its arguments
        assert all(c["arguments"] == c["arguments"].strip() for c in calls)


def test_required_streams_arguments_as_they_come():
    m = RequiredCalls()
    assert m.feed('[{"na').chunk() == {}
    first = m.feed('me": "f"').chunk()["tool_calls"]  # the name is known: the call starts
    assert [(c["index"], c["type"], c["function"]) for c in first] == [
        (0, "function", {"name": "f", "arguments": ""})]
    assert m.feed(', "parameters": {"a"').chunk() == {
        "tool_calls": [{"index": 0, "function": {"arguments": '{"a"'}}]}
    assert m.feed(": 1}").chunk() == {"tool_calls": [{"index": 0,
                                                        "function": {"arguments": ": 1}"}}]}
    assert m.feed("}, ").chunk() == {}
    assert m.feed('{"name": "g", "parameters": {}}]').chunk()["tool_calls"][0]["index"] == 1
    assert m.calls == 2


def test_named_call_streams_the_whole_text_as_arguments():
    content, calls, chunks = streamed(NamedCall("f"), ['{"a"', ": [1,", " 2]}"])
    assert (content, calls) == ("", [{"name": "f", "arguments": '{"a": [1, 2]}'}])
    assert set(chunks[0]["tool_calls"][0]) == {"index", "id", "type", "function"}
    assert all(set(c["tool_calls"][0]) == {"index", "function"} for c in chunks[1:])
    msg = whole(NamedCall("f"), '{"a": 1}')
    assert msg["content"] is None and msg["tool_calls"][0]["function"] == {
        "name": "f", "arguments": '{"a": 1}'}
    assert whole(NamedCall("f"), "")["tool_calls"][0]["function"]["arguments"] == ""


def test_delta_merges_pieces_of_one_call():
    a, b = Delta(), Delta()
    a.text("x")
    a.start(0, "f", "{")
    b.args(0, "}")
    b.start(1, "g")
    b.text("y")
    d = a.merge(b).chunk()
    assert d["content"] == "xy"
    assert [(c["index"], c["function"]) for c in d["tool_calls"]] == [
        (0, {"name": "f", "arguments": "{}"}), (1, {"name": "g", "arguments": ""})]
    assert Delta().chunk() == {} and Delta().message() == {"role": "assistant", "content": ""}
