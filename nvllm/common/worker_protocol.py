"""The leader <-> worker wire protocol: typed messages (msgspec Structs) and their codec.

Every message is an array-like Struct whose integer tag is its ``KIND``, so a frame is the
msgpack array ``[kind, field0, field1, ...]``. One ``msgspec.msgpack.Decoder`` over the
union of messages checks every field's type and static constraint while it decodes: a
malformed frame becomes a ``ProtocolError`` naming the field's path (msgspec's
``$[2][0]``), never a half-built message. Nothing here is ever unpickled.

A step plan's integer data travel as columns (``Column``): raw little-endian bytes
(msgpack bin; the worker reads them with ``np.frombuffer``, no per-element work), or, for
big plans on one host, an ``ArrayRef`` into the shared-memory ring
(nvllm/common/plan_arrays.py) in the same field. Either way the worker reads each column
straight into its batch state without building per-sequence objects.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Annotated, Any, ClassVar

import msgspec
import numpy as np
from msgspec import Meta, Struct

from nvllm.common.errors import ProtocolError

NonNeg = Annotated[int, Meta(ge=0)]
Rank = Annotated[int, Meta(ge=0)]
# A column: the array's raw little-endian bytes, or an ArrayRef's list form (a region of
# the plan ring; plan_arrays resolves and checks it).
Column = bytes | list

# Column dtypes, by role: sequence ids can exceed 2**31; counts, token and block ids and
# CSR offsets cannot (max_model_len, the vocabulary and the cache are far below it).
ID_DTYPE = np.dtype("<i8")
INT_DTYPE = np.dtype("<i4")


class WorkerSampling(Struct, array_like=True, forbid_unknown_fields=True):
    """What rank 0 needs to sample one sequence (a subset of SamplingParams). Trailing
    fields with defaults may be left off the wire (a field added later costs old frames
    nothing)."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: NonNeg = 0
    min_p: float = 0.0
    seed: int | None = None
    min_tokens: NonNeg = 0
    stop_token_ids: list[NonNeg] = []  # masked until min_tokens
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: NonNeg | None = None
    # Rank 0 masks the logits with this compiled grammar (sent before in LoadGrammars).
    grammar_key: str | None = None
    # logit_bias as two parallel lists, ids unique and inside the vocabulary (the leader
    # checked them): rank 0 adds them to the row as they are, with no map to rebuild.
    logit_bias_ids: list[NonNeg] = []
    logit_bias_values: list[float] = []
    # Top-k of the prompt positions this sequence computes (None: do not score the prompt;
    # the leader sets it on one sequence of a request, until its prompt is scored).
    prompt_logprobs: NonNeg | None = None


def column(values: Any, dtype: np.dtype) -> bytes:
    """A column's inline form: `values` (a sequence or array of ints) as raw bytes."""
    return np.asarray(values, dtype).tobytes()


def csr(lists: list, dtype: np.dtype = INT_DTYPE) -> tuple[bytes, bytes]:
    """Lists of ints as (flat values, offsets): list i is flat[offsets[i]:offsets[i + 1]].
    One C-level pass over the values (itertools.chain into np.fromiter)."""
    offsets = np.zeros(len(lists) + 1, INT_DTYPE)
    np.cumsum([len(x) for x in lists], out=offsets[1:])
    flat = np.fromiter(itertools.chain.from_iterable(lists), dtype, int(offsets[-1]))
    return flat.tobytes(), offsets.tobytes()


EMPTY_OFFSETS = column([0], INT_DTYPE)


class NewSeqs(Struct, array_like=True, forbid_unknown_fields=True):
    """Sequences the workers do not hold yet (new, or resumed after preemption), whole,
    as columns of n entries: ids (int64), prompt length, tokens already in the KV cache
    (a prefix hit), tokens to compute this step (int32); every known token (prompt +
    generated) and the block table as CSR (int32 values, n + 1 int32 offsets); and the
    sampling parameters, one object each (rare: a sequence sends them once)."""

    seq_ids: Column = b""
    num_prompt_tokens: Column = b""
    num_computed_tokens: Column = b""
    num_new_tokens: Column = b""
    token_ids: Column = b""
    token_offsets: Column = EMPTY_OFFSETS
    block_ids: Column = b""
    block_offsets: Column = EMPTY_OFFSETS
    sampling: list[WorkerSampling] = []


class RunningSeqs(Struct, array_like=True, forbid_unknown_fields=True):
    """Deltas for sequences the workers hold, as columns of n entries: ids (int64), tokens
    to compute (int32), blocks appended to the table since the last plan (CSR). No token
    ids: every rank appends the tokens the group samples itself (rank 0 broadcasts them),
    so a plan can be sent before the leader has seen the previous step's tokens.

    Speculative decoding: a running sequence may carry draft tokens (CSR
    ``spec_token_ids``/``spec_offsets``; absent or ``[0]`` offsets: none anywhere). The
    workers place them after its known tokens without counting them as known; its
    ``num_new_tokens`` is then 1 + its drafts (the last known token and every draft are
    computed), and rank 0 verifies them from the logits of all those positions."""

    seq_ids: Column = b""
    num_new_tokens: Column = b""
    new_block_ids: Column = b""
    new_block_offsets: Column = EMPTY_OFFSETS
    spec_token_ids: Column = b""
    spec_offsets: Column = EMPTY_OFFSETS


class StepPlan(Struct, array_like=True, forbid_unknown_fields=True, tag=1):
    """One step for every rank: ``new`` and ``running`` sequences (columns; the step's
    order is new then running) and the ids of sequences to drop (finished, aborted or
    preempted; a plain list: few per step).

    Later features add a column, not a reshaping: speculative tokens to verify per
    running sequence are a CSR pair in RunningSeqs (``spec_token_ids``,
    ``spec_offsets``); tokens to roll back a per-sequence int32 column there
    (``num_rollback``), and a weight version one int field of StepPlan; each goes last
    with a default, so frames without it still decode.
    """

    step_id: NonNeg
    new_cols: NewSeqs = msgspec.field(default_factory=NewSeqs)
    running_cols: RunningSeqs = msgspec.field(default_factory=RunningSeqs)
    finished_ids: list[NonNeg] = []
    # Draft-model speculative decoding: after this step, rank 0 proposes up to this many
    # draft tokens (greedy, from the draft model) for each sequence of draft_seq_ids that
    # sampled, within the slots its block table holds (the scheduler reserves them); 0:
    # none. Sequences not listed (paused for low acceptance, at their length limit) get
    # none.
    num_draft_tokens: NonNeg = 0
    draft_seq_ids: list[NonNeg] = []
    KIND: ClassVar[int] = 1

    @classmethod
    def of(cls, step_id: int, new_seqs: list[NewSeq], running: list[RunningSeq],
           finished_ids: list[int]) -> StepPlan:
        """A plan from per-sequence records (tests, tools; the engine's PlanBuilder
        writes the columns directly)."""
        tok, tok_off = csr([s.token_ids for s in new_seqs])
        blk, blk_off = csr([s.block_table for s in new_seqs])
        rblk, rblk_off = csr([r.new_block_ids for r in running])
        spec, spec_off = (csr([r.spec_token_ids for r in running])
                          if any(r.spec_token_ids for r in running) else (b"", EMPTY_OFFSETS))
        return cls(step_id, NewSeqs(
            column([s.seq_id for s in new_seqs], ID_DTYPE),
            column([s.num_prompt_tokens for s in new_seqs], INT_DTYPE),
            column([s.num_computed_tokens for s in new_seqs], INT_DTYPE),
            column([s.num_new_tokens for s in new_seqs], INT_DTYPE),
            tok, tok_off, blk, blk_off, [s.sampling for s in new_seqs]),
            RunningSeqs(column([r.seq_id for r in running], ID_DTYPE),
                        column([r.num_new_tokens for r in running], INT_DTYPE), rblk,
                        rblk_off, spec, spec_off), list(finished_ids))

    @property
    def new_seqs(self) -> list[NewSeq]:
        """The new sequences as records (inline plans only; for tests and logs)."""
        n = self.new_cols
        ids = _ints(n.seq_ids, ID_DTYPE)
        npr, nc, nn = (_ints(c) for c in (n.num_prompt_tokens, n.num_computed_tokens,
                                          n.num_new_tokens))
        toks = _split(n.token_ids, n.token_offsets)
        blks = _split(n.block_ids, n.block_offsets)
        return [NewSeq(*t) for t in zip(ids, toks, npr, nc, nn, blks, n.sampling)]

    @property
    def running(self) -> list[RunningSeq]:
        """The running sequences as records (inline plans only; for tests and logs)."""
        r = self.running_cols
        ids = _ints(r.seq_ids, ID_DTYPE)
        spec = (_split(r.spec_token_ids, r.spec_offsets) if len(_ints(r.spec_offsets)) > 1
                else [[] for _ in ids])
        return [RunningSeq(*t) for t in zip(ids, _ints(r.num_new_tokens),
                                            _split(r.new_block_ids, r.new_block_offsets),
                                            spec)]


def _ints(col: Column, dtype: np.dtype = INT_DTYPE) -> list[int]:
    if not isinstance(col, bytes):
        raise TypeError("a column in the plan ring: read it with plan_arrays.columns")
    return np.frombuffer(col, dtype).tolist()


def _split(flat: Column, offsets: Column) -> list[list[int]]:
    vals, off = _ints(flat), _ints(offsets)
    return [vals[a:b] for a, b in zip(off, off[1:])]


@dataclass(slots=True)
class NewSeq:
    """One new sequence as a record (StepPlan.of, StepPlan.new_seqs); not on the wire."""

    seq_id: int
    token_ids: list[int]  # every token known so far: prompt + generated
    num_prompt_tokens: int
    num_computed_tokens: int  # tokens whose KV is already in the cache (prefix hit)
    num_new_tokens: int  # tokens to compute this step
    block_table: list[int]
    sampling: WorkerSampling = field(default_factory=WorkerSampling)


@dataclass(slots=True)
class RunningSeq:
    """One running sequence's delta as a record; not on the wire."""

    seq_id: int
    num_new_tokens: int
    new_block_ids: list[int]  # blocks appended to the block table since the last plan
    spec_token_ids: list[int] = field(default_factory=list)  # drafts to verify


class InitKVCache(Struct, array_like=True, forbid_unknown_fields=True, tag=2):
    num_blocks: NonNeg
    KIND: ClassVar[int] = 2


class Shutdown(Struct, array_like=True, forbid_unknown_fields=True, tag=3):
    KIND: ClassVar[int] = 3


class LoadGrammars(Struct, array_like=True, forbid_unknown_fields=True, tag=4):
    """To rank 0 only, before the plan that first needs them: compiled grammars for
    structured output (xgrammar's serialized JSON) by key, the TokenizerInfo they were
    compiled against (with the group's first grammars, else None), and keys to forget."""

    tokenizer_info: str | None
    keys: list[str]
    data: list[str]
    drop: list[str]
    KIND: ClassVar[int] = 4


class WeightChunk(Struct, array_like=True, forbid_unknown_fields=True, tag=5):
    """One chunk of a weight update (update_weights): HF-named full tensors, each as an
    ArrayRef's list form (a region of a shared-memory segment the sender owns, or inline
    bytes) and its torch dtype name (bfloat16 travels as uint16). Every rank slices its
    own shard out and stages it; nothing is applied before CommitWeights. Every rank
    answers with a WeightsAck once it no longer reads the chunk's memory."""

    update_id: NonNeg
    chunk: NonNeg  # ordinal within the update, from 0
    names: list[str]
    dtypes: list[str]
    refs: list[list]
    # A chunk of one tensor's rows [first, total) (a tensor over chunk_bytes is sent in
    # row ranges); None: whole tensors.
    rows: list[NonNeg] | None = None
    KIND: ClassVar[int] = 5


class CommitWeights(Struct, array_like=True, forbid_unknown_fields=True, tag=6):
    """Apply what every rank staged for `update_id` (sent only once all of them staged
    every chunk without error); each rank answers with a WeightsAck."""

    update_id: NonNeg
    KIND: ClassVar[int] = 6


class AbortWeights(Struct, array_like=True, forbid_unknown_fields=True, tag=7):
    """Drop what was staged for `update_id`: the old weights stay (no answer)."""

    update_id: NonNeg
    KIND: ClassVar[int] = 7


class WeightsAck(Struct, array_like=True, forbid_unknown_fields=True, tag=13):
    """A rank's answer to a WeightChunk (`chunk` its ordinal) or a CommitWeights (`chunk`
    -1): `error` empty when it staged (or applied) everything, else why it refused; a
    refusal leaves the rank's weights and the engine as they were."""

    rank: Rank
    update_id: NonNeg
    chunk: int
    error: str = ""
    staged_bytes: NonNeg = 0  # this rank's staging memory so far
    KIND: ClassVar[int] = 13


INIT_GROUP_CHUNK = -2  # the WeightsAck chunk that answers an InitWeightGroup


class InitWeightGroup(Struct, array_like=True, forbid_unknown_fields=True, tag=20):
    """Join a trainer's weight-update process group as rank ``rank_offset + rank``
    (init_weight_update_group; nvllm/worker/weight_group.py), waiting at most
    ``timeout_s``; each rank answers with a WeightsAck of chunk -2 for ``group_id``."""

    group_id: NonNeg
    master_address: str
    master_port: NonNeg
    rank_offset: NonNeg
    world_size: NonNeg
    group_name: str
    backend: str
    timeout_s: float
    KIND: ClassVar[int] = 20


class WeightsFromGroup(Struct, array_like=True, forbid_unknown_fields=True, tag=21):
    """One chunk of an update the trainer broadcasts over the weight-update group, in
    this order: HF names, torch dtype names, full shapes. Staged like a WeightChunk."""

    update_id: NonNeg
    chunk: NonNeg
    names: list[str]
    dtypes: list[str]
    shapes: list[list[NonNeg]]
    KIND: ClassVar[int] = 21


class WeightsFromPath(Struct, array_like=True, forbid_unknown_fields=True, tag=22):
    """An update read by every rank from a checkpoint (a safetensors folder or a .gguf
    file) through the loader, each rank its own shards; staged like a WeightChunk."""

    update_id: NonNeg
    chunk: NonNeg
    path: str
    KIND: ClassVar[int] = 22


class SleepWorker(Struct, array_like=True, forbid_unknown_fields=True, tag=23):
    """Free this rank's KV cache (and CUDA graphs) and its weights' device memory:
    level 1 keeps the weights in host memory, level 2 drops their contents
    (nvllm/worker/sleep.py). Answered by a SleepAck; a refusal frees nothing."""

    level: Annotated[int, Meta(ge=1, le=2)]
    KIND: ClassVar[int] = 23


class WakeWorker(Struct, array_like=True, forbid_unknown_fields=True, tag=24):
    """Allocate again what sleep freed, of `tags` ("weights", "kv_cache"); a SleepAck
    answers."""

    tags: Annotated[list[str], Meta(max_length=2)]
    KIND: ClassVar[int] = 24


class SleepAck(Struct, array_like=True, forbid_unknown_fields=True, tag=25):
    """A rank's answer to SleepWorker / WakeWorker: bytes freed or allocated again, and
    what its device and process hold afterwards; `missing`: after a level-2 wake of the
    weights (rank 0 only), the checkpoint tensors an update must write again."""

    rank: Rank
    op: str  # "sleep" | "wake"
    error: str = ""
    weights_bytes: NonNeg = 0
    kv_cache_bytes: NonNeg = 0
    device_bytes: NonNeg = 0
    rss_bytes: NonNeg = 0
    missing: list[str] = []
    KIND: ClassVar[int] = 25


class WorkerReady(Struct, array_like=True, forbid_unknown_fields=True, tag=10):
    """Sent by every rank after loading weights (num_blocks: what fits in its budget;
    load_s and peak_rss_mib: how long loading took and the process's peak memory), and
    again after the KV cache is allocated (stage 'kv')."""

    rank: Rank
    stage: str
    num_blocks: NonNeg
    load_s: float = 0.0
    peak_rss_mib: float = 0.0
    KIND: ClassVar[int] = 10


class StepResult(Struct, array_like=True, forbid_unknown_fields=True, tag=11):
    """Rank 0's answer to a plan. A sequence that verified drafts emits several tokens
    (its accepted drafts, then the target's own): ``token_ids`` is flat, ``num_tokens``
    says how many each of ``seq_ids`` has (None: one each), and ``logprobs`` has one entry
    per token."""

    step_id: NonNeg
    seq_ids: list[NonNeg]  # sequences that sampled a token this step
    token_ids: list[NonNeg]
    # Per token when asked: [logprob of the token, [[id, logprob], ...]]
    logprobs: list | None
    worker_time_s: float
    # Per sequence that scored prompt positions this step (its chunk's):
    # [seq_id, first, [[logprob, [[id, logprob], ...]], ...]], entry j scoring prompt token
    # first + j (>= 1) given the tokens before it. None: no sequence asked.
    prompt_logprobs: list | None = None
    num_tokens: list[NonNeg] | None = None
    # Draft-model proposals for the next step, one list per sequence of ``seq_ids`` (the
    # plan's num_draft_tokens > 0; None otherwise), drafted after this step's tokens.
    draft_token_ids: list[list[NonNeg]] | None = None
    KIND: ClassVar[int] = 11

    def per_seq(self) -> dict[int, tuple[list[int], list | None]]:
        """seq id -> (its tokens, their logprobs entries or None)."""
        counts = self.num_tokens or [1] * len(self.seq_ids)
        out, pos = {}, 0
        lps = self.logprobs
        for sid, n in zip(self.seq_ids, counts):
            out[sid] = (self.token_ids[pos:pos + n],
                        None if lps is None else lps[pos:pos + n])
            pos += n
        return out


class WorkerError(Struct, array_like=True, forbid_unknown_fields=True, tag=12):
    rank: Rank
    step_id: int
    message: str
    traceback: str
    KIND: ClassVar[int] = 12


MESSAGES: dict[int, type] = {
    c.KIND: c for c in (StepPlan, InitKVCache, LoadGrammars, WeightChunk, CommitWeights,
                        AbortWeights, Shutdown, WorkerReady, StepResult, WorkerError,
                        WeightsAck, InitWeightGroup, WeightsFromGroup, WeightsFromPath,
                        SleepWorker, WakeWorker, SleepAck)
}

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(
    StepPlan | InitKVCache | LoadGrammars | WeightChunk | CommitWeights | AbortWeights
    | Shutdown | WorkerReady | StepResult | WorkerError | WeightsAck | InitWeightGroup
    | WeightsFromGroup | WeightsFromPath | SleepWorker | WakeWorker | SleepAck)


def encode(msg: Any) -> bytes:
    return _encoder.encode(msg)


def decode(data: bytes, max_bytes: int = 1 << 30) -> Any:
    """The message in `data`; ProtocolError for a frame over `max_bytes` or one that is
    not exactly a well-typed message (the error names the field's path)."""
    if len(data) > max_bytes:
        raise ProtocolError(f"frame of {len(data)} bytes exceeds the limit of {max_bytes}")
    try:
        return _decoder.decode(data)
    except msgspec.ValidationError as e:
        what = "message kind" if str(e).endswith("`$[0]`") else "message"  # the tag
        raise ProtocolError(f"bad {what}: {e}") from None
    except msgspec.DecodeError as e:
        raise ProtocolError(f"not a msgpack message frame: {e}") from None
