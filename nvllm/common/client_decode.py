"""Reading what a client sent: one frame -> one typed message, every field within its limit.

The boundary is hostile, so the frame is decoded straight into typed structs whose
constraints come from the engine's limits (``nvllm/common/client_limits.py``): msgspec
checks each type, length and range while it reads the bytes, so an oversized list or
string is refused before Python builds it, and nothing is ever unpickled. A frame that
fails raises ``ClientProtocolError`` with a message naming the field and the limit
(``nvllm/common/field_errors.py``), never echoing what the client sent, and the request id
to answer when one could be read. Value rules that are not about the engine's limits
(temperature >= 0, ...) are SamplingParams' own, the same for every caller.
"""

# No `from __future__ import annotations`: the structs below are built inside a function
# from its limits, and msgspec must see their annotations as objects, not names.
import functools
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from nvllm.common import client_limits as cl
from nvllm.common import client_protocol as cp
from nvllm.common import weight_transfer as wt
from nvllm.common.client_limits import (
    INT64_MAX,
    INT64_MIN,
    ClientLimits,
    Int64,
    TokenId,
    TtlMs,
    default_limits,
)
from nvllm.common.cuda_ipc import IpcRef, is_ipc_ref
from nvllm.common.field_errors import FieldError, field_error
from nvllm.common.request_checks import prompt_length_error
from nvllm.common.sampling_params import SamplingParams
from nvllm.common.sleep_mode import WAKE_TAGS
from nvllm.common.structured_outputs import KINDS
from nvllm.common.transport import ArrayRef, BadRef


def _bounded_str(limit: int) -> Any:
    # msgspec counts characters; a text within `limit` bytes has at most `limit` of them,
    # so this refuses most oversized text while decoding, and _check_bytes the rest.
    return Annotated[str, Meta(max_length=limit)]


@functools.cache
def _types(lim: ClientLimits) -> tuple[Any, type]:
    """The message union whose field constraints are these limits, and its Submit."""
    grammar_text = _bounded_str(lim.max_grammar_bytes)

    class Structured(msgspec.Struct, forbid_unknown_fields=True):
        json: grammar_text | dict[str, Any] | None = None  # type: ignore[valid-type]
        json_object: bool = False
        regex: grammar_text | None = None  # type: ignore[valid-type]
        grammar: grammar_text | None = None  # type: ignore[valid-type]
        choice: Annotated[list[grammar_text], Meta(  # type: ignore[valid-type]
            max_length=lim.max_grammar_bytes)] | None = None

    stop_str = _bounded_str(lim.max_stop_string_chars)

    class Params(msgspec.Struct, forbid_unknown_fields=True):
        n: Annotated[int, Meta(le=lim.max_n)] = 1
        temperature: float = 1.0
        top_p: float = 1.0
        top_k: Int64 = 0
        min_p: float = 0.0
        seed: int | None = None
        max_tokens: Int64 = 16
        min_tokens: Int64 = 0
        stop_token_ids: Annotated[list[TokenId], Meta(
            max_length=lim.max_stop_token_ids)] | None = None
        ignore_eos: bool = False
        repetition_penalty: float = 1.0
        presence_penalty: float = 0.0
        frequency_penalty: float = 0.0
        logprobs: Int64 | None = None
        stop: stop_str | Annotated[list[stop_str], Meta(  # type: ignore[valid-type]
            max_length=lim.max_stop_strings)] | None = None
        include_stop_str_in_output: bool = False
        skip_special_tokens: bool = True
        structured_outputs: Structured | None = None
        logit_bias: Annotated[dict[int | str, float], Meta(
            max_length=lim.max_logit_bias)] | None = None
        prompt_logprobs: Int64 | None = None

    class Submit(msgspec.Struct, tag_field="op", tag="submit"):
        id: _bounded_str(lim.max_request_id_bytes) | Int64  # type: ignore[valid-type]
        prompt: _bounded_str(lim.max_prompt_bytes) | None = None  # type: ignore[valid-type]
        prompt_token_ids: Annotated[list[TokenId], Meta(
            max_length=lim.max_model_len)] | None = None
        params: Params | None = None
        priority: Int64 | None = 0
        ttl_ms: TtlMs | None = None
        routing_key: _bounded_str(lim.max_request_id_bytes) | None = None  # type: ignore[valid-type]
        output_token_ids: Annotated[list[TokenId], Meta(
            max_length=lim.max_model_len)] | None = None
        output_text_offset: Annotated[int, Meta(ge=0, le=INT64_MAX)] | None = None
        stream: Literal[True] = True  # every request streams (docs/protocol.md)
        v: Literal[1] = 1

    class Abort(msgspec.Struct, tag_field="op", tag="abort"):
        id: _bounded_str(lim.max_request_id_bytes) | Int64  # type: ignore[valid-type]
        v: Literal[1] = 1

    class Tokenize(msgspec.Struct, tag_field="op", tag="tokenize"):
        id: _bounded_str(lim.max_request_id_bytes) | Int64  # type: ignore[valid-type]
        prompt: _bounded_str(lim.max_prompt_bytes)  # type: ignore[valid-type]
        add_special_tokens: bool = True
        return_token_strs: bool = False
        v: Literal[1] = 1

    class Detokenize(msgspec.Struct, tag_field="op", tag="detokenize"):
        id: _bounded_str(lim.max_request_id_bytes) | Int64  # type: ignore[valid-type]
        token_ids: Annotated[list[TokenId], Meta(max_length=lim.max_model_len)]
        v: Literal[1] = 1

    plain = tuple(msgspec.defstruct(c.__name__, [("v", Literal[1], 1)], tag_field="op",
                                    tag=c.OP) for c in (cp.InfoRequest, cp.HealthRequest,
                                                        cp.MetricsRequest, cp.Ping,
                                                        cp.ResumeGeneration, cp.WeightsAbort))
    union = (Submit | Abort | Tokenize | Detokenize | plain[0] | plain[1] | plain[2]
             | plain[3] | plain[4] | plain[5])
    for extra in _weight_types() + _weight_source_types() + _sleep_types():
        union = union | extra
    return union, Submit  # type: ignore[return-value]


@functools.cache
def _weight_types() -> tuple[type, ...]:
    """pause and the weight-update messages: every list, name and count bounded."""
    many = Meta(max_length=wt.MAX_TENSORS_PER_CHUNK)
    name = Annotated[str, Meta(min_length=1, max_length=wt.MAX_WEIGHT_NAME_CHARS)]

    class PauseGeneration(msgspec.Struct, tag_field="op", tag="pause"):
        mode: Literal["abort", "wait", "keep"] = "abort"
        clear_cache: bool = True
        v: Literal[1] = 1

    class WeightsChunk(msgspec.Struct, tag_field="op", tag="weights_chunk"):
        chunk: Annotated[int, Meta(ge=0, le=INT64_MAX)]
        names: Annotated[list[name], many]  # type: ignore[valid-type]
        dtypes: Annotated[list[Literal["float32", "float16", "bfloat16"]], many]
        refs: Annotated[list[Annotated[list[Any], Meta(max_length=6)]], many]
        rows: Annotated[list[Annotated[int, Meta(ge=0, le=INT64_MAX)]], Meta(
            min_length=2, max_length=2)] | None = None
        v: Literal[1] = 1

    class WeightsCommit(msgspec.Struct, tag_field="op", tag="weights_commit"):
        weight_version: Int64 | Annotated[str, Meta(
            max_length=wt.WEIGHT_VERSION_MAX_CHARS)] | None = None
        v: Literal[1] = 1

    return PauseGeneration, WeightsChunk, WeightsCommit


@functools.cache
def _weight_source_types() -> tuple[type, ...]:
    """init_weight_update_group, weights_from_distributed, weights_from_path: addresses,
    ports, ranks, names, shapes and paths bounded (nvllm/common/client_limits.py)."""
    many = Meta(max_length=wt.MAX_TENSORS_PER_CHUNK)
    name = Annotated[str, Meta(min_length=1, max_length=wt.MAX_WEIGHT_NAME_CHARS)]
    dim = Annotated[int, Meta(ge=0, le=INT64_MAX)]

    class InitWeightUpdateGroup(msgspec.Struct, tag_field="op",
                                tag="init_weight_update_group"):
        master_address: Annotated[str, Meta(min_length=1,
                                             max_length=cl.MAX_MASTER_ADDRESS_CHARS)]
        master_port: Annotated[int, Meta(ge=cl.MIN_PORT, le=cl.MAX_PORT)]
        rank_offset: Annotated[int, Meta(ge=1, le=cl.MAX_GROUP_WORLD_SIZE - 1)]
        world_size: Annotated[int, Meta(ge=2, le=cl.MAX_GROUP_WORLD_SIZE)]
        group_name: Annotated[str, Meta(min_length=1, max_length=cl.MAX_GROUP_NAME_CHARS)] \
            = "weight_update_group"
        backend: Literal["gloo", "nccl"] | None = None
        timeout_s: Annotated[float, Meta(gt=0, le=cl.MAX_GROUP_TIMEOUT_S)] = 60.0
        v: Literal[1] = 1

    class WeightsFromDistributed(msgspec.Struct, tag_field="op",
                                 tag="weights_from_distributed"):
        chunk: Annotated[int, Meta(ge=0, le=INT64_MAX)]
        names: Annotated[list[name], many]  # type: ignore[valid-type]
        dtypes: Annotated[list[Literal["float32", "float16", "bfloat16"]], many]
        shapes: Annotated[list[Annotated[list[dim], Meta(  # type: ignore[valid-type]
            max_length=cl.MAX_TENSOR_DIMS)]], many]
        v: Literal[1] = 1

    class UpdateWeightsFromPath(msgspec.Struct, tag_field="op", tag="weights_from_path"):
        path: Annotated[str, Meta(min_length=1, max_length=cl.MAX_PATH_CHARS)]
        weight_version: Int64 | Annotated[str, Meta(
            max_length=wt.WEIGHT_VERSION_MAX_CHARS)] | None = None
        v: Literal[1] = 1

    return InitWeightUpdateGroup, WeightsFromDistributed, UpdateWeightsFromPath
def _sleep_types() -> tuple[type, ...]:
    """sleep, wake_up and state: a level, a pause mode, at most every wake tag once."""

    class Sleep(msgspec.Struct, tag_field="op", tag="sleep"):
        level: Literal[1, 2] = 1
        mode: Literal["abort", "wait", "keep"] = "abort"
        v: Literal[1] = 1

    class WakeUp(msgspec.Struct, tag_field="op", tag="wake_up"):
        tags: Annotated[list[Literal["weights", "kv_cache", "scheduling"]], Meta(
            min_length=1, max_length=len(WAKE_TAGS))] | None = None
        v: Literal[1] = 1

    state = msgspec.defstruct("StateRequest", [("v", Literal[1], 1)], tag_field="op",
                              tag=cp.StateRequest.OP)
    return Sleep, WakeUp, state


class _Envelope(msgspec.Struct):
    """What an error answer needs from a frame that failed: its request id, if any, and
    the token-id prompt's bytes (its header says how many ids it holds)."""

    id: Any = None
    prompt_token_ids: msgspec.Raw = msgspec.Raw()


@functools.cache
def _decoders(lim: ClientLimits) -> tuple[msgspec.msgpack.Decoder, type]:
    union, submit = _types(lim)
    return msgspec.msgpack.Decoder(union), submit


_ENVELOPE = msgspec.msgpack.Decoder(_Envelope)
_BY_OP = {c.OP: c for c in cp.CLIENT_MESSAGES}


def decode_client_frame(payload: bytes,
                        limits: ClientLimits | None = None) -> cp.ClientMessage:
    """One client frame -> a typed request, or ClientProtocolError (code, message, id)."""
    lim = limits or default_limits()
    decoder, submit_type = _decoders(lim)
    try:
        frame = decoder.decode(payload)
    except msgspec.ValidationError as e:
        raise _invalid(str(e), payload, lim) from None
    except (msgspec.DecodeError, RecursionError, ValueError, OverflowError) as e:
        raise _unreadable(e, payload) from None
    if isinstance(frame, submit_type):
        return _submit(frame, lim)
    cls = _BY_OP[type(frame).__struct_config__.tag]
    if cls is cp.Abort:
        return cls(frame.id)
    if cls in (cp.Tokenize, cp.Detokenize):
        return _tokenize(cls, frame, lim)
    if cls is cp.PauseGeneration:
        return cls(mode=frame.mode, clear_cache=frame.clear_cache)
    if cls is cp.WeightsCommit:
        return cls(weight_version=frame.weight_version)
    if cls is cp.WeightsChunk:
        return _weights_chunk(frame)
    if cls in (cp.InitWeightUpdateGroup, cp.WeightsFromDistributed,
               cp.UpdateWeightsFromPath):
        return _weight_source(cls, frame)
    if cls is cp.Sleep:
        return cls(level=frame.level, mode=frame.mode)
    if cls is cp.WakeUp:
        return cls(tags=None if frame.tags is None else list(frame.tags))
    return cls()


def _tokenize(cls: type, frame: Any, lim: ClientLimits) -> cp.ClientMessage:
    """tokenize: the text's size in bytes; detokenize: every id inside the vocabulary."""
    rid = frame.id
    try:
        _check_bytes("id", rid, lim.max_request_id_bytes, "max_request_id_bytes")
        if cls is cp.Tokenize:
            _check_bytes("prompt", frame.prompt, lim.max_prompt_bytes, "max_prompt_bytes")
            return cp.Tokenize(id=rid, prompt=frame.prompt,
                               add_special_tokens=frame.add_special_tokens,
                               return_token_strs=frame.return_token_strs)
    except FieldError as e:
        raise cp.ClientProtocolError(e.code, e.message, None if e.field == "id" else rid) \
            from None
    vocab = lim.vocab_size
    if vocab is not None:
        for j, t in enumerate(frame.token_ids):
            if t >= vocab:
                raise cp.ClientProtocolError(
                    "invalid_request", f"token_ids[{j}] is {t}, outside the vocabulary "
                    f"(ids 0..{vocab - 1}: vocab_size {vocab})", rid)
    return cp.Detokenize(id=rid, token_ids=list(frame.token_ids))


def _weight_source(cls: type, frame: Any) -> cp.ClientMessage:
    """A decoded weight-source message as the server's, its lists one entry per tensor."""
    fields = msgspec.structs.asdict(frame)
    fields.pop("v")
    if cls is cp.WeightsFromDistributed and not \
            len(frame.names) == len(frame.dtypes) == len(frame.shapes):
        raise cp.ClientProtocolError("invalid_request", "weights_from_distributed: `names`, "
                                     "`dtypes` and `shapes` must have one entry each per "
                                     "tensor")
    if cls is cp.InitWeightUpdateGroup and frame.rank_offset >= frame.world_size:
        raise cp.ClientProtocolError("invalid_request", "init_weight_update_group: "
                                     "rank_offset must be below world_size")
    return cls(**fields)


def _weights_chunk(frame: Any) -> cp.WeightsChunk:
    """A chunk's refs: one per name and dtype, each a well-formed ArrayRef of the
    dtype's wire type, at most MAX_CHUNK_BYTES in all."""
    def bad(message: str) -> cp.ClientProtocolError:
        return cp.ClientProtocolError("invalid_request", message)

    if not len(frame.names) == len(frame.dtypes) == len(frame.refs):
        raise bad("weights_chunk: `names`, `dtypes` and `refs` must have one entry each per "
                  "tensor")
    total = 0
    for i, (dtype, ref) in enumerate(zip(frame.dtypes, frame.refs)):
        if is_ipc_ref(ref):  # a trainer's CUDA tensor, by handle: no bytes in the frame
            try:
                IpcRef.decode(ref)
            except wt.WeightUpdateError as e:
                raise bad(f"weights_chunk: refs.{i}: {e}") from None
            continue
        try:
            r = ArrayRef.decode(ref)
        except BadRef as e:
            raise bad(f"weights_chunk: refs.{i}: {e}") from None
        if r.dtype != wt.WIRE_DTYPES[dtype]:
            raise bad(f"weights_chunk: refs.{i}: a {dtype} tensor travels as "
                      f"{wt.WIRE_DTYPES[dtype]}, not {r.dtype}")
        total += r.nbytes
        if total > wt.MAX_CHUNK_BYTES:
            raise bad(f"weights_chunk: over {wt.MAX_CHUNK_BYTES} bytes of tensors in one "
                      "chunk: send smaller chunks")
    if frame.rows is not None and len(frame.names) != 1:
        raise bad("weights_chunk: a chunk with `rows` holds one tensor's rows")
    return cp.WeightsChunk(chunk=frame.chunk, names=list(frame.names),
                           dtypes=list(frame.dtypes), refs=[list(r) for r in frame.refs],
                           rows=None if frame.rows is None else list(frame.rows))


def _unreadable(e: Exception, payload: bytes) -> cp.ClientProtocolError:
    if isinstance(e, OverflowError):  # an integer beyond 64 bits, somewhere
        return cp.ClientProtocolError("invalid_request", "an integer is outside int64",
                                      _request_id(payload))
    if isinstance(e, RecursionError) or "recursion" in str(e):
        return cp.ClientProtocolError("bad_frame", f"the frame nests too deeply (a message "
                                                   f"nests at most {cp.MAX_DEPTH} levels)")
    return cp.ClientProtocolError("bad_frame", "the frame is not valid msgpack (or holds "
                                               "text that is not UTF-8)")


def _invalid(text: str, payload: bytes, lim: ClientLimits) -> cp.ClientProtocolError:
    """A frame the typed decoder refused. The decoder stops at the first bad field, so
    the frame is read once more, untyped, for what the answer needs: whether it is
    msgpack at all (trailing bytes, nesting past the decoder's depth: bad_frame) and its
    request id. Only refused frames pay for this read."""
    try:
        envelope = _ENVELOPE.decode(payload)
    except (msgspec.DecodeError, RecursionError, ValueError, OverflowError) as e:
        return _unreadable(e, payload)
    except msgspec.ValidationError:  # the frame is not a map
        envelope = _Envelope()
    rid = envelope.id
    err = field_error(text, lim)
    if err.field == "prompt_token_ids" and text.startswith("Expected `array` of length <="):
        err.message = prompt_length_error(_array_len(envelope.prompt_token_ids), lim) \
            or err.message
    valid = isinstance(rid, str) or (type(rid) is int and INT64_MIN <= rid <= INT64_MAX)
    return cp.ClientProtocolError(err.code, err.message,
                                  rid if valid and err.field not in ("id", "") else None)


def _array_len(raw: msgspec.Raw) -> int:
    """How many items a msgpack array holds, from its header."""
    b = bytes(raw)
    if b and 0x90 <= b[0] <= 0x9F:
        return b[0] & 0x0F
    if len(b) >= 3 and b[0] == 0xDC:
        return int.from_bytes(b[1:3], "big")
    if len(b) >= 5 and b[0] == 0xDD:
        return int.from_bytes(b[1:5], "big")
    return 0


def _request_id(payload: bytes) -> str | int | None:
    """The frame's request id when it has a valid one."""
    try:
        rid = _ENVELOPE.decode(payload).id
    except Exception:  # noqa: BLE001 (any frame that does not even hold a map)
        return None
    if isinstance(rid, str) or (type(rid) is int and INT64_MIN <= rid <= INT64_MAX):
        return rid
    return None


def _submit(frame: Any, lim: ClientLimits) -> cp.Submit:
    """The decoded submit as the server's message: the checks the decoder cannot make
    (exactly one prompt; texts' sizes in bytes; SamplingParams' value rules)."""
    rid = frame.id

    def bad(message: str) -> cp.ClientProtocolError:
        return cp.ClientProtocolError("invalid_request", message, rid)

    if (frame.prompt is None) == (frame.prompt_token_ids is None):
        raise bad("give exactly one of 'prompt' and 'prompt_token_ids'")
    try:
        _check_bytes("id", rid, lim.max_request_id_bytes, "max_request_id_bytes")
        _check_bytes("prompt", frame.prompt, lim.max_prompt_bytes, "max_prompt_bytes")
        _check_bytes("routing_key", frame.routing_key, lim.max_request_id_bytes,
                     "max_request_id_bytes")
        params = _params(frame.params, lim)
    except FieldError as e:
        raise cp.ClientProtocolError(e.code, e.message, None if e.field == "id" else rid) \
            from None
    except (TypeError, ValueError) as e:
        raise bad(str(e)) from None
    return cp.Submit(rid, frame.prompt, frame.prompt_token_ids, params,
                     frame.priority or 0, frame.ttl_ms, frame.routing_key,
                     frame.output_token_ids, frame.output_text_offset)


def _params(raw: Any, lim: ClientLimits) -> SamplingParams:
    if raw is None:
        return SamplingParams()
    fields = msgspec.structs.asdict(raw)
    so = fields["structured_outputs"]
    if so is not None:
        fields["structured_outputs"] = {k: getattr(so, k) for k in KINDS
                                        if getattr(so, k) not in (None, False)}
    params = SamplingParams(**fields)
    if params.structured_outputs is not None:
        _check_bytes(f"params.structured_outputs.{params.structured_outputs.kind}",
                     params.structured_outputs.text, lim.max_grammar_bytes,
                     "max_grammar_bytes")
    return params


def _check_bytes(field: str, text: Any, limit: int, name: str) -> None:
    if isinstance(text, str) and len(text) * 4 > limit:  # else it fits whatever it holds
        size = len(text.encode("utf-8", "surrogatepass"))
        if size > limit:
            raise FieldError("invalid_request", field, f"{field} is {size} bytes, more "
                                                       f"than {name} {limit}")
