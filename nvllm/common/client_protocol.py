"""The client wire (docs/protocol.md): typed messages between clients and the leader.

Every frame is one msgpack map with an ``op``. ``decode_client_frame`` turns what a client
sent into one of the request types below, checking every field's type and limit once,
here; a frame that fails raises ``ClientProtocolError`` carrying the error code and the
request id to answer (never a ``repr`` of what the client sent). ``encode`` turns any
message into a frame; ``decode_server_frame`` is the lenient reader the clients use.
Nothing is ever unpickled. docs/protocol.md documents these types (a test checks it).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, ClassVar

import msgpack

from nvllm.common.outputs import CompletionDelta
from nvllm.common.sampling_params import SamplingParams
from nvllm.common.structured_outputs import KINDS
from nvllm.common.utils import INT64_MAX, is_int, shown

if TYPE_CHECKING:
    from nvllm.common.config import EngineConfig

PROTOCOL_VERSION = 1
MAX_DEPTH = 8  # the deepest a valid message nests (submit -> params -> stop -> str is 3)
PROMPT_BYTES_PER_TOKEN = 32  # max_prompt_bytes' default, per token of max_model_len

# Error codes that mean a malformed or hostile frame (not a request the engine refused).
HOSTILE_CODES = frozenset({"bad_frame", "bad_op", "bad_version", "invalid_request"})

RequestId = str | int


class ClientProtocolError(ValueError):
    """A client frame that cannot be served: answered with ``error`` (code, message)."""

    def __init__(self, code: str, message: str, request_id: RequestId | None = None) -> None:
        super().__init__(message)
        self.code, self.message, self.request_id = code, message, request_id


@dataclass(frozen=True, slots=True)
class ClientLimits:
    """Every bound on what one client frame may carry, checked once, on decode. The
    defaults are EngineConfig's (operators tune them with nvllm-launch flags); a
    violation is ``invalid_request`` naming the field and the limit."""

    max_model_len: int = 4096
    max_request_id_bytes: int = 256
    max_prompt_bytes: int = 4096 * PROMPT_BYTES_PER_TOKEN
    max_n: int = 128
    max_stop_strings: int = 16
    max_stop_string_chars: int = 256
    max_stop_token_ids: int = 256
    max_grammar_bytes: int = 64 << 10
    max_logit_bias: int = 1024

    @classmethod
    def from_config(cls, config: EngineConfig) -> ClientLimits:
        return cls(config.max_model_len, config.max_request_id_bytes,
                   config.max_prompt_bytes or config.max_model_len * PROMPT_BYTES_PER_TOKEN,
                   config.max_n, config.max_stop_strings, config.max_stop_string_chars,
                   config.max_stop_token_ids, config.max_grammar_bytes,
                   config.max_logit_bias)

    @functools.cache  # noqa: B019 (frozen, hashable, a handful per process)
    def unpack_options(self) -> dict[str, int]:
        """msgpack's own container limits, about twice the field limits: a frame far
        beyond them fails to decode (bad_frame) before anything is built from it, one
        just beyond gets the error that names the field."""
        longest_str = max(self.max_prompt_bytes, self.max_request_id_bytes,
                          self.max_stop_string_chars * 4, self.max_grammar_bytes)
        longest_list = max(self.max_model_len, self.max_stop_token_ids, self.max_stop_strings)
        return {"max_str_len": 2 * longest_str + 1024, "max_bin_len": self.max_request_id_bytes,
                "max_array_len": 2 * longest_list + 1024,
                "max_map_len": 2 * self.max_logit_bias + 64, "max_ext_len": 0}


DEFAULT_LIMITS = ClientLimits()


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
    # Only on each completion's first message when the request asked (CompletionDelta).
    prompt_logprobs: list | None = None
    OP: ClassVar[str] = "output"

    @classmethod
    def of(cls, delta: CompletionDelta, client_id: RequestId) -> Output:
        return cls(client_id, delta.index, delta.token_ids, delta.text, delta.logprobs,
                   delta.finish_reason, delta.usage, delta.prompt_logprobs)

    def to_delta(self) -> CompletionDelta:
        return CompletionDelta(str(self.id), self.index, self.token_ids, self.text,
                               self.logprobs, self.finish_reason, self.usage,
                               self.prompt_logprobs)


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
    """The msgpack map of a message: ``op`` first, then its fields (``usage`` and
    ``prompt_logprobs`` only when set; a Submit's params as a map without the engine-filled
    ``eos_token_ids``)."""
    out: dict[str, Any] = {"op": msg.OP}
    for f in fields(msg):
        v = getattr(msg, f.name)
        if isinstance(v, SamplingParams):
            v = v.to_dict()
            v.pop("eos_token_ids", None)
        elif f.name in ("usage", "prompt_logprobs") and v is None:
            continue
        out[f.name] = v
    if type(msg) in CLIENT_MESSAGES and not isinstance(msg, Ping):
        out["v"] = PROTOCOL_VERSION
    return out


def encode(msg: Any) -> bytes:
    return msgpack.packb(to_map(msg), use_bin_type=True)


# ---- decoding what clients send --------------------------------------------------------



def depth_exceeds(obj: Any, limit: int) -> bool:
    """Whether containers nest deeper than `limit` (iterative: no recursion to exhaust)."""
    stack = [(obj, 1)]
    while stack:
        o, d = stack.pop()
        if isinstance(o, (list, dict)):
            if d > limit:
                return True
            stack.extend((x, d + 1) for x in (o.values() if isinstance(o, dict) else o))
    return False


def decode_client_frame(payload: bytes, limits: ClientLimits = DEFAULT_LIMITS) -> Any:
    """One client frame -> a typed request, or ClientProtocolError (code, message, id)."""
    try:
        msg = msgpack.unpackb(payload, raw=False, strict_map_key=False,
                              **limits.unpack_options())
    except Exception as e:  # msgpack raises several unrelated types on garbage
        raise ClientProtocolError("bad_frame", f"not a msgpack frame within the limits "
                                               f"({type(e).__name__})") from None
    if not isinstance(msg, dict):
        raise ClientProtocolError("bad_frame", "a message must be a msgpack map")
    if depth_exceeds(msg, MAX_DEPTH):
        raise ClientProtocolError("bad_frame", f"a message nests at most {MAX_DEPTH} levels")
    rid = msg.get("id")
    if rid is not None:
        if not isinstance(rid, (str, int)) or isinstance(rid, bool):
            raise ClientProtocolError("invalid_request", "id must be a string or an integer")
        if isinstance(rid, int) and not -INT64_MAX - 1 <= rid <= INT64_MAX:
            raise ClientProtocolError("invalid_request", "an integer id must fit in int64")
        if isinstance(rid, str) and len(rid.encode()) > limits.max_request_id_bytes:
            raise ClientProtocolError("invalid_request", f"id is longer than "
                                      f"{limits.max_request_id_bytes} bytes")
    version = msg.get("v", PROTOCOL_VERSION)
    if version != PROTOCOL_VERSION:
        raise ClientProtocolError("bad_version", f"protocol version {shown(version)} is "
                                                 f"not {PROTOCOL_VERSION}", rid)
    op = msg.get("op")
    cls = _BY_OP.get(op) if isinstance(op, str) else None
    if cls is None:
        raise ClientProtocolError("bad_op", "unknown op (expected one of "
                                            f"{', '.join(sorted(_BY_OP))})", rid)
    if cls is Submit:
        return _decode_submit(msg, rid, limits)
    if cls is Abort:
        return Abort(rid)
    return cls()


def _decode_submit(msg: dict, rid: RequestId | None, limits: ClientLimits) -> Submit:
    if rid is None:
        raise ClientProtocolError("invalid_request", "submit needs an 'id'")

    def bad(why: str) -> ClientProtocolError:
        return ClientProtocolError("invalid_request", why, rid)

    raw = msg.get("params") or {}
    if not isinstance(raw, dict):
        raise bad("'params' must be a map")
    _check_param_sizes(raw, limits, bad)
    try:
        params = SamplingParams.from_dict(raw)
    except (TypeError, ValueError) as e:
        raise bad(str(e)) from None
    prompt, ids = msg.get("prompt"), msg.get("prompt_token_ids")
    if (prompt is None) == (ids is None):
        raise bad("give exactly one of 'prompt' and 'prompt_token_ids'")
    if prompt is not None:
        if not isinstance(prompt, str):
            raise bad("'prompt' must be a string")
        if len(prompt.encode("utf-8", "surrogatepass")) > limits.max_prompt_bytes:
            raise bad(f"prompt is longer than {limits.max_prompt_bytes} bytes (max_prompt_bytes; "
                      f"max_model_len is {limits.max_model_len} tokens)")
    if ids is not None:
        if not isinstance(ids, list):
            raise bad("'prompt_token_ids' must be a list of integers")
        # What the engine could never serve is `rejected`, as the engine itself says it.
        if len(ids) > limits.max_model_len:
            raise ClientProtocolError("rejected", f"prompt has {len(ids)} tokens, "
                                      f"max_model_len is {limits.max_model_len}", rid)
        if not all(is_int(t) and 0 <= t <= INT64_MAX for t in ids):
            raise ClientProtocolError("rejected", "a prompt token id is outside the "
                                      "vocabulary (token ids are integers from 0)", rid)
    if msg.get("stream", True) is not True:  # the non-streaming mode was removed
        raise bad("'stream' must be true or absent: every request streams its outputs "
                  "(collect them on the client)")
    priority = msg.get("priority") or 0
    if not is_int(priority) or not -INT64_MAX - 1 <= priority <= INT64_MAX:
        raise bad("'priority' must be an integer in int64")
    ttl_ms = msg.get("ttl_ms")
    if ttl_ms is not None and (not isinstance(ttl_ms, (int, float)) or isinstance(ttl_ms, bool)
                               or not 0 < ttl_ms < math.inf):
        raise bad("'ttl_ms' must be a positive number or null")
    return Submit(rid, prompt, ids, params, priority, ttl_ms)


def _check_param_sizes(raw: dict, limits: ClientLimits, bad: Any) -> None:
    """Sizes SamplingParams does not bound itself (its own checks name bad values)."""
    n = raw.get("n", 1)
    if is_int(n) and n > limits.max_n:
        raise bad(f"n is {n}, more than max_n {limits.max_n}")
    stop = raw.get("stop")
    if isinstance(stop, list):
        if len(stop) > limits.max_stop_strings:
            raise bad(f"stop has {len(stop)} strings, more than max_stop_strings "
                      f"{limits.max_stop_strings}")
        stop_strs = stop
    else:
        stop_strs = [stop] if isinstance(stop, str) else []
    if any(isinstance(x, str) and len(x) > limits.max_stop_string_chars for x in stop_strs):
        raise bad(f"a stop string is longer than max_stop_string_chars "
                  f"{limits.max_stop_string_chars}")
    ids = raw.get("stop_token_ids")
    if isinstance(ids, list):
        if len(ids) > limits.max_stop_token_ids:
            raise bad(f"stop_token_ids has {len(ids)} ids, more than max_stop_token_ids "
                      f"{limits.max_stop_token_ids}")
        if not all(is_int(t) and 0 <= t <= INT64_MAX for t in ids):
            raise bad("stop_token_ids must be integers in [0, 2**63)")
    bias = raw.get("logit_bias")
    if isinstance(bias, dict) and len(bias) > limits.max_logit_bias:
        raise bad(f"logit_bias has {len(bias)} entries, more than max_logit_bias "
                  f"{limits.max_logit_bias}")
    unknown = [k for k in raw if not isinstance(k, str)]
    if unknown:
        raise bad("params keys must be strings")
    _check_structured_size(raw.get("structured_outputs"), limits, bad)


def _check_structured_size(so: Any, limits: ClientLimits, bad: Any) -> None:
    """A structured_outputs spec's text (or its choices, together) within
    max_grammar_bytes; its shape is StructuredOutputsParams' to check."""
    if not isinstance(so, dict):
        return
    for kind, v in so.items():
        parts = v if isinstance(v, list) else [v]
        size = sum(len(x.encode("utf-8", "surrogatepass")) for x in parts if isinstance(x, str))
        if size > limits.max_grammar_bytes:
            name = f"structured_outputs.{kind}" if kind in KINDS else "structured_outputs"
            raise bad(f"{name} is {size} bytes, more than max_grammar_bytes "
                      f"{limits.max_grammar_bytes}")


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
                          msg.get("usage"), msg.get("prompt_logprobs"))
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
