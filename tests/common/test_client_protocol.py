"""The client wire: docs/protocol.md matches the types, messages round-trip, and every
malformed frame maps to its error code without echoing what the client sent."""

from __future__ import annotations

import dataclasses
import pathlib
import re

import msgpack
import msgspec
import pytest

from nvllm.common import client_protocol as cp
from nvllm.common.client_decode import decode_client_frame
from nvllm.common.client_limits import (
    PROMPT_BYTES_PER_TOKEN,
    ClientLimits,
    client_limits,
    default_limits,
)
from nvllm.common.outputs import CompletionDelta
from nvllm.common.sampling_params import SamplingParams

DOC = pathlib.Path(__file__).resolve().parents[2] / "docs" / "protocol.md"


def _doc_tables() -> dict[str, dict[str, list[str]]]:
    """section title -> op -> the fields its row lists."""
    tables: dict[str, dict[str, list[str]]] = {}
    section = None
    for line in DOC.read_text().splitlines():
        if line.startswith("#"):
            section = line.lstrip("#").strip()
        m = re.match(r"\| `(\w+)` \|([^|]*)\|", line)
        if m and section in ("Client → leader", "Leader → client"):
            tables.setdefault(section, {})[m.group(1)] = re.findall(r"`(\w+)`", m.group(2))
    return tables


def _fields(cls: type) -> list[str]:
    # `v`, the protocol version every client message carries, is the envelope's.
    return [f.name for f in msgspec.structs.fields(cls)
            if not (f.name == "v" and issubclass(cls, cp.ClientMessage))]


@pytest.mark.parametrize("section,types", [("Client → leader", cp.CLIENT_MESSAGES),
                                           ("Leader → client", cp.SERVER_MESSAGES)])
def test_the_protocol_doc_lists_every_type_and_field(section, types):
    table = _doc_tables()[section]
    assert {c.OP: _fields(c) for c in types} == table


def _params_table() -> list[str]:
    """The fields docs/protocol.md's sampling-parameter table lists, in order."""
    text = DOC.read_text()
    table = text[text.index("### Sampling parameters (`params`)"):]
    table = table[:table.index("\n## ")]
    return re.findall(r"^\| `(\w+)` \|", table, re.M)


def _wire_params_fields() -> list[str]:
    """The fields of the struct the leader decodes `params` into."""
    from nvllm.common.client_decode import _types

    submit = _types(default_limits())[1]
    (params_type,) = [f.type for f in msgspec.structs.fields(submit) if f.name == "params"]
    struct = next(t for t in params_type.__args__ if t is not type(None))
    return [f.name for f in msgspec.structs.fields(struct)]


def test_the_protocol_doc_lists_every_sampling_parameter():
    """A field added to SamplingParams (or to the wire's params) without its row in
    docs/protocol.md fails here, as does a row for a field that is gone."""
    client_fields = [f.name for f in dataclasses.fields(SamplingParams)
                     if f.name != "eos_token_ids"]  # the engine fills it, never a client
    assert _params_table() == client_fields == _wire_params_fields()


def test_the_decoders_submit_has_the_submit_messages_fields():
    from nvllm.common.client_decode import _types

    wire = [f.name for f in msgspec.structs.fields(_types(default_limits())[1])]
    assert sorted(set(wire) - {"stream"}) == sorted(_fields(cp.Submit) + ["v"])


def test_client_messages_round_trip():
    sub = cp.Submit("r1", None, [5, 6], SamplingParams(temperature=0, max_tokens=3,
                                                       stop=["x"], logit_bias={9: -2.5}),
                    priority=-2, ttl_ms=250.0)
    assert decode_client_frame(cp.encode(sub)) == sub
    for msg in (cp.Abort(7), cp.InfoRequest(), cp.HealthRequest(), cp.MetricsRequest(),
                cp.Ping()):
        assert decode_client_frame(cp.encode(msg)) == msg


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
        decode_client_frame(frame)
    assert (e.value.code, e.value.request_id) == (code, rid)
    assert e.value.message and SECRET not in e.value.message


def test_clients_skip_malformed_leader_frames():
    assert cp.decode_server_frame(b"\xc1") is None
    assert cp.decode_server_frame(_pack([1])) is None
    assert cp.decode_server_frame(_pack({"op": "output", "index": "x"})) is None
    assert cp.decode_server_frame(_pack({"op": "nope"})) is None


LIMITS = ClientLimits(max_model_len=64, vocab_size=None, max_num_seqs=256,
                      max_request_id_bytes=32, max_prompt_bytes=256, max_n=4,
                      max_stop_strings=2, max_stop_string_chars=8, max_stop_token_ids=3,
                      max_grammar_bytes=512, max_logit_bias=8)


def _submit(**fields) -> bytes:
    return _pack({"op": "submit", "id": "a", "prompt": "x", **fields})


# Each limit's violation: the code, and words naming the field and the limit.
@pytest.mark.parametrize("frame,code,words", [
    # 1,023 nested lists in 1 KB: refused inside the decoder, before any Python walks it.
    (b"\x82\xa2op\xa4info\xa1x" + b"\x91" * 1023 + b"\xc0", "bad_frame", "nests too deeply"),
    (b"\x82\xa2op\xa4info\xa1v" + b"\x91" * 1023 + b"\xc0", "bad_frame", "nests too deeply"),
    (b"\x82\xa2op\xa4info\xa1v" + b"\x91" * 100 + b"\xc0", "bad_version", "version must be 1"),
    # A map, then bytes after it (a pickle starts so): not one msgpack value.
    (b"\x80\x04garbage", "bad_frame", "not valid msgpack"),
    (_pack({"op": "submit", "id": "i" * 33, "prompt": "x"}), "invalid_request",
     "id has more than 32 bytes (max_request_id_bytes is 32)"),
    (_pack({"op": "submit", "id": "é" * 20, "prompt": "x"}), "invalid_request",
     "id is 40 bytes, more than max_request_id_bytes 32"),
    (_pack({"op": "submit", "id": 2**63, "prompt": "x"}), "invalid_request", "id must be an "
     "integer in int64"),
    (_submit(prompt="p" * 257), "invalid_request",
     "prompt has more than 256 bytes (max_prompt_bytes is 256)"),
    (_submit(prompt="é" * 200), "invalid_request",
     "prompt is 400 bytes, more than max_prompt_bytes 256"),
    (_pack({"op": "submit", "id": "a", "prompt_token_ids": [1] * 65}), "rejected",
     "prompt has 65 tokens, max_model_len is 64"),
    (_pack({"op": "submit", "id": "a", "prompt_token_ids": [1] * 300}), "rejected",
     "prompt has 300 tokens, max_model_len is 64"),
    (_pack({"op": "submit", "id": "a", "prompt_token_ids": [1] * 70_000}), "rejected",
     "prompt has 70000 tokens, max_model_len is 64"),
    (_pack({"op": "submit", "id": "a", "prompt_token_ids": [2**63]}), "rejected",
     "prompt_token_ids[0] is outside the vocabulary"),
    (_pack({"op": "submit", "id": "a", "prompt_token_ids": [1, -1]}), "rejected",
     "prompt_token_ids[1] is outside the vocabulary"),
    (_submit(params={"n": 5}), "invalid_request", "params.n must be <= 4 (max_n is 4)"),
    (_submit(params={"stop": ["a", "b", "c"]}), "invalid_request",
     "params.stop has more than 2 items (max_stop_strings is 2)"),
    (_submit(params={"stop": "s" * 9}), "invalid_request",
     "params.stop has more than 8 characters (max_stop_string_chars is 8)"),
    (_submit(params={"stop": ["a", "s" * 9]}), "invalid_request",
     "params.stop[1] has more than 8 characters (max_stop_string_chars is 8)"),
    (_submit(params={"stop_token_ids": [1, 2, 3, 4]}), "invalid_request",
     "params.stop_token_ids has more than 3 items (max_stop_token_ids is 3)"),
    (_submit(params={"stop_token_ids": [2**64 - 1]}), "invalid_request", "2**63"),
    (_submit(params={"logit_bias": {i: 1.0 for i in range(9)}}), "invalid_request",
     "params.logit_bias has more than 8 entries (max_logit_bias is 8)"),
    (_submit(params={"logit_bias": {-1: 1.0}}), "invalid_request", "logit_bias: keys"),
    (_submit(params={"logit_bias": {5: 101}}), "invalid_request", "[-100, 100]"),
    (_submit(params={"logit_bias": {5: "x"}}), "invalid_request",
     "params.logit_bias[...] must be a number"),
    (_submit(params={"logit_bias": [5]}), "invalid_request", "params.logit_bias must be a map"),
    (_submit(priority=2**64 - 1), "invalid_request", "int64"),
    (_submit(priority=2**63), "invalid_request", "int64"),
    # Far past a limit, a list is refused from its header: never built.
    (_submit(params={"stop_token_ids": [1] * 100_000}), "invalid_request",
     "params.stop_token_ids has more than 3 items"),
    (_pack({"op": "submit", "id": "a", "prompt": "x" * 10_000}), "invalid_request",
     "max_prompt_bytes is 256"),
    (_submit(params={"structured_outputs": {"regex": "a" * 513}}), "invalid_request",
     "params.structured_outputs.regex has more than 512 bytes (max_grammar_bytes is 512)"),
    (_submit(params={"structured_outputs": {"regex": "é" * 300}}), "invalid_request",
     "params.structured_outputs.regex is 600 bytes, more than max_grammar_bytes 512"),
    (_submit(params={"structured_outputs": {"choice": ["ab"] * 300}}), "invalid_request",
     "params.structured_outputs.choice is 1800 bytes, more than max_grammar_bytes 512"),
    (_submit(params={"structured_outputs": {"x" * 600: "a"}}), "invalid_request",
     "structured_outputs: unknown field (its name is not shown)"),
    (_submit(params={"structured_outputs": {"regex": "a", "choice": ["b"]}}),
     "invalid_request", "set exactly one of"),
    (_submit(params={"structured_outputs": {"json": "{not json"}}), "invalid_request",
     "structured_outputs.json: is not valid JSON text"),
    (_submit(params={"best_of": 2}), "invalid_request", "unknown sampling parameter 'best_of'"),
    (_submit(params={5: 1}), "invalid_request", "params: keys must be a string"),
    (_submit(params={"temperature": "hot"}), "invalid_request",
     "params.temperature must be a number, not a string"),
    (_submit(params={"top_p": 0}), "invalid_request", "SamplingParams.top_p: must be in (0, 1]"),
    (_pack({"op": "abort"}), "invalid_request", "'id' is required"),
])
def test_limits_are_checked_on_decode(frame, code, words):
    with pytest.raises(cp.ClientProtocolError) as e:
        decode_client_frame(frame, LIMITS)
    assert e.value.code == code and words in e.value.message, e.value.message


def test_prompt_of_exactly_max_model_len_tokens_decodes():
    """The wire refuses only prompts over max_model_len (65 above); one of exactly 64
    tokens reaches the engine, which judges it with max_tokens."""
    sub = decode_client_frame(_pack({"op": "submit", "id": "a",
                                     "prompt_token_ids": [1] * 64}), LIMITS)
    assert sub.prompt_token_ids == [1] * 64


def test_every_limit_at_its_bound_decodes():
    sub = decode_client_frame(_pack({
        "op": "submit", "id": "i" * 32, "prompt": "p" * 256,
        "params": {"n": 4, "stop": ["s" * 8] * 2, "stop_token_ids": [1, 2, 3],
                   "logit_bias": {i: 1.0 for i in range(8)},
                   "structured_outputs": {"regex": "a" * 512}},
        "priority": 2**63 - 1, "ttl_ms": 1e300}), LIMITS)
    assert sub.params.n == 4 and sub.params.stop == ["s" * 8] * 2 and sub.ttl_ms == 1e300


def test_logit_bias_up_to_the_limit_decodes_with_int_keys():
    # msgpack keeps int keys (the Python clients send them so); JSON-style string keys
    # from other clients become ints too.
    for bias in ({i: 1.5 for i in range(default_limits().max_logit_bias)},
                 {str(i): -1 for i in range(default_limits().max_logit_bias)}):
        sub = decode_client_frame(_submit(params={"logit_bias": bias}))
        assert sub.params.logit_bias == {int(k): float(v) for k, v in bias.items()}
        assert all(type(k) is int for k in sub.params.logit_bias)
    with pytest.raises(cp.ClientProtocolError) as e:
        decode_client_frame(_submit(params={"logit_bias": {i: 1.0 for i in range(5000)}}))
    assert e.value.code == "invalid_request" and "(max_logit_bias is 1024)" in e.value.message


def test_limits_follow_the_engine_config(tiny):
    from nvllm.common.config import EngineConfig

    config = EngineConfig(tiny("qwen3"), device="cpu", max_n=3, max_logit_bias=5,
                          max_num_seqs=7).finalize()
    limits = client_limits(config)
    assert limits.max_n == 3 and limits.max_model_len == config.max_model_len
    assert limits.max_logit_bias == 5 and limits.max_num_seqs == 7
    assert limits.vocab_size == config.model_info.vocab_size
    assert limits.max_prompt_bytes == PROMPT_BYTES_PER_TOKEN * config.max_model_len
    with pytest.raises(cp.ClientProtocolError, match=r"params.n must be <= 3 \(max_n is 3\)"):
        decode_client_frame(_submit(params={"n": 4}), limits)


def test_limits_have_no_defaults_of_their_own():
    """EngineConfig's defaults are the only ones: ClientLimits repeats none."""
    from nvllm.common.config import EngineConfig

    assert all(f.default is dataclasses.MISSING for f in dataclasses.fields(ClientLimits))
    bare = EngineConfig(model="")
    for f in dataclasses.fields(ClientLimits):
        if f.name in EngineConfig.__dataclass_fields__ and f.name not in (
                "max_model_len", "max_prompt_bytes"):
            assert getattr(default_limits(), f.name) == getattr(bare, f.name), f.name


def test_hostile_values_are_never_echoed():
    huge_key = "k" * 500
    for frame in (_submit(params={huge_key: 1}), _submit(params={"temperature": SECRET}),
                  _submit(params={"stop": [SECRET[:8], 5]})):
        with pytest.raises(cp.ClientProtocolError) as e:
            decode_client_frame(frame)
        assert SECRET not in e.value.message and huge_key not in e.value.message
        assert len(e.value.message) < 300


def _chunk(**kw) -> bytes:
    msg = {"op": "weights_chunk", "v": 1, "chunk": 0, "names": ["model.norm.weight"],
           "dtypes": ["bfloat16"], "refs": [[1, "uint16", [64], "nvllm-tr-7-0123456789ab",
                                             0, 3]]}
    return msgpack.packb({**msg, **kw})


def test_rl_messages_round_trip():
    for msg in (cp.PauseGeneration(mode="keep", clear_cache=False), cp.ResumeGeneration(),
                cp.WeightsCommit(weight_version="step-3"), cp.WeightsCommit(weight_version=7),
                cp.WeightsAbort()):
        assert decode_client_frame(cp.encode(msg)) == msg
    got = decode_client_frame(_chunk())
    assert isinstance(got, cp.WeightsChunk) and got.refs[0][3] == "nvllm-tr-7-0123456789ab"
    for msg in (cp.Paused("wait"), cp.Resumed(), cp.WeightsStaged(4),
                cp.WeightsCommitted("v"), cp.WeightsAborted()):
        assert cp.decode_server_frame(cp.encode(msg)) == msg
    out = cp.decode_server_frame(cp.encode(cp.Output.of(
        CompletionDelta("r", 0, [1], "a", weight_version=3), "r")))
    assert out.to_delta().weight_version == 3


@pytest.mark.parametrize("frame,words", [
    (msgpack.packb({"op": "pause", "mode": "later"}), "mode"),
    (_chunk(names=["x" * 257]), "names[0] has more than 256"),
    (_chunk(names=["a"] * 4097, dtypes=["float32"] * 4097, refs=[[0, "float32", [0], b""]] * 4097),
     "names has more than 4096"),
    (_chunk(dtypes=["int8"]), "dtypes[0]"),
    (_chunk(dtypes=["float32"]), "travels as float32, not uint16"),
    (_chunk(names=["a", "b"]), "one entry each"),
    (_chunk(refs=[[1, "uint16", [64], "/dev/shm/other", 0, 3]]), "not an nvllm transport buffer"),
    (_chunk(refs=[[1, "uint16", [1 << 31, 4], "nvllm-tr-7-0123456789ab", 0, 3]]),
     "over 4294967296 bytes"),
    (msgpack.packb({"op": "weights_commit", "weight_version": "v" * 300}), "weight_version"),
])
def test_rl_messages_are_bounded_on_decode(frame, words):
    with pytest.raises(cp.ClientProtocolError) as e:
        decode_client_frame(frame)
    assert e.value.code == "invalid_request" and words in e.value.message, e.value.message
