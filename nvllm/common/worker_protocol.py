"""The leader <-> worker wire protocol: message dataclasses and their msgpack codec.

Messages travel as msgpack arrays ``[kind, field0, field1, ...]`` (positional, so a
running decode costs a handful of bytes per sequence). Decoding checks every field's
type, so a malformed frame becomes a ``ProtocolError``, never a half-built message.
Nothing here is ever unpickled.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar

import msgpack

from nvllm.common.errors import ProtocolError
from nvllm.common.utils import is_int

# Field type specs: "int", "float", "str", "bool", "any", "ints" (list of int), "floats"
# (list of int or float, decoded as floats), "?int" (int or None), a message class
# (nested), or [cls] (list of nested).


@dataclass(slots=True)
class WorkerSampling:
    """What rank 0 needs to sample one sequence (a subset of SamplingParams)."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    min_tokens: int = 0
    stop_token_ids: list[int] = field(default_factory=list)  # masked until min_tokens
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: int | None = None
    # Rank 0 masks the logits with this compiled grammar (sent before in LoadGrammars).
    grammar_key: str | None = None
    # logit_bias as two parallel lists, ids unique and inside the vocabulary (the leader
    # checked them): rank 0 adds them to the row as they are, with no map to rebuild.
    logit_bias_ids: list[int] = field(default_factory=list)
    logit_bias_values: list[float] = field(default_factory=list)
    # Top-k of the prompt positions this sequence computes (None: do not score the prompt;
    # the leader sets it on one sequence of a request, until its prompt is scored).
    prompt_logprobs: int | None = None
    SPEC: ClassVar[tuple] = ("float", "float", "int", "float", "?int", "int", "ints",
                             "float", "float", "float", "?int", "?str", "ints", "floats",
                             "?int")


@dataclass(slots=True)
class NewSeq:
    """A sequence the workers do not hold yet (new, or resumed after preemption)."""

    seq_id: int
    token_ids: list[int]  # every token known so far: prompt + generated
    num_prompt_tokens: int
    num_computed_tokens: int  # tokens whose KV is already in the cache (prefix hit)
    num_new_tokens: int  # tokens to compute this step
    block_table: list[int]
    sampling: WorkerSampling
    SPEC: ClassVar[tuple] = ("int", "ints", "int", "int", "int", "ints", WorkerSampling)


@dataclass(slots=True)
class RunningSeq:
    """Delta for a sequence the workers already hold. No token ids: every rank appends
    the tokens the group samples itself (rank 0 broadcasts them), so a plan can be sent
    before the leader has seen the previous step's tokens (async scheduling)."""

    seq_id: int
    num_new_tokens: int
    new_block_ids: list[int]  # blocks appended to the block table since the last plan
    SPEC: ClassVar[tuple] = ("int", "int", "ints")


@dataclass(slots=True)
class StepPlan:
    step_id: int
    new_seqs: list[NewSeq]
    running: list[RunningSeq]
    finished_ids: list[int]  # finished, aborted or preempted: workers drop their state
    # Big plans on one host: encoded ArrayRefs (nvllm.common.plan_arrays) holding the new
    # sequences' token ids and block tables and the running sequences as columns; then
    # those lists travel empty. None: everything is in the lists.
    bulk: list | None = None
    KIND: ClassVar[int] = 1
    SPEC: ClassVar[tuple] = ("int", [NewSeq], [RunningSeq], "ints", "?refs")


@dataclass(slots=True)
class InitKVCache:
    num_blocks: int
    KIND: ClassVar[int] = 2
    SPEC: ClassVar[tuple] = ("int",)


@dataclass(slots=True)
class LoadGrammars:
    """To rank 0 only, before the plan that first needs them: compiled grammars for
    structured output (xgrammar's serialized JSON) by key, the TokenizerInfo they were
    compiled against (with the group's first grammars, else None), and keys to forget."""

    tokenizer_info: str | None
    keys: list[str]
    data: list[str]
    drop: list[str]
    KIND: ClassVar[int] = 4
    SPEC: ClassVar[tuple] = ("?str", "strs", "strs", "strs")


@dataclass(slots=True)
class Shutdown:
    KIND: ClassVar[int] = 3
    SPEC: ClassVar[tuple] = ()


@dataclass(slots=True)
class WorkerReady:
    """Sent by every rank after loading weights (num_blocks: what fits in its budget;
    load_s and peak_rss_mib: how long loading took and the process's peak memory), and
    again after the KV cache is allocated (stage 'kv')."""

    rank: int
    stage: str
    num_blocks: int
    load_s: float = 0.0
    peak_rss_mib: float = 0.0
    KIND: ClassVar[int] = 10
    SPEC: ClassVar[tuple] = ("int", "str", "int", "float", "float")


@dataclass(slots=True)
class StepResult:
    step_id: int
    seq_ids: list[int]  # sequences that sampled a token this step
    token_ids: list[int]
    # Per sampled sequence when asked: [logprob of the token, [[id, logprob], ...]]
    logprobs: list | None
    worker_time_s: float
    # Per sequence that scored prompt positions this step (its chunk's):
    # [seq_id, first, [[logprob, [[id, logprob], ...]], ...]], entry j scoring prompt token
    # first + j (>= 1) given the tokens before it. None: no sequence asked.
    prompt_logprobs: list | None = None
    KIND: ClassVar[int] = 11
    SPEC: ClassVar[tuple] = ("int", "ints", "ints", "any", "float", "any")


@dataclass(slots=True)
class WorkerError:
    rank: int
    step_id: int
    message: str
    traceback: str
    KIND: ClassVar[int] = 12
    SPEC: ClassVar[tuple] = ("int", "int", "str", "str")


MESSAGES: dict[int, type] = {
    c.KIND: c for c in (StepPlan, InitKVCache, LoadGrammars, Shutdown, WorkerReady, StepResult,
                        WorkerError)
}


_FIELD_NAMES: dict[type, tuple[str, ...]] = {}


def _enc(obj: Any) -> Any:
    # Hot path (every step): lists of ints and floats go to msgpack as they are; only
    # dataclasses, and lists of them, are unfolded.
    cls = type(obj)
    if cls is list:
        return [_enc(x) for x in obj] if obj and dataclasses.is_dataclass(obj[0]) else obj
    names = _FIELD_NAMES.get(cls)
    if names is None:
        if not dataclasses.is_dataclass(obj):
            return obj
        names = _FIELD_NAMES[cls] = tuple(f.name for f in dataclasses.fields(obj))
    return [_enc(getattr(obj, n)) for n in names]


def encode(msg: Any) -> bytes:
    return msgpack.packb([msg.KIND, *_enc(msg)[:]], use_bin_type=True)



def _is_ref(r: Any) -> bool:
    from nvllm.common.transport.refs import ArrayRef, BadRef

    try:
        ArrayRef.decode(r)
    except BadRef:
        return False
    return True


# Leaf field checks, by spec name (built once: _dec runs for every field of every frame).
_CHECKS: dict[str, Any] = {
    "int": is_int,
    "?int": lambda x: x is None or is_int(x),
    "float": lambda x: isinstance(x, (int, float)) and not isinstance(x, bool),
    "str": lambda x: isinstance(x, str),
    "?str": lambda x: x is None or isinstance(x, str),
    "strs": lambda x: type(x) is list and all(type(i) is str for i in x),
    "bool": lambda x: isinstance(x, bool),
    # type() is int: a C-speed check per element that also refuses bools.
    "ints": lambda x: type(x) is list and all(type(i) is int for i in x),
    "floats": lambda x: type(x) is list and all(type(i) in (float, int) for i in x),
    "any": lambda x: True,
    "?refs": lambda x: x is None or (type(x) is list and all(_is_ref(r) for r in x)),
}


def _dec(spec: Any, v: Any, where: str) -> Any:
    if isinstance(spec, list):
        if not isinstance(v, list):
            raise ProtocolError(f"{where}: expected a list")
        return [_dec(spec[0], x, f"{where}[{i}]") for i, x in enumerate(v)]
    if isinstance(spec, type):
        if not isinstance(v, list) or len(v) != len(spec.SPEC):
            raise ProtocolError(f"{where}: expected {spec.__name__} with {len(spec.SPEC)} fields")
        return spec(*[_dec(s, x, f"{where}.{f.name}")
                      for s, x, f in zip(spec.SPEC, v, dataclasses.fields(spec))])
    if not _CHECKS[spec](v):
        raise ProtocolError(f"{where}: expected {spec}, got {type(v).__name__}")
    if spec == "float":
        return float(v)
    return [float(x) for x in v] if spec == "floats" else v


def decode(data: bytes, max_bytes: int = 1 << 30) -> Any:
    if len(data) > max_bytes:
        raise ProtocolError(f"frame of {len(data)} bytes exceeds the limit of {max_bytes}")
    try:
        obj = msgpack.unpackb(data, raw=False, strict_map_key=False)
    except Exception as e:  # msgpack raises several unrelated types on garbage
        raise ProtocolError(f"not a msgpack frame: {e}") from None
    if not isinstance(obj, list) or not obj or not is_int(obj[0]):
        raise ProtocolError("frame is not [kind, ...]")
    cls = MESSAGES.get(obj[0])
    if cls is None:
        raise ProtocolError(f"unknown message kind {obj[0]}")
    return _dec(cls, obj[1:], cls.__name__)
