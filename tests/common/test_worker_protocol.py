"""The leader <-> worker wire protocol: round trips, strict decoding (ProtocolError naming
the field path, never a half-built message, nothing unpickled), frame size."""

from __future__ import annotations

import pickle

import msgpack
import msgspec
import pytest

from nvllm.common.errors import ProtocolError
from nvllm.common.worker_protocol import (
    MESSAGES,
    AbortWeights,
    CommitWeights,
    InitKVCache,
    InitWeightGroup,
    LoadGrammars,
    NewSeq,
    RunningSeq,
    Shutdown,
    SleepAck,
    SleepWorker,
    StepPlan,
    StepResult,
    WakeWorker,
    WeightChunk,
    WeightsAck,
    WeightsFromGroup,
    WeightsFromPath,
    WorkerError,
    WorkerReady,
    WorkerSampling,
    decode,
    encode,
)


def _plan() -> StepPlan:
    s1 = WorkerSampling()
    s2 = WorkerSampling(temperature=0.7, top_p=0.9, top_k=50, min_p=0.05, seed=2**63 - 1,
                        min_tokens=3, stop_token_ids=[2, 70000], repetition_penalty=1.1,
                        presence_penalty=-0.5, frequency_penalty=1.5, logprobs=5,
                        grammar_key="json-0123abcd",
                        logit_bias_ids=[3, 150000], logit_bias_values=[-100.0, 0.5])
    return StepPlan.of(
        step_id=17,
        new_seqs=[
            NewSeq(seq_id=1, token_ids=[1, 2, 3, 4, 5], num_prompt_tokens=5,
                   num_computed_tokens=0, num_new_tokens=5, block_table=[9, 3], sampling=s1),
            NewSeq(seq_id=2**40, token_ids=[100, 65535, 150000], num_prompt_tokens=2,
                   num_computed_tokens=1, num_new_tokens=2, block_table=[0], sampling=s2),
        ],
        running=[
            RunningSeq(seq_id=3, num_new_tokens=1, new_block_ids=[]),
            RunningSeq(seq_id=4, num_new_tokens=1, new_block_ids=[11]),
        ],
        finished_ids=[5, 6],
    )


ROUND_TRIP = [
    _plan(),
    StepPlan(step_id=0),
    StepPlan.of(0, [], [], []),
    InitKVCache(num_blocks=1234),
    LoadGrammars(tokenizer_info='{"vocab": []}', keys=["regex-1", "json-2"],
                 data=['{"g": 1}', '{"g": 2}'], drop=["choice-3"]),
    LoadGrammars(tokenizer_info=None, keys=[], data=[], drop=[]),
    Shutdown(),
    WorkerReady(rank=1, stage="weights", num_blocks=512),
    WorkerReady(rank=0, stage="kv", num_blocks=0),
    StepResult(step_id=3, seq_ids=[1, 2], token_ids=[10, 20], logprobs=None,
               worker_time_s=0.0125),
    StepResult(step_id=4, seq_ids=[1, 2, 3], token_ids=[10, 20, 30],
               logprobs=[[-0.5, [[10, -0.5], [11, -1.25]]], None, [-3.0, []]],
               worker_time_s=1.0),
    WorkerError(rank=2, step_id=9, message="boom: ünïcode", traceback="Traceback ...\n  x"),
    WeightChunk(update_id=3, chunk=0, names=["model.norm.weight"], dtypes=["bfloat16"],
                refs=[[1, "uint16", [64], "nvllm-tr-12-0123456789ab", 128, 4]]),
    CommitWeights(update_id=3),
    AbortWeights(update_id=3),
    WeightsAck(rank=1, update_id=3, chunk=-1, error="", staged_bytes=4096),
    WeightChunk(update_id=4, chunk=2, names=["lm_head.weight"], dtypes=["float32"],
                refs=[[1, "float32", [8, 64], "nvllm-tr-12-0123456789ab", 0, 5]],
                rows=[16, 96]),
    InitWeightGroup(group_id=1, master_address="10.0.0.1", master_port=29500,
                    rank_offset=1, world_size=3, group_name="weight_update_group",
                    backend="gloo", timeout_s=60.0),
    WeightsFromGroup(update_id=5, chunk=0, names=["model.norm.weight"], dtypes=["float32"],
                     shapes=[[64]]),
    WeightsFromPath(update_id=6, chunk=0, path="/ckpt/step-7"),
    SleepWorker(level=2),
    WakeWorker(tags=["weights", "kv_cache"]),
    SleepAck(rank=1, op="wake", error="", weights_bytes=10, kv_cache_bytes=20,
             device_bytes=30, rss_bytes=40, missing=["model.norm.weight"]),
]


@pytest.mark.parametrize("msg", ROUND_TRIP, ids=lambda m: type(m).__name__)
def test_round_trip(msg):
    data = encode(msg)
    assert isinstance(data, bytes)
    out = decode(data)
    assert type(out) is type(msg)
    assert out == msg
    # Nested messages come back as their own classes, not as lists.
    if isinstance(msg, StepPlan):
        for a in out.new_seqs:
            assert type(a) is NewSeq and type(a.sampling) is WorkerSampling
        for a in out.running:
            assert type(a) is RunningSeq


def test_float_lists_take_ints_and_decode_as_floats():
    # msgpack packs 2.0 as a float, but a foreign encoder may send 2: both mean a bias.
    values = decode(_mutated((2, 8, 1, 13), [2, -0.5])).new_seqs[1].sampling.logit_bias_values
    assert values == [2.0, -0.5] and all(type(v) is float for v in values)


def test_every_kind_is_covered():
    assert {type(m) for m in ROUND_TRIP} == set(MESSAGES.values())
    assert len({c.KIND for c in MESSAGES.values()}) == len(MESSAGES)


def test_float_fields_decode_as_float():
    out = decode(encode(StepResult(step_id=1, seq_ids=[], token_ids=[], logprobs=None,
                                   worker_time_s=3)))
    assert out.worker_time_s == 3.0 and isinstance(out.worker_time_s, float)


# --- rejection -------------------------------------------------------------------------

def _raw(*items) -> bytes:
    return msgpack.packb(list(items), use_bin_type=True)


def _rejects(data: bytes, **kw) -> ProtocolError:
    with pytest.raises(ProtocolError) as ei:
        decode(data, **kw)
    return ei.value


@pytest.mark.parametrize("data", [
    b"\xc1",  # never-used msgpack byte
    b"\xc1\xc1\xc1garbage",
    bytes(range(200, 256)),
    b"",
])
def test_rejects_garbage(data):
    _rejects(data)


def test_rejects_truncated_frames():
    data = encode(_plan())
    for cut in (1, 2, len(data) // 2, len(data) - 1):
        _rejects(data[:cut])


def test_rejects_trailing_bytes():
    _rejects(encode(Shutdown()) + b"\x00")


@pytest.mark.parametrize("obj", [
    {"kind": 3}, 3, "shutdown", None, True, 1.5, b"\x03", [], ["3"], [True], [3.0], [None],
])
def test_rejects_valid_msgpack_not_a_message_list(obj):
    _rejects(msgpack.packb(obj, use_bin_type=True))


@pytest.mark.parametrize("kind", [0, 8, 9, 14, 99, -1, 2**40])
def test_rejects_unknown_kind(kind):
    err = _rejects(_raw(kind))
    assert "kind" in str(err)


@pytest.mark.parametrize("frame", [
    [Shutdown.KIND, 1],
    [InitKVCache.KIND],
    [InitKVCache.KIND, 1, 2],
    [WorkerError.KIND, 0, 0, "m"],
    [StepPlan.KIND],  # no step id
    [StepPlan.KIND, 1, [], [b"", b"", b"", b"\0\0\0\0", b"", b"\0\0\0\0", b""],
     []],  # RunningSeqs: 7 of 6
    [StepPlan.KIND, 1, [b""] * 10, [], []],  # NewSeqs: 10 of 9
    [StepPlan.KIND, 1, [], [], [], 0, [], 7],  # a field StepPlan does not have
    [StepPlan.KIND, 1, [b"", b"", b"", b"", b"", b"", b"", b"", [[0.0] * 16]], [], []],
])
def test_rejects_wrong_field_count(frame):
    _rejects(msgpack.packb(frame, use_bin_type=True))


def _plan_frame() -> list:
    return msgpack.unpackb(encode(_plan()), raw=False)


def _mutated(path: tuple, value) -> bytes:
    frame = _plan_frame()
    node = frame
    for i in path[:-1]:
        node = node[i]
    node[path[-1]] = value
    return msgpack.packb(frame, use_bin_type=True)


@pytest.mark.parametrize("path,value", [
    ((1,), "17"),  # step_id: str where int
    ((1,), True),  # step_id: bool where int
    ((1,), 17.0),  # step_id: float where int
    ((1,), None),
    ((1,), -1),  # step_id >= 0
    ((4,), [5.0, 6.0]),  # finished_ids: float list where ints
    ((4,), [5, True]),  # bool inside an int list
    ((4,), [5, "6"]),
    ((4,), [5, -6]),
    ((4,), 5),  # an int where a list is expected
    ((2,), {"a": 1}),  # new_cols not an array
    ((2, 0), "1"),  # a column: str where bytes (or a ring ref)
    ((2, 0), 5),
    ((2, 8), None),  # NewSeqs.sampling missing
    ((2, 8, 0, 0), "0.0"),  # WorkerSampling.temperature: str where float
    ((2, 8, 0, 0), False),  # bool where float
    ((2, 8, 0, 2), 0.0),  # WorkerSampling.top_k: float where int
    ((2, 8, 0, 2), -1),  # top_k >= 0
    ((2, 8, 1, 4), 1.5),  # WorkerSampling.seed: ?int
    ((2, 8, 1, 6), [1.0]),  # WorkerSampling.stop_token_ids
    ((2, 8, 1, 12), [3.0, 4.0]),  # WorkerSampling.logit_bias_ids: floats where ints
    ((2, 8, 1, 13), [1.0, True]),  # WorkerSampling.logit_bias_values: a bool
    ((2, 8, 1, 13), [1.0, "2"]),  # a str
    ((2, 8, 1, 13), 1.0),  # not a list
    ((3, 1), True),  # RunningSeqs.num_new_tokens: bool where a column
    ((3, 2), "11"),  # RunningSeqs.new_block_ids
])
def test_rejects_wrong_field_types(path, value):
    _rejects(_mutated(path, value))


def test_errors_name_the_field_path():
    err = _rejects(_mutated((2, 8, 1, 2), -3))
    assert "$[2][8][1][2]" in str(err), err


@pytest.mark.parametrize("frame", [
    [InitKVCache.KIND, "5"],
    [InitKVCache.KIND, True],
    [InitKVCache.KIND, 5.0],
    [WorkerReady.KIND, 0, 1, 5],  # stage: int where str
    [WorkerReady.KIND, 0, b"kv", 5],  # bytes where str
    [WorkerReady.KIND, -1, "kv", 5],  # rank >= 0
    [StepResult.KIND, 1, [1], [2], None, "0.1"],
    [StepResult.KIND, 1, [1], [2.0], None, 0.1],
    [StepResult.KIND, 1, [1], [2], None, True],
    [WorkerError.KIND, 0, 0, 5, "tb"],
])
def test_rejects_wrong_field_types_other_messages(frame):
    _rejects(msgpack.packb(frame, use_bin_type=True))


def test_max_bytes():
    data = encode(_plan())
    assert decode(data, max_bytes=len(data)) == _plan()
    err = _rejects(data, max_bytes=len(data) - 1)
    assert str(len(data)) in str(err)


class _Boom:
    """Unpickling this would run code; decode must never get there."""

    def __reduce__(self):
        return (_explode, ("unpickled!",))


def _explode(msg):
    raise AssertionError(msg)


@pytest.mark.parametrize("protocol", [0, 2, 4, pickle.HIGHEST_PROTOCOL])
def test_rejects_pickle_and_never_unpickles(protocol, monkeypatch):
    calls = []
    monkeypatch.setattr(pickle, "loads", lambda *a, **k: calls.append(a))
    monkeypatch.setattr(pickle, "load", lambda *a, **k: calls.append(a))
    for obj in (_Boom(), Shutdown(), [3], {"kind": 3}):
        _rejects(pickle.dumps(obj, protocol=protocol))
    assert calls == []


# --- frame size ------------------------------------------------------------------------

def _decode_plan(n: int, with_block: bool) -> StepPlan:
    return StepPlan.of(
        step_id=123_456,
        new_seqs=[],
        running=[RunningSeq(seq_id=1000 + i, num_new_tokens=1,
                            new_block_ids=[60_000 + i] if with_block else [])
                 for i in range(n)],
        finished_ids=[],
    )


@pytest.mark.parametrize("with_block,limit", [(False, 16.5), (True, 20.5)])
def test_decode_plan_size_per_sequence(with_block, limit):
    n = 256
    plan = _decode_plan(n, with_block)
    data = encode(plan)
    per_seq = len(data) / n
    # Raw columns: an int64 id, an int32 count and an int32 offset per sequence, plus an
    # int32 block id when one is added; no token ids: the workers keep the tokens they
    # sample. Fixed width, so decoding is one np.frombuffer per column.
    assert per_seq <= limit, per_seq
    assert decode(data) == plan


def test_messages_are_tagged_array_structs():
    for kind, cls in MESSAGES.items():
        info = msgspec.inspect.type_info(cls)
        assert issubclass(cls, msgspec.Struct) and info.array_like and info.tag == kind
    for cls in (WorkerSampling,):
        assert issubclass(cls, msgspec.Struct) and msgspec.inspect.type_info(cls).array_like
