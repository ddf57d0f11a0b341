"""The leader's client endpoint: a ZMQ ROUTER speaking protocol v1 (docs/protocol.md).

One thread runs both the socket and the engine: between steps it drains every message
that arrived (never blocking while requests run), and when idle it blocks on the socket.
Frames are msgpack maps; anything malformed gets an error reply and changes nothing.
Frames over `max_frame_bytes` never reach Python: ZMQ drops them and disconnects the
sender. A non-loopback bind requires CURVE (`curve_key_dir`, see common/zmq_utils.py):
only clients whose public key is authorised complete the handshake.
"""

from __future__ import annotations

import copy
import itertools
import logging
import os
import secrets
import threading
import time
from collections import OrderedDict, defaultdict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import zmq

from nvllm.common import client_protocol as cp
from nvllm.common import trace
from nvllm.common.client_decode import decode_client_frame
from nvllm.common.client_limits import client_limits
from nvllm.common.errors import EngineDeadError, Overloaded, RequestRejected
from nvllm.common.zmq_utils import (
    ClientOutboxes,
    check_curve_bind,
    curve_server,
    make_socket,
)
from nvllm.leader.engine import LLMEngine
from nvllm.leader.grammar import GrammarError
from nvllm.leader.output_processor import EngineOutput
from nvllm.leader.rollout_control import MESSAGES as ROLLOUT_MESSAGES
from nvllm.leader.rollout_control import RolloutControl
from nvllm.leader.sleep_control import MESSAGES as SLEEP_MESSAGES
from nvllm.leader.sleep_control import SleepControl
from nvllm.leader.tokenize_control import MESSAGES as TOKENIZE_MESSAGES
from nvllm.leader.tokenize_control import TokenizeControl

logger = logging.getLogger(__name__)

# Default frame limit (on the wire: CURVE adds 33 bytes per frame); a 1M-token prompt is
# ~5 MiB of msgpack.
MAX_FRAME_BYTES = 64 << 20
MIN_FRAME_BYTES = 1024
IDLE_POLL_MS = 100
FLUSH_ON_CLOSE_S = 2.0  # shutdown: how long final messages may take to leave
# Text prompts longer than this are tokenized on a thread of their own, so a big prompt
# never stalls the step loop (shorter ones cost less than the hand-off).
INLINE_TOKENIZE_CHARS = 2048
_EVICTED_REMEMBERED = 4096
_LOG_PER_S = 10


@dataclass(slots=True)
class _Owner:
    client: bytes
    client_rid: Any
    remaining: int  # completions that have not sent their final message yet
    aborted: bool = False  # while its prompt is still being tokenized


class EngineServer:
    def __init__(self, engine: LLMEngine, host: str = "127.0.0.1", port: int = 0,
                 model_name: str | None = None, *,
                 curve_key_dir: str | os.PathLike | None = None,
                 max_frame_bytes: int = MAX_FRAME_BYTES) -> None:
        check_curve_bind(host, curve_key_dir, "the client endpoint")
        self._pong = cp.Pong(boot=secrets.token_hex(8))
        if not isinstance(max_frame_bytes, int) or max_frame_bytes < MIN_FRAME_BYTES:
            # The limit also applies to handshake commands (CURVE's is ~300 bytes): below
            # this floor no client could even connect.
            raise ValueError(f"max_frame_bytes must be an integer >= {MIN_FRAME_BYTES}, got "
                             f"{max_frame_bytes!r}")
        self.engine = engine
        self.limits = client_limits(engine.config)
        self.model_name = model_name or engine.config.model
        self.max_frame_bytes = max_frame_bytes
        self.ctx = zmq.Context()
        self.sock = make_socket(self.ctx, zmq.ROUTER, max_msg_bytes=max_frame_bytes)
        # A message to a client that is gone or full raises instead of vanishing (it then
        # waits in that client's outbox), and a client that reconnects with its identity
        # (nvllm clients keep one per object) takes its streams over.
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
        self._auth = None
        try:
            if curve_key_dir is not None:  # CURVE options must be set before bind
                self._auth = curve_server(self.ctx, self.sock, curve_key_dir)
            if port:
                self.sock.bind(f"tcp://{host}:{port}")
            else:
                port = self.sock.bind_to_random_port(f"tcp://{host}")
        except BaseException:
            self.close()
            raise
        self.endpoint = f"tcp://{host}:{port}"
        self.dead: str | None = None
        self.draining = False  # shutting down: no new requests, in-flight ones finish
        self._owners: dict[str, _Owner] = {}  # internal request id -> who asked
        self._by_client: dict[bytes, dict[Any, str]] = defaultdict(dict)  # their id -> ours
        self._last_seen: dict[bytes, float] = {}
        self._ids = itertools.count()
        self._last_sweep = time.monotonic()
        self._log_window = [0.0, 0]  # [window start, bad frames logged in it]
        # Messages a client could not take yet, in order; bounded by max_client_outbox.
        self._outbox = ClientOutboxes(self.sock, engine.config.max_client_outbox)
        self._evicted: OrderedDict[bytes, None] = OrderedDict()
        # Submits whose text prompt is being tokenized off the loop, in arrival order.
        # Submits admitted once their long prompt is tokenized and/or their grammar is
        # compiled (each off the loop): internal id -> (submit, token ids, grammar).
        self._tokenizing: dict[str, tuple[cp.Submit, Future | None, Future | None]] = {}
        self._tokenize_pool: ThreadPoolExecutor | None = None
        self._tokenizer: Any = None  # a copy: fast tokenizers are not shared across threads
        self._cancelled: Any = None  # serve() sets it: a step waits no longer than this says
        self._abandoned = False  # shutdown gave up on a step in flight
        self._trace = trace.tracer("leader")  # None unless $NVLLM_TRACE is set
        # pause/resume and weight updates from clients (nvllm/leader/rollout_control.py)
        self.rollout = RolloutControl(self)
        self.sleep = SleepControl(self)  # sleep / wake_up (nvllm/leader/sleep_control.py)
        # tokenize / detokenize for front ends (nvllm/leader/tokenize_control.py)
        self.tokenize = TokenizeControl(self, INLINE_TOKENIZE_CHARS)

    # ---- sending -----------------------------------------------------------------------

    def _send(self, client: bytes, msg: Any) -> None:
        """Send now, or queue behind what the client has not taken yet; never block, and
        never drop a message silently (an overflowing client is evicted)."""
        if client in self._evicted:
            return
        if not self._outbox.send(client, cp.encode(msg)):
            self._evict(client)

    def _evict(self, client: bytes) -> None:
        """A client that stopped reading: a ROUTER cannot drop one peer, so its requests
        end, its queued messages go, and its later frames get an `evicted` error."""
        live = self._by_client.pop(client, {})
        logger.warning("client %s stopped reading (%d messages queued for it): evicted, "
                       "%d request(s) aborted", client.hex()[:10],
                       len(self._outbox.get(client, ())), len(live))
        self._outbox.pop(client, None)
        self._evicted[client] = None
        if len(self._evicted) > _EVICTED_REMEMBERED:
            self._evicted.popitem(last=False)
        self.engine.metrics.clients_evicted.inc()
        for ours in live.values():
            self._owners.pop(ours, None)
            self.engine.abort_request(ours)

    def _error(self, client: bytes, rid: Any, code: str, message: str) -> None:
        # Every refusal is logged (malformed frames as warnings), but a flood of garbage
        # must not become a flood of log lines.
        now = time.monotonic()
        if now - self._log_window[0] > 1.0:
            if self._log_window[1] > _LOG_PER_S:
                logger.warning("... and %d more error replies in the last second",
                               self._log_window[1] - _LOG_PER_S)
            self._log_window = [now, 0]
        self._log_window[1] += 1
        if self._log_window[1] <= _LOG_PER_S:
            logger.log(logging.WARNING if code in cp.HOSTILE_CODES else logging.INFO,
                       "client %s: %s: %s", client.hex()[:10], code, message[:200])
        self._send(client, cp.Error(rid, code, message))

    # ---- receiving ---------------------------------------------------------------------

    def _handle(self, frames: list[bytes]) -> None:
        """One client frame. Whatever it does, it is answered and the loop goes on."""
        client = frames[0]
        try:
            self._handle_one(client, frames[-1])
        except Exception:  # a bug reached by one frame must not end the serve loop
            logger.exception("error while handling a client frame")
            self._error(client, None, "internal_error", "the leader failed to handle this "
                                                        "message; it is still serving")

    def _handle_one(self, client: bytes, payload: bytes) -> None:
        if client in self._evicted:
            frame = cp.encode(cp.Error(None, "evicted", "this client stopped reading its "
                                       "messages and was evicted; connect anew"))
            self._outbox.try_send(client, frame)
            return
        self._last_seen[client] = time.monotonic()
        try:
            msg = decode_client_frame(payload, self.limits)
        except cp.ClientProtocolError as e:
            return self._error(client, e.request_id, e.code, e.message)
        if isinstance(msg, cp.Ping):
            return self._send(client, self._pong)
        if isinstance(msg, cp.Submit):
            return self._submit(client, msg)
        if isinstance(msg, cp.Abort):
            ours = self._by_client[client].get(msg.id)
            if ours is not None:
                self._abort(ours)
            return None
        if isinstance(msg, cp.InfoRequest):
            e = self.engine
            return self._send(client, cp.Info(
                cp.PROTOCOL_VERSION, self.model_name, e.config.source.tokenizer,
                e.config.max_model_len,
                e.vocab_size, e.capacity_tokens, e.config.block_size,
                e.config.tensor_parallel_size, self.dead is None))
        if isinstance(msg, cp.HealthRequest):
            ready = self.dead is None and not self.draining
            return self._send(client, cp.Health(ready, self.dead or (
                "shutting down" if self.draining else None)))
        if isinstance(msg, cp.MetricsRequest):
            return self._send(client, cp.Metrics(self.engine.metrics.exposition()))
        if isinstance(msg, TOKENIZE_MESSAGES):
            if self.draining:
                return self._error(client, msg.id, "engine_unavailable",
                                   "the engine is shutting down")
            return self.tokenize.handle(client, msg)
        if isinstance(msg, ROLLOUT_MESSAGES):
            if self.dead is not None:
                return self._error(client, None, "engine_unavailable", self.dead)
            return self.rollout.handle(client, msg)
        if isinstance(msg, SLEEP_MESSAGES):
            if self.dead is not None:
                return self._error(client, None, "engine_unavailable", self.dead)
            return self.sleep.handle(client, msg)
        raise AssertionError(f"unhandled client message {type(msg).__name__}")

    def _submit(self, client: bytes, msg: cp.Submit) -> None:
        rid = msg.id
        if self.dead is not None:
            return self._error(client, rid, "engine_unavailable", self.dead)
        if self.draining:
            return self._error(client, rid, "engine_unavailable", "the engine is shutting down")
        if rid in self._by_client[client]:
            return self._error(client, rid, "duplicate_id",
                               "this request id is already in flight on this connection")
        internal = f"srv-{next(self._ids)}"
        grammar = None
        if msg.params.structured_outputs is not None:
            try:
                grammar = self.engine.grammar_future(msg.params.structured_outputs)
            except (GrammarError, RequestRejected) as e:
                return self._error(client, rid, "invalid_request" if isinstance(
                    e, GrammarError) else "rejected", str(e))
        tokens = None
        if (msg.prompt is not None and len(msg.prompt) > INLINE_TOKENIZE_CHARS
                and self.engine.tokenizer is not None):
            tokens = self._tokenize_later(msg.prompt)
        if tokens is not None or (grammar is not None and not grammar.done()):
            self._tokenizing[internal] = (msg, tokens, grammar)
        elif not self._admit(client, msg, internal, msg.prompt_token_ids, grammar):
            return None
        self._owners[internal] = _Owner(client, rid, msg.params.n)
        self._by_client[client][rid] = internal

    def _admit(self, client: bytes, msg: cp.Submit, internal: str,
               token_ids: list[int] | None, grammar: Future | None = None) -> bool:
        """Process and admit a submit (its prompt as text, or as `token_ids`; its compiled
        grammar, done); an error is answered here."""
        try:
            self.engine.submit(msg.prompt if token_ids is None else None, msg.params,
                               prompt_token_ids=token_ids, request_id=internal,
                               priority=msg.priority, ttl_ms=msg.ttl_ms, grammar=grammar,
                               output_token_ids=msg.output_token_ids,
                               output_text_offset=msg.output_text_offset)
            return True
        except Overloaded as e:
            self._error(client, msg.id, "overloaded", str(e))
        except (ValueError, TypeError) as e:  # RequestRejected is a ValueError
            code = ("rejected" if isinstance(e, RequestRejected)
                    and not isinstance(e, GrammarError) else "invalid_request")
            self._error(client, msg.id, code, str(e))
        return False

    def off_loop(self, fn: Callable[[Any], Any]) -> Future:
        """`fn(tokenizer)` on the tokenizing thread, off the step loop."""
        if self._tokenize_pool is None:
            self._tokenize_pool = ThreadPoolExecutor(1, thread_name_prefix="nvllm-tokenize")
            tok = self.engine.tokenizer
            # Shared where its calls only read (FastTokenizer: the Rust tokenizer's encode
            # and decode borrow it immutably); transformers' tokenizers may reconfigure
            # their backend per call, so that thread gets its own copy.
            self._tokenizer = tok if getattr(tok, "shared_across_threads", False) \
                else copy.deepcopy(tok)
        return self._tokenize_pool.submit(lambda: fn(self._tokenizer))

    def _tokenize_later(self, prompt: str) -> Future:
        return self.off_loop(lambda tok: tok(prompt).input_ids)

    def _admit_tokenized(self) -> None:
        """Admit the submits whose prompts are tokenized and grammars compiled, in arrival
        order among those ready (a slow compile holds back only its own request)."""
        for internal, (msg, tokens, grammar) in list(self._tokenizing.items()):
            if (tokens is not None and not tokens.done()) or (
                    grammar is not None and not grammar.done()):
                continue
            del self._tokenizing[internal]
            owner = self._owners.get(internal)
            if owner is None:  # its client was evicted meanwhile
                continue
            ok = False
            if tokens is not None and tokens.exception() is not None:
                self._error(owner.client, msg.id, "rejected", "the prompt could not be "
                                                              "tokenized")
            else:
                ids = msg.prompt_token_ids if tokens is None else tokens.result()
                ok = self._admit(owner.client, msg, internal, ids, grammar)
            if not ok:
                self._owners.pop(internal, None)
                self._by_client[owner.client].pop(owner.client_rid, None)
            elif owner.aborted:
                self._emit(self.engine.abort_request(internal))

    def _abort(self, internal: str) -> None:
        owner = self._owners.get(internal)
        if internal in self._tokenizing and owner is not None:
            owner.aborted = True  # ends as soon as it is admitted, with its final messages
        else:
            self._emit(self.engine.abort_request(internal))

    # ---- outputs -----------------------------------------------------------------------

    def _emit(self, out: EngineOutput) -> None:
        """Send `out`'s deltas to their clients, each as it comes."""
        for k, d in enumerate(out.deltas):
            owner = self._owners.get(d.request_id)
            if owner is None:
                continue
            if self._trace is not None:  # stamped before the send: the client may stamp
                # its receipt before this thread runs again
                self._trace.message("out_sent", owner.client_rid, d.index,
                                    d.finish_reason is not None, step=out.step_of(k))
            self._send(owner.client, cp.Output.of(d, owner.client_rid))
            if d.finish_reason is not None:
                owner.remaining -= 1
                if owner.remaining == 0:
                    self._owners.pop(d.request_id, None)
                    self._by_client[owner.client].pop(owner.client_rid, None)

    def _sweep_silent_clients(self) -> bool:
        """Abort the requests of clients that stopped pinging (gone, or hung); at most
        every 0.5 s (returns whether it ran)."""
        now = time.monotonic()
        if now - self._last_sweep < 0.5:
            return False
        self._last_sweep = now
        limit = self.engine.config.client_timeout_s
        self.rollout.sweep(limit)
        for client, live in list(self._by_client.items()):
            if live and now - self._last_seen.get(client, now) > limit:
                logger.warning("client silent for %.0f s: aborting its %d request(s)", limit,
                               len(live))
                for ours in list(live.values()):
                    self._abort(ours)
            if not self._by_client.get(client):
                self._by_client.pop(client, None)
                self._last_seen.pop(client, None)
        for client in list(self._outbox):
            if client not in self._by_client and now - self._last_seen.get(client, 0) > limit:
                del self._outbox[client]  # replies to a client long gone
        return True

    def _fail_everything(self, error: str) -> None:
        self.dead = error.split("\n")[0]
        logger.error("engine unavailable: %s", error)
        for owner in self._owners.values():
            self._error(owner.client, owner.client_rid, "engine_unavailable", self.dead)
        self._owners.clear()
        self._by_client.clear()
        # The engine ended its requests itself before raising (LLMEngine._fail_all).

    # ---- the loop ----------------------------------------------------------------------

    def _drain(self, timeout_ms: int) -> None:
        """Read what clients sent, at most max_client_frames_per_step frames: the rest
        waits in ZMQ's queues (and, past its high-water mark, in the senders' own), so a
        flood delays its sender, not the running streams."""
        for _ in range(self.engine.config.max_client_frames_per_step):
            if not self.sock.poll(timeout_ms):
                return
            self._handle(self.sock.recv_multipart())
            timeout_ms = 0

    def serve(self, stop: threading.Event, shutdown_timeout_s: float = 0.0) -> None:
        """Admit and step until `stop` is set; idle waits block on the socket. Then stop
        admitting, let in-flight requests finish for up to shutdown_timeout_s, and abort
        the rest (each client still gets its final message)."""
        give_up_at: list[float] = []

        def past_shutdown_deadline() -> bool:
            # A step waiting on hung workers must not hold shutdown past its timeout.
            if not stop.is_set():
                return False
            if not give_up_at:
                give_up_at.append(time.monotonic() + shutdown_timeout_s)
            return time.monotonic() > give_up_at[0]

        self._cancelled = past_shutdown_deadline
        if self.engine.served_by is not None:
            raise RuntimeError(f"this engine is already served at {self.engine.served_by}")
        self.engine.served_by = self.endpoint
        try:
            self._serve(stop, shutdown_timeout_s)
        finally:
            self.engine.served_by = None

    def _serve(self, stop: threading.Event, shutdown_timeout_s: float) -> None:
        batch_wait = self.engine.config.batch_timeout_ms / 1000.0
        while not stop.is_set():
            busy = self.dead is None and self.engine.has_unfinished_requests() \
                and not self.rollout.settled
            self._drain(0 if busy else 5 if self._tokenizing or self.tokenize.pending
                        else IDLE_POLL_MS)
            self._admit_tokenized()
            self.tokenize.poll()
            if not busy and batch_wait and self.engine.has_unfinished_requests():
                # Idle until now: give more arrivals a moment to join the first prefill.
                deadline = time.monotonic() + batch_wait
                while (left := deadline - time.monotonic()) > 0:
                    self._drain(max(1, int(left * 1000)))
            self._step()
        self.draining = True
        deadline = time.monotonic() + shutdown_timeout_s
        while (self.dead is None and time.monotonic() < deadline and not self._abandoned
               and (self.engine.has_unfinished_requests() or self._tokenizing)):
            self._drain(0)
            self._admit_tokenized()
            self._step()
        self.tokenize.cancel_all("the engine is shutting down")
        for internal in list(self._tokenizing):  # never admitted: end them here
            msg, _, _ = self._tokenizing.pop(internal)
            owner = self._owners.pop(internal, None)
            if owner is not None:
                self._error(owner.client, msg.id, "engine_unavailable",
                            "the engine is shutting down")
        self._emit(self.engine.abort_all())
        self._drain(0)
        deadline = time.monotonic() + FLUSH_ON_CLOSE_S  # final messages get out, boundedly
        while self._outbox and time.monotonic() < deadline:
            self._outbox.flush()
            if self._outbox:
                self._drain(10)

    def _step(self) -> None:
        self._outbox.flush()
        swept = self._sweep_silent_clients()
        if self.dead is not None:
            return
        try:
            if self.engine.has_unfinished_requests() and not self.rollout.settled:
                self._emit(self.engine.step(self._cancelled))
                self.rollout.poll()
                self.sleep.poll()
            elif swept:
                # Idle: a worker death (or, with restart_workers, its recovery) must not
                # wait for the next request; health answers the truth meanwhile.
                self._emit(self.engine.check_workers())
        except EngineDeadError as e:
            self._fail_everything(str(e))
        except KeyboardInterrupt:  # shutdown's deadline passed while the workers hung
            logger.warning("shutdown: the step in flight did not finish in time; ending "
                           "every request")
            self._abandoned = True

    def close(self) -> None:
        if self._tokenize_pool is not None:
            self._tokenize_pool.shutdown(wait=False, cancel_futures=True)
        # What ZMQ still holds for clients leaves within the linger, never later.
        self.sock.close(linger=int(FLUSH_ON_CLOSE_S * 1000))
        if self._auth is not None:  # its ZAP socket lives on ctx: stop it before term
            self._auth.stop()
            self._auth = None
        self.ctx.term()
