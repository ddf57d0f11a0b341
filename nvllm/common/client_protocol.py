"""The client wire (docs/protocol.md): typed messages between clients and the leader.

Every frame is one msgpack map with an ``op``. ``decode_client_frame`` turns what a client
sent into one of the request types below, checking every field's type and limit once,
here; a frame that fails raises ``ClientProtocolError`` carrying the error code and the
request id to answer (never a ``repr`` of what the client sent). ``encode`` turns any
message into a frame; ``decode_server_frame`` is the lenient reader the clients use.
Nothing is ever unpickled. docs/protocol.md documents these types (a test checks it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

import msgpack

from nvllm.common.outputs import CompletionDelta
from nvllm.common.sampling_params import SamplingParams

PROTOCOL_VERSION = 1

# Error codes that mean a malformed or hostile frame (not a request the engine refused).
HOSTILE_CODES = frozenset({"bad_frame", "bad_op", "bad_version", "invalid_request"})

RequestId = str | int


class ClientProtocolError(ValueError):
    """A client frame that cannot be served: answered with ``error`` (code, message)."""

    def __init__(self, code: str, message: str, request_id: RequestId | None = None) -> None:
        super().__init__(message)
        self.code, self.message, self.request_id = code, message, request_id


# ---- client -> leader ------------------------------------------------------------------


@dataclass(slots=True)
class Submit:
    """Start a request: ``prompt`` or ``prompt_token_ids``, exactly one."""

    id: RequestId
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    params: SamplingParams = field(default_factory=SamplingParams)
    priority: int = 0  # lower runs first; ties first come, first served
    ttl_ms: float | None = None  # the request ends with "timeout" this long after arrival
    stream: bool = True  # False: one output per completion, holding everything
    OP: ClassVar[str] = "submit"


@dataclass(slots=True)
class Abort:
    id: RequestId
    OP: ClassVar[str] = "abort"


@dataclass(slots=True)
class InfoRequest:
    OP: ClassVar[str] = "info"


@dataclass(slots=True)
class HealthRequest:
    OP: ClassVar[str] = "health"


@dataclass(slots=True)
class MetricsRequest:
    OP: ClassVar[str] = "metrics"


@dataclass(slots=True)
class Ping:
    OP: ClassVar[str] = "ping"


# ---- leader -> client ------------------------------------------------------------------


@dataclass(slots=True)
class Output:
    """One ``CompletionDelta`` on the wire; ``id`` is the client's request id."""

    id: RequestId
    index: int
    token_ids: list[int]
    text: str
    logprobs: list | None
    finish_reason: str | None
    usage: dict | None = None
    OP: ClassVar[str] = "output"

    @classmethod
    def of(cls, delta: CompletionDelta, client_id: RequestId) -> Output:
        return cls(client_id, delta.index, delta.token_ids, delta.text, delta.logprobs,
                   delta.finish_reason, delta.usage)

    def to_delta(self) -> CompletionDelta:
        return CompletionDelta(str(self.id), self.index, self.token_ids, self.text,
                               self.logprobs, self.finish_reason, self.usage)


@dataclass(slots=True)
class Error:
    id: RequestId | None
    code: str
    message: str
    OP: ClassVar[str] = "error"


@dataclass(slots=True)
class Info:
    v: int
    model: str  # the served name
    model_path: str
    max_model_len: int
    vocab_size: int
    kv_capacity_tokens: int
    block_size: int
    tensor_parallel_size: int
    ready: bool
    OP: ClassVar[str] = "info"


@dataclass(slots=True)
class Health:
    ready: bool
    reason: str | None = None
    OP: ClassVar[str] = "health"


@dataclass(slots=True)
class Metrics:
    text: str  # Prometheus text exposition
    OP: ClassVar[str] = "metrics"


@dataclass(slots=True)
class Pong:
    OP: ClassVar[str] = "pong"


CLIENT_MESSAGES: tuple[type, ...] = (Submit, Abort, InfoRequest, HealthRequest,
                                     MetricsRequest, Ping)
SERVER_MESSAGES: tuple[type, ...] = (Output, Error, Info, Health, Metrics, Pong)
_BY_OP = {c.OP: c for c in CLIENT_MESSAGES}


# ---- encoding --------------------------------------------------------------------------


def to_map(msg: Any) -> dict[str, Any]:
    """The msgpack map of a message: ``op`` first, then its fields (``usage`` only when
    set; a Submit's params as a map without the engine-filled ``eos_token_ids``)."""
    out: dict[str, Any] = {"op": msg.OP}
    for f in fields(msg):
        v = getattr(msg, f.name)
        if isinstance(v, SamplingParams):
            v = v.to_dict()
            v.pop("eos_token_ids", None)
        elif f.name == "usage" and v is None:
            continue
        out[f.name] = v
    if type(msg) in CLIENT_MESSAGES and not isinstance(msg, Ping):
        out["v"] = PROTOCOL_VERSION
    return out


def encode(msg: Any) -> bytes:
    return msgpack.packb(to_map(msg), use_bin_type=True)


# ---- decoding what clients send --------------------------------------------------------


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def decode_client_frame(payload: bytes) -> Any:
    """One client frame -> a typed request, or ClientProtocolError (code, message, id)."""
    try:
        msg = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except Exception as e:  # msgpack raises several unrelated types on garbage
        raise ClientProtocolError("bad_frame", f"not a msgpack frame ({type(e).__name__})"
                                  ) from None
    if not isinstance(msg, dict):
        raise ClientProtocolError("bad_frame", "a message must be a msgpack map")
    rid = msg.get("id")
    if rid is not None and (not isinstance(rid, (str, int)) or isinstance(rid, bool)):
        raise ClientProtocolError("invalid_request", "id must be a string or an integer")
    version = msg.get("v", PROTOCOL_VERSION)
    if version != PROTOCOL_VERSION:
        shown = version if _is_int(version) else f"of type {type(version).__name__}"
        raise ClientProtocolError("bad_version", f"protocol version {shown} is not "
                                                 f"{PROTOCOL_VERSION}", rid)
    op = msg.get("op")
    cls = _BY_OP.get(op) if isinstance(op, str) else None
    if cls is None:
        shown = f"'{op[:40]}'" if isinstance(op, str) else f"of type {type(op).__name__}"
        raise ClientProtocolError("bad_op", f"unknown op {shown}", rid)
    if cls is Submit:
        return _decode_submit(msg, rid)
    if cls is Abort:
        return Abort(rid)
    return cls()


def _decode_submit(msg: dict, rid: RequestId | None) -> Submit:
    if rid is None:
        raise ClientProtocolError("invalid_request", "submit needs an 'id'")

    def bad(why: str) -> ClientProtocolError:
        return ClientProtocolError("invalid_request", why, rid)

    raw = msg.get("params") or {}
    if not isinstance(raw, dict):
        raise bad("'params' must be a map")
    try:
        params = SamplingParams.from_dict(raw)
    except (TypeError, ValueError) as e:
        raise bad(str(e)) from None
    prompt, ids = msg.get("prompt"), msg.get("prompt_token_ids")
    if (prompt is None) == (ids is None):
        raise bad("give exactly one of 'prompt' and 'prompt_token_ids'")
    if prompt is not None and not isinstance(prompt, str):
        raise bad("'prompt' must be a string")
    if ids is not None and not isinstance(ids, list):
        raise bad("'prompt_token_ids' must be a list of integers")
    stream = msg.get("stream", True)
    if not isinstance(stream, bool):
        raise bad("'stream' must be a bool")
    priority = msg.get("priority") or 0
    if not _is_int(priority):
        raise bad("'priority' must be an integer")
    ttl_ms = msg.get("ttl_ms")
    if ttl_ms is not None and (not isinstance(ttl_ms, (int, float)) or isinstance(ttl_ms, bool)
                               or not 0 < ttl_ms < math.inf):
        raise bad("'ttl_ms' must be a positive number or null")
    return Submit(rid, prompt, ids, params, priority, ttl_ms, stream)


# ---- decoding what the leader sends (clients) ------------------------------------------


def decode_server_frame(payload: bytes) -> Output | Error | Info | Health | Metrics | Pong | None:
    """A leader frame as a typed message; None for anything malformed (a client skips it
    rather than stopping on one bad frame)."""
    try:
        msg = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except Exception:  # msgpack raises several unrelated types on garbage
        return None
    if not isinstance(msg, dict):
        return None
    op = msg.get("op")
    try:
        if op == "output":
            return Output(msg.get("id"), int(msg.get("index", 0)), msg.get("token_ids") or [],
                          msg.get("text") or "", msg.get("logprobs"), msg.get("finish_reason"),
                          msg.get("usage"))
        if op == "error":
            return Error(msg.get("id"), str(msg.get("code", "error")),
                         str(msg.get("message", "")))
        if op == "info":
            return Info(**{f.name: msg.get(f.name) for f in fields(Info)})
        if op == "health":
            return Health(bool(msg.get("ready")), msg.get("reason"))
        if op == "metrics":
            return Metrics(str(msg.get("text", "")))
        if op == "pong":
            return Pong()
    except (TypeError, ValueError):
        return None
    return None
