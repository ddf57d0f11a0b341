"""The leader's sockets to one worker group: send plans, receive results, watch liveness.

One PUSH socket per worker (every rank gets every plan; one serialization, N sends), one
PULL socket that all ranks push to (rank 0's results, every rank's ready and error
messages), and a ROUTER that answers heartbeats (libzmq answers them, without the GIL).
Only the group's own workers can reach them: on one host they are ``ipc://`` paths
inside a private (0700) folder, which no other user can enter; across nodes they bind tcp
on the master address as CURVE servers that admit the workers' key (DIR/worker.key) only,
never a client key.

The leader never blocks on a receive for long: between short polls it asks whether every
worker still lives: the launcher's process check for local workers, and for every rank
(local or on another node) the heartbeats a background thread answers.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import msgpack
import zmq

from nvllm.common import trace, worker_protocol
from nvllm.common.errors import EngineDeadError, ProtocolError
from nvllm.common.zmq_utils import (
    bind_ipc,
    bind_random,
    curve_server,
    curve_server_keys,
    make_socket,
)

logger = logging.getLogger(__name__)

POLL_MS = 100
CANCEL_POLL_MS = 20  # how soon a deferred Ctrl-C is noticed while waiting
# Leader and worker frames are small; anything bigger than this is hostile or broken.
MAX_WORKER_FRAME_BYTES = 256 << 20


class HeartbeatMonitor:
    """Answers the workers' heartbeats on a ROUTER socket without the GIL, and records when
    each rank was last heard from.

    The answer is libzmq's own: ``zmq.proxy_steerable`` with the ROUTER as both its ends
    reflects every ping to its sender from a native thread that never takes the GIL. A
    Python thread could not answer while the leader holds the GIL: a full garbage
    collection over a heap holding torch and transformers, or a C extension call, takes
    ~0.1 s on a quiet machine and seconds on a loaded one, and workers would leave a
    leader that is only busy. The proxy's capture copy (PUB, which drops rather than
    blocks) feeds a Python thread that keeps ``last_seen``.

    A rank is judged only after its first heartbeat (start-up has its own timeout); from
    then on, `timeout_s` of silence means the process is dead, stopped, or unreachable.
    A killed process is found sooner: each rank's plan socket has exactly one peer, so a
    disconnect seen by that socket's monitor that is not undone within DISCONNECT_GRACE_S
    names the rank at once.
    """

    DISCONNECT_GRACE_S = 1.0

    def __init__(self, ctx: zmq.Context, num_workers: int, bind: Callable[[zmq.Socket], str],
                 timeout_s: float, secure: Callable[[zmq.Socket], None] = lambda s: None,
                 per_rank: list[zmq.Socket] = ()) -> None:
        """`bind` binds the ROUTER and returns its endpoint."""
        self.num_workers = num_workers
        self.timeout_s = timeout_s
        self.last_seen: dict[int, float] = {}
        self.where: dict[int, str] = {}
        self.disconnected: dict[int, float] = {}
        router = make_socket(ctx, zmq.ROUTER, max_msg_bytes=4096)
        secure(router)
        self.endpoint = bind(router)
        name = f"inproc://nvllm-heartbeats-{id(self):x}"
        capture = make_socket(ctx, zmq.PUB)
        capture.bind(f"{name}-capture")
        self._seen = make_socket(ctx, zmq.SUB)
        self._seen.setsockopt(zmq.SUBSCRIBE, b"")
        self._seen.connect(f"{name}-capture")
        steer = make_socket(ctx, zmq.PAIR)
        steer.bind(f"{name}-control")
        self._control = make_socket(ctx, zmq.PAIR)
        self._control.connect(f"{name}-control")
        self._monitors = [s.get_monitor_socket(zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED)
                          for s in per_rank]
        self._stop = threading.Event()
        self._last_loop = time.monotonic()
        self._echo = threading.Thread(target=self._answer, args=(router, capture, steer),
                                      daemon=True, name="heartbeat-echo")
        self._echo.start()
        self._thread = threading.Thread(target=self._run, daemon=True, name="heartbeats")
        self._thread.start()

    @staticmethod
    def _answer(router: zmq.Socket, capture: zmq.Socket, steer: zmq.Socket) -> None:
        """Reflect every ping to its sender until close() says TERMINATE (pyzmq runs the
        proxy with the GIL released)."""
        try:
            zmq.proxy_steerable(router, router, capture, steer)
        except zmq.ZMQError:
            pass  # the context is being terminated
        for s in (router, capture, steer):
            s.close(0)

    def _run(self) -> None:
        from zmq.utils.monitor import recv_monitor_message

        poller = zmq.Poller()
        for s in (self._seen, *self._monitors):
            poller.register(s, zmq.POLLIN)
        while not self._stop.is_set():
            ready = dict(poller.poll(POLL_MS))
            now = time.monotonic()
            if now - self._last_loop > self.timeout_s / 2:
                # This thread did not run (the leader was stopped or starved): the silence
                # is ours, so every rank gets a fresh timeout instead of a verdict.
                for rank in self.last_seen:
                    self.last_seen[rank] = now
            self._last_loop = now
            for rank, mon in enumerate(self._monitors):
                if mon in ready:
                    event = recv_monitor_message(mon)["event"]
                    if event == zmq.EVENT_DISCONNECTED:
                        self.disconnected[rank] = time.monotonic()
                    else:
                        self.disconnected.pop(rank, None)
            while self._seen in ready:
                try:
                    self._note(self._seen.recv_multipart(zmq.NOBLOCK)[-1])
                except zmq.Again:
                    break
        for s in (self._seen, *self._monitors):
            s.close(0)

    def _note(self, frame: bytes) -> None:
        """Record one ping (the capture copy's last frame)."""
        try:
            rank, pid, host = msgpack.unpackb(frame, raw=False)
            if not (isinstance(rank, int) and 0 <= rank < self.num_workers):
                raise ValueError(f"rank {rank!r} out of range")
        except Exception as e:  # garbage from a stray peer: log, never crash
            logger.warning("dropping a malformed heartbeat: %s", e)
            return
        if rank not in self.last_seen:
            self.where[rank] = f"pid {pid} on {host}"
        self.last_seen[rank] = time.monotonic()

    def silent(self) -> dict[int, str]:
        """rank -> why it counts as dead, for every rank that does."""
        now, dead = time.monotonic(), {}
        if now - self._last_loop > self.timeout_s / 2:
            return dead  # our own thread has not run lately: no verdict on anyone yet
        for rank, seen in list(self.last_seen.items()):
            if now - seen > self.timeout_s:
                dead[rank] = (f"worker rank {rank} ({self.where.get(rank, '?')}) sent no "
                              f"heartbeat for {now - seen:.1f} s: it is hung, stopped, or "
                              "its host is unreachable")
        for rank, when in list(self.disconnected.items()):
            if now - when > self.DISCONNECT_GRACE_S:
                dead[rank] = (f"worker rank {rank} ({self.where.get(rank, '?')}) "
                              "disconnected: its process exited or its host is unreachable")
        return dead

    def close(self) -> None:
        self._stop.set()
        try:
            self._control.send(b"TERMINATE")
        except zmq.ZMQError:
            pass
        self._echo.join(timeout=2)
        self._control.close(0)
        self._thread.join(timeout=2)


class WorkerGroupClient:
    def __init__(self, num_workers: int, host: str = "127.0.0.1",
                 heartbeat_timeout_s: float = 4.0, curve_key_dir: str | None = None,
                 ipc_dir: str | None = None) -> None:
        """Binds every socket to an ``ipc://`` path in `ipc_dir` (a private folder the
        caller made, and removes after close: see zmq_utils.private_ipc_dir), or without
        it to a random tcp port on `host`. With `curve_key_dir`, every socket is also a
        CURVE server (keypair DIR/server.key_secret) admitting only the workers' public
        key DIR/worker.key (workers connect with DIR/worker.key_secret); the client keys
        in DIR/clients are refused here."""
        self.ctx = zmq.Context()
        self.num_workers = num_workers
        self.plan_socks = [make_socket(self.ctx, zmq.PUSH) for _ in range(num_workers)]
        self.result_sock = make_socket(self.ctx, zmq.PULL, max_msg_bytes=MAX_WORKER_FRAME_BYTES)
        self._auth = None

        def secure(sock: zmq.Socket) -> None:
            if curve_key_dir is None:
                return
            if self._auth is None:
                self._auth = curve_server(self.ctx, sock, curve_key_dir, workers=True)
            else:
                curve_server_keys(sock, curve_key_dir)

        def binder(name: str) -> Callable[[zmq.Socket], str]:
            if ipc_dir is not None:
                return lambda sock: bind_ipc(sock, ipc_dir, name)
            return lambda sock: bind_random(sock, host)

        try:
            for s in (*self.plan_socks, self.result_sock):
                secure(s)
            self.plan_endpoints = [binder(f"plan-{rank}")(s)
                                   for rank, s in enumerate(self.plan_socks)]
            self.result_endpoint = binder("result")(self.result_sock)
            self.heartbeats = HeartbeatMonitor(self.ctx, num_workers, binder("heartbeat"),
                                               heartbeat_timeout_s, secure, self.plan_socks)
        except BaseException:  # a missing key file, a bad ipc folder
            if self._auth is not None:
                self._auth.stop()
            self.ctx.destroy(0)
            raise
        # The launcher's process check: rank -> how it died, for its local workers.
        self.liveness_check: Callable[[], dict[int, str]] = dict
        self.dead: str | None = None
        self._closed = False
        self._trace = trace.tracer("leader")  # None unless $NVLLM_TRACE is set

    @property
    def heartbeat_endpoint(self) -> str:
        return self.heartbeats.endpoint

    def check_alive(self) -> str | None:
        """None while every rank lives; else what died (and the group stays dead)."""
        if self.dead is None:
            died = self._dead_ranks()
            if died:
                self.dead = died[min(died)]
                logger.error("%s", self.dead)
        return self.dead

    def _dead_ranks(self) -> dict[int, str]:
        # A process exit names the rank with its exit code: it wins over heartbeat silence.
        return {**self.heartbeats.silent(), **self.liveness_check()}

    def broadcast(self, msg: Any, ranks: list[int] | None = None) -> int:
        """Send `msg` to every rank (or to `ranks`). A send never blocks for good: while a
        rank's queue is full (or it has no connection) the liveness checks keep running,
        and after heartbeat_timeout_s the group counts as dead."""
        self._check_dead()
        data = worker_protocol.encode(msg)
        deadline = time.monotonic() + self.heartbeats.timeout_s
        for rank in range(len(self.plan_socks)) if ranks is None else ranks:
            sock = self.plan_socks[rank]
            while True:
                try:
                    sock.send(data, flags=zmq.NOBLOCK, copy=False)
                    break
                except zmq.Again:
                    pass
                if self.check_alive() is not None:
                    raise EngineDeadError(self.dead)
                if time.monotonic() > deadline:
                    self.dead = (f"worker rank {rank} took no plan for "
                                 f"{self.heartbeats.timeout_s:g} s (its plan queue is full or "
                                 "it has no connection): it is hung or gone")
                    logger.error("%s", self.dead)
                    raise EngineDeadError(self.dead)
                sock.poll(POLL_MS, zmq.POLLOUT)
        return len(data)

    def recv(self, timeout_s: float, cancelled: Callable[[], bool] | None = None) -> Any:
        """Next message from any worker; raises EngineDeadError on death or timeout, and
        KeyboardInterrupt, before taking a message, once `cancelled()` is true."""
        self._check_dead()
        deadline = time.monotonic() + timeout_s
        while True:
            if cancelled is not None and cancelled():
                raise KeyboardInterrupt
            if self.result_sock.poll(POLL_MS if cancelled is None else CANCEL_POLL_MS):
                data = self.result_sock.recv()
                try:
                    msg = worker_protocol.decode(data)
                except ProtocolError as e:
                    logger.error("dropping malformed frame from a worker: %s", e)
                    continue
                if self._trace is not None and isinstance(msg, worker_protocol.StepResult):
                    self._trace.event("result_recv", step=msg.step_id)
                if isinstance(msg, worker_protocol.WorkerError):
                    error = (f"worker rank {msg.rank} failed at step {msg.step_id}: "
                             f"{msg.message}\n{msg.traceback}")
                    # A peer's death surfaces on the survivors as a collective error;
                    # name the root cause first.
                    died = self._death_within(HeartbeatMonitor.DISCONNECT_GRACE_S + 0.5,
                                              msg.rank)
                    self.dead = error if died is None else f"{died}; then {error}"
                    logger.error("%s", self.dead)
                    raise EngineDeadError(self.dead)
                return msg
            if self.check_alive() is not None:
                raise EngineDeadError(self.dead)
            if time.monotonic() > deadline:
                # The watchdog: a step that never finishes is an error, not a hang.
                self.dead = (f"no answer from the workers within {timeout_s:.0f} s (a stuck "
                             "step or collective); raise step_timeout_s if steps are that slow")
                logger.error("%s", self.dead)
                raise EngineDeadError(self.dead)

    def _death_within(self, grace_s: float, reporter: int) -> str | None:
        """Another rank's death within grace_s (the reporter exits on purpose)."""
        deadline = time.monotonic() + grace_s
        while True:
            died = {r: d for r, d in self._dead_ranks().items() if r != reporter}
            if died:
                return died[min(died)]
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.05)

    def _check_dead(self) -> None:
        if self.dead is not None:
            raise EngineDeadError(self.dead)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.heartbeats.close()
        for s in (*self.plan_socks, self.result_sock):
            s.close(0)
        if self._auth is not None:
            self._auth.stop()
        self.ctx.term()
