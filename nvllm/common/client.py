"""Clients of a running nvllm engine (protocol: docs/protocol.md).

``Client`` is synchronous (one thread at a time); ``AsyncClient`` multiplexes any number of
concurrent requests over one socket in asyncio. Both speak msgpack over a ZMQ DEALER.
With ``curve_key_dir`` (layout in common/zmq_utils.py) the connection is CURVE-encrypted
and authenticated; a server that refuses the key never answers, so calls time out.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import time
from collections import defaultdict, deque
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any

import msgpack
import zmq
import zmq.asyncio

from nvllm.common.errors import EngineDeadError, NvllmError, RequestRejected
from nvllm.common.outputs import CompletionOutput, RequestOutput
from nvllm.common.sampling_params import SamplingParams
from nvllm.common.zmq_utils import curve_client

PROTOCOL_VERSION = 1
PING_INTERVAL_S = 1.0


class ClientError(NvllmError):
    """The engine answered a request with an error message."""

    def __init__(self, code: str, message: str, request_id: str | None = None) -> None:
        super().__init__(f"{code}: {message}")
        self.code, self.message, self.request_id = code, message, request_id


def _raise_for(msg: dict) -> None:
    code, text, rid = msg.get("code", "error"), msg.get("message", ""), msg.get("id")
    if code == "rejected":
        raise RequestRejected(text)
    if code == "engine_unavailable":
        raise EngineDeadError(text)
    raise ClientError(code, text, rid)


@dataclass(slots=True)
class StreamDelta:
    """What one streamed message adds to one completion: only what is new."""

    request_id: str
    index: int
    token_ids: list[int]
    text: str
    logprobs: list | None = None
    finish_reason: str | None = None
    usage: dict | None = None


@dataclass
class _Pending:
    n: int
    prompt: str | None
    token_ids: dict[int, list[int]] = field(default_factory=lambda: defaultdict(list))
    text: dict[int, str] = field(default_factory=lambda: defaultdict(str))
    logprobs: dict[int, list] = field(default_factory=lambda: defaultdict(list))
    finish: dict[int, str] = field(default_factory=dict)
    usage: dict[int, dict] = field(default_factory=dict)

    def add(self, d: StreamDelta) -> None:
        self.token_ids[d.index].extend(d.token_ids)
        self.text[d.index] += d.text
        if d.logprobs:
            self.logprobs[d.index].extend(d.logprobs)
        if d.finish_reason is not None:
            self.finish[d.index] = d.finish_reason
            self.usage[d.index] = d.usage or {}

    @property
    def done(self) -> bool:
        return len(self.finish) >= self.n

    def to_output(self, request_id: str) -> RequestOutput:
        outs = [CompletionOutput(i, self.token_ids[i], self.text[i], self.finish.get(i),
                                 self.logprobs[i] or None) for i in range(self.n)]
        usage = self.usage.get(0, {})
        return RequestOutput(request_id, self.prompt, [], outs, finished=True,
                             num_cached_tokens=usage.get("cached_tokens", 0))


def _unpack(data: bytes) -> Any:
    """Decode one frame; logprob maps are keyed by token id, hence strict_map_key=False."""
    try:
        return msgpack.unpackb(data, raw=False, strict_map_key=False)
    except Exception:  # msgpack raises several unrelated types on garbage
        return None


def _submit_msg(rid: str, prompt: str | list[int], params: SamplingParams | dict | None,
                priority: int, ttl_ms: int | None, stream: bool) -> dict:
    if isinstance(params, SamplingParams):
        p = params.to_dict()
        p.pop("eos_token_ids", None)
    else:
        p = dict(params or {})
    msg: dict[str, Any] = {"v": PROTOCOL_VERSION, "op": "submit", "id": rid, "params": p,
                           "priority": priority, "ttl_ms": ttl_ms, "stream": stream}
    if isinstance(prompt, str):
        msg["prompt"] = prompt
    else:
        msg["prompt_token_ids"] = list(prompt)
    return msg


def _delta(msg: dict) -> StreamDelta:
    return StreamDelta(str(msg.get("id")), int(msg.get("index", 0)), msg.get("token_ids") or [],
                       msg.get("text") or "", msg.get("logprobs"), msg.get("finish_reason"),
                       msg.get("usage"))


def _connect(ctx: zmq.Context, endpoint: str, timeout_s: float,
             curve_key_dir: str | os.PathLike | None) -> zmq.Socket:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    # A send blocks while there is no connection to queue on (after a refused CURVE
    # handshake there is none): bound it like every wait for an answer.
    sock.setsockopt(zmq.SNDTIMEO, max(1, int(timeout_s * 1000)))
    try:
        if curve_key_dir is not None:  # keys must be set before connect
            curve_client(sock, curve_key_dir)
        sock.connect(endpoint)
    except BaseException:
        sock.close(0)
        ctx.term()
        raise
    return sock


def _no_answer_hint(endpoint: str, timeout_s: float,
                    curve_key_dir: str | os.PathLike | None) -> str:
    # A refused CURVE handshake is silent by design: say what to check.
    why = "" if curve_key_dir is None else (
        f" (is this client's public key in the server's clients/ folder, and "
        f"{curve_key_dir}/server.key the server's?)")
    return f"no answer from {endpoint} in {timeout_s:g} s{why}"


def _n_of(params: SamplingParams | dict | None) -> int:
    if isinstance(params, SamplingParams):
        return params.n
    return int((params or {}).get("n", 1))


class Client:
    """Synchronous client. ``stream()`` yields ``StreamDelta``s; ``generate()`` collects."""

    def __init__(self, endpoint: str, timeout_s: float = 600.0, *,
                 curve_key_dir: str | os.PathLike | None = None) -> None:
        self.endpoint = endpoint
        self.timeout_s = timeout_s
        self._ctx = zmq.Context()
        self._sock = _connect(self._ctx, endpoint, timeout_s, curve_key_dir)
        self._no_answer = _no_answer_hint(endpoint, timeout_s, curve_key_dir)
        self._ids = itertools.count()
        self._prefix = f"c{os.getpid()}-{id(self):x}-"
        self._inbox: dict[str, deque] = defaultdict(deque)  # replies for other requests
        self._last_ping = 0.0

    def _send(self, msg: dict, *, best_effort: bool = False) -> None:
        """Send, waiting at most timeout_s for room; `best_effort` (pings, aborts on the
        way out) never waits and drops the message instead."""
        try:
            self._sock.send(msgpack.packb(msg, use_bin_type=True),
                            flags=zmq.NOBLOCK if best_effort else 0)
        except zmq.Again:
            if not best_effort:
                raise TimeoutError(self._no_answer) from None

    def _recv(self, deadline: float) -> dict:
        while True:
            now = time.monotonic()
            if now - self._last_ping >= PING_INTERVAL_S:
                self._send({"op": "ping"}, best_effort=True)
                self._last_ping = now
            if now > deadline:
                raise TimeoutError(self._no_answer)
            if self._sock.poll(int(min(PING_INTERVAL_S, deadline - now) * 1000) + 1):
                msg = _unpack(self._sock.recv())
                if isinstance(msg, dict) and msg.get("op") != "pong":
                    return msg

    def _wait_for(self, rid: str | None, ops: tuple[str, ...]) -> dict:
        """Next message for request `rid` (or the next of `ops` when rid is None)."""
        if rid is not None and self._inbox.get(rid):
            return self._inbox[rid].popleft()
        deadline = time.monotonic() + self.timeout_s
        while True:
            msg = self._recv(deadline)
            mid = msg.get("id")
            if rid is not None and mid == rid:
                return msg
            if rid is None and msg.get("op") in ops:
                return msg
            if mid is not None:
                self._inbox[str(mid)].append(msg)

    def _request(self, op: str) -> dict:
        self._send({"v": PROTOCOL_VERSION, "op": op})
        msg = self._wait_for(None, (op, "error"))
        if msg.get("op") == "error":
            _raise_for(msg)
        return msg

    def info(self) -> dict:
        return self._request("info")

    def health(self) -> dict:
        return self._request("health")

    def metrics(self) -> str:
        return self._request("metrics")["text"]

    def stream(self, prompt: str | list[int], params: SamplingParams | dict | None = None, *,
               request_id: str | None = None, priority: int = 0,
               ttl_ms: int | None = None) -> Iterator[StreamDelta]:
        rid = request_id or self._prefix + str(next(self._ids))
        self._send(_submit_msg(rid, prompt, params, priority, ttl_ms, stream=True))
        remaining = _n_of(params)
        try:
            while remaining:
                msg = self._wait_for(rid, ())
                if msg.get("op") == "error":
                    _raise_for(msg)
                d = _delta(msg)
                if d.finish_reason is not None:
                    remaining -= 1
                yield d
        finally:
            if remaining:  # the caller stopped early: don't leave the request running
                self._send({"v": PROTOCOL_VERSION, "op": "abort", "id": rid},
                           best_effort=True)
            self._inbox.pop(rid, None)

    def generate(self, prompt: str | list[int], params: SamplingParams | dict | None = None,
                 **kwargs: Any) -> RequestOutput:
        rid = kwargs.pop("request_id", None) or self._prefix + str(next(self._ids))
        acc = _Pending(_n_of(params), prompt if isinstance(prompt, str) else None)
        for d in self.stream(prompt, params, request_id=rid, **kwargs):
            acc.add(d)
        return acc.to_output(rid)

    def abort(self, request_id: str) -> None:
        self._send({"v": PROTOCOL_VERSION, "op": "abort", "id": request_id})

    def close(self) -> None:
        self._sock.close(0)
        self._ctx.term()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class AsyncClient:
    """asyncio client: any number of concurrent requests over one socket."""

    def __init__(self, endpoint: str, timeout_s: float = 600.0, *,
                 curve_key_dir: str | os.PathLike | None = None) -> None:
        self.endpoint = endpoint
        self.timeout_s = timeout_s
        self._ctx = zmq.asyncio.Context()
        self._sock = _connect(self._ctx, endpoint, timeout_s, curve_key_dir)
        self._no_answer = _no_answer_hint(endpoint, timeout_s, curve_key_dir)
        self._ids = itertools.count()
        self._prefix = f"a{os.getpid()}-{id(self):x}-"
        self._queues: dict[str, asyncio.Queue] = {}
        self._control: dict[str, asyncio.Future] = {}
        self._tasks: list[asyncio.Task] = []

    def _ensure_tasks(self) -> None:
        if not self._tasks:
            loop = asyncio.get_running_loop()
            self._tasks = [loop.create_task(self._reader()), loop.create_task(self._pinger())]

    async def _send(self, msg: dict, *, best_effort: bool = False) -> None:
        """As Client._send (zmq.asyncio honours SNDTIMEO)."""
        try:
            await self._sock.send(msgpack.packb(msg, use_bin_type=True),
                                  flags=zmq.NOBLOCK if best_effort else 0)
        except zmq.Again:
            if not best_effort:
                raise TimeoutError(self._no_answer) from None

    async def _reader(self) -> None:
        while True:
            msg = _unpack(await self._sock.recv())
            if not isinstance(msg, dict):
                continue  # undecodable: one bad frame must not stop the reader
            op, rid = msg.get("op"), msg.get("id")
            if rid is not None and str(rid) in self._queues:
                self._queues[str(rid)].put_nowait(msg)
            elif op in self._control and not self._control[op].done():
                self._control.pop(op).set_result(msg)
            elif op == "error" and rid is None and self._control:
                # An error about no request answers the control calls in flight.
                for fut in self._control.values():
                    if not fut.done():
                        fut.set_result(msg)
                self._control.clear()

    async def _pinger(self) -> None:
        while True:
            if self._queues:
                await self._send({"op": "ping"}, best_effort=True)
            await asyncio.sleep(PING_INTERVAL_S)

    async def _request(self, op: str) -> dict:
        self._ensure_tasks()
        fut = self._control.get(op)
        if fut is None or fut.done():
            fut = self._control[op] = asyncio.get_running_loop().create_future()
            await self._send({"v": PROTOCOL_VERSION, "op": op})
        try:
            msg = await asyncio.wait_for(asyncio.shield(fut), self.timeout_s)
        finally:
            if not fut.done() and self._control.get(op) is fut:
                # Timed out or cancelled: ask again next time rather than wait on this one.
                self._control.pop(op)
        if msg.get("op") == "error":
            _raise_for(msg)
        return msg

    async def info(self) -> dict:
        return await self._request("info")

    async def health(self) -> dict:
        return await self._request("health")

    async def metrics(self) -> str:
        return (await self._request("metrics"))["text"]

    async def stream(self, prompt: str | list[int], params: SamplingParams | dict | None = None,
                     *, request_id: str | None = None, priority: int = 0,
                     ttl_ms: int | None = None) -> AsyncIterator[StreamDelta]:
        self._ensure_tasks()
        rid = request_id or self._prefix + str(next(self._ids))
        if rid in self._queues:
            raise ValueError(f"request id {rid!r} is already in flight on this client")
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[rid] = queue
        remaining = _n_of(params)
        try:
            await self._send(_submit_msg(rid, prompt, params, priority, ttl_ms, stream=True))
            while remaining:
                msg = await self._next(queue)
                if msg.get("op") == "error":
                    _raise_for(msg)
                d = _delta(msg)
                if d.finish_reason is not None:
                    remaining -= 1
                yield d
        finally:
            self._queues.pop(rid, None)
            if remaining:  # cancelled or abandoned: free the engine's work
                await self._send({"v": PROTOCOL_VERSION, "op": "abort", "id": rid},
                                 best_effort=True)

    async def _next(self, queue: asyncio.Queue) -> dict:
        # Not asyncio.wait_for(queue.get()): on Python < 3.12 it can swallow a cancel that
        # lands as a message arrives, and the cancelled stream would run to its end.
        get = asyncio.ensure_future(queue.get())
        try:
            done, _ = await asyncio.wait({get}, timeout=self.timeout_s)
        finally:
            if not get.done():
                get.cancel()
        if not done:
            raise TimeoutError(self._no_answer)
        return get.result()

    async def generate(self, prompt: str | list[int],
                       params: SamplingParams | dict | None = None,
                       **kwargs: Any) -> RequestOutput:
        rid = kwargs.pop("request_id", None) or self._prefix + str(next(self._ids))
        acc = _Pending(_n_of(params), prompt if isinstance(prompt, str) else None)
        async for d in self.stream(prompt, params, request_id=rid, **kwargs):
            acc.add(d)
        return acc.to_output(rid)

    async def abort(self, request_id: str) -> None:
        await self._send({"v": PROTOCOL_VERSION, "op": "abort", "id": request_id})

    def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        self._sock.close(0)
        self._ctx.term()
