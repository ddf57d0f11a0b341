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
import secrets
import time
from collections import defaultdict, deque
from collections.abc import AsyncIterator, Iterator
from typing import Any

import msgpack
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from nvllm.common import client_protocol as cp
from nvllm.common.errors import EngineDeadError, NvllmError, RequestRejected
from nvllm.common.outputs import CompletionDelta, RequestAccumulator, RequestOutput
from nvllm.common.sampling_params import SamplingParams
from nvllm.common.sleep_client import AsyncSleepClient, SleepClient
from nvllm.common.tokenize_client import AsyncTokenizeClient, TokenizeClient
from nvllm.common.trace import Tracer
from nvllm.common.weight_source_client import AsyncWeightSourceClient, WeightSourceClient
from nvllm.common.weight_transfer import WeightUpdateError
from nvllm.common.zmq_utils import curve_client

PING_INTERVAL_S = 1.0
# A lost connection to the leader that is not back within this fails the live requests
# (engine_unavailable) instead of leaving them to wait for timeout_s.
LINK_GRACE_S = 5.0
# An AsyncClient request whose caller leaves this many messages unread is aborted, so a
# slow reader costs only its own request (the socket is always read).
MAX_BUFFERED = 4096
_LINK_EVENTS = (zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_CLOSED
                | zmq.EVENT_HANDSHAKE_SUCCEEDED)
# What a stream yields: the engine's own delta type (kept under the name clients know).
StreamDelta = CompletionDelta


class ClientError(NvllmError):
    """The engine answered a request with an error message."""

    def __init__(self, code: str, message: str, request_id: str | None = None) -> None:
        super().__init__(f"{code}: {message}")
        self.code, self.message, self.request_id = code, message, request_id


def _raise_for(msg: cp.Error) -> None:
    if msg.code == "rejected":
        raise RequestRejected(msg.message)
    if msg.code == "weights_refused":
        raise WeightUpdateError(msg.message)
    if msg.code == "engine_unavailable":
        raise EngineDeadError(msg.message)
    raise ClientError(msg.code, msg.message, msg.id)


def _submit_msg(rid: str, prompt: str | list[int], params: SamplingParams | dict | None,
                priority: int, ttl_ms: int | None, routing_key: str | None = None) -> bytes:
    """The submit frame. A dict of params travels as given (the leader validates it and
    names any bad field); a SamplingParams as its fields."""
    text, ids = (prompt, None) if isinstance(prompt, str) else (None, list(prompt))
    if isinstance(params, SamplingParams) or params is None:
        return cp.encode(cp.Submit(rid, text, ids, params or SamplingParams(), priority,
                                   ttl_ms, routing_key))
    msg = cp.to_map(cp.Submit(rid, text, ids, SamplingParams(), priority, ttl_ms,
                              routing_key))
    msg["params"] = dict(params)
    return msgpack.packb(msg, use_bin_type=True)


def _control_result(msg: Any) -> dict:
    """An info/health/metrics answer as the map clients return (an error raises)."""
    if isinstance(msg, cp.Error):
        _raise_for(msg)
    return cp.to_map(msg)


class _Link:
    """Whether the connection to the leader is up, from the socket monitor's events."""

    def __init__(self) -> None:
        self.up = False
        self.down_since: float | None = None

    def on_event(self, event: int) -> None:
        if event in (zmq.EVENT_CONNECTED, zmq.EVENT_HANDSHAKE_SUCCEEDED):
            self.up, self.down_since = True, None
        elif self.up and self.down_since is None:  # disconnected or closed
            self.down_since = time.monotonic()

    def lost(self) -> bool:
        return self.down_since is not None and time.monotonic() - self.down_since > LINK_GRACE_S


class _Boots:
    """Which server process answers: ``pong`` carries a random id per server process, and
    a change means the connection came back to a new one (restarted on the same port),
    which never had the requests sent before. Those fail at once, whatever the timing of
    the reconnect; the link's grace alone misses a server back within it."""

    def __init__(self) -> None:
        self.boot: str | None = None
        self.epoch = 0  # how many changes seen; a request remembers the one it was sent in

    def saw(self, boot: str) -> bool:
        """Record a pong's id; true when it names a new server process."""
        changed = bool(boot) and self.boot is not None and boot != self.boot
        if boot:
            self.epoch += changed
            self.boot = boot
        return changed


def _restarted(endpoint: str) -> str:
    return (f"the server at {endpoint} restarted; the requests it had in flight were lost "
            f"with it (send them again)")


def _connect(ctx: zmq.Context, endpoint: str, timeout_s: float,
             curve_key_dir: str | os.PathLike | None) -> tuple[zmq.Socket, zmq.Socket]:
    """The DEALER socket and its monitor, attached before connecting: a connection made
    before the monitor was would never count as up, so its loss would go unseen."""
    sock = ctx.socket(zmq.DEALER)
    monitor = None
    sock.setsockopt(zmq.LINGER, 0)
    # One random identity per client object, kept across reconnects: the leader
    # (ROUTER_HANDOVER) hands the new connection this client's streams, and nobody can
    # guess it to take them.
    sock.setsockopt(zmq.ROUTING_ID, b"nv" + secrets.token_bytes(15))
    # A send blocks while there is no connection to queue on (after a refused CURVE
    # handshake there is none): bound it like every wait for an answer.
    sock.setsockopt(zmq.SNDTIMEO, max(1, int(timeout_s * 1000)))
    try:
        if curve_key_dir is not None:  # keys must be set before connect
            curve_client(sock, curve_key_dir)
        monitor = sock.get_monitor_socket(_LINK_EVENTS)
        sock.connect(endpoint)
    except BaseException:
        if monitor is not None:
            sock.disable_monitor()
            monitor.close(0)
        sock.close(0)
        ctx.term()
        raise
    return sock, monitor


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


class Client(WeightSourceClient, SleepClient, TokenizeClient):
    """Synchronous client. ``stream()`` yields ``StreamDelta``s; ``generate()`` collects."""

    def __init__(self, endpoint: str, timeout_s: float = 600.0, *,
                 curve_key_dir: str | os.PathLike | None = None) -> None:
        self.endpoint = endpoint
        self.timeout_s = timeout_s
        self._ctx = zmq.Context()
        self._sock, self._monitor = _connect(self._ctx, endpoint, timeout_s, curve_key_dir)
        self._no_answer = _no_answer_hint(endpoint, timeout_s, curve_key_dir)
        self._ids = itertools.count()
        self._prefix = f"c{os.getpid()}-{id(self):x}-"
        self._inbox: dict[str, deque] = defaultdict(deque)  # replies for other requests
        self._last_ping = 0.0
        self._link = _Link()
        self._boots = _Boots()

    def _send(self, frame: bytes, *, best_effort: bool = False) -> None:
        """Send, waiting at most timeout_s for room; `best_effort` (pings, aborts on the
        way out) never waits and drops the message instead."""
        try:
            self._sock.send(frame, flags=zmq.NOBLOCK if best_effort else 0)
        except zmq.Again:
            if not best_effort:
                raise TimeoutError(self._no_answer) from None

    def _recv(self, deadline: float, epoch: int | None = None) -> Any:
        """The next message that is not a pong; `epoch`: fail if the server restarted
        since the request waiting was sent."""
        while True:
            if epoch is not None and self._boots.epoch != epoch:
                raise EngineDeadError(_restarted(self.endpoint))
            now = time.monotonic()
            if now - self._last_ping >= PING_INTERVAL_S:
                self._send(cp.encode(cp.Ping()), best_effort=True)
                self._last_ping = now
            if now > deadline:
                raise TimeoutError(self._no_answer)
            while self._monitor.poll(0):
                self._link.on_event(parse_monitor_message(self._monitor.recv_multipart())
                                    ["event"])
            if self._link.lost():
                raise EngineDeadError(f"lost the connection to the leader at {self.endpoint} "
                                      f"for over {LINK_GRACE_S:g} s")
            if self._sock.poll(int(min(PING_INTERVAL_S, deadline - now) * 1000) + 1):
                msg = cp.decode_server_frame(self._sock.recv())
                if isinstance(msg, cp.Pong):
                    self._boots.saw(msg.boot)
                elif msg is not None:
                    return msg

    def _wait_for(self, rid: str | None, kinds: tuple[type, ...],
                  epoch: int | None = None) -> Any:
        """Next message for request `rid` (or the next of `kinds` when rid is None);
        `epoch`: the server restart count when the request was sent."""
        if rid is not None and self._inbox.get(rid):
            return self._inbox[rid].popleft()
        deadline = time.monotonic() + self.timeout_s
        while True:
            msg = self._recv(deadline, epoch)
            mid = getattr(msg, "id", None)
            if rid is not None and mid == rid:
                return msg
            if rid is None and isinstance(msg, kinds) and mid is None:
                return msg
            if mid is not None:
                self._inbox[str(mid)].append(msg)

    def _request(self, request: Any, answer: type) -> dict:
        self._send(cp.encode(request))
        return _control_result(self._wait_for(None, (answer, cp.Error)))

    def info(self) -> dict:
        return self._request(cp.InfoRequest(), cp.Info)

    def health(self) -> dict:
        return self._request(cp.HealthRequest(), cp.Health)

    def metrics(self) -> str:
        return self._request(cp.MetricsRequest(), cp.Metrics)["text"]

    def _new_id(self) -> str:
        return self._prefix + str(next(self._ids))

    def _ask(self, msg: Any) -> dict:
        """One question answered by one message with its id (or an error, raised)."""
        rid = str(msg.id)
        epoch = self._boots.epoch
        self._send(cp.encode(msg))
        try:
            return _control_result(self._wait_for(rid, (), epoch))
        finally:
            self._inbox.pop(rid, None)

    def stream(self, prompt: str | list[int], params: SamplingParams | dict | None = None, *,
               request_id: str | None = None, priority: int = 0,
               ttl_ms: int | None = None,
               routing_key: str | None = None) -> Iterator[StreamDelta]:
        """`routing_key`: behind a data-parallel router, requests with the same key go to
        the same replica (docs/data-parallel.md)."""
        rid = request_id or self._new_id()
        epoch = self._boots.epoch
        self._send(_submit_msg(rid, prompt, params, priority, ttl_ms, routing_key))
        remaining = _n_of(params)
        try:
            while remaining:
                msg = self._wait_for(rid, (), epoch)
                if isinstance(msg, cp.Error):
                    _raise_for(msg)
                d = msg.to_delta()
                if d.finish_reason is not None:
                    remaining -= 1
                yield d
        finally:
            if remaining:  # the caller stopped early: don't leave the request running
                self._send(cp.encode(cp.Abort(rid)), best_effort=True)
            self._inbox.pop(rid, None)

    def generate(self, prompt: str | list[int], params: SamplingParams | dict | None = None,
                 **kwargs: Any) -> RequestOutput:
        rid = kwargs.pop("request_id", None) or self._new_id()
        acc = RequestAccumulator(_n_of(params), prompt if isinstance(prompt, str) else None)
        for d in self.stream(prompt, params, request_id=rid, **kwargs):
            acc.add(d)
        return acc.to_output(rid)

    def abort(self, request_id: str) -> None:
        self._send(cp.encode(cp.Abort(request_id)))

    def close(self) -> None:
        self._sock.disable_monitor()
        self._monitor.close(0)
        self._sock.close(0)
        self._ctx.term()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class AsyncClient(AsyncWeightSourceClient, AsyncSleepClient, AsyncTokenizeClient):
    """asyncio client: any number of concurrent requests over one socket."""

    def __init__(self, endpoint: str, timeout_s: float = 600.0, *,
                 curve_key_dir: str | os.PathLike | None = None,
                 max_buffered: int = MAX_BUFFERED, trace: Tracer | None = None) -> None:
        """`trace`: record every ``output`` message as it is decoded (``out_recv``, see
        nvllm/common/trace.py)."""
        self.endpoint = endpoint
        self.trace = trace
        self.timeout_s = timeout_s
        self.max_buffered = max_buffered
        self._ctx = zmq.asyncio.Context()
        self._sock, self._monitor = _connect(self._ctx, endpoint, timeout_s, curve_key_dir)
        self._no_answer = _no_answer_hint(endpoint, timeout_s, curve_key_dir)
        self._ids = itertools.count()
        self._prefix = f"a{os.getpid()}-{id(self):x}-"
        self._link = _Link()
        self._boots = _Boots()
        self._queues: dict[str, asyncio.Queue] = {}
        self._ended: set[str] = set()  # requests already given their last message here
        self._control: dict[str, asyncio.Future] = {}
        self._tasks: list[asyncio.Task] = []

    def _ensure_tasks(self) -> None:
        if not self._tasks:
            loop = asyncio.get_running_loop()
            self._tasks = [loop.create_task(self._reader()), loop.create_task(self._pinger()),
                           loop.create_task(self._watch())]

    async def _send(self, frame: bytes, *, best_effort: bool = False) -> None:
        """As Client._send (zmq.asyncio honours SNDTIMEO)."""
        try:
            await self._sock.send(frame, flags=zmq.NOBLOCK if best_effort else 0)
        except zmq.Again:
            if not best_effort:
                raise TimeoutError(self._no_answer) from None

    async def _reader(self) -> None:
        while True:
            msg = cp.decode_server_frame(await self._sock.recv())
            if msg is None:
                continue  # undecodable: one bad frame must not stop the reader
            if self.trace is not None and isinstance(msg, cp.Output):
                self.trace.message("out_recv", msg.id, msg.index, msg.finish_reason is not None)
            if isinstance(msg, cp.Pong):
                if self._boots.saw(msg.boot):
                    self._fail_all(_restarted(self.endpoint))
                continue
            rid = getattr(msg, "id", None)
            if rid is not None and str(rid) in self._queues:
                self._deliver(str(rid), msg)
            elif msg.OP in self._control and not self._control[msg.OP].done():
                self._control.pop(msg.OP).set_result(msg)
            elif isinstance(msg, cp.Error) and rid is None and self._control:
                # An error about no request answers the control calls in flight.
                for fut in self._control.values():
                    if not fut.done():
                        fut.set_result(msg)
                self._control.clear()

    def _deliver(self, rid: str, msg: Any) -> None:
        """Queue a message for its request; a caller that left max_buffered unread loses
        that request (aborted, with an error), never the others on this socket."""
        if rid in self._ended:
            return
        try:
            self._queues[rid].put_nowait(msg)
        except asyncio.QueueFull:
            self._end(rid, cp.Error(rid, "client_overflow", f"the caller left "
                                    f"{self.max_buffered} messages unread; request aborted"))
            self._background(self._send(cp.encode(cp.Abort(rid)), best_effort=True))

    def _end(self, rid: str, error: cp.Error) -> None:
        """Give a request its last message here, client-side (nothing after it is kept);
        what was queued before stays unless the queue is full."""
        queue = self._queues[rid]
        while queue.full():
            queue.get_nowait()
        queue.put_nowait(error)
        self._ended.add(rid)

    def _background(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.append(task)
        task.add_done_callback(lambda t: t in self._tasks and self._tasks.remove(t))

    async def _watch(self) -> None:
        while True:
            frames = await self._monitor.recv_multipart()
            self._link.on_event(parse_monitor_message(frames)["event"])

    async def _pinger(self) -> None:
        while True:
            if self._queues:
                await self._send(cp.encode(cp.Ping()), best_effort=True)
                if self._link.lost():  # the leader is gone: fail what waits on it
                    self._fail_all(f"lost the connection to the leader at {self.endpoint} "
                                   f"for over {LINK_GRACE_S:g} s")
            await asyncio.sleep(PING_INTERVAL_S)

    def _fail_all(self, why: str) -> None:
        """End every request waiting here with engine_unavailable."""
        for rid in list(self._queues):
            if rid not in self._ended:
                self._end(rid, cp.Error(rid, "engine_unavailable", why))

    async def _request(self, request: Any) -> dict:
        self._ensure_tasks()
        op = request.OP  # answered by the message of the same op (or an error)
        fut = self._control.get(op)
        if fut is None or fut.done():
            fut = self._control[op] = asyncio.get_running_loop().create_future()
            await self._send(cp.encode(request))
        try:
            msg = await asyncio.wait_for(asyncio.shield(fut), self.timeout_s)
        finally:
            if not fut.done() and self._control.get(op) is fut:
                # Timed out or cancelled: ask again next time rather than wait on this one.
                self._control.pop(op)
        return _control_result(msg)

    async def info(self) -> dict:
        return await self._request(cp.InfoRequest())

    async def health(self) -> dict:
        return await self._request(cp.HealthRequest())

    async def metrics(self) -> str:
        return (await self._request(cp.MetricsRequest()))["text"]

    def _new_id(self) -> str:
        return self._prefix + str(next(self._ids))

    async def _ask(self, msg: Any) -> dict:
        """One question answered by one message with its id (or an error, raised)."""
        self._ensure_tasks()
        rid = str(msg.id)
        queue: asyncio.Queue = asyncio.Queue(self.max_buffered)
        self._queues[rid] = queue
        try:
            await self._send(cp.encode(msg))
            return _control_result(await self._next(queue))
        finally:
            self._queues.pop(rid, None)
            self._ended.discard(rid)

    async def stream(self, prompt: str | list[int], params: SamplingParams | dict | None = None,
                     *, request_id: str | None = None, priority: int = 0,
                     ttl_ms: int | None = None,
                     routing_key: str | None = None) -> AsyncIterator[StreamDelta]:
        self._ensure_tasks()
        rid = request_id or self._new_id()
        if rid in self._queues:
            raise ValueError(f"request id {rid!r} is already in flight on this client")
        queue: asyncio.Queue = asyncio.Queue(self.max_buffered)
        self._queues[rid] = queue
        remaining = _n_of(params)
        try:
            await self._send(_submit_msg(rid, prompt, params, priority, ttl_ms,
                                         routing_key))
            while remaining:
                msg = await self._next(queue)
                if isinstance(msg, cp.Error):
                    _raise_for(msg)
                d = msg.to_delta()
                if d.finish_reason is not None:
                    remaining -= 1
                yield d
        finally:
            self._queues.pop(rid, None)
            self._ended.discard(rid)
            if remaining:  # cancelled or abandoned: free the engine's work
                await self._send(cp.encode(cp.Abort(rid)), best_effort=True)

    async def _next(self, queue: asyncio.Queue) -> Any:
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
        rid = kwargs.pop("request_id", None) or self._new_id()
        acc = RequestAccumulator(_n_of(params), prompt if isinstance(prompt, str) else None)
        async for d in self.stream(prompt, params, request_id=rid, **kwargs):
            acc.add(d)
        return acc.to_output(rid)

    async def abort(self, request_id: str) -> None:
        await self._send(cp.encode(cp.Abort(request_id)))

    def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        self._sock.disable_monitor()
        self._monitor.close(0)
        self._sock.close(0)
        self._ctx.term()
