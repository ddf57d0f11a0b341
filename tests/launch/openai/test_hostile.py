"""The gateway against hostile HTTP callers, in process (FastAPI's TestClient, a fake
leader): body size limit, refused and accepted-but-ignored fields, request chat templates,
priority, out-of-range integers and list sizes, the API key on every route but /health,
and chat templates rendered off the event loop."""

from __future__ import annotations

import threading

import pytest
from starlette.requests import Request

from nvllm.launch.openai import schemas
from nvllm.launch.openai.body import read_body
from nvllm.launch.openai.errors import ApiError

MESSAGES = [{"role": "user", "content": "hi"}]
CHAT = {"messages": MESSAGES, "max_tokens": 2}
COMPLETION = {"prompt": "hi", "max_tokens": 2}


def error(r, status: int) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return err


# ---- body size ------------------------------------------------------------------------------


def test_body_over_the_limit_gets_413(gateway, leader):
    c = gateway(max_body_bytes=1000)
    big = {**COMPLETION, "prompt": "x" * 2000}
    for route in ("/v1/completions", "/v1/chat/completions"):
        err = error(c.post(route, json=big), 413)
        assert err["code"] == "request_too_large" and "1000 bytes" in err["message"]
    # Chunked (no Content-Length): cut off while reading.
    chunks = (b'{"prompt": "' + b"x" * 500 if i == 0 else b"x" * 500 for i in range(10))
    err = error(c.post("/v1/completions", content=chunks,
                       headers={"content-type": "application/json"}), 413)
    assert "1000 bytes" in err["message"]
    assert not leader.submits
    assert c.post("/v1/completions", json=COMPLETION).status_code == 200


def _request(chunks: list[bytes], headers: dict[str, str]) -> tuple[Request, list[int]]:
    """A Request over `chunks`, and the count of receive() calls it made."""
    calls = [0]

    async def receive() -> dict:
        i = calls[0]
        calls[0] += 1
        return {"type": "http.request", "body": chunks[i], "more_body": i < len(chunks) - 1}

    scope = {"type": "http", "method": "POST", "path": "/", "query_string": b"",
             "headers": [(k.encode(), v.encode()) for k, v in headers.items()]}
    return Request(scope, receive), calls


def test_body_is_read_incrementally_and_stops_at_the_limit():
    import asyncio

    chunks = [b"x" * 400] * 100
    req, calls = _request(chunks, {})
    with pytest.raises(ApiError) as e:
        asyncio.run(read_body(req, 1000))
    assert e.value.status == 413 and calls[0] == 3  # 1200 bytes read, not 40000
    req, calls = _request(chunks, {"content-length": "40000"})
    with pytest.raises(ApiError):
        asyncio.run(read_body(req, 1000))
    assert calls[0] == 0  # refused on the header alone
    req, _ = _request([b"ab", b"cd"], {"content-length": "4"})
    assert asyncio.run(read_body(req, 4)) == b"abcd"


# ---- refused, ignored and unknown fields -----------------------------------------------------

REFUSED = {"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "auto",
           "functions": [{"name": "f"}], "function_call": "auto", "parallel_tool_calls": False,
           "suffix": "end", "best_of": 3, "prediction": {"type": "content"},
           "audio": {"voice": "x"}, "modalities": ["text", "audio"], "web_search_options": {},
           "reasoning_effort": "low", "verbosity": "low", "use_beam_search": True,
           "truncate_prompt_tokens": 5}


def test_the_refused_list_is_covered():
    assert set(REFUSED) == set(schemas.UNSUPPORTED)


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_unsupported_fields_get_400_naming_them(gateway, leader, name):
    c = gateway()
    routes = [("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)]
    if name in schemas.ChatBody.model_fields:  # tools & co: chat only
        routes.pop()
    for route, body in routes:
        err = error(c.post(route, json={**body, name: REFUSED[name]}), 400)
        assert (err["param"], err["code"]) == (name, "unsupported_parameter"), err
        assert name in err["message"]
    assert not leader.submits


def test_neutral_values_and_ignored_fields_are_accepted_and_not_forwarded(gateway, leader):
    c = gateway()
    neutral = {"echo": False, "suffix": None, "best_of": 2, "n": 2, "logit_bias": {},
               "response_format": {"type": "text"}, "tools": [], "tool_choice": "none",
               "user": "u1", "store": False, "metadata": {"a": "b"}, "service_tier": "auto",
               "safety_identifier": "s", "prompt_cache_key": "k",
               "prompt_cache_retention": "in_memory"}
    for route, body in (("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)):
        r = c.post(route, json={**body, **neutral})
        assert r.status_code == 200, r.text
        sent = leader.submits[-1]
        assert not (set(neutral) - {"n"}) & (set(sent) | set(sent["params"])), sent
    assert set(schemas.ACCEPTED_IGNORED) <= set(neutral)
    # best_of other than n is output-changing: refused.
    err = error(c.post("/v1/completions", json={**COMPLETION, "best_of": 2}), 400)
    assert err["param"] == "best_of"


@pytest.mark.parametrize("route,body,param", [
    ("/v1/completions", {**COMPLETION, "frobnicate": 1}, "frobnicate"),
    ("/v1/completions", {**COMPLETION, "messages": MESSAGES}, "messages"),
    ("/v1/chat/completions", {**CHAT, "prompt": "hi"}, "prompt"),
    ("/v1/chat/completions", {**CHAT, "logprobz": True}, "logprobz"),
])
def test_unknown_fields_are_errors(gateway, route, body, param):
    err = error(gateway().post(route, json=body), 400)
    assert (err["param"], err["code"]) == (param, "unknown_parameter")
    assert err["message"] == f"unrecognized request field: {param}"


def test_unknown_nested_fields_are_errors(gateway):
    c = gateway()
    msgs = [{"role": "assistant", "content": "x", "tool_callz": []}]
    err = error(c.post("/v1/chat/completions", json={**CHAT, "messages": msgs}), 400)
    assert err["param"] == "messages.0.tool_callz"
    err = error(c.post("/v1/completions", json={**COMPLETION, "stream": True,
                                                "stream_options": {"foo": 1}}), 400)
    assert err["param"] == "stream_options.foo"


# ---- integers and list sizes -----------------------------------------------------------------

BIG = 2**64 + 5
OUT_OF_RANGE = [
    ("/v1/completions", {"prompt": [1, BIG]}, "prompt"),
    ("/v1/completions", {"prompt": [[1], [-3]]}, "prompt"),
    ("/v1/completions", {"prompt": [-1]}, "prompt"),
    ("/v1/completions", {**COMPLETION, "stop_token_ids": [BIG]}, "stop_token_ids.0"),
    ("/v1/completions", {**COMPLETION, "stop_token_ids": [3, -1]}, "stop_token_ids.1"),
    ("/v1/completions", {**COMPLETION, "seed": BIG}, "seed"),
    ("/v1/completions", {**COMPLETION, "max_tokens": 2**63}, "max_tokens"),
    ("/v1/completions", {**COMPLETION, "top_k": BIG}, "top_k"),
    ("/v1/completions", {**COMPLETION, "min_tokens": BIG}, "min_tokens"),
    ("/v1/completions", {**COMPLETION, "ttl_ms": BIG}, "ttl_ms"),
    ("/v1/completions", {**COMPLETION, "n": BIG}, "n"),
    ("/v1/completions", {**COMPLETION, "logprobs": BIG}, "logprobs"),
    ("/v1/chat/completions", {**CHAT, "max_completion_tokens": BIG}, "max_completion_tokens"),
    ("/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": BIG}, "top_logprobs"),
]


@pytest.mark.parametrize("route,body,param", OUT_OF_RANGE,
                         ids=[str(i) for i in range(len(OUT_OF_RANGE))])
def test_out_of_range_integers_get_400_naming_the_field(gateway, leader, route, body, param):
    err = error(gateway().post(route, json=body), 400)
    assert (err["param"], err["code"]) == (param, "invalid_value"), err
    assert not leader.submits


def test_an_integer_too_long_to_parse_is_a_json_error(gateway):
    raw = b'{"prompt": [' + b"9" * 5000 + b"]}"
    err = error(gateway().post("/v1/completions", content=raw,
                               headers={"content-type": "application/json"}), 400)
    assert err["code"] == "invalid_json"


def test_deep_nesting_and_nan_are_json_errors(gateway):
    c = gateway()
    for raw in (b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
                b'{"prompt": "x", "temperature": NaN}'):
        err = error(c.post("/v1/completions", content=raw,
                           headers={"content-type": "application/json"}), 400)
        assert err["code"] == "invalid_json", err


LISTS = [
    ("/v1/completions", {**COMPLETION, "stop": ["s"] * (schemas.MAX_STOP + 1)}, "stop"),
    ("/v1/completions", {**COMPLETION, "stop": "s" * (schemas.MAX_STOP_CHARS + 1)}, "stop"),
    ("/v1/completions",
     {**COMPLETION, "stop_token_ids": [1] * (schemas.MAX_STOP_TOKEN_IDS + 1)}, "stop_token_ids"),
    ("/v1/completions", {"prompt": [1] * (schemas.MAX_PROMPT_TOKEN_IDS + 1)}, "prompt"),
    ("/v1/completions", {"prompt": ["a"] * (schemas.MAX_PROMPTS + 1)}, "prompt"),
    ("/v1/completions", {**COMPLETION, "n": schemas.MAX_N + 1}, "n"),
    ("/v1/completions", {**COMPLETION, "logprobs": schemas.MAX_LOGPROBS + 1}, "logprobs"),
    ("/v1/chat/completions", {**CHAT, "logprobs": True,
                              "top_logprobs": schemas.MAX_LOGPROBS + 1}, "top_logprobs"),
    ("/v1/chat/completions", {**CHAT, "messages": MESSAGES * (schemas.MAX_MESSAGES + 1)},
     "messages"),
]


@pytest.mark.parametrize("route,body,param", LISTS, ids=[str(i) for i in range(len(LISTS))])
def test_list_sizes_are_bounded(gateway, leader, route, body, param):
    err = error(gateway().post(route, json=body), 400)
    assert err["param"] == param, err
    assert not leader.submits


# ---- priority -------------------------------------------------------------------------------


def test_priority_needs_the_operators_flag(gateway, leader):
    for route, body in (("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)):
        err = error(gateway().post(route, json={**body, "priority": -5}), 400)
        assert err["param"] == "priority" and "--allow-priority" in err["message"]
    assert not leader.submits
    r = gateway(allow_priority=True).post("/v1/completions", json={**COMPLETION, "priority": -5})
    assert r.status_code == 200 and leader.submits[-1]["priority"] == -5


# ---- request chat templates -----------------------------------------------------------------

TEMPLATE = "{% for m in messages %}<{{ m.content }}>{% endfor %}"


def test_request_chat_templates_are_refused_by_default(gateway, leader):
    c = gateway()
    for body, param in (({"chat_template": TEMPLATE}, "chat_template"),
                        ({"chat_template_kwargs": {"chat_template": TEMPLATE}},
                         "chat_template_kwargs.chat_template")):
        err = error(c.post("/v1/chat/completions", json={**CHAT, **body}), 400)
        assert err["param"] == param and "--trust-request-chat-template" in err["message"]
    err = error(c.post("/v1/chat/completions",
                       json={**CHAT, "chat_template_kwargs": {"tokenize": True}}), 400)
    assert err["param"] == "chat_template_kwargs.tokenize"
    assert not leader.submits
    # Other template variables pass through.
    r = c.post("/v1/chat/completions", json={**CHAT,
                                             "chat_template_kwargs": {"enable_thinking": False}})
    assert r.status_code == 200, r.text


def test_trusted_request_chat_template_is_used(gateway, leader, tiny):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny("qwen3"))
    want = tok("<hi>", add_special_tokens=False).input_ids
    c = gateway(trust_request_chat_template=True)
    for body in ({"chat_template": TEMPLATE},
                 {"chat_template_kwargs": {"chat_template": TEMPLATE}}):
        r = c.post("/v1/chat/completions", json={**CHAT, **body})
        assert r.status_code == 200, r.text
        assert leader.submits[-1]["prompt_token_ids"] == want


# A few seconds of jinja loops (the CVE-2025-61620 shape, scaled down to end).
SLOW_TEMPLATE = ("{% for i in range(100000) %}{% for j in range(SLOW) %}{% set k = i * j %}"
                 "{% endfor %}{% endfor %}x")


def test_a_slow_chat_template_does_not_freeze_the_event_loop(gateway):
    """A template render that does not end until the test says so: meanwhile other
    requests are answered (each one proves the event loop is free), then it finishes.
    Rendering on the event loop would stall the first of them until the render gives up
    (60 s), and the render would then have failed."""
    c = gateway(trust_request_chat_template=True)
    assert c.get("/v1/models").status_code == 200  # info and tokenizer loaded
    assert c.post("/v1/chat/completions", json=CHAT).status_code == 200
    tok = c.app.state.gateway._tokenizer
    real_render = tok.apply_chat_template
    rendering, release = threading.Event(), threading.Event()

    def blocking_render(*args, **kwargs):
        if kwargs.get("chat_template") is not None:  # only the request's own template
            rendering.set()
            assert release.wait(60), "never released"
        return real_render(*args, **kwargs)

    tok.apply_chat_template = blocking_render
    body = {**CHAT, "chat_template": "{{ messages[0].content }}"}
    result = {}

    def slow() -> None:
        result["status"] = c.post("/v1/chat/completions", json=body).status_code

    t = threading.Thread(target=slow, daemon=True)
    t.start()
    try:
        assert rendering.wait(30), "the render never started"
        for _ in range(3):  # answered while the render is stuck
            r = c.post("/v1/completions", json=COMPLETION)
            assert r.status_code == 200
        assert not release.is_set() and t.is_alive()
    finally:
        release.set()
        t.join(60)
        tok.apply_chat_template = real_render
    assert result["status"] == 200


# ---- the API key and /health ----------------------------------------------------------------


def test_api_key_guards_every_route_but_health(gateway):
    c = gateway(api_key="sekret")
    key = {"Authorization": "Bearer sekret"}
    for method, path, kw in (("GET", "/metrics", {}), ("GET", "/v1/models", {}),
                             ("POST", "/v1/completions", {"json": COMPLETION}),
                             ("POST", "/v1/chat/completions", {"json": CHAT})):
        err = error(c.request(method, path, **kw), 401)
        assert err["code"] == "invalid_api_key"
        assert c.request(method, path, headers=key, **kw).status_code == 200, path
    r = c.get("/metrics", headers=key)
    assert "fake_leader_up 1" in r.text
    r = c.get("/health")
    assert r.status_code == 200 and r.json() == {"status": "ok"}


def test_health_says_nothing_but_the_status(gateway, leader, caplog):
    c = gateway()
    leader.ready = False
    with caplog.at_level("WARNING", logger="nvllm.gateway"):
        r = c.get("/health")
    assert r.status_code == 503 and r.json() == {"status": "unavailable"}
    assert leader.model_path not in r.text
    assert leader.model_path in caplog.text  # the reason goes to the log
