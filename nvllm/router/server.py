"""The router: one client endpoint (protocol v1, docs/protocol.md) in front of several
engine replicas, each request forwarded to one replica's leader as a client.

Clients (``nvllm.Client``, ``AsyncClient``, the HTTP gateway) attach to it unchanged. For
each ``submit`` the policy (nvllm/router/policy.py) picks a replica; the router renames
the request (its own id, unique across clients) and relays every message the replica
streams back under the client's id, so a replica never sees two clients' ids collide.
``abort`` follows the request; a client silent past ``client_timeout_s`` has its requests
aborted on their replicas, as a leader does. ``info``, ``health`` and ``metrics`` answer
for the whole set (metrics with a ``replica`` label per replica, plus the router's own).
The RL control messages go to every replica, answered once all did
(nvllm/router/control_relay.py).

One thread: it reads the client socket and every replica's socket, never blocking on a
send (a client that stops reading has an outbox, bounded as the leader's is). A replica
whose connection drops gets no new requests until it answers ``health`` ready again, and
each request it had is replayed on another replica from what its client was shown
(nvllm/router/replay.py), or, where that cannot be, ends with one ``engine_unavailable``
error saying why.
"""

from __future__ import annotations

import itertools
import logging
import os
import secrets
import threading
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any

import msgspec
import zmq

from nvllm.common import client_protocol as cp
from nvllm.common.zmq_utils import (
    ClientOutboxes,
    check_curve_bind,
    curve_server,
    make_socket,
)
from nvllm.router.control_relay import GROUP_OPS, GROUP_REFUSAL, RELAYED_OPS, ControlRelay
from nvllm.router.metrics import PrefixAccuracy, merge_expositions, router_exposition
from nvllm.router.policy import (
    CacheAware,
    CacheAwareConfig,
    NoReplicaError,
    StickyRoutes,
    make_policy,
    route,
)
from nvllm.router.replay import Flight
from nvllm.router.replica import ReplicaLink

logger = logging.getLogger(__name__)

POLL_MS = 50
METRICS_WAIT_S = 2.0  # replicas that have not sent their metrics by then are left out
FLUSH_ON_CLOSE_S = 2.0
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
_DECODE = msgspec.msgpack.Decoder()
_ENCODE = msgspec.msgpack.Encoder()


@dataclass(frozen=True, slots=True)
class RouterConfig:
    """How the router routes and bounds its clients (the bounds are the leader's own
    settings, by the same names)."""

    policy: str = "cache_aware"
    cache_aware: CacheAwareConfig = field(default_factory=CacheAwareConfig)
    max_sticky_keys: int = 65536
    max_key_tokens: int = 32768  # a prompt's routing key: at most its first this many ids
    replica_timeout_s: float = 10.0  # no health answer this long: no new requests there
    client_timeout_s: float = 10.0
    max_request_id_bytes: int = 256
    max_client_outbox: int = 4096
    max_client_frames_per_step: int = 256


@dataclass(slots=True)
class _MetricsAsk:
    client: bytes
    waiting: set[int]
    texts: dict[int, str]
    deadline: float


def _valid_id(rid: Any, max_bytes: int) -> bool:
    if isinstance(rid, str):
        return len(rid.encode("utf-8", "surrogatepass")) <= max_bytes
    return type(rid) is int and INT64_MIN <= rid <= INT64_MAX


class Router:
    def __init__(self, replica_endpoints: list[str], config: RouterConfig | None = None, *,
                 host: str = "127.0.0.1", port: int = 0,
                 curve_key_dir: str | os.PathLike | None = None,
                 max_frame_bytes: int = 64 << 20) -> None:
        if not replica_endpoints:
            raise ValueError("a router needs at least one replica endpoint")
        check_curve_bind(host, curve_key_dir, "the router's client endpoint")
        self.config = config or RouterConfig()
        self._pong = cp.Pong(boot=secrets.token_hex(8))
        self.policy = make_policy(self.config.policy, self.config.cache_aware)
        self.sticky = StickyRoutes(self.config.max_sticky_keys)
        self.ctx = zmq.Context()
        self.front = make_socket(self.ctx, zmq.ROUTER, max_msg_bytes=max_frame_bytes)
        self.front.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.front.setsockopt(zmq.ROUTER_HANDOVER, 1)
        self._auth = None
        self.links: list[ReplicaLink] = []
        try:
            if curve_key_dir is not None:
                self._auth = curve_server(self.ctx, self.front, curve_key_dir)
            if port:
                self.front.bind(f"tcp://{host}:{port}")
            else:
                port = self.front.bind_to_random_port(f"tcp://{host}")
            # Keyed to the replicas too: one on another host admits only keyed clients.
            self.links = [ReplicaLink.connect(self.ctx, i, ep, max_frame_bytes,
                                              curve_key_dir)
                          for i, ep in enumerate(replica_endpoints)]
        except BaseException:
            self.close()
            raise
        self.endpoint = f"tcp://{host}:{port}"
        self.draining = False
        self.decisions: Counter[str] = Counter()
        self.routed_to: Counter[int] = Counter()  # replica -> requests routed there
        # By the lost replica: requests resumed on another, and those that could not be.
        self.replayed: Counter[int] = Counter()
        self.failed_by_replica_loss: Counter[int] = Counter()
        self.prefix_accuracy = PrefixAccuracy()  # the tree's predictions against usage
        self._flights: dict[int, Flight] = {}  # the router's request id -> whose
        self._by_client: dict[bytes, dict[Any, int]] = defaultdict(dict)
        self._last_seen: dict[bytes, float] = {}
        self._outbox = ClientOutboxes(self.front, self.config.max_client_outbox)
        self._metrics_asks: list[_MetricsAsk] = []
        self.control = ControlRelay()
        self._ids = itertools.count(1)
        self._last_sweep = time.monotonic()

    # ---- the loop ----------------------------------------------------------------------

    def ready(self) -> bool:
        """Whether every replica is up (what a launcher waits for before announcing)."""
        return all(link.up for link in self.links)

    def serve(self, stop: threading.Event, shutdown_timeout_s: float = 0.0) -> None:
        """Route until `stop` is set; then refuse new requests, let those in flight finish
        for up to shutdown_timeout_s, abort the rest and relay their final messages."""
        poller = zmq.Poller()
        poller.register(self.front, zmq.POLLIN)
        for link in self.links:
            poller.register(link.sock, zmq.POLLIN)
            poller.register(link.monitor, zmq.POLLIN)
        while not stop.is_set():
            self._turn(poller)
        self.draining = True
        deadline = time.monotonic() + shutdown_timeout_s
        while self._flights and time.monotonic() < deadline:
            self._turn(poller)
        for rid, f in list(self._flights.items()):
            self.links[f.replica].send(cp.Abort(rid))
        deadline = time.monotonic() + FLUSH_ON_CLOSE_S
        while (self._flights or self._outbox) and time.monotonic() < deadline:
            self._turn(poller)

    def _turn(self, poller: zmq.Poller) -> None:
        poller.poll(10 if self._outbox else POLL_MS)
        for _ in range(self.config.max_client_frames_per_step):
            if not self.front.poll(0):
                break
            frames = self.front.recv_multipart()
            self._handle(frames[0], frames[-1])
        for link in self.links:
            for _ in range(4096):  # bounded: the client socket gets its turn
                if not link.sock.poll(0):
                    break
                self._from_replica(link, link.sock.recv())
            if link.link_events():
                self._replica_lost(link)
        now = time.monotonic()
        for link in self.links:
            link.poll_health(now, self.config.replica_timeout_s)
        self._answer_metrics(now)
        for client, answer in self.control.done():
            self._send(client, answer)
        self._outbox.flush()
        self._sweep_silent_clients(now)

    # ---- to clients --------------------------------------------------------------------

    def _send(self, client: bytes, msg: Any) -> None:
        frame = cp.encode(msg) if isinstance(msg, cp.ServerMessage) else _ENCODE.encode(msg)
        # A pong is only news while it is fresh: never queued.
        if not self._outbox.send(client, frame, queue=not isinstance(msg, cp.Pong)):
            self._evict(client)

    def _evict(self, client: bytes) -> None:
        """A client that stopped reading: its requests end on their replicas."""
        live = self._by_client.pop(client, {})
        logger.warning("client %s stopped reading: %d request(s) aborted", client.hex()[:10],
                       len(live))
        self._outbox.pop(client, None)
        for rid in live.values():
            self._drop(rid, abort=True)

    def _error(self, client: bytes, rid: Any, code: str, message: str) -> None:
        logger.log(logging.WARNING if code in cp.HOSTILE_CODES else logging.INFO,
                   "client %s: %s: %s", client.hex()[:10], code, message[:200])
        self._send(client, cp.Error(rid, code, message))

    # ---- from clients ------------------------------------------------------------------

    def _handle(self, client: bytes, payload: bytes) -> None:
        try:
            self._handle_one(client, payload)
        except Exception:  # a bug reached by one frame must not end the loop
            logger.exception("error while routing a client frame")
            self._error(client, None, "internal_error", "the router failed to handle this "
                                                        "message; it is still serving")

    def _handle_one(self, client: bytes, payload: bytes) -> None:
        self._last_seen[client] = time.monotonic()
        try:
            msg = _DECODE.decode(payload)
        except (msgspec.DecodeError, RecursionError, ValueError, OverflowError):
            return self._error(client, None, "bad_frame", "the frame is not valid msgpack")
        if not isinstance(msg, dict):
            return self._error(client, None, "bad_frame", "a message is a msgpack map")
        if msg.get("v", cp.PROTOCOL_VERSION) != cp.PROTOCOL_VERSION:
            return self._error(client, None, "bad_version", "protocol version must be 1 "
                                                            "(the router speaks version 1)")
        op = msg.get("op")
        if op == "ping":
            return self._send(client, self._pong)
        if op == "submit":
            return self._submit(client, msg)
        if op == "abort":
            rid = self._by_client.get(client, {}).get(msg.get("id"))
            if rid is not None:
                self._flights[rid].aborted = True  # a replay is aborted too
                self.links[self._flights[rid].replica].send(cp.Abort(rid))
            return None
        if op == "info":
            return self._info(client)
        if op == "health":
            return self._health(client)
        if op == "metrics":
            return self._ask_metrics(client)
        if op in RELAYED_OPS:
            if self.draining:
                return self._error(client, None, "engine_unavailable", "the router is "
                                                                       "shutting down")
            if not self.control.start(client, msg, self.links):
                return self._error(client, None, "engine_unavailable",
                                   f"no replica is up ({self._why_down()})")
            return None
        if op in ("tokenize", "detokenize"):  # a front end then uses its own tokenizer
            rid = msg.get("id")
            return self._error(client, rid if _valid_id(rid, self.config.max_request_id_bytes)
                               else None, "bad_op", f"the data-parallel router does not "
                               f"answer {op}: use the model's tokenizer on the client")
        if op in GROUP_OPS:
            return self._error(client, None, "bad_op", GROUP_REFUSAL.format(op=op))
        return self._error(client, None, "bad_op", "unknown op (expected one of abort, "
                                                   "health, info, metrics, ping, submit, "
                                                   + ", ".join(RELAYED_OPS) + ")")

    def _submit(self, client: bytes, msg: dict[str, Any]) -> None:
        rid, limit = msg.get("id"), self.config.max_request_id_bytes
        if not _valid_id(rid, limit):
            return self._error(client, None, "invalid_request", f"id must be a string of at "
                               f"most {limit} bytes (max_request_id_bytes) or an int64")
        key = msg.get("routing_key")
        if key is not None and not (isinstance(key, str) and _valid_id(key, limit)):
            return self._error(client, rid, "invalid_request", f"routing_key must be a "
                               f"string of at most {limit} bytes (max_request_id_bytes)")
        if self.draining:
            return self._error(client, rid, "engine_unavailable", "the router is shutting "
                                                                  "down")
        live = self._by_client[client]
        if rid in live:
            return self._error(client, rid, "duplicate_id",
                               "this request id is already in flight on this connection")
        tokens = self._routing_tokens(msg)
        tree = getattr(self.policy, "tree", None)  # read before route() inserts the prompt
        matched = tree.match(tokens) if tree is not None and tokens[:1] != [-1] else None
        try:
            replica, decision = route(self.policy, self.sticky, tokens,
                                      key, [lk.load for lk in self.links],
                                      [lk.up for lk in self.links])
        except NoReplicaError:
            return self._error(client, rid, "engine_unavailable",
                               f"no replica is up ({self._why_down()})")
        ours = next(self._ids)
        msg["id"] = ours
        link = self.links[replica]
        if not link.send(msg):
            return self._error(client, rid, "engine_unavailable",
                               f"replica {replica} cannot take requests now")
        self.decisions[decision] += 1
        self.routed_to[replica] += 1
        params = msg.get("params")
        n = params.get("n", 1) if isinstance(params, dict) else 1
        self._flights[ours] = Flight(client, rid, replica,
                                     n if type(n) is int and n >= 1 else 1, msg)
        if matched is not None:
            self._flights[ours].predicted = (replica, matched.get(replica, 0))
        live[rid] = ours
        link.load += 1

    def _routing_tokens(self, msg: dict[str, Any]) -> list[int]:
        """The prompt as the policy sees it: its token ids, or for a text prompt its UTF-8
        bytes after a -1 (no token id), so text never matches ids. Only a head of
        max_key_tokens: a prefix decides the route."""
        cap = self.config.max_key_tokens
        ids = msg.get("prompt_token_ids")
        if isinstance(ids, list):
            head = ids[:cap]
            return head if all(type(t) is int for t in head) else []
        text = msg.get("prompt")
        if isinstance(text, str):
            return [-1, *text[:cap].encode("utf-8", "surrogatepass")[:cap]]
        return []

    def _why_down(self) -> str:
        return "; ".join(f"replica {lk.index}: {lk.reason or 'starting'}"
                         for lk in self.links if not lk.up)

    def _info(self, client: bytes) -> None:
        up = [lk for lk in self.links if lk.up] or [lk for lk in self.links if lk.info]
        if not up:
            return self._error(client, None, "engine_unavailable",
                               f"no replica has answered yet ({self._why_down()})")
        first = up[0].info
        assert first is not None
        self._send(client, cp.Info(
            cp.PROTOCOL_VERSION, first["model"], first.get("model_path"),
            min(lk.info["max_model_len"] for lk in up if lk.info),
            first["vocab_size"], sum(lk.info["kv_capacity_tokens"] for lk in up if lk.info),
            first["block_size"], first["tensor_parallel_size"],
            any(lk.up for lk in self.links) and not self.draining))

    def _health(self, client: bytes) -> None:
        up = sum(lk.up for lk in self.links)
        if self.draining:
            return self._send(client, cp.Health(False, "shutting down"))
        if not up:
            return self._send(client, cp.Health(False, f"no replica is up "
                                                       f"({self._why_down()})"))
        reason = None if up == len(self.links) else (
            f"{up} of {len(self.links)} replicas up ({self._why_down()})")
        self._send(client, cp.Health(True, reason))

    def _ask_metrics(self, client: bytes) -> None:
        waiting = {lk.index for lk in self.links if lk.up and lk.ask(cp.MetricsRequest())}
        self._metrics_asks.append(_MetricsAsk(client, waiting, {},
                                              time.monotonic() + METRICS_WAIT_S))
        self._answer_metrics(time.monotonic())

    def _answer_metrics(self, now: float) -> None:
        while self._metrics_asks and (not self._metrics_asks[0].waiting
                                      or now > self._metrics_asks[0].deadline):
            ask = self._metrics_asks.pop(0)
            own = router_exposition(self)
            self._send(ask.client, cp.Metrics(merge_expositions(ask.texts) + own))

    # ---- from replicas -----------------------------------------------------------------

    def _from_replica(self, link: ReplicaLink, payload: bytes) -> None:
        try:
            msg = _DECODE.decode(payload)
        except (msgspec.DecodeError, RecursionError, ValueError, OverflowError):
            return None
        if not isinstance(msg, dict):
            return None
        op, rid = msg.get("op"), msg.get("id")
        if op in ("output", "error") and rid is not None:
            return self._relay(rid, msg)
        asked = op if op != "error" else (link.pending[0] if link.pending else "")
        link.answered(asked)
        if asked in RELAYED_OPS and self.control.answered(link.index, asked, msg):
            return None
        if op == "health":
            link.ready = bool(msg.get("ready"))
            link.reason = None if link.ready else (msg.get("reason") or "not ready")
        elif op == "info":
            link.info = msg
            if isinstance(self.policy, CacheAware):
                self.policy.set_capacity(link.index, int(msg["kv_capacity_tokens"]))
        elif op == "metrics":
            for ask in self._metrics_asks:
                if link.index in ask.waiting:
                    ask.waiting.discard(link.index)
                    ask.texts[link.index] = str(msg.get("text", ""))
                    break
        return None

    def _relay(self, rid: Any, msg: dict[str, Any]) -> None:
        f = self._flights.get(rid)
        if f is None:  # its client was evicted or went silent, or the replica was lost
            return
        msg["id"] = f.client_rid
        if msg.get("op") == "output":
            f.forwarded(msg)
        self._send(f.client, msg)
        if msg.get("op") == "error":
            f.remaining = 0
        elif msg.get("finish_reason") is not None:
            f.remaining -= 1
            if f.predicted is not None and f.predicted[0] == f.replica:  # not a replay
                info = self.links[f.replica].info or {}
                self.prefix_accuracy.answered(f.replica, f.predicted[1], msg.get("usage"),
                                              int(info.get("block_size", 16)))
                f.predicted = None  # once per request, not per completion
        if f.remaining <= 0:
            self._drop(rid)

    def _drop(self, rid: int, *, abort: bool = False) -> None:
        f = self._flights.pop(rid, None)
        if f is None:
            return
        self.links[f.replica].load -= 1
        live = self._by_client.get(f.client)
        if live is not None:
            live.pop(f.client_rid, None)
        if abort:
            self.links[f.replica].send(cp.Abort(rid))

    def _replica_lost(self, link: ReplicaLink) -> None:
        """Its connection dropped: every request it had is replayed elsewhere, or ends
        here with one error saying why it could not be."""
        lost = [rid for rid, f in self._flights.items() if f.replica == link.index]
        logger.error("replica %d (%s) is gone: %s; replaying its %d request(s) in flight",
                     link.index, link.endpoint, link.reason, len(lost))
        self.policy.replica_lost(link.index)
        for rid in lost:
            f = self._flights[rid]
            why = f.why_not_replayable() or self._replay(rid, f)
            if why is not None:
                self.failed_by_replica_loss[link.index] += 1
                self._send(f.client, cp.Error(f.client_rid, "engine_unavailable", (
                    f"replica {link.index} went away while this request ran, and it "
                    f"could not be replayed on another: {why} (docs/data-parallel.md)")))
                self._drop(rid)
        for ask in self._metrics_asks:
            ask.waiting.discard(link.index)
        self.control.lost(link.index)

    def _replay(self, rid: int, f: Flight) -> str | None:
        """Resume `f` on another replica under a new id (the lost replica's late messages,
        if any, then match nothing); None when sent, else why not."""
        try:
            replica, _ = route(self.policy, self.sticky, self._routing_tokens(f.submit),
                               f.submit.get("routing_key"), [lk.load for lk in self.links],
                               [lk.up for lk in self.links])
        except NoReplicaError:
            return f"no other replica is up ({self._why_down()})"
        ours = next(self._ids)
        link = self.links[replica]
        if not link.send(f.resume_submit(ours)):
            return f"replica {replica} cannot take requests now"
        if f.aborted:
            link.send(cp.Abort(ours))  # it ends there, with the final message it owes
        self.replayed[f.replica] += 1
        self.links[f.replica].load -= 1
        del self._flights[rid]
        f.replica, f.replays = replica, f.replays + 1
        self._flights[ours] = f
        self._by_client[f.client][f.client_rid] = ours
        link.load += 1
        logger.info("request %r of client %s replayed on replica %d after %d token(s)",
                    f.client_rid, f.client.hex()[:10], replica, len(f.token_ids))
        return None

    def _sweep_silent_clients(self, now: float) -> None:
        if now - self._last_sweep < 0.5:
            return
        self._last_sweep = now
        limit = self.config.client_timeout_s
        for client, live in list(self._by_client.items()):
            if live and now - self._last_seen.get(client, now) > limit:
                logger.warning("client silent for %.0f s: aborting its %d request(s)",
                               limit, len(live))
                for rid in list(live.values()):
                    self._drop(rid, abort=True)
            if not self._by_client.get(client):
                self._by_client.pop(client, None)
                if client not in self._outbox:
                    self._last_seen.pop(client, None)

    def close(self) -> None:
        for link in self.links:
            link.close()
        self.front.close(linger=int(FLUSH_ON_CLOSE_S * 1000))
        if self._auth is not None:
            self._auth.stop()
            self._auth = None
        self.ctx.term()
