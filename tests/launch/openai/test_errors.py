"""nvllm.launch.openai.errors and schemas: request bodies that do not validate, and leader
errors, as OpenAI error objects (no leader, no HTTP)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from nvllm.common.client import ClientError
from nvllm.common.errors import EngineDeadError, RequestRejected
from nvllm.launch.openai.errors import ApiError, from_leader, from_validation
from nvllm.launch.openai.schemas import ChatBody, CompletionBody, check_body, leader_params


def invalid(model, raw: bytes) -> dict:
    with pytest.raises(ValidationError) as e:
        model.model_validate_json(raw)
    return from_validation(e.value).body()["error"]


def test_validation_errors():
    assert invalid(CompletionBody, b"{")["code"] == "invalid_json"
    e = invalid(CompletionBody, b'{"prompt": [1, "a"]}')
    assert e["param"] == "prompt" and e["message"].startswith("prompt: must be a string")
    e = invalid(CompletionBody, b'{"prompt": "x", "temperature": "0.5"}')
    assert e["param"] == "temperature" and e["code"] == "invalid_value"
    e = invalid(ChatBody, b'{"messages": [{"role": "user", "content": 5}]}')
    assert e["param"] == "messages.0.content"  # the union that failed, not just its list
    assert e["message"] == "messages.0.content: must be a string or a list of content parts"
    e = invalid(CompletionBody, b'{"prompt": "x", "structured_outputs": {"json": 5}}')
    assert e["param"] == "structured_outputs.json"
    assert e["message"] == ("structured_outputs.json: must be a JSON schema (an object or its "
                            "JSON text)")


def test_check_body_limits():
    body = CompletionBody.model_validate({"prompt": "x", "max_tokens": 9, "min_tokens": 10})
    with pytest.raises(ApiError, match=r"max_tokens is 9, more than the model's context"):
        check_body(body, 8)
    with pytest.raises(ApiError, match=r"min_tokens \(10\) is more than max_tokens \(9\)"):
        check_body(body, 100)


def test_leader_params_only_what_was_set():
    body = CompletionBody.model_validate({"prompt": "x", "stop": ["a", ""], "seed": 3})
    assert leader_params(body, None, 5) == {"n": 1, "max_tokens": 5, "seed": 3, "stop": ["a"]}
    assert leader_params(body, 2, 5)["logprobs"] == 2


def test_leader_errors():
    assert from_leader(RequestRejected("too long")).status == 400
    assert from_leader(EngineDeadError("gone")).status == 503
    e = from_leader(ClientError("invalid_request", "SamplingParams.top_k: bad"))
    assert (e.status, e.param, e.code) == (400, "top_k", "invalid_value")
    assert from_leader(ClientError("overloaded", "busy")).status == 503
    assert from_leader(ClientError("odd", "q")).body()["error"]["message"] == "leader error odd: q"
    assert from_leader(TimeoutError()).status == 504
