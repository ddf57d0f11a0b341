"""EngineServer (the client endpoint) over an LLMEngine with the fake worker group: no
worker processes. The test drives the server's loop by hand (`_drain` takes what
arrived, `_step` steps the engine and streams) and talks to it over a ZMQ DEALER, as
clients do: malformed or unknown frames get an error reply and change nothing.
"""

from __future__ import annotations

import time

import msgpack
import pytest
import zmq
from fake_workers import prompt_ids

from nvllm.leader.server import EngineServer

WAIT_MS = 5000  # generous: only a broken server ever waits this long
VERSION = 1  # of the client protocol (docs/protocol.md)


@pytest.fixture
def connected(serve_engine):
    return serve_engine()


def exchange(server, dealer, payload: bytes | dict) -> dict:
    """Send one frame, let the server take it, and return its one reply."""
    if isinstance(payload, dict):
        payload = msgpack.packb(payload, use_bin_type=True)
    dealer.send(payload)
    server._drain(WAIT_MS)
    assert dealer.poll(WAIT_MS), "no reply"
    reply = msgpack.unpackb(dealer.recv(), raw=False)
    assert not dealer.poll(0), "more than one reply"
    return reply


@pytest.mark.parametrize("payload, rid, code", [
    ({"op": "frobnicate", "id": 1}, 1, "bad_op"),
    ({"id": "no-op"}, "no-op", "bad_op"),
    ({"op": "ping", "id": 2, "v": VERSION + 1}, 2, "bad_version"),
    (b"\xc1\xc1 not msgpack", None, "bad_frame"),
    (msgpack.packb([1, 2, 3]), None, "bad_frame"),
    (msgpack.packb("submit"), None, "bad_frame"),
    ({"op": "submit", "prompt_token_ids": [100, 101]}, None, "invalid_request"),
    ({"op": "submit", "id": [1], "prompt_token_ids": [100, 101]}, None, "invalid_request"),
])
def test_a_bad_frame_gets_an_error_and_changes_nothing(connected, payload, rid, code):
    engine, server, dealer = connected
    reply = exchange(server, dealer, payload)
    assert reply["op"] == "error" and reply["code"] == code and reply["id"] == rid
    assert isinstance(reply["message"], str) and reply["message"]
    assert not engine.requests and not engine.has_unfinished_requests()


def test_the_server_still_serves_after_bad_frames(connected):
    engine, server, dealer = connected
    bad = [({"op": "frobnicate", "id": 1}, "bad_op"),
           ({"op": "ping", "id": 2, "v": 99}, "bad_version"),
           (b"\xc1garbage", "bad_frame"),
           (msgpack.packb([1, 2]), "bad_frame"),
           ({"op": "submit", "prompt_token_ids": [100, 101]}, "invalid_request")]
    for payload, code in bad:
        assert exchange(server, dealer, payload)["code"] == code
    assert exchange(server, dealer, {"op": "ping", "v": VERSION})["op"] == "pong"

    dealer.send(msgpack.packb({"op": "submit", "id": "r1", "prompt_token_ids": prompt_ids(0, 5),
                               "params": {"max_tokens": 4, "ignore_eos": True}}))
    server._drain(WAIT_MS)
    assert len(engine.requests) == 1
    msgs = []
    for _ in range(50):
        if not engine.has_unfinished_requests():
            break
        server._step()
    while dealer.poll(WAIT_MS if not msgs or msgs[-1]["finish_reason"] is None else 0):
        msgs.append(msgpack.unpackb(dealer.recv(), raw=False))
    assert [m["op"] for m in msgs] == ["output"] * 4 and {m["id"] for m in msgs} == {"r1"}
    assert [m["finish_reason"] for m in msgs] == [None, None, None, "length"]
    assert sum((m["token_ids"] for m in msgs), []) and all(len(m["token_ids"]) == 1
                                                           for m in msgs)
    assert "".join(m["text"] for m in msgs) == " the the the the"
    assert msgs[-1]["usage"] == {"prompt_tokens": 5, "completion_tokens": 4,
                                 "cached_tokens": 0}
    assert not engine.requests


@pytest.mark.parametrize("scheduling", ["sync"])  # (no engine steps involved)
def test_a_ping_flood_is_read_at_a_bounded_rate(serve_engine):
    """The server reads at most max_client_frames_per_step frames between two steps; the
    rest wait in ZMQ's queues, so a flood delays its sender, not the running streams."""
    engine, server, dealer = serve_engine(max_client_frames_per_step=8)
    for _ in range(40):
        dealer.send(msgpack.packb({"op": "ping"}))
    per_drain = []
    while sum(per_drain) < 40:
        assert len(per_drain) < 40, "pings went unanswered"
        server._drain(WAIT_MS)
        n = 0
        while dealer.poll(100):
            dealer.recv()
            n += 1
        per_drain.append(n)
    assert max(per_drain) == 8 and sum(per_drain) == 40


def test_an_exception_while_handling_a_frame_does_not_end_the_loop(connected, monkeypatch):
    engine, server, dealer = connected

    def broken(*args, **kwargs):
        raise RuntimeError("a bug reached by one frame")

    monkeypatch.setattr(server, "_submit", broken)
    err = exchange(server, dealer, {"op": "submit", "id": "x", "prompt_token_ids": [100]})
    assert err["op"] == "error" and err["code"] == "internal_error"
    monkeypatch.undo()
    assert exchange(server, dealer, {"op": "ping"})["op"] == "pong"


@pytest.mark.parametrize("scheduling", ["sync"])  # it counts engine steps
def test_a_client_that_never_reads_is_evicted_and_others_keep_streaming(make_engine,
                                                                        monkeypatch):
    """One client submits 100 streams and reads nothing: past its outbox bound it is
    evicted (requests aborted, blocks freed, later frames answered 'evicted'), while a
    reading client's stream gets a delta every step throughout."""
    from fake_workers import metric

    engine, _ = make_engine(max_client_outbox=50, max_num_seqs=128,
                            max_num_batched_tokens=2048, num_kv_blocks=4096)
    from nvllm.leader import server as server_module

    real_make_socket = server_module.make_socket

    def small_buffers(*args, **kwargs):  # (options must be set before bind)
        sock = real_make_socket(*args, **kwargs)
        sock.setsockopt(zmq.SNDHWM, 10)  # small ZMQ buffers: the bound is reached soon
        sock.setsockopt(zmq.SNDBUF, 4096)
        return sock

    monkeypatch.setattr(server_module, "make_socket", small_buffers)
    server = EngineServer(engine, host="127.0.0.1", port=0)
    ctx = zmq.Context()
    hog, good = ctx.socket(zmq.DEALER), ctx.socket(zmq.DEALER)
    for s in (hog, good):
        s.setsockopt(zmq.LINGER, 0)
    hog.setsockopt(zmq.RCVHWM, 10)
    hog.setsockopt(zmq.RCVBUF, 4096)
    try:
        hog.connect(server.endpoint)
        good.connect(server.endpoint)
        params = {"max_tokens": 60, "ignore_eos": True}
        for i in range(100):
            hog.send(msgpack.packb({"op": "submit", "id": i, "prompt_token_ids":
                                    prompt_ids(i, 4), "params": params}))
        good.send(msgpack.packb({"op": "submit", "id": "g", "prompt_token_ids":
                                 prompt_ids(500, 4), "params": params}))
        server._drain(WAIT_MS)
        while len(engine.requests) < 101:
            server._drain(WAIT_MS)
        # Sync steps, every sequence decoding: each step owes the reading client one
        # delta, and it gets it whatever the other client does.
        for step in range(60):
            server._step()
            server._drain(0)
            assert good.poll(WAIT_MS), f"no delta for the reading client at step {step}"
            m = msgpack.unpackb(good.recv(), raw=False)
            assert len(m["token_ids"]) == 1 and not good.poll(0)
        assert m["finish_reason"] == "length"
        for _ in range(10):
            if not engine.has_unfinished_requests():
                break
            server._step()
        assert metric(engine, "nvllm:clients_evicted_total") == 1
        assert not engine.requests and engine.kv.num_free_blocks == engine.kv.num_blocks
        hog.send(msgpack.packb({"op": "ping"}))
        server._drain(WAIT_MS)
        codes = []
        while hog.poll(200):
            m = msgpack.unpackb(hog.recv(), raw=False)
            codes.append(m.get("code"))
        assert codes[-1] == "evicted"
    finally:
        hog.close(0)
        good.close(0)
        ctx.term()
        server.close()


def test_a_long_text_prompt_is_tokenized_off_the_loop(connected, tokenizer, monkeypatch):
    """A prompt past INLINE_TOKENIZE_CHARS leaves the loop for a tokenizer thread: the
    frame is handled without admitting it, it is admitted once tokenized (with exactly the
    tokenizer's ids), and an abort meanwhile still ends it with its final message."""
    from nvllm.leader import server as server_module

    monkeypatch.setattr(server_module, "INLINE_TOKENIZE_CHARS", 100)  # (a tiny model)
    engine, server, dealer = connected
    text = "hello world " * 20
    assert len(text) > server_module.INLINE_TOKENIZE_CHARS
    for rid in ("long", "gone"):
        dealer.send(msgpack.packb({"op": "submit", "id": rid, "prompt": text,
                                   "params": {"max_tokens": 2, "ignore_eos": True}}))
    server._drain(WAIT_MS)
    server._drain(WAIT_MS)
    assert len(server._tokenizing) == 2 and not engine.requests  # not on the loop
    dealer.send(msgpack.packb({"op": "abort", "id": "gone"}))
    server._drain(WAIT_MS)
    deadline = time.monotonic() + 30
    while server._tokenizing:
        assert time.monotonic() < deadline
        for _, fut, _ in list(server._tokenizing.values()):
            fut.result(timeout=30)
        server._admit_tokenized()
    want = tokenizer(text).input_ids
    assert [r.prompt_token_ids for r in engine.requests.values()] == [want]
    finals = {}
    for _ in range(20):
        if not engine.has_unfinished_requests():
            break
        server._step()
    while dealer.poll(500):
        m = msgpack.unpackb(dealer.recv(), raw=False)
        if m.get("finish_reason") is not None:
            finals[m["id"]] = m["finish_reason"]
    assert finals == {"gone": "abort", "long": "length"}
    assert not engine.requests and engine.kv.num_free_blocks == engine.kv.num_blocks


def test_a_compiling_grammar_holds_back_only_its_own_request(connected, monkeypatch):
    """A constrained submit waits off the loop for its grammar while a later free one is
    admitted and finishes; once compiled it is admitted with that grammar, and a spec that
    fails to compile is that request's invalid_request."""
    from concurrent.futures import Future

    from nvllm.leader.grammar import CompiledGrammar, GrammarError

    engine, server, dealer = connected
    futures: dict[str, Future] = {}

    def get(so):
        return futures.setdefault(so.regex, Future())

    monkeypatch.setattr(engine.grammars, "get", get)
    for rid, so in (("slow", {"regex": "a+"}), ("bad", {"regex": "b("}), ("free", None)):
        params = {"max_tokens": 2} | ({"structured_outputs": so} if so else
                                     {"ignore_eos": True})
        dealer.send(msgpack.packb({"op": "submit", "id": rid, "prompt_token_ids": [5, 6],
                                   "params": params}))
        server._drain(WAIT_MS)
    assert set(server._tokenizing) and len(engine.requests) == 1  # only "free"
    for _ in range(20):
        if not engine.has_unfinished_requests():
            break
        server._step()
    futures["b("].set_exception(GrammarError("invalid structured_outputs.regex: nope"))
    futures["a+"].set_result(CompiledGrammar("regex-test", "{}"))
    server._admit_tokenized()
    assert not server._tokenizing
    (req,) = engine.requests.values()
    assert [s.grammar.key for s in req.seqs] == ["regex-test"]
    msgs = {}
    while dealer.poll(500):
        m = msgpack.unpackb(dealer.recv(), raw=False)
        msgs.setdefault(m["id"], []).append(m)
    assert msgs["free"][-1]["finish_reason"] == "length"
    assert [(m["op"], m["code"]) for m in msgs["bad"]] == [("error", "invalid_request")]
    assert "slow" not in msgs
    engine.abort_request(req.request_id)


def test_a_served_engine_is_owned_by_its_server_thread(serve_engine, tokenizer):
    """While a server serves an engine, the offline API refuses it (naming the client to
    use) and a second step overlapping the server's fails loudly: two threads stepping
    one engine would corrupt the scheduler and read each other's results."""
    import threading

    from nvllm import LLM

    engine, server, _ = serve_engine()
    stop = threading.Event()
    thread = threading.Thread(target=server.serve, args=(stop,), daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + WAIT_MS / 1000
        while engine.served_by is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert engine.served_by == server.endpoint
        llm = LLM.from_engine(engine)
        with pytest.raises(RuntimeError, match=f"served at {server.endpoint}.*nvllm.Client"):
            llm.generate("hello")
        assert not engine.requests  # refused before anything was submitted
        with pytest.raises(RuntimeError, match="already served"):
            server.serve(threading.Event())
    finally:
        stop.set()
        thread.join(10)
    assert engine.served_by is None  # the offline API works again once serving stops
    with engine._step_lock, pytest.raises(RuntimeError, match="another thread"):
        engine.step()
