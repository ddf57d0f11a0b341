"""tokenize / detokenize over the client wire (nvllm/leader/tokenize_control.py), through
EngineServer with the fake worker group: answers are the engine tokenizer's own, long
work leaves the loop, and every bad field or tokenizer failure is answered for that
message alone."""

from __future__ import annotations

import time

import msgpack
import pytest

WAIT_MS = 5000


def ask(server, dealer, msg: dict) -> dict:
    dealer.send(msgpack.packb(msg, use_bin_type=True))
    server._drain(WAIT_MS)
    assert dealer.poll(WAIT_MS), "no reply"
    reply = msgpack.unpackb(dealer.recv(), raw=False)
    assert not dealer.poll(0), "more than one reply"
    return reply


@pytest.fixture
def connected(serve_engine):
    return serve_engine()


def test_tokenize_and_detokenize_answer_with_the_engines_tokenizer(connected, tokenizer):
    engine, server, dealer = connected
    text = "Hello world, how are you?"
    got = ask(server, dealer, {"op": "tokenize", "id": "t1", "prompt": text})
    assert got == {"op": "tokenize", "id": "t1", "token_ids": tokenizer(text).input_ids,
                   "token_strs": None}
    got = ask(server, dealer, {"op": "tokenize", "id": 7, "prompt": text,
                               "add_special_tokens": False, "return_token_strs": True})
    ids = tokenizer(text, add_special_tokens=False).input_ids
    assert got["id"] == 7 and got["token_ids"] == ids
    assert got["token_strs"] == tokenizer.convert_ids_to_tokens(ids)
    got = ask(server, dealer, {"op": "detokenize", "id": "d", "token_ids": ids})
    assert got == {"op": "detokenize", "id": "d", "text": tokenizer.decode(ids)}
    assert not engine.requests and not engine.has_unfinished_requests()


def test_long_texts_are_tokenized_off_the_loop(connected, tokenizer):
    engine, server, dealer = connected
    server.tokenize.inline_chars = 50  # (a tiny model's prompts are short)
    text = "hello world " * 20
    dealer.send(msgpack.packb({"op": "tokenize", "id": "long", "prompt": text}))
    dealer.send(msgpack.packb({"op": "detokenize", "id": "ids", "token_ids": [100] * 30}))
    server._drain(WAIT_MS)
    server._drain(WAIT_MS)
    assert server.tokenize.pending == 2  # handed off, not answered on the loop
    replies = {}
    deadline = time.monotonic() + 30
    while len(replies) < 2:
        assert time.monotonic() < deadline, "never answered"
        server.tokenize.poll()
        if dealer.poll(20):
            m = msgpack.unpackb(dealer.recv(), raw=False)
            replies[m["id"]] = m
    assert replies["long"]["token_ids"] == tokenizer(text).input_ids
    assert replies["ids"]["text"] == tokenizer.decode([100] * 30)
    assert server.tokenize.pending == 0


@pytest.mark.parametrize("msg, field", [
    ({"op": "detokenize", "id": "x", "token_ids": [1, 10**9]}, "token_ids[1]"),
    ({"op": "detokenize", "id": "x", "token_ids": [-1]}, "token_ids[0]"),
    ({"op": "detokenize", "id": "x", "token_ids": [1] * 100_000}, "max_model_len"),
    ({"op": "tokenize", "id": "x", "prompt": "a" * 10_000_000}, "max_prompt_bytes"),
    ({"op": "tokenize", "id": "x", "prompt": 5}, "prompt"),
    ({"op": "tokenize", "id": "x"}, "prompt"),
])
def test_a_bad_field_is_refused_naming_it(connected, msg, field):
    engine, server, dealer = connected
    got = ask(server, dealer, msg)
    assert got["op"] == "error" and got["code"] == "invalid_request" and got["id"] == "x"
    assert field in got["message"]
    assert not engine.requests and server.tokenize.pending == 0


def test_no_tokenizer_or_a_failing_one_is_answered_and_the_server_goes_on(connected,
                                                                          tokenizer):
    engine, server, dealer = connected

    class Broken:
        def __call__(self, *a, **k):
            raise RuntimeError("boom")

        decode = __call__

    engine.tokenizer = Broken()
    got = ask(server, dealer, {"op": "tokenize", "id": 1, "prompt": "hi"})
    assert (got["op"], got["code"], got["id"]) == ("error", "rejected", 1)
    engine.tokenizer = None
    got = ask(server, dealer, {"op": "detokenize", "id": 2, "token_ids": [1]})
    assert (got["op"], got["code"], got["id"]) == ("error", "rejected", 2)
    assert "prompt_token_ids" in got["message"]
    engine.tokenizer = tokenizer
    got = ask(server, dealer, {"op": "tokenize", "id": 3, "prompt": "hi"})
    assert got["token_ids"] == tokenizer("hi").input_ids


def test_the_clients_tokenize_and_detokenize(connected, tokenizer):
    import asyncio
    import threading

    from nvllm.common.client import AsyncClient, Client

    engine, server, _ = connected
    stop = threading.Event()
    loop = threading.Thread(target=server.serve, args=(stop,), daemon=True)
    loop.start()
    try:
        ids = tokenizer("hello there").input_ids
        with Client(server.endpoint, timeout_s=30) as c:
            got = c.tokenize("hello there", return_token_strs=True)
            assert got["token_ids"] == ids
            assert got["token_strs"] == tokenizer.convert_ids_to_tokens(ids)
            assert c.detokenize(ids) == tokenizer.decode(ids)

        async def run() -> tuple:
            ac = AsyncClient(server.endpoint, timeout_s=30)
            try:
                return await asyncio.gather(ac.tokenize("hello there"), ac.detokenize(ids))
            finally:
                ac.close()

        tok, text = asyncio.run(run())
        assert tok["token_ids"] == ids and text == tokenizer.decode(ids)
    finally:
        stop.set()
        loop.join(30)
    assert not loop.is_alive()
