"""nvllm.launch.openai.tools over HTTP against a fake leader (the gateway in process): what
tools, tool_choice and parallel_tool_calls send the leader (the template's prompt, the forced
constraint), the 400s, and the replies built from scripted model text, streamed and not,
as the openai client reassembles them."""

from __future__ import annotations

import json

import jsonschema
import pytest

from nvllm.launch.openai import schemas, tools
from nvllm.launch.openai.schemas import ChatBody

openai = pytest.importorskip("openai")
from openai.lib.streaming.chat import ChatCompletionStreamState  # noqa: E402

WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "enum": ["Paris", "Oslo"]},
    "days": {"type": "integer", "enum": [1, 2, 3]}}, "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "now"}}]
MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]
CHAT = {"messages": MESSAGES, "max_tokens": 8, "tools": TOOLS}


@pytest.fixture
def leader_model() -> str:
    return "qwen3-tools"  # its tokenizer has <tool_call>: hermes, for "auto"


@pytest.fixture
def tokenizer(tiny):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny("qwen3-tools"))


def error(r, status: int = 400) -> dict:
    assert r.status_code == status, r.text
    return r.json()["error"]


def client(c) -> openai.OpenAI:
    """The openai client over the in-process app."""
    return openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=c,
                         max_retries=0)


def stream_final(c, **kw):
    """The streamed reply reassembled by the openai client's own stream state."""
    state = ChatCompletionStreamState()
    chunks = list(client(c).chat.completions.create(model="fake", stream=True, **kw))
    for chunk in chunks:
        state.handle_chunk(chunk)
    return state.get_final_completion(), chunks


# ---- the request ------------------------------------------------------------------------------

REFUSED = [
    ({"messages": MESSAGES, "tool_choice": "auto"}, "tool_choice", "tool_choice needs tools"),
    ({"messages": MESSAGES, "tool_choice": "required", "tools": []}, "tool_choice", "needs"),
    ({"messages": MESSAGES, "tool_choice": {"type": "function", "function": {"name": "now"}}},
     "tool_choice", "needs tools"),
    ({"messages": MESSAGES, "parallel_tool_calls": True}, "parallel_tool_calls", "needs tools"),
    ({**CHAT, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice.function.name", "'nope', which is not among tools"),
    ({**CHAT, "tool_choice": "sometimes"}, "tool_choice", '"none", "auto", "required" or'),
    ({**CHAT, "tools": TOOLS + TOOLS[:1]}, "tools", "two functions have the same name"),
    ({**CHAT, "tools": TOOLS * (schemas.MAX_TOOLS // 2 + 1)}, "tools",
     f"at most {schemas.MAX_TOOLS} items"),
    ({**CHAT, "tools": [{"type": "function", "function": {"name": "a b"}}]},
     "tools.0.function.name", "should match pattern"),
    ({**CHAT, "tools": [{"type": "retrieval", "function": {"name": "a"}}]}, "tools.0.type",
     "'function'"),
    ({**CHAT, "tools": [{"type": "function", "function": {"name": "a", "parameters": {
        "enum": ["x" * schemas.MAX_CONSTRAINT_CHARS]}}}]}, "tools.0.function.parameters",
     "more than the limit"),
    # tool_choice "required" over many big functions: the combined schema is too big
    ({**CHAT, "tool_choice": "required", "tools": [
        {"type": "function", "function": {"name": f"f{i}", "parameters": {
            "enum": ["x" * (schemas.MAX_CONSTRAINT_CHARS // 3)]}}} for i in range(4)]},
     "tools", "the schema tool_choice needs is"),
    ({**CHAT, "tool_choice": "required", "tools": [
        {"type": "function", "function": {"name": n, "parameters": {
            "$defs": {"D": {"type": t}}, "properties": {"d": {"$ref": "#/$defs/D"}}}}}
        for n, t in (("a", "string"), ("b", "integer"))]}, "tools", "define $defs/D differently"),
    ({**CHAT, "tool_choice": "required", "response_format": {"type": "json_object"}},
     "tool_choice", "response_format and tool_choice each constrain the output"),
    ({**CHAT, "tool_choice": "required", "ignore_eos": True}, "ignore_eos",
     "ignore_eos cannot be combined with tool_choice"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": [
        {"id": "1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]},
     "messages.0.tool_calls", "only assistant messages have tool_calls"),
]


@pytest.mark.parametrize("body,param,message", REFUSED, ids=[str(i) for i in range(len(REFUSED))])
def test_refused_tool_requests_name_the_field(gateway, leader, body, param, message):
    err = error(gateway().post("/v1/chat/completions", json=body))
    assert err["param"] == param, err
    assert message in err["message"], err
    assert not leader.submits


def test_tools_and_tool_turns_reach_the_template(gateway, leader, tokenizer):
    """Tools render as the template's # Tools block; an assistant turn with tool_calls (its
    content null, as the openai client sends it back) and the tool results render as the
    template writes them, arguments as JSON objects."""
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    messages = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    for choice in ("none", "auto", None):
        body = {**CHAT, "messages": messages, **({"tool_choice": choice} if choice else {})}
        assert gateway().post("/v1/chat/completions", json=body).status_code == 200
        sent = leader.submits[-1]
        prompt = tokenizer.decode(sent["prompt_token_ids"])
        assert prompt == tokenizer.apply_chat_template(
            [*MESSAGES, {**messages[1], "tool_calls": [{**call, "function": {
                "name": "get_weather", "arguments": {"city": "Paris"}}}]}, messages[2]],
            tools=TOOLS, tokenize=False, add_generation_prompt=True)
        assert '"name": "get_weather", "description": "Weather"' in prompt
        assert '{"name": "get_weather", "arguments": {"city": "Paris"}}' in prompt
        assert "<tool_response>\nsunny\n</tool_response>" in prompt
        assert "structured_outputs" not in sent["params"]
    r = gateway().post("/tokenize", json={"messages": messages, "tools": TOOLS})
    assert r.json()["tokens"] == sent["prompt_token_ids"]


def constraint(leader) -> dict:
    return json.loads(leader.submits[-1]["params"]["structured_outputs"]["json"])


def test_a_named_function_is_forced_by_its_parameters_schema(gateway, leader):
    body = {**CHAT, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    assert gateway().post("/v1/chat/completions", json=body).status_code == 200
    assert constraint(leader) == WEATHER
    body = {**CHAT, "tool_choice": {"type": "function", "function": {"name": "now"}}}
    assert gateway().post("/v1/chat/completions", json=body).status_code == 200
    assert constraint(leader) == tools.NO_PARAMETERS


def test_required_schema_accepts_exactly_calls_of_the_tools():
    schema = tools.required_schema(ChatBody.model_validate({**CHAT, "tool_choice": "required"}))
    jsonschema.Draft202012Validator.check_schema(schema)
    ok = [{"name": "get_weather", "parameters": {"city": "Oslo", "days": 2}},
          {"name": "now", "parameters": {}}]
    jsonschema.validate(ok, schema)
    for bad in ([], [{"name": "nope", "parameters": {}}],
                [{"name": "get_weather", "parameters": {"city": "Rome"}}],
                [{"name": "get_weather"}], [{"name": "now", "parameters": {}, "x": 1}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    one = tools.required_schema(ChatBody.model_validate(
        {**CHAT, "tool_choice": "required", "parallel_tool_calls": False}))
    jsonschema.validate(ok[:1], one)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(ok, one)


def test_required_schema_lifts_definitions_to_the_root():
    params = {"type": "object", "properties": {"u": {"$ref": "#/$defs/Unit"}},
              "$defs": {"Unit": {"enum": ["C", "F"]}}, "required": ["u"]}
    body = ChatBody.model_validate({**CHAT, "tool_choice": "required", "tools": [
        {"type": "function", "function": {"name": "t", "parameters": params}},
        {"type": "function", "function": {"name": "s", "parameters": params}}]})
    schema = tools.required_schema(body)
    assert schema["$defs"] == {"Unit": {"enum": ["C", "F"]}}
    jsonschema.validate([{"name": "s", "parameters": {"u": "C"}}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "s", "parameters": {"u": "K"}}], schema)


# ---- the reply --------------------------------------------------------------------------------

def test_named_reply_is_a_tool_call(gateway, leader):
    c = gateway()
    leader.script = ['{"city": ', '"Paris"', "}"]
    body = {**CHAT, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    r = c.post("/v1/chat/completions", json=body).json()["choices"][0]
    assert r["finish_reason"] == "tool_calls" and r["message"]["content"] is None
    (call,) = r["message"]["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    final, chunks = stream_final(c, **{k: v for k, v in body.items() if k != "max_tokens"})
    msg = final.choices[0].message
    assert final.choices[0].finish_reason == "tool_calls"
    assert [(t.function.name, t.function.arguments) for t in msg.tool_calls] == [
        ("get_weather", '{"city": "Paris"}')]
    pieces = [ch.choices[0].delta.tool_calls for ch in chunks if ch.choices]
    assert len([p for p in pieces if p]) == 3  # the arguments as they came


def test_required_reply_is_the_calls(gateway, leader):
    c = gateway()
    leader.script = ['[{"name": "get_weather", "parameters": {"city": "Oslo"}}, ',
                     '{"name": "now", "parameters": {}}]']
    body = {**CHAT, "tool_choice": "required"}
    r = c.post("/v1/chat/completions", json=body).json()["choices"][0]
    assert r["finish_reason"] == "tool_calls" and r["message"]["content"] is None
    want = [("get_weather", {"city": "Oslo"}), ("now", {})]
    assert [(t["function"]["name"], json.loads(t["function"]["arguments"]))
            for t in r["message"]["tool_calls"]] == want
    final, _ = stream_final(c, **body)
    assert [(t.function.name, json.loads(t.function.arguments))
            for t in final.choices[0].message.tool_calls] == want
    assert final.choices[0].finish_reason == "tool_calls"
    leader.script = ['[{"name": "now", "param']  # cut by max_tokens: not calls, content
    r = c.post("/v1/chat/completions", json=body).json()["choices"][0]
    assert r["message"] == {"role": "assistant", "content": '[{"name": "now", "param'}


AUTO_TEXT = ["I will check", ".\n<tool_call>", '\n{"name": "get_weather", ',
             '"arguments": {"city": "Paris"}}\n</tool', "_call>"]


@pytest.mark.parametrize("parser,script,content,calls", [
    ("auto", AUTO_TEXT, "I will check.", [("get_weather", '{"city": "Paris"}')]),
    ("hermes", ["No calls <tool_call>{oops}</tool_call>"],
     "No calls <tool_call>{oops}</tool_call>", []),
    ("llama3_json", ['{"name": "now", ', '"parameters": {}}'], None, [("now", "{}")]),
])
def test_auto_reply_is_parsed(gateway, leader, parser, script, content, calls):
    c = gateway(tool_call_parser=parser)
    leader.script = script
    for n in (1, 2):
        r = c.post("/v1/chat/completions", json={**CHAT, "n": n}).json()
        for choice in r["choices"]:
            assert choice["message"]["content"] == (content if calls else "".join(script))
            assert [(t["function"]["name"], t["function"]["arguments"])
                    for t in choice["message"].get("tool_calls", [])] == calls
            assert choice["finish_reason"] == ("tool_calls" if calls else "stop")
        final, chunks = stream_final(c, **{**CHAT, "n": n})
        for choice in final.choices:
            assert (choice.message.content or None) == (content if calls else "".join(script))
            assert [(t.function.name, t.function.arguments)
                    for t in choice.message.tool_calls or []] == calls
            assert choice.finish_reason == ("tool_calls" if calls else "stop")
        seen = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
        assert "<tool_call>" not in seen or not calls


def test_tool_choice_none_leaves_the_text_alone(gateway, leader):
    leader.script = AUTO_TEXT
    r = gateway().post("/v1/chat/completions", json={**CHAT, "tool_choice": "none"}).json()
    assert r["choices"][0]["message"] == {"role": "assistant", "content": "".join(AUTO_TEXT)}
    assert r["choices"][0]["finish_reason"] == "stop"
