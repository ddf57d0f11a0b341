"""Structured output and tool calling over HTTP, end to end: the official openai client
against nvllm-serve in front of a real engine (tiny qwen3-tools, random weights, CPU), where
only the constraint can make an output valid. Schemas bound their length (enum, maxLength,
maxItems, parallel_tool_calls false) so every output can finish within max_tokens."""

from __future__ import annotations

import json
import re
import signal
import subprocess

import jsonschema
import pytest
from served import serve, teardown
from subproc import free_port, stop_process, wait_healthy

from nvllm import LLM

pytestmark = pytest.mark.e2e
openai = pytest.importorskip("openai")
from openai.lib.streaming.chat import ChatCompletionStreamState  # noqa: E402

MODEL = "tiny-tools"
WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]},
    "days": {"type": "integer", "enum": [1, 2, 3]}},
    "required": ["city", "days"], "additionalProperties": False}
SEARCH = {"type": "object", "properties": {
    "query": {"type": "string", "maxLength": 12},
    "tags": {"type": "array", "items": {"enum": ["news", "web"]}, "maxItems": 2}},
    "required": ["query"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "search", "description": "Search the web",
                                           "parameters": SEARCH}}]
PARAMS = {"get_weather": WEATHER, "search": SEARCH}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
ANSWER = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]},
                                           "score": {"type": "integer", "enum": [1, 2, 3]},
                                           "note": {"type": "string", "maxLength": 6}},
          "required": ["answer", "score", "note"], "additionalProperties": False}
MAX_TOKENS = 96


@pytest.fixture(scope="module")
def server(tiny, tmp_path_factory):
    s = serve(LLM(tiny("qwen3-tools"), device="cpu", dtype="float32"))
    gateway = None
    try:
        port = free_port()
        with open(tmp_path_factory.mktemp("gateway") / "gateway.log", "w") as log:
            gateway = start(s.endpoint, port, log)
        base = f"http://127.0.0.1:{port}"
        wait_healthy(base, gateway, 60)
        yield openai.OpenAI(base_url=f"{base}/v1", api_key="x", timeout=60, max_retries=0)
    finally:
        if gateway is not None:
            stop_process(gateway, signal.SIGTERM)
        teardown(s)


def start(endpoint: str, port: int, log) -> subprocess.Popen:
    from nvllm.launch.openai.process import start_gateway_process

    return start_gateway_process(endpoint, "127.0.0.1", port, MODEL, stdout=log,
                                 stderr=subprocess.STDOUT)


def chat(client, stream: bool = False, **kw):
    """A chat reply; streamed, as the openai client's own stream state reassembles it."""
    kw = {"model": MODEL, "messages": MESSAGES, "max_tokens": MAX_TOKENS, **kw}
    if not stream:
        return client.chat.completions.create(**kw)
    state = ChatCompletionStreamState()
    for chunk in client.chat.completions.create(stream=True, **kw):
        state.handle_chunk(chunk)
    return state.get_final_completion()


def check_calls(choice, names: set[str]) -> list:
    assert choice.finish_reason == "tool_calls", choice
    calls = choice.message.tool_calls
    assert calls and not choice.message.content
    for c in calls:
        assert c.type == "function" and c.id.startswith("call_")
        assert c.function.name in names
        jsonschema.validate(json.loads(c.function.arguments), PARAMS[c.function.name])
    return calls


@pytest.mark.parametrize("stream", [False, True])
def test_required_tool_calls_validate(server, stream):
    for seed in range(3):
        r = chat(server, stream, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
                 temperature=1.0, seed=seed, n=2)
        for choice in r.choices:
            assert len(check_calls(choice, set(PARAMS))) == 1


@pytest.mark.parametrize("stream", [False, True])
def test_named_tool_call_validates(server, stream):
    for name in PARAMS:
        r = chat(server, stream, tools=TOOLS, temperature=0,
                 tool_choice={"type": "function", "function": {"name": name}})
        (call,) = check_calls(r.choices[0], {name})


def test_a_tool_call_goes_back_into_the_conversation(server):
    r = chat(server, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
             temperature=0)
    msg = r.choices[0].message
    messages = [*MESSAGES, msg, {"role": "tool", "tool_call_id": msg.tool_calls[0].id,
                                 "content": "sunny, 21 C"}]
    r = chat(server, tools=TOOLS, messages=messages, max_tokens=4, temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert r.usage.prompt_tokens > chat(server, tools=TOOLS, max_tokens=1).usage.prompt_tokens


@pytest.mark.parametrize("stream", [False, True])
def test_response_format_json_schema(server, stream):
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER,
                                                  "strict": True}}
    for seed in range(3):
        r = chat(server, stream, response_format=fmt, temperature=1.0, seed=seed, n=2)
        for choice in r.choices:
            assert choice.finish_reason == "stop", choice
            jsonschema.validate(json.loads(choice.message.content), ANSWER)


def test_response_format_json_object(server):
    """Any object: a random model mostly writes one longer than max_tokens (it still starts
    as one); seeded, some of the 8 close it, and those parse."""
    r = chat(server, response_format={"type": "json_object"}, temperature=1.0, seed=0, n=8,
             max_tokens=128)
    ends = [c.finish_reason for c in r.choices]
    assert "stop" in ends and set(ends) <= {"stop", "length"}
    for c in r.choices:
        assert c.message.content.startswith("{")
        if c.finish_reason == "stop":
            assert isinstance(json.loads(c.message.content), dict)


def test_regex_and_choice_over_both_routes(server):
    regex = r"[a-c]{2,4}-\d{2}"
    for seed in range(3):
        r = chat(server, temperature=1.0, seed=seed, extra_body={"guided_regex": regex})
        assert re.fullmatch(regex, r.choices[0].message.content), r
        r = server.completions.create(model=MODEL, prompt="Pick one:", max_tokens=16,
                                      temperature=1.0, seed=seed,
                                      extra_body={"structured_outputs": {"regex": regex}})
        assert re.fullmatch(regex, r.choices[0].text) and r.choices[0].finish_reason == "stop"
        choices = ["red", "green", "light blue"]
        r = chat(server, temperature=1.0, seed=seed,
                 extra_body={"structured_outputs": {"choice": choices}})
        assert r.choices[0].message.content in choices
        assert r.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("extra,param", [
    ({"guided_regex": "(unclosed"}, "guided_regex"),
    ({"structured_outputs": {"grammar": "root ::= undefined_rule"}}, "structured_outputs"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"$ref": "#/nope"}}}}}},
     "response_format"),
])
def test_constraints_that_do_not_compile_are_400s(server, extra, param):
    with pytest.raises(openai.BadRequestError) as e:
        chat(server, extra_body=extra)
    err = e.value.body
    assert e.value.status_code == 400 and err["type"] == "invalid_request_error", err
    assert err["param"] == param and "structured_outputs" in err["message"], err
    # the server keeps serving
    assert chat(server, max_tokens=2).choices[0].finish_reason == "length"
