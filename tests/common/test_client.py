"""The clients against a scripted leader (a raw ROUTER in the test): a slow reader loses
only its own request, and a lost leader fails live streams instead of leaving them to
hang until timeout_s."""

from __future__ import annotations

import asyncio
import socket
import time

import msgpack
import pytest
import zmq

from nvllm.common import client as client_module
from nvllm.common.client import AsyncClient, Client, ClientError
from nvllm.common.errors import EngineDeadError


def _output(rid: str, i: int, last: bool = False) -> bytes:
    return msgpack.packb({"op": "output", "id": rid, "index": 0, "token_ids": [i], "text": "x",
                          "logprobs": None, "finish_reason": "length" if last else None})


@pytest.fixture
def leader():
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    yield sock, f"tcp://127.0.0.1:{port}"
    sock.close(0)
    ctx.term()


def _submits(sock, n: int) -> tuple[bytes, list[dict]]:
    """Read frames until n submits arrived; returns (client identity, submits)."""
    got, ident = [], None
    deadline = time.monotonic() + 10
    while len(got) < n:
        assert sock.poll(max(1, int(1000 * (deadline - time.monotonic())))), "no submit"
        ident, payload = sock.recv_multipart()
        msg = msgpack.unpackb(payload, raw=False)
        if msg.get("op") == "submit":
            got.append(msg)
    return ident, got


def test_a_slow_reader_loses_only_its_own_request(leader):
    sock, endpoint = leader

    async def run():
        c = AsyncClient(endpoint, timeout_s=30, max_buffered=8)
        try:
            slow = c.stream("a", {"max_tokens": 100}, request_id="slow")
            fast = c.stream("b", {"max_tokens": 3}, request_id="fast")
            first_slow = asyncio.ensure_future(slow.__anext__())
            first_fast = asyncio.ensure_future(fast.__anext__())
            ident, _ = await asyncio.to_thread(_submits, sock, 2)
            for i in range(100):  # far more than the slow caller's buffer
                sock.send_multipart([ident, _output("slow", i)])
            for i in range(3):
                sock.send_multipart([ident, _output("fast", i, last=i == 2)])
            fast_tokens = [(await first_fast).token_ids[0]]
            fast_tokens += [d.token_ids[0] async for d in fast]
            assert fast_tokens == [0, 1, 2]
            with pytest.raises(ClientError, match="client_overflow"):
                await first_slow
                async for _ in slow:
                    pass
        finally:
            c.close()

    asyncio.run(run())
    # The overflowing request was aborted at the leader.
    # (Polled until the abort came, then 0.5 s more for a wrong one: a loaded machine
    # can hold the client's send back longer than one short poll.)
    aborts = []
    deadline = time.monotonic() + 15
    while sock.poll(500) or ("slow" not in aborts and time.monotonic() < deadline):
        if sock.poll(0):
            msg = msgpack.unpackb(sock.recv_multipart()[-1], raw=False)
            if msg.get("op") == "abort":
                aborts.append(msg["id"])
    assert "slow" in aborts and "fast" not in aborts


def test_a_lost_leader_fails_live_streams(leader, monkeypatch):
    monkeypatch.setattr(client_module, "LINK_GRACE_S", 0.5)
    sock, endpoint = leader
    with Client(endpoint, timeout_s=60) as c:
        stream = c.stream("a", {"max_tokens": 100}, request_id="r")
        sock_thread_result = {}

        def answer_once():
            i, _ = _submits(sock, 1)
            sock.send_multipart([i, _output("r", 0)])
            sock_thread_result["ident"] = i

        import threading

        t = threading.Thread(target=answer_once)
        t.start()
        assert next(stream).token_ids == [0]
        t.join(10)
        ident = sock_thread_result["ident"]
        assert ident.startswith(b"nv") and len(ident) == 17  # its random, stable identity
        sock.close(0)  # the leader goes away
        # Hold its port (bound, not listening) so a parallel test's socket cannot take it
        # and answer the client's reconnect as if the leader were back.
        hold = socket.socket()
        hold.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            hold.bind(("127.0.0.1", int(endpoint.rsplit(":", 1)[1])))
        except OSError:
            pass
        t0 = time.monotonic()
        with pytest.raises(EngineDeadError, match="lost the connection"):
            next(stream)
        assert time.monotonic() - t0 < 10  # not timeout_s (60 s)
        hold.close()


@pytest.mark.parametrize("params", [
    client_module.SamplingParams(logit_bias={5: 2.0, 70000: -100.0}),  # int keys on the wire
    {"logit_bias": {"5": 2, "70000": -100}},  # a JSON-style map as given: the leader converts
], ids=["SamplingParams", "dict"])
def test_submits_carry_logit_bias_as_the_leader_decodes_it(params):
    from nvllm.common.client_decode import decode_client_frame

    frame = client_module._submit_msg("r", [1, 2], params, 0, None)
    assert decode_client_frame(frame).params.logit_bias == {5: 2.0, 70000: -100.0}


def test_async_client_work_per_message_does_not_grow_with_live_streams(leader):
    """Issue 22: the same 25 streams' messages cost an AsyncClient the same work (Python
    lines run in nvllm, asyncio and pyzmq, counted without a clock: tests/support/
    work_counter.py) with 100 or 1,000 other streams open on it."""
    import os

    import zmq.asyncio
    from work_counter import NVLLM, LineCounter

    sock, endpoint = leader
    roots = (NVLLM, os.path.dirname(asyncio.__file__), os.path.dirname(zmq.__file__))

    async def measure(live: int) -> LineCounter:
        c = AsyncClient(endpoint, timeout_s=60)

        async def consume(rid: str) -> int:
            return len([d async for d in c.stream([1, 2, 3], {"max_tokens": 2},
                                                   request_id=rid)])
        tasks = {rid: asyncio.ensure_future(consume(rid))
                 for rid in (f"{live}-{i}" for i in range(live + 25))}
        try:
            ident, _ = await asyncio.to_thread(_submits, sock, live + 25)
            counter = LineCounter(*roots)
            measured = [tasks[f"{live}-{i}"] for i in range(live, live + 25)]
            with counter:
                for i in range(live, live + 25):
                    sock.send_multipart([ident, _output(f"{live}-{i}", 0)])
                    sock.send_multipart([ident, _output(f"{live}-{i}", 1, last=True)])
                assert [await t for t in measured] == [2] * 25
            return counter
        finally:
            for t in tasks.values():
                t.cancel()
            await asyncio.gather(*tasks.values(), return_exceptions=True)
            c.close()

    small, large = asyncio.run(measure(100)), asyncio.run(measure(1000))
    print(f"{small.lines} lines with 100 streams open, {large.lines} with 1,000; "
          f"top: {large.by_function.most_common(5)}")
    assert small.lines > 0
    # (+100: the pinger may run once more in one of the two windows)
    assert large.lines <= 1.05 * small.lines + 100, (
        f"{large.lines} lines with 1,000 streams open, {small.lines} with 100; grown: "
        f"{large.grown(small, 1.05)}")


class _ScriptedLeader:
    """A leader on `port` (0: any) that answers pings with pong(`boot`) and each submit
    with one final token, in a thread, until stop()."""

    def __init__(self, boot: str, port: int = 0) -> None:
        import threading

        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
        if port:
            self.sock.bind(f"tcp://127.0.0.1:{port}")
        else:
            port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.port, self.boot, self.pongs = port, boot, 0
        self.submits: list[str] = []
        self.final = True
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            if not self.sock.poll(50):
                continue
            ident, payload = self.sock.recv_multipart()
            msg = msgpack.unpackb(payload, raw=False)
            if msg.get("op") == "ping":
                self.sock.send_multipart([ident, msgpack.packb({"op": "pong",
                                                                "boot": self.boot})])
                self.pongs += 1
            elif msg.get("op") == "submit":
                self.submits.append(msg["id"])
                self.sock.send_multipart([ident, _output(msg["id"], 0, last=self.final)])

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.sock.close(0)
        self.ctx.term()


def _wait(cond, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline
        time.sleep(0.02)


def test_a_leader_restarted_within_the_grace_fails_the_streams_it_never_had():
    """The leader dies and a new one takes its port well inside LINK_GRACE_S: the link is
    back, so only the pong's boot id shows the request was lost. It fails at once (not
    after timeout_s), and the same client's next request is served by the new leader."""
    old = _ScriptedLeader("boot-a")
    old.final = False
    new = None
    try:
        with Client(f"tcp://127.0.0.1:{old.port}", timeout_s=60) as c:
            stream = c.stream([1, 2], {"max_tokens": 10}, request_id="r")
            assert next(stream).token_ids == [0]
            _wait(lambda: old.pongs >= 1)
            time.sleep(0.2)  # the pong on its way before the socket drops it
            old.stop()
            new = _ScriptedLeader("boot-b", old.port)
            t0 = time.monotonic()
            with pytest.raises(EngineDeadError, match="restarted"):
                next(stream)
            assert time.monotonic() - t0 < client_module.LINK_GRACE_S
            out = c.generate([3], {"max_tokens": 1})
            assert out.outputs[0].token_ids == [0] and len(new.submits) == 1
    finally:
        old.stop() if not old._stop.is_set() else None
        if new is not None:
            new.stop()


def test_async_streams_fail_when_the_leader_restarted_within_the_grace():
    old = _ScriptedLeader("boot-a")
    old.final = False
    holder: dict = {}

    async def run():
        c = AsyncClient(f"tcp://127.0.0.1:{old.port}", timeout_s=60)
        try:
            streams = [c.stream([k], {"max_tokens": 10}, request_id=f"r{k}") for k in (1, 2)]
            for s in streams:
                assert (await s.__anext__()).token_ids == [0]
            await asyncio.to_thread(_wait, lambda: old.pongs >= 1)
            await asyncio.sleep(0.2)
            old.stop()
            holder["new"] = _ScriptedLeader("boot-b", old.port)
            t0 = time.monotonic()
            for s in streams:
                with pytest.raises(EngineDeadError, match="restarted"):
                    await s.__anext__()
            assert time.monotonic() - t0 < client_module.LINK_GRACE_S
            holder["new"].final = True
            out = [d async for d in c.stream([3], {"max_tokens": 1})]
            assert [d.token_ids for d in out] == [[0]]
        finally:
            c.close()

    try:
        asyncio.run(run())
    finally:
        if not old._stop.is_set():
            old.stop()
        if "new" in holder:
            holder["new"].stop()
