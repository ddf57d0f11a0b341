"""The client wire: docs/protocol.md matches the types, messages round-trip, and every
malformed frame maps to its error code without echoing what the client sent."""

from __future__ import annotations

import dataclasses
import pathlib
import re

import msgpack
import pytest

from nvllm.common import client_protocol as cp
from nvllm.common.outputs import CompletionDelta
from nvllm.common.sampling_params import SamplingParams

DOC = pathlib.Path(__file__).resolve().parents[2] / "docs" / "protocol.md"


def _doc_tables() -> dict[str, dict[str, list[str]]]:
    """section title -> op -> the fields its row lists."""
    tables: dict[str, dict[str, list[str]]] = {}
    section = None
    for line in DOC.read_text().splitlines():
        if line.startswith("## "):
            section = line[3:].strip()
        m = re.match(r"\| `(\w+)` \|([^|]*)\|", line)
        if m and section in ("Client → leader", "Leader → client"):
            tables.setdefault(section, {})[m.group(1)] = re.findall(r"`(\w+)`", m.group(2))
    return tables


def _fields(cls: type) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)]


@pytest.mark.parametrize("section,types", [("Client → leader", cp.CLIENT_MESSAGES),
                                           ("Leader → client", cp.SERVER_MESSAGES)])
def test_the_protocol_doc_lists_every_type_and_field(section, types):
    table = _doc_tables()[section]
    assert {c.OP: _fields(c) for c in types} == table


def test_client_messages_round_trip():
    sub = cp.Submit("r1", None, [5, 6], SamplingParams(temperature=0, max_tokens=3,
                                                       stop=["x"], logit_bias={9: -2.5}),
                    priority=-2, ttl_ms=250.0)
    assert cp.decode_client_frame(cp.encode(sub)) == sub
    for msg in (cp.Abort(7), cp.InfoRequest(), cp.HealthRequest(), cp.MetricsRequest(),
                cp.Ping()):
        assert cp.decode_client_frame(cp.encode(msg)) == msg


def test_server_messages_round_trip():
    delta = CompletionDelta("r", 1, [3, 4], "ab", [{3: -0.5}, {4: -1.0}], "stop",
                            {"prompt_tokens": 2, "completion_tokens": 2, "cached_tokens": 0})
    out = cp.decode_server_frame(cp.encode(cp.Output.of(delta, "client-id")))
    assert out.to_delta() == dataclasses.replace(delta, request_id="client-id")
    info = cp.Info(1, "m", "/p", 64, 100, 512, 16, 2, True)
    for msg in (cp.Error(None, "bad_op", "x"), info, cp.Health(False, "why"),
                cp.Metrics("text"), cp.Pong()):
        assert cp.decode_server_frame(cp.encode(msg)) == msg
    assert "usage" not in msgpack.unpackb(cp.encode(cp.Output.of(
        CompletionDelta("r", 0, [1], "a"), "r")))  # only on a completion's last message
    # Prompt logprobs (on a completion's first message when asked): token-id keys survive.
    first = CompletionDelta("r", 0, [5], "x", prompt_logprobs=[None, {7: -0.25, 9: -2.5}])
    out = cp.decode_server_frame(cp.encode(cp.Output.of(first, "r")))
    assert out.to_delta() == first
    assert "prompt_logprobs" not in msgpack.unpackb(cp.encode(cp.Output.of(
        CompletionDelta("r", 0, [1], "a"), "r")))


def _pack(obj) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


SECRET = "s3cr3t-" * 20


@pytest.mark.parametrize("frame,code,rid", [
    (b"\xc1\xc1", "bad_frame", None),
    (_pack([1, 2]), "bad_frame", None),
    (_pack({"op": "submit", "id": [SECRET]}), "invalid_request", None),
    (_pack({"op": "info", "v": 2}), "bad_version", None),
    (_pack({"op": "info", "v": SECRET}), "bad_version", None),
    (_pack({"op": SECRET, "id": "a"}), "bad_op", "a"),
    (_pack({"op": ["x"] * 50}), "bad_op", None),
    (_pack({"op": "submit", "prompt": "hi"}), "invalid_request", None),
    (_pack({"op": "submit", "id": "a", "prompt": "hi", "prompt_token_ids": [1]}),
     "invalid_request", "a"),
    (_pack({"op": "submit", "id": "a", "prompt": 5}), "invalid_request", "a"),
    (_pack({"op": "submit", "id": "a", "prompt_token_ids": SECRET}), "invalid_request", "a"),
    (_pack({"op": "submit", "id": "a", "prompt_token_ids": [1.5]}), "rejected", "a"),
    (_pack({"op": "submit", "id": "a", "prompt": "x", "params": [1]}), "invalid_request", "a"),
    (_pack({"op": "submit", "id": "a", "prompt": "x", "params": {"temperature": -1}}),
     "invalid_request", "a"),
    (_pack({"op": "submit", "id": "a", "prompt": "x", "stream": 1}), "invalid_request", "a"),
    # The non-streaming mode was removed: refused, never silently streamed.
    (_pack({"op": "submit", "id": "a", "prompt": "x", "stream": False}), "invalid_request",
     "a"),
    (_pack({"op": "submit", "id": "a", "prompt": "x", "priority": 1.5}), "invalid_request",
     "a"),
    (_pack({"op": "submit", "id": "a", "prompt": "x", "ttl_ms": float("nan")}),
     "invalid_request", "a"),
    (_pack({"op": "submit", "id": "a", "prompt": "x", "ttl_ms": True}), "invalid_request",
     "a"),
])
def test_bad_frames_get_their_code_and_no_echo(frame, code, rid):
    with pytest.raises(cp.ClientProtocolError) as e:
        cp.decode_client_frame(frame)
    assert (e.value.code, e.value.request_id) == (code, rid)
    assert e.value.message and SECRET not in e.value.message


def test_clients_skip_malformed_leader_frames():
    assert cp.decode_server_frame(b"\xc1") is None
    assert cp.decode_server_frame(_pack([1])) is None
    assert cp.decode_server_frame(_pack({"op": "output", "index": "x"})) is None
    assert cp.decode_server_frame(_pack({"op": "nope"})) is None


LIMITS = cp.ClientLimits(max_model_len=64, max_request_id_bytes=32, max_prompt_bytes=256,
                         max_n=4, max_stop_strings=2, max_stop_string_chars=8,
                         max_stop_token_ids=3, max_grammar_bytes=512, max_logit_bias=8)


def _submit(**fields) -> bytes:
    return _pack({"op": "submit", "id": "a", "prompt": "x", **fields})


@pytest.mark.parametrize("frame,code,words", [
    # 1,023 nested lists in 1 KB: refused before anything formats or walks it recursively.
    (b"\x82\xa2op\xa4info\xa1v" + b"\x91" * 1023 + b"\xc0", "bad_frame", "nests at most"),
    (_pack({"op": "submit", "id": "i" * 33, "prompt": "x"}), "invalid_request", "32 bytes"),
    (_pack({"op": "submit", "id": 2**63, "prompt": "x"}), "invalid_request", "int64"),
    (_submit(prompt="p" * 257), "invalid_request", "max_prompt_bytes"),
    (_pack({"op": "submit", "id": "a", "prompt_token_ids": [1] * 65}), "rejected",
     "max_model_len is 64"),
    (_pack({"op": "submit", "id": "a", "prompt_token_ids": [2**63]}), "rejected",
     "outside the vocabulary"),
    (_submit(params={"n": 5}), "invalid_request", "max_n 4"),
    (_submit(params={"stop": ["a", "b", "c"]}), "invalid_request", "max_stop_strings 2"),
    (_submit(params={"stop": "s" * 9}), "invalid_request", "max_stop_string_chars 8"),
    (_submit(params={"stop_token_ids": [1, 2, 3, 4]}), "invalid_request",
     "max_stop_token_ids 3"),
    (_submit(params={"stop_token_ids": [2**64 - 1]}), "invalid_request", "2**63"),
    (_submit(params={"logit_bias": {i: 1.0 for i in range(9)}}), "invalid_request",
     "logit_bias has 9 entries, more than max_logit_bias 8"),
    (_submit(params={"logit_bias": {-1: 1.0}}), "invalid_request", "logit_bias: keys"),
    (_submit(params={"logit_bias": {5: 101}}), "invalid_request", "[-100, 100]"),
    (_submit(params={"logit_bias": {5: "x"}}), "invalid_request", "[-100, 100]"),
    (_submit(params={"logit_bias": [5]}), "invalid_request", "logit_bias: must be a map"),
    (_submit(priority=2**64 - 1), "invalid_request", "int64"),
    # Containers beyond msgpack's own limits never decode at all.
    (_submit(params={"stop_token_ids": [1] * 100_000}), "bad_frame", "limits"),
    (_pack({"op": "submit", "id": "a", "prompt": "x" * 10_000}), "bad_frame", "limits"),
    (_submit(params={"structured_outputs": {"regex": "a" * 513}}), "invalid_request",
     "structured_outputs.regex is 513 bytes, more than max_grammar_bytes 512"),
    (_submit(params={"structured_outputs": {"choice": ["ab"] * 300}}), "invalid_request",
     "structured_outputs.choice is 600 bytes"),
    (_submit(params={"structured_outputs": {"x" * 600: "a"}}), "invalid_request",
     "unknown field(s) a str of length 600"),
    (_submit(params={"structured_outputs": {"regex": "a", "choice": ["b"]}}),
     "invalid_request", "set exactly one of"),
    (_submit(params={"structured_outputs": {"json": "{not json"}}), "invalid_request",
     "structured_outputs.json: is not valid JSON text"),
    (_submit(params={f"k{i}": i for i in range(100)}), "bad_frame", "limits"),
    (_submit(params={"logit_bias": {i: 1.0 for i in range(100)}}), "bad_frame", "limits"),
])
def test_limits_are_checked_on_decode(frame, code, words):
    with pytest.raises(cp.ClientProtocolError) as e:
        cp.decode_client_frame(frame, LIMITS)
    assert e.value.code == code and words in e.value.message, e.value.message


def test_prompt_of_exactly_max_model_len_tokens_decodes():
    """The wire refuses only prompts over max_model_len (65 above); one of exactly 64
    tokens reaches the engine, which judges it with max_tokens."""
    sub = cp.decode_client_frame(_pack({"op": "submit", "id": "a",
                                        "prompt_token_ids": [1] * 64}), LIMITS)
    assert sub.prompt_token_ids == [1] * 64


def test_logit_bias_up_to_the_limit_decodes_with_int_keys():
    # msgpack keeps int keys (the Python clients send them so); JSON-style string keys
    # from other clients become ints too.
    for bias in ({i: 1.5 for i in range(cp.DEFAULT_LIMITS.max_logit_bias)},
                 {str(i): -1 for i in range(cp.DEFAULT_LIMITS.max_logit_bias)}):
        sub = cp.decode_client_frame(_submit(params={"logit_bias": bias}))
        assert sub.params.logit_bias == {int(k): float(v) for k, v in bias.items()}
        assert all(type(k) is int for k in sub.params.logit_bias)
    # Far past the limit (more than msgpack's map bound) it never decodes.
    with pytest.raises(cp.ClientProtocolError) as e:
        cp.decode_client_frame(_submit(params={"logit_bias": {i: 1.0 for i in range(5000)}}))
    assert e.value.code == "bad_frame"


def test_limits_follow_the_engine_config(tiny):
    from nvllm.common.config import EngineConfig

    config = EngineConfig(tiny("qwen3"), device="cpu", max_n=3, max_logit_bias=5).finalize()
    limits = cp.ClientLimits.from_config(config)
    assert limits.max_n == 3 and limits.max_model_len == config.max_model_len
    assert limits.max_logit_bias == 5
    assert limits.max_prompt_bytes == cp.PROMPT_BYTES_PER_TOKEN * config.max_model_len


def test_hostile_values_are_never_echoed():
    huge_key = "k" * 500
    for frame in (_submit(params={huge_key: 1}), _submit(params={"temperature": SECRET}),
                  _submit(params={"stop": [SECRET[:8], 5]})):
        with pytest.raises(cp.ClientProtocolError) as e:
            cp.decode_client_frame(frame)
        assert SECRET not in e.value.message and huge_key not in e.value.message
        assert len(e.value.message) < 300
