"""The client wire (docs/protocol.md): typed messages between clients and the leader.

Every message is a ``msgspec.Struct`` and travels as one msgpack map whose ``op`` names
its type (msgspec's tag), then its fields by name. ``encode`` turns any message into a
frame; ``decode_server_frame`` is the clients' lenient reader. What clients send is read
by ``nvllm/common/client_decode.py:decode_client_frame``, which checks every field against
the engine's limits while it decodes. Nothing is ever unpickled. docs/protocol.md lists
these types and their fields (a test checks it against ``msgspec.structs.fields``).
"""

from __future__ import annotations

from typing import Any, ClassVar

import msgspec

from nvllm.common.outputs import CompletionDelta
from nvllm.common.sampling_params import SamplingParams
from nvllm.common.sleep_mode import SleepReport

PROTOCOL_VERSION = 1
MAX_DEPTH = 8  # the deepest a JSON schema given as a map may nest (gateway and wire)

# Error codes that mean a malformed or hostile frame (not a request the engine refused).
HOSTILE_CODES = frozenset({"bad_frame", "bad_op", "bad_version", "invalid_request"})

RequestId = str | int


class ClientProtocolError(ValueError):
    """A client frame that cannot be served: answered with ``error`` (code, message)."""

    def __init__(self, code: str, message: str, request_id: RequestId | None = None) -> None:
        super().__init__(message)
        self.code, self.message, self.request_id = code, message, request_id


# ---- client -> leader ------------------------------------------------------------------


class ClientMessage(msgspec.Struct, tag_field="op", kw_only=True):
    """What every client message carries besides its fields: the protocol version."""

    v: int = PROTOCOL_VERSION
    OP: ClassVar[str]


class Submit(ClientMessage, tag="submit"):
    """Start a request: ``prompt`` or ``prompt_token_ids``, exactly one."""

    id: RequestId
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    params: SamplingParams = msgspec.field(default_factory=SamplingParams)
    priority: int = 0  # lower runs first; ties first come, first served
    ttl_ms: float | None = None  # the request ends with "timeout" this long after arrival
    # Requests with the same key go to the same data-parallel replica while it is up
    # (nvllm/router: the OpenAI ``user``); a single engine ignores it.
    routing_key: str | None = None
    # Resuming a stream elsewhere (the data-parallel router's replay of a lost replica's
    # request): the completion's tokens already produced, which the leader takes as its
    # own outputs (max_tokens counts them, penalties and the grammar see them), and how
    # many characters of their text the client already has (None: what a leader streams).
    output_token_ids: list[int] | None = None
    output_text_offset: int | None = None
    OP: ClassVar[str] = "submit"


class Abort(ClientMessage, tag="abort"):
    id: RequestId
    OP: ClassVar[str] = "abort"


class InfoRequest(ClientMessage, tag="info"):
    OP: ClassVar[str] = "info"


class HealthRequest(ClientMessage, tag="health"):
    OP: ClassVar[str] = "health"


class MetricsRequest(ClientMessage, tag="metrics"):
    OP: ClassVar[str] = "metrics"


class Ping(ClientMessage, tag="ping"):
    OP: ClassVar[str] = "ping"


# Serving RL rollouts (nvllm/leader/weight_sync.py): vLLM's pause_generation,
# resume_generation and update_weights. Each is answered by the message of the same op.


class PauseGeneration(ClientMessage, tag="pause"):
    mode: str = "abort"  # "abort" | "wait" | "keep"
    clear_cache: bool = True
    OP: ClassVar[str] = "pause"


class ResumeGeneration(ClientMessage, tag="resume"):
    OP: ClassVar[str] = "resume"


class WeightsChunk(ClientMessage, tag="weights_chunk"):
    """One chunk of a weight update (chunk 0 starts one): HF names, torch dtype names and
    ArrayRefs (nvllm/common/transport/refs.py) into shared memory the client created (or
    inline bytes), which the leader forwards to every worker."""

    chunk: int
    names: list[str]
    dtypes: list[str]
    refs: list[list]
    rows: list[int] | None = None  # [first, total]: one tensor's rows first.. (a piece)
    OP: ClassVar[str] = "weights_chunk"


class WeightsCommit(ClientMessage, tag="weights_commit"):
    weight_version: int | str | None = None
    OP: ClassVar[str] = "weights_commit"


class WeightsAbort(ClientMessage, tag="weights_abort"):
    OP: ClassVar[str] = "weights_abort"


# Weight updates from other sources (nvllm/leader/weight_sources.py): a trainer's process
# group (SGLang's init_weights_update_group / update_weights_from_distributed) and a path.


class InitWeightUpdateGroup(ClientMessage, tag="init_weight_update_group"):
    """Every worker joins the trainer's process group as rank ``rank_offset`` + its tp
    rank; the trainer (rank 0) hosts the group's TCPStore at master_address:port."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str = "weight_update_group"
    backend: str | None = None  # "gloo" | "nccl"; None: nccl on CUDA, gloo on CPU
    timeout_s: float = 60.0
    OP: ClassVar[str] = "init_weight_update_group"


class WeightsFromDistributed(ClientMessage, tag="weights_from_distributed"):
    """One chunk of an update the trainer broadcasts over the group (chunk 0 starts one;
    committed by ``weights_commit``): HF names, torch dtype names, full shapes, in the
    order of the broadcasts."""

    chunk: int
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    OP: ClassVar[str] = "weights_from_distributed"


class UpdateWeightsFromPath(ClientMessage, tag="weights_from_path"):
    """Load a checkpoint folder or .gguf file of the served model on every rank, then
    apply it (all or nothing)."""

    path: str
    weight_version: int | str | None = None
    OP: ClassVar[str] = "weights_from_path"
# Sleep and wake (nvllm/leader/sleep_mode.py): vLLM's sleep, wake_up and is_sleeping.
# sleep and wake_up are answered by the message of the same op; state by EngineState.


class Sleep(ClientMessage, tag="sleep"):
    level: int = 1  # 1 | 2
    mode: str = "abort"  # how running requests end first, as pause's
    OP: ClassVar[str] = "sleep"


class WakeUp(ClientMessage, tag="wake_up"):
    tags: list[str] | None = None  # of "weights", "kv_cache", "scheduling"; None: all
    OP: ClassVar[str] = "wake_up"


class Tokenize(ClientMessage, tag="tokenize"):
    """A text's token ids by the engine's own tokenizer (answer: ``tokenize``), so a
    front end (the OpenAI gateway's ``/tokenize``) need not load a second copy of it."""

    id: RequestId
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False  # also each id's token string (the vocabulary's)
    OP: ClassVar[str] = "tokenize"


class Detokenize(ClientMessage, tag="detokenize"):
    """Token ids back to text by the engine's tokenizer (answer: ``detokenize``)."""

    id: RequestId
    token_ids: list[int]
    OP: ClassVar[str] = "detokenize"


class StateRequest(ClientMessage, tag="state"):
    OP: ClassVar[str] = "state"


# ---- leader -> client ------------------------------------------------------------------


class ServerMessage(msgspec.Struct, tag_field="op", omit_defaults=True):
    """A message from the leader; fields at their default (None) stay off the wire."""

    OP: ClassVar[str]


class Output(ServerMessage, tag="output"):
    """One ``CompletionDelta`` on the wire; ``id`` is the client's request id."""

    id: RequestId
    index: int
    token_ids: list[int]
    text: str
    logprobs: list[dict[int, float]] | None
    finish_reason: str | None
    usage: dict[str, int] | None = None
    # Only on each completion's first message when the request asked (CompletionDelta).
    prompt_logprobs: list[dict[int, float] | None] | None = None
    # The weights in force when it was made (set by update_weights; absent: never updated).
    weight_version: int | str | None = None
    OP: ClassVar[str] = "output"

    @classmethod
    def of(cls, delta: CompletionDelta, client_id: RequestId) -> Output:
        return cls(client_id, delta.index, delta.token_ids, delta.text, delta.logprobs,
                   delta.finish_reason, delta.usage, delta.prompt_logprobs,
                   delta.weight_version)

    def to_delta(self) -> CompletionDelta:
        return CompletionDelta(str(self.id), self.index, self.token_ids, self.text,
                               self.logprobs, self.finish_reason, self.usage,
                               self.prompt_logprobs, self.weight_version)


class Error(ServerMessage, tag="error", omit_defaults=False):
    id: RequestId | None  # null when the frame could not be read
    code: str
    message: str
    OP: ClassVar[str] = "error"


class Info(ServerMessage, tag="info", omit_defaults=False):
    v: int
    model: str  # the served name
    model_path: str | None
    max_model_len: int
    vocab_size: int
    kv_capacity_tokens: int
    block_size: int
    tensor_parallel_size: int
    ready: bool
    OP: ClassVar[str] = "info"


class Health(ServerMessage, tag="health"):
    ready: bool
    reason: str | None = None
    OP: ClassVar[str] = "health"


class Metrics(ServerMessage, tag="metrics"):
    text: str  # Prometheus text exposition
    OP: ClassVar[str] = "metrics"


class Pong(ServerMessage, tag="pong"):
    """``boot``: random per server process. A client that sees it change knows the server
    it reconnected to is a new one that never had its requests in flight."""

    boot: str = ""
    OP: ClassVar[str] = "pong"


class Paused(ServerMessage, tag="pause", omit_defaults=False):
    """Generation is paused and settled (for "wait": the running requests finished)."""

    mode: str
    OP: ClassVar[str] = "pause"


class Resumed(ServerMessage, tag="resume"):
    OP: ClassVar[str] = "resume"


class WeightsStaged(ServerMessage, tag="weights_chunk", omit_defaults=False):
    """Every worker staged the chunk and stopped reading its memory: reuse it."""

    chunk: int
    OP: ClassVar[str] = "weights_chunk"


class WeightsCommitted(ServerMessage, tag="weights_commit", omit_defaults=False):
    weight_version: int | str
    OP: ClassVar[str] = "weights_commit"


class WeightsAborted(ServerMessage, tag="weights_abort"):
    OP: ClassVar[str] = "weights_abort"


class WeightUpdateGroupReady(ServerMessage, tag="init_weight_update_group"):
    """Every worker joined the weight-update group."""

    OP: ClassVar[str] = "init_weight_update_group"


class DistributedStaged(ServerMessage, tag="weights_from_distributed",
                        omit_defaults=False):
    """Every worker received and staged this chunk's broadcasts."""

    chunk: int
    OP: ClassVar[str] = "weights_from_distributed"


class WeightsFromPathLoaded(ServerMessage, tag="weights_from_path", omit_defaults=False):
    weight_version: int | str
    OP: ClassVar[str] = "weights_from_path"
class _SleepAnswer(ServerMessage, omit_defaults=False):
    """A SleepReport (nvllm/common/sleep_mode.py) on the wire."""

    level: int
    asleep: list[str]
    weights_bytes: int
    kv_cache_bytes: int
    device_bytes: int
    rss_bytes: int
    weights_missing: int

    @classmethod
    def of(cls, report: SleepReport) -> Any:
        return cls(**report.to_dict())

    def to_report(self) -> SleepReport:
        return SleepReport(self.level, list(self.asleep), self.weights_bytes,
                           self.kv_cache_bytes, self.device_bytes, self.rss_bytes,
                           self.weights_missing)


class Slept(_SleepAnswer, tag="sleep"):
    OP: ClassVar[str] = "sleep"


class WokeUp(_SleepAnswer, tag="wake_up"):
    OP: ClassVar[str] = "wake_up"


class EngineState(ServerMessage, tag="state", omit_defaults=False):
    """Whether the engine sleeps (and what: `asleep`, at `level`; `weights_missing` after
    a level-2 wake), is paused, and the weight_version in force."""

    is_sleeping: bool
    is_paused: bool
    level: int
    asleep: list[str]
    weights_missing: int
    weight_version: int | str | None
    OP: ClassVar[str] = "state"


class Tokenized(ServerMessage, tag="tokenize", omit_defaults=False):
    id: RequestId
    token_ids: list[int]
    token_strs: list[str | None] | None = None
    OP: ClassVar[str] = "tokenize"


class Detokenized(ServerMessage, tag="detokenize", omit_defaults=False):
    id: RequestId
    text: str
    OP: ClassVar[str] = "detokenize"


CLIENT_MESSAGES: tuple[type, ...] = (Submit, Abort, InfoRequest, HealthRequest,
                                     MetricsRequest, Ping, PauseGeneration, ResumeGeneration,
                                     WeightsChunk, WeightsCommit, WeightsAbort,
                                     InitWeightUpdateGroup, WeightsFromDistributed,
                                     UpdateWeightsFromPath, Sleep, WakeUp, StateRequest,
                                     Tokenize, Detokenize)
SERVER_MESSAGES: tuple[type, ...] = (Output, Error, Info, Health, Metrics, Pong, Paused,
                                     Resumed, WeightsStaged, WeightsCommitted, WeightsAborted,
                                     WeightUpdateGroupReady, DistributedStaged,
                                     WeightsFromPathLoaded, Slept, WokeUp, EngineState,
                                     Tokenized, Detokenized)
ServerFrame = (Output | Error | Info | Health | Metrics | Pong | Paused | Resumed
               | WeightsStaged | WeightsCommitted | WeightsAborted | WeightUpdateGroupReady
               | DistributedStaged | WeightsFromPathLoaded | Slept | WokeUp | EngineState
               | Tokenized | Detokenized)


# ---- encoding --------------------------------------------------------------------------

_ENCODER = msgspec.msgpack.Encoder()
_PARAM_DEFAULTS = SamplingParams().to_dict()


def params_map(params: SamplingParams) -> dict[str, Any]:
    """A SamplingParams as the wire's ``params`` map: only the fields that differ from
    their default (the decoder fills the rest), never the engine-filled ``eos_token_ids``."""
    out = {}
    for name, default in _PARAM_DEFAULTS.items():
        v = getattr(params, name)
        if name != "eos_token_ids" and v != default:
            out[name] = v.to_dict() if name == "structured_outputs" else v
    return out


def encode(msg: ClientMessage | ServerMessage) -> bytes:
    if isinstance(msg, Submit):
        msg = msgspec.structs.replace(msg, params=params_map(msg.params))  # type: ignore[arg-type]
    return _ENCODER.encode(msg)


def to_map(msg: ClientMessage | ServerMessage) -> dict[str, Any]:
    """A message as the map its frame holds (``op`` first), for callers that want plain
    data (the clients' info/health answers, tests)."""
    return msgspec.msgpack.decode(encode(msg))


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


# ---- decoding what the leader sends (clients) ------------------------------------------

_SERVER_DECODER = msgspec.msgpack.Decoder(ServerFrame)


def decode_server_frame(payload: bytes) -> ServerFrame | None:
    """A leader frame as a typed message; None for anything malformed (a client skips it
    rather than stopping on one bad frame)."""
    try:
        return _SERVER_DECODER.decode(payload)
    except (msgspec.DecodeError, ValueError, OverflowError, RecursionError):
        return None

