"""Every client limit, violated over a live EngineServer (fake workers, loop driven by
hand as in test_server.py): the error names the field and the limit, the engine's state
is what it was, and another client's stream carries on to its end."""

from __future__ import annotations

import msgpack
import pytest
import zmq
from fake_workers import prompt_ids

from nvllm.common.client_limits import client_limits

WAIT_MS = 5000
# Small limits, so each frame is small; every one comes from these engine options.
OPTIONS = dict(max_model_len=128, max_num_seqs=8, max_request_id_bytes=16,
               max_prompt_bytes=64, max_n=3, max_stop_strings=2, max_stop_string_chars=6,
               max_stop_token_ids=2, max_grammar_bytes=40, max_logit_bias=2)


def _submit(**fields) -> dict:
    return {"op": "submit", "id": "bad", "prompt_token_ids": [5, 6], **fields}


VIOLATIONS = [  # (frame, code, words naming the field and the limit)
    ({"op": "submit", "id": "x" * 17, "prompt_token_ids": [5]}, "invalid_request",
     "id has more than 16 bytes (max_request_id_bytes is 16)"),
    ({"op": "submit", "id": "bad", "prompt": "p" * 65}, "invalid_request",
     "prompt has more than 64 bytes (max_prompt_bytes is 64)"),
    (_submit(prompt_token_ids=[5] * 129), "rejected",
     "prompt has 129 tokens, max_model_len is 128"),
    (_submit(params={"n": 4}), "invalid_request", "params.n must be <= 3 (max_n is 3)"),
    (_submit(params={"stop": ["a", "b", "c"]}), "invalid_request",
     "params.stop has more than 2 items (max_stop_strings is 2)"),
    (_submit(params={"stop": ["abcdefg"]}), "invalid_request",
     "params.stop[0] has more than 6 characters (max_stop_string_chars is 6)"),
    (_submit(params={"stop_token_ids": [1, 2, 3]}), "invalid_request",
     "params.stop_token_ids has more than 2 items (max_stop_token_ids is 2)"),
    (_submit(params={"logit_bias": {1: 1.0, 2: 1.0, 3: 1.0}}), "invalid_request",
     "params.logit_bias has more than 2 entries (max_logit_bias is 2)"),
    (_submit(params={"structured_outputs": {"regex": "a" * 41}}), "invalid_request",
     "params.structured_outputs.regex has more than 40 bytes (max_grammar_bytes is 40)"),
    (_submit(params={"structured_outputs": {"choice": ["yes", "no"] * 5}}),
     "invalid_request", "more than max_grammar_bytes 40"),
    (_submit(priority=2**63), "invalid_request", "priority must be an integer in int64"),
    (_submit(ttl_ms=0), "invalid_request", "ttl_ms must be a positive number"),
    # The engine's own rules, from the same limits: the model's vocabulary and max_num_seqs.
    (_submit(prompt_token_ids=[5, 10**9]), "rejected", "outside the vocabulary (valid ids"),
    (_submit(params={"stop_token_ids": [10**9]}), "rejected",
     "stop_token_ids holds 1 id(s) outside the vocabulary"),
    (_submit(params={"n": 3, "max_tokens": 127}), "rejected", "exceeds max_model_len 128"),
]


def _recv(sock) -> dict:
    assert sock.poll(WAIT_MS), "no reply"
    return msgpack.unpackb(sock.recv(), raw=False, strict_map_key=False)


def test_the_limits_are_the_engine_configs(serve_engine):
    engine, server, _ = serve_engine(**OPTIONS)
    assert server.limits == client_limits(engine.config)
    assert server.limits.vocab_size == engine.vocab_size and server.limits.max_n == 3


@pytest.mark.parametrize("frame,code,words", VIOLATIONS,
                         ids=[f"{i}-{w.split()[0]}" for i, (_, _, w) in enumerate(VIOLATIONS)])
def test_a_limit_violation_is_named_and_changes_nothing(serve_engine, frame, code, words):
    engine, server, other = serve_engine(**OPTIONS)
    # Another client's request is running when the bad frame arrives.
    other.send(msgpack.packb({"op": "submit", "id": "good", "prompt_token_ids":
                              prompt_ids(0, 4), "params": {"max_tokens": 6,
                                                           "ignore_eos": True}}))
    server._drain(WAIT_MS)
    for _ in range(3):  # until its first delta is out (two steps when async)
        server._step()
        if other.poll(0):
            break
    assert _recv(other)["id"] == "good"
    before = (set(engine.requests), engine.kv.num_free_blocks,
              engine.scheduler.num_waiting_requests)

    ctx = zmq.Context()
    bad = ctx.socket(zmq.DEALER)
    bad.setsockopt(zmq.LINGER, 0)
    try:
        bad.connect(server.endpoint)
        bad.send(msgpack.packb(frame, use_bin_type=True))
        server._drain(WAIT_MS)
        reply = _recv(bad)
        assert (reply["op"], reply["code"]) == ("error", code), reply
        assert words in reply["message"], reply["message"]
        assert not bad.poll(0), "one reply only"
        after = (set(engine.requests), engine.kv.num_free_blocks,
                 engine.scheduler.num_waiting_requests)
        assert after == before
    finally:
        bad.close(0)
        ctx.term()
    msgs = []
    for _ in range(20):
        if not engine.has_unfinished_requests():
            break
        server._step()
    while other.poll(200):
        msgs.append(_recv(other))
    assert {m["id"] for m in msgs} == {"good"} and msgs[-1]["finish_reason"] == "length"
    assert not engine.requests and engine.kv.num_free_blocks == engine.kv.num_blocks
