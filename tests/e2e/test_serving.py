"""Clients attached over ZMQ (protocol v1): streaming, abort, TTL, priorities, overload,
client disconnect, and a load of 200 concurrent streams checked against offline output."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import msgpack
import pytest
from raw_client import RawClient
from served import serve, teardown, wait_idle
from zmq.utils.monitor import recv_monitor_message

from nvllm import LLM, SamplingParams
from nvllm.common.errors import RequestRejected
from nvllm.leader.server import MAX_FRAME_BYTES, EngineServer

pytestmark = pytest.mark.e2e

GREEDY = {"temperature": 0.0, "max_tokens": 16, "ignore_eos": True}


@pytest.fixture(scope="module")
def served(tiny):
    llm = LLM(tiny("qwen3"), device="cpu", dtype="float32", max_num_seqs=64,
              client_timeout_s=2.0)
    s = serve(llm)
    yield s
    teardown(s)


@pytest.fixture(scope="module")
def one_at_a_time(tiny):
    """An engine that runs one sequence at a time and queues at most 3."""
    llm = LLM(tiny("qwen3"), device="cpu", dtype="float32", max_num_seqs=1,
              max_queued_requests=3)
    s = serve(llm)
    yield s
    teardown(s)


def offline(tiny, prompts, params=GREEDY):
    with LLM(tiny("qwen3"), device="cpu", dtype="float32") as llm:
        outs = llm.generate(prompts, SamplingParams(**params), use_tqdm=False)
    return [(o.token_ids, o.text) for o in outs]


def test_stream_deltas_add_up_to_the_offline_output(served, tiny):
    prompts = ["The capital of France is", "naïve café — 東京 ✓"]
    ref = offline(tiny, prompts)
    with RawClient(served.endpoint, timeout_s=60) as c:
        assert c.info()["ready"] and c.health()["ready"]
        for prompt, (ref_ids, ref_text) in zip(prompts, ref):
            deltas = list(c.stream(prompt, GREEDY))
            assert all(len(d.token_ids) == 1 for d in deltas)
            assert [t for d in deltas for t in d.token_ids] == ref_ids
            assert "".join(d.text for d in deltas) == ref_text
            assert [d.finish_reason for d in deltas][-1] == "length"
            assert all(d.finish_reason is None for d in deltas[:-1])
            assert deltas[-1].usage["completion_tokens"] == 16
    wait_idle(served.llm)


def test_stop_string_never_leaks_into_the_stream(served):
    with RawClient(served.endpoint, timeout_s=60) as c:
        full = c.generate("Once upon a time", GREEDY).text
        assert len(full) > 8
        stop = full[4:7]
        deltas = list(c.stream("Once upon a time", {**GREEDY, "stop": [stop]}))
    text = "".join(d.text for d in deltas)
    assert text == full[:full.index(stop)]
    assert deltas[-1].finish_reason == "stop"


def test_abort_mid_stream_frees_blocks(served):
    with RawClient(served.endpoint, timeout_s=60) as c:
        stream = c.stream("Tell me a long story", {**GREEDY, "max_tokens": 500})
        got = [next(stream) for _ in range(3)]
        assert all(d.finish_reason is None for d in got)
        stream.close()  # leaving the generator sends an abort
        wait_idle(served.llm)
        # An explicit abort by id also ends the request with finish_reason "abort".
        c.send_map({"op": "submit", "id": "y", "prompt": "Hi", "params": {**GREEDY,
                                                                        "max_tokens": 500}})
        assert c.wait_map("y", ())["finish_reason"] is None
        c.abort("y")
        while (m := c.wait_map("y", ()))["finish_reason"] is None:
            pass
        assert m["finish_reason"] == "abort"
    wait_idle(served.llm)


def test_ttl_expires_while_running(served):
    with RawClient(served.endpoint, timeout_s=60) as c:
        t0 = time.monotonic()
        out = c.generate("Tell me a long story", {**GREEDY, "max_tokens": 1000},
                         ttl_ms=400)
    assert out.finish_reason == "timeout"
    assert 0 < len(out.token_ids) < 1000
    assert time.monotonic() - t0 < 5
    wait_idle(served.llm)


def test_ttl_expires_while_waiting_and_priorities_order_admission(one_at_a_time):
    ep = one_at_a_time.endpoint
    with RawClient(ep, timeout_s=60) as c:
        long = {**GREEDY, "max_tokens": 1000}  # far longer than late's 200 ms TTL
        c.send_map({"op": "submit", "id": "A", "prompt": "First", "params": long})
        assert c.wait_map("A", ())["finish_reason"] is None  # A runs; the rest must wait
        c.send_map({"op": "submit", "id": "late", "prompt": "x", "params": GREEDY,
                 "ttl_ms": 200})
        c.send_map({"op": "submit", "id": "B", "prompt": "y", "params": GREEDY, "priority": 5})
        c.send_map({"op": "submit", "id": "C", "prompt": "z", "params": GREEDY, "priority": 0})
        # The queue holds 3 (late, B, C): one more is refused at once.
        c.send_map({"op": "submit", "id": "D", "prompt": "w", "params": GREEDY})
        err = c.wait_map("D", ())
        assert err["op"] == "error" and err["code"] == "overloaded"
        assert "max_queued_requests=3" in err["message"]
        late = c.wait_map("late", ())
        assert late["finish_reason"] == "timeout" and late["token_ids"] == []
        finish_order = []
        pending = {"A", "B", "C"}
        while pending:
            msg = c.recv_map(time.monotonic() + 60)
            if msg.get("finish_reason") is not None:
                finish_order.append(msg["id"])
                pending.discard(msg["id"])
    assert finish_order == ["A", "C", "B"]
    wait_idle(one_at_a_time.llm)


def test_rejections_and_bad_frames_are_answered(served):
    with RawClient(served.endpoint, timeout_s=60) as c:
        with pytest.raises(RequestRejected, match="max_model_len is 1024"):
            c.generate([5] * 2000, GREEDY)
        with pytest.raises(Exception, match="temperature"):
            c.generate("hi", {"temperature": -1})
        c._sock.send(b"\xc1\xc1 not msgpack")
        assert c.wait_map(None, ("error",))["code"] == "bad_frame"
        import pickle

        c._sock.send(pickle.dumps({"op": "info"}))
        assert c.wait_map(None, ("error",))["code"] == "bad_frame"
        assert c.generate("still serving", GREEDY).finish_reason == "length"
    wait_idle(served.llm)


def _pack(msg) -> bytes:
    return msgpack.packb(msg, use_bin_type=True)


# A str field whose bytes are not UTF-8: {"op": "submit", "id": "u", "prompt": <ff fe>}.
_BAD_UTF8 = (b"\x83" + _pack("op") + _pack("submit") + _pack("id") + _pack("u")
             + _pack("prompt") + b"\xa2\xff\xfe")


@pytest.mark.parametrize("frame,rid,code", [
    (_pack({"op": "submit", "id": "t", "prompt": "hello"})[:-3], None, "bad_frame"),
    (_pack([1, 2]), None, "bad_frame"),
    (b"\x81\x91\x01\x01", None, "bad_frame"),  # a map keyed by a list
    (_BAD_UTF8, None, "bad_frame"),
    (_pack({"op": "explode", "id": "o"}), "o", "bad_op"),
    (_pack({"op": "info", "v": 2}), None, "bad_version"),
    (_pack({"op": "submit", "id": ["x"], "prompt": "x"}), None, "invalid_request"),
    (_pack({"op": "submit", "id": "w", "prompt": 5}), "w", "invalid_request"),
    (_pack({"op": "submit", "id": "w", "prompt": b"bytes"}), "w", "invalid_request"),
    (_pack({"op": "submit", "id": "w", "prompt": "x", "params": "hot"}), "w",
     "invalid_request"),
    (_pack({"op": "submit", "id": "w", "prompt": "x", "params": {"temperature": "hot"}}),
     "w", "invalid_request"),
    (_pack({"op": "submit", "id": "w", "prompt_token_ids": "abc"}), "w", "invalid_request"),
    (_pack({"op": "submit", "id": "w", "prompt": "x", "priority": "high"}), "w",
     "invalid_request"),
    (_pack({"op": "submit", "id": "w", "prompt": "x", "ttl_ms": float("nan")}), "w",
     "invalid_request"),
    (_pack({"op": "submit", "id": "w", "prompt": "x", "stream": "no"}), "w",
     "invalid_request"),
    (_pack({"op": "submit", "id": "v", "prompt_token_ids": [1, 10**9]}), "v", "rejected"),
    (_pack({"op": "submit", "id": "v", "prompt_token_ids": [-1]}), "v", "rejected"),
    (_pack({"op": "submit", "id": "v", "prompt_token_ids": [1.5]}), "v", "rejected"),
], ids=["truncated", "not-a-map", "list-key", "bad-utf8", "unknown-op", "bad-version",
        "id-type", "prompt-int", "prompt-bin", "params-type", "param-type", "ids-type",
        "priority-type", "ttl-nan", "stream-type", "id-over-vocab", "id-negative",
        "id-float"])
def test_hostile_frames_get_an_error_and_the_engine_keeps_serving(served, frame, rid, code,
                                                                 caplog):
    caplog.set_level("INFO", logger="nvllm.leader.server")
    served.server._log_window = [0.0, 0]  # these tests run faster than the log rate limit
    with RawClient(served.endpoint, timeout_s=60) as c:
        c._sock.send(frame)
        err = c.recv_map(time.monotonic() + 30)
        assert (err["op"], err["id"], err["code"]) == ("error", rid, code), err
        assert err["message"]
        assert any(f": {code}: " in r.getMessage() for r in caplog.records), "not logged"
        assert c.generate("still serving", {**GREEDY, "max_tokens": 2}).finish_reason == "length"
    wait_idle(served.llm)


def _nested(depth: int) -> list:
    v: list = []
    for _ in range(depth - 1):
        v = [v]
    return v


# The numbered hostile frames: (1) ~1 KB, a map whose "v" is 1,023 nested lists;
# (2) one submit with n=64 and 1,000,000 stop_token_ids (~9 MB, under the 64 MiB frame
# limit); (3) a submit whose id is 1 MiB. The typed decoder refuses each from the first
# bytes it reads of the bad field (the list's or string's header, the version's type),
# naming the field and the limit (the nesting, past the decoder's depth, is bad_frame);
# nothing is built from the rest.
HUGE_ID = "I" * (1 << 20)


@pytest.mark.parametrize("frame,size,rid,code,words", [
    (_pack({"op": "ping", "v": _nested(1023)}), 1000, None, "bad_frame", "nests too deeply"),
    (_pack({"op": "submit", "v": 1, "id": "s", "prompt": "x",
            "params": {"n": 64, "stop_token_ids": [2**63 - 1] * 1_000_000}}), 9_000_000, "s",
     "invalid_request", "params.stop_token_ids has more than 256 items (max_stop_token_ids is"),
    (_pack({"op": "submit", "v": 1, "id": HUGE_ID, "prompt": "x"}), 1 << 20, None,
     "invalid_request", "id has more than 256 bytes (max_request_id_bytes is 256)"),
], ids=["1-deep-nesting", "2-million-stop-ids", "3-mib-id"])
def test_numbered_hostile_frames_are_refused_and_the_engine_keeps_serving(
        served, frame, size, rid, code, words, procs):
    assert size <= len(frame) < size * 1.1 and len(frame) < served.server.max_frame_bytes
    workers = served.llm.worker_pids
    with RawClient(served.endpoint, timeout_s=60) as c:
        c._sock.send(frame)
        err = c.recv_map(time.monotonic() + 30)
        assert (err["op"], err["id"], err["code"]) == ("error", rid, code), err
        assert words in err["message"]
        assert len(err["message"]) < 200 and "IIII" not in err["message"]
        assert c.health()["ready"]
        assert c.generate("still serving", {**GREEDY, "max_tokens": 2}).finish_reason == "length"
    assert all(procs.pid_alive(p) for p in workers) and served.llm.worker_pids == workers
    wait_idle(served.llm)


def test_an_id_over_the_limit_is_named_and_never_echoed(served):
    """(3), multi-byte: an id of few characters but more bytes than max_request_id_bytes
    gets invalid_request naming the limit, and the message never shows the id."""
    limit = served.server.limits.max_request_id_bytes
    rid = "é" * (limit // 2 + 1)  # within the limit in characters, over it in bytes
    with RawClient(served.endpoint, timeout_s=60) as c:
        c.send_map({"op": "submit", "v": 1, "id": rid, "prompt": "x", "params": GREEDY})
        err = c.recv_map(time.monotonic() + 30)
        assert (err["op"], err["code"]) == ("error", "invalid_request"), err
        assert err["id"] is None and f"more than max_request_id_bytes {limit}" in err["message"]
        assert "éé" not in err["message"] and len(err["message"]) < 200
        assert c.generate("still serving", {**GREEDY, "max_tokens": 2}).finish_reason == "length"
    wait_idle(served.llm)


def test_oversized_frame_drops_only_that_connection(served):
    """ZMQ drops a frame over the limit and the connection it came on; the client
    reconnects with its identity, so its running request carries on to its end."""
    limit = served.server.max_frame_bytes
    assert limit == MAX_FRAME_BYTES  # the default
    ep = served.endpoint
    with RawClient(ep, timeout_s=60) as bad, RawClient(ep, timeout_s=60) as good:
        bad.send_map({"op": "submit", "id": "r", "prompt": "A long story",
                      "params": {**GREEDY, "max_tokens": 300}})
        assert bad.wait_map("r", ())["finish_reason"] is None
        bad._sock.send(b"\x00" * (limit + 1))
        # (generous: the loop ends as soon as the drop is seen; a loaded 2-core CI machine
        # took over 10 s once)
        deadline = time.monotonic() + 30
        while bad._link.down_since is None:  # the client's own monitor sees the drop
            assert time.monotonic() < deadline, "the oversized frame did not cost its connection"
            if bad._monitor.poll(100):
                bad._link.on_event(recv_monitor_message(bad._monitor)["event"])
        # Others are served meanwhile; the same client is served again on the connection ZMQ
        # re-opens by itself, and its request in flight was not orphaned.
        assert good.generate("Hello", GREEDY).finish_reason == "length"
        while (m := bad.wait_map("r", ()))["finish_reason"] is None:
            pass
        assert m["finish_reason"] == "length"
        assert bad.generate("Hello again", GREEDY).finish_reason == "length"
    wait_idle(served.llm)


def test_client_that_disappears_has_its_requests_aborted(served):
    code = textwrap.dedent(f"""
        from nvllm.common.client import Client
        c = Client({served.endpoint!r})
        for i, d in enumerate(c.stream("A very long story", {{"temperature": 0,
                "max_tokens": 900, "ignore_eos": True}})):
            if i == 2:
                print("streaming", flush=True)
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "streaming"
        assert served.llm.engine.requests
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        wait_idle(served.llm, timeout=10)  # client_timeout_s=2 in this fixture
    finally:
        if proc.poll() is None:
            proc.kill()


LOAD_CLIENT = textwrap.dedent("""
    import asyncio, json, sys
    from nvllm.common.client import AsyncClient

    async def main(endpoint, first, count):
        c = AsyncClient(endpoint)
        async def one(i):
            ids, text = [], ""
            async for d in c.stream(f"Request {i}: tell me about number {i}.",
                                    {"temperature": 0, "max_tokens": 12, "ignore_eos": True}):
                ids += d.token_ids
                text += d.text
            return i, ids, text
        results = await asyncio.gather(*(one(i) for i in range(first, first + count)))
        c.close()
        print(json.dumps(results))

    asyncio.run(main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3])))
""")


def test_200_concurrent_streams_from_several_processes(served, tiny):
    n_proc, per = 4, 50
    prompts = [f"Request {i}: tell me about number {i}." for i in range(n_proc * per)]
    ref = offline(tiny, prompts, {"temperature": 0, "max_tokens": 12, "ignore_eos": True})
    procs = [subprocess.Popen([sys.executable, "-c", LOAD_CLIENT, served.endpoint,
                               str(k * per), str(per)], stdout=subprocess.PIPE, text=True)
             for k in range(n_proc)]
    results = {}
    for p in procs:
        out, _ = p.communicate(timeout=300)
        assert p.returncode == 0
        for i, ids, text in json.loads(out):
            results[i] = (ids, text)
    assert len(results) == 200
    for i, (ids, text) in enumerate(ref):
        assert results[i] == (ids, text), f"request {i} differs from the offline output"
    wait_idle(served.llm)


def test_batch_timeout_gathers_arrivals_into_the_first_prefill(tiny):
    from nvllm.common import worker_protocol as protocol

    llm = LLM(tiny("qwen3"), device="cpu", dtype="float32", batch_timeout_ms=600)
    plans = []
    broadcast = llm.engine.workers.broadcast

    def spy(msg):
        if isinstance(msg, protocol.StepPlan):
            plans.append(len(msg.new_seqs))
        return broadcast(msg)

    llm.engine.workers.broadcast = spy
    s = serve(llm)
    try:
        with RawClient(s.endpoint, timeout_s=60) as c:
            for i in range(3):
                c.send_map({"op": "submit", "id": i, "prompt": f"prompt {i}", "params": GREEDY})
                # Arrivals one at a time: each is in the engine before the next is sent.
                deadline = time.monotonic() + 10
                while len(llm.engine.requests) < i + 1:
                    assert time.monotonic() < deadline, f"submit {i} never reached the engine"
                    time.sleep(0.01)
            done = 0
            while done < 3:
                done += c.recv_map(time.monotonic() + 60).get("finish_reason") is not None
        assert plans[0] == 3, f"first plan admitted {plans[0]} of 3 requests"
    finally:
        teardown(s)


def test_worker_death_ends_requests_with_engine_unavailable(tiny):
    llm = LLM(tiny("qwen3"), device="cpu", dtype="float32", tensor_parallel_size=2)
    s = serve(llm)
    try:
        with RawClient(s.endpoint, timeout_s=60) as c:
            c.send_map({"op": "submit", "id": "r", "prompt": "A long story",
                     "params": {**GREEDY, "max_tokens": 900}})
            assert c.wait_map("r", ())["finish_reason"] is None  # running
            t0 = time.monotonic()
            os.kill(llm.worker_pids[1], signal.SIGKILL)
            while (m := c.wait_map("r", ()))["op"] == "output":
                assert m["finish_reason"] is None
            assert m["op"] == "error" and m["code"] == "engine_unavailable"
            assert "rank 1" in m["message"] and time.monotonic() - t0 < 5
            health = c.health()
            assert health["ready"] is False and "rank 1" in health["reason"]
            c.send_map({"op": "submit", "id": "after", "prompt": "x", "params": GREEDY})
            assert c.wait_map("after", ())["code"] == "engine_unavailable"
    finally:
        teardown(s)


@pytest.mark.parametrize("grace_s,expected", [(30.0, "length"), (0.0, "abort")])
def test_shutdown_drains_or_aborts(tiny, grace_s, expected):
    llm = LLM(tiny("qwen3"), device="cpu", dtype="float32")
    server = EngineServer(llm.engine)
    stop = threading.Event()
    thread = threading.Thread(target=server.serve, args=(stop, grace_s), daemon=True)
    thread.start()
    try:
        with RawClient(server.endpoint, timeout_s=60) as c:
            c.send_map({"op": "submit", "id": "r", "prompt": "A story",
                     "params": {**GREEDY, "max_tokens": 60}})
            assert c.wait_map("r", ())["finish_reason"] is None
            stop.set()  # what SIGTERM does in nvllm-launch
            while (m := c.wait_map("r", ()))["finish_reason"] is None:
                pass
            assert m["finish_reason"] == expected
            thread.join(30)
            assert not thread.is_alive()
    finally:
        stop.set()
        thread.join(30)
        server.close()
        llm.shutdown()


def test_a_flood_of_bad_frames_is_logged_at_a_bounded_rate(served, caplog):
    caplog.set_level("INFO", logger="nvllm.leader.server")
    served.server._log_window = [0.0, 0]
    with RawClient(served.endpoint, timeout_s=60) as c:
        for _ in range(25):
            c._sock.send(b"\xc1")
        for _ in range(25):
            assert c.recv_map(time.monotonic() + 30)["code"] == "bad_frame"
        # Until the server's one-second log window has rolled over.
        deadline = time.monotonic() + 10
        while time.monotonic() - served.server._log_window[0] <= 1.0:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        c._sock.send(b"\xc1")
        assert c.recv_map(time.monotonic() + 30)["code"] == "bad_frame"
    lines = [r.getMessage() for r in caplog.records if r.name == "nvllm.leader.server"]
    assert sum(": bad_frame: " in m for m in lines) == 11  # 10 of the burst, then the next
    assert any("and 15 more error replies" in m for m in lines)


def test_logit_bias_through_the_zmq_client(served):
    """nvllm.Client sends SamplingParams' int keys, or a dict's JSON-style string keys as
    given; both force the token at every step, and a bad one is named."""
    with RawClient(served.endpoint, timeout_s=60) as c:
        plain = c.generate("Once upon a time", GREEDY).token_ids
        t = next(t for t in range(300, 1000) if t not in plain)
        params = SamplingParams(**GREEDY, logit_bias={t: 100.0})
        assert c.generate("Once upon a time", params).token_ids == [t] * 16
        assert c.generate("Once upon a time",
                          {**GREEDY, "logit_bias": {str(t): 100}}).token_ids == [t] * 16
        with pytest.raises(RequestRejected, match="logit_bias holds 1 id"):
            c.generate("Once upon a time", {**GREEDY, "logit_bias": {10**9: 1}})
        assert c.generate("Once upon a time", GREEDY).token_ids == plain
    wait_idle(served.llm)
