"""Property-based fuzzing of the gateway's HTTP bodies (FastAPI's TestClient on
create_app, a fake leader): random JSON bodies for /v1/completions and
/v1/chat/completions (real field names with wrong types and ranges, huge integers, deep
nesting, random keys and strings, raw non-JSON). Every answer is 200 or a 4xx carrying an
OpenAI error object, never a 5xx, and the app still serves a normal request after each.
Fixed seed (``derandomize``): a failure reproduces."""

from __future__ import annotations

import json

import pytest
from fake_leader import FakeLeader
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

COMPLETION = {"prompt": "hi", "max_tokens": 2}
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
SAMPLING = ["model", "temperature", "top_p", "top_k", "min_p", "max_tokens",
            "max_completion_tokens", "stop", "seed", "n", "presence_penalty",
            "frequency_penalty", "stream", "stream_options", "ignore_eos", "min_tokens",
            "repetition_penalty", "priority", "ttl_ms", "stop_token_ids",
            "include_stop_str_in_output", "skip_special_tokens", "user", "logit_bias",
            "best_of", "echo", "suffix", "response_format", "tools", "metadata"]
FIELDS = {"/v1/completions": SAMPLING + ["prompt", "logprobs"],
          "/v1/chat/completions": SAMPLING + ["messages", "logprobs", "top_logprobs",
                                              "add_generation_prompt", "chat_template",
                                              "chat_template_kwargs"]}

huge = st.one_of(st.integers(), st.sampled_from([2**31, 2**63, 2**64 + 5, -(2**63) - 1,
                                                 10**30, -(10**30)]))
numbers = st.one_of(st.integers(-3, 300), huge,
                    st.floats(allow_nan=False, allow_infinity=False),
                    st.sampled_from([0.0, -0.0, 1e308, -1e308, 5e-324, 0.5, 2.0001]))
leaves = st.one_of(st.none(), st.booleans(), numbers, st.text(max_size=30))
values = st.recursive(leaves, lambda kids: st.one_of(
    st.lists(kids, max_size=5), st.dictionaries(st.text(max_size=8), kids, max_size=5)),
    max_leaves=25)
messages = st.lists(st.fixed_dictionaries(
    {"role": st.one_of(st.sampled_from(["user", "assistant", "system", "tool"]),
                       st.text(max_size=8)),
     "content": st.one_of(st.text(max_size=40), st.none(),
                          st.lists(st.fixed_dictionaries(
                              {"type": st.sampled_from(["text", "image_url", "x"]),
                               "text": st.one_of(st.text(max_size=20), values)}),
                              max_size=3), values)},
    optional={"name": st.one_of(st.text(max_size=8), values)}), min_size=0, max_size=4)
good = {  # values that are in range, so that other fields' errors can show
    "prompt": st.one_of(st.text(max_size=40), st.lists(st.integers(0, 1000), max_size=8),
                        st.lists(st.text(max_size=8), min_size=1, max_size=3),
                        st.lists(st.lists(st.integers(0, 1000), min_size=1, max_size=4),
                                 min_size=1, max_size=3)),
    "messages": messages, "max_tokens": st.integers(1, 4), "n": st.integers(1, 3),
    "temperature": st.floats(0, 2), "stream": st.booleans(),
    "stop": st.one_of(st.text(max_size=5), st.lists(st.text(max_size=5), max_size=3)),
    "stop_token_ids": st.lists(st.integers(0, 1000), max_size=3),
    "logprobs": st.one_of(st.integers(0, 5), st.booleans()), "top_logprobs": st.integers(0, 5),
    "seed": st.integers(0, 2**63 - 1), "ignore_eos": st.booleans(),
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans()}),
}


@st.composite
def bodies(draw, route: str):
    """A valid body, then real fields given good or wrong values, maybe junk keys."""
    body = dict(COMPLETION if route == "/v1/completions" else CHAT)
    for name in draw(st.lists(st.sampled_from(FIELDS[route]), max_size=5, unique=True)):
        wrong = draw(st.one_of(leaves, values, huge))
        body[name] = draw(good[name]) if name in good and draw(st.booleans()) else wrong
    if draw(st.integers(0, 5)) == 0:
        body.update(draw(st.dictionaries(st.text(max_size=8), values, max_size=2)))
    if draw(st.integers(0, 9)) == 0:
        body = draw(values)  # not even a map
    return body


def _deep(depth: int, opener: str) -> bytes:
    closer = {"[": "]", "{\"a\":": "}"}[opener]
    return (f'{{"prompt": {opener * depth}1{closer * depth}, "max_tokens": 1}}').encode()


raw_bodies = st.one_of(
    st.binary(max_size=100),
    st.text(max_size=100).map(str.encode),
    st.builds(_deep, st.integers(1, 3000), st.sampled_from(["[", "{\"a\":"])),
    st.sampled_from([b"", b"{", b'{"prompt": NaN}', b'{"prompt": "x", "n": Infinity}',
                     b'{"prompt": "\\ud800"}', b"\xff\xfe{}", b"null", b"[]",
                     b'{"prompt": "x", "prompt": 5}',
                     b'{"prompt": [' + b"9" * 5000 + b"]}"]))


@pytest.fixture
def app(tiny):
    from fastapi.testclient import TestClient

    from nvllm.launch.openai.app import GatewayConfig, create_app

    leader = FakeLeader(tiny("qwen3"))
    client = TestClient(create_app(GatewayConfig(leader.endpoint, "fake")),
                        raise_server_exceptions=False)
    client.__enter__()
    assert client.post("/v1/completions", json=COMPLETION).status_code == 200  # warm
    yield client
    client.__exit__(None, None, None)
    leader.close()


def check(r) -> None:
    """200, or a 4xx with an OpenAI error object; never a 5xx."""
    if r.status_code == 200:
        if r.headers["content-type"].startswith("text/event-stream"):
            assert r.text.rstrip().endswith("data: [DONE]"), r.text[-300:]
            assert '"error"' not in r.text, r.text[-300:]
        else:
            assert r.json()["choices"], r.text
        return
    assert 400 <= r.status_code < 500, (r.status_code, r.text[:500])
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"]


def still_serves(client) -> None:
    r = client.post("/v1/completions", json=COMPLETION)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "x", r.text


FUZZ = settings(derandomize=True, deadline=None, max_examples=400,
                suppress_health_check=[HealthCheck.function_scoped_fixture,
                                       HealthCheck.too_slow])


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
@FUZZ
@given(data=st.data())
def test_random_json_bodies_get_200_or_an_openai_4xx(app, route, data):
    body = data.draw(bodies(route))
    try:
        payload = json.dumps(body).encode()
    except ValueError:  # too deep for json.dumps: send it raw
        return
    check(app.post(route, content=payload, headers={"content-type": "application/json"}))
    still_serves(app)


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
@settings(FUZZ, max_examples=150)
@given(raw=raw_bodies)
def test_raw_bodies_get_200_or_an_openai_4xx(app, route, raw):
    check(app.post(route, content=raw, headers={"content-type": "application/json"}))
    still_serves(app)
