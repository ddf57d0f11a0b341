"""The leader <-> worker wire protocol: round trips, strict decoding, frame size."""

from __future__ import annotations

import dataclasses
import pickle

import msgpack
import pytest

from nvllm.common.errors import ProtocolError
from nvllm.common.worker_protocol import (
    MESSAGES,
    InitKVCache,
    LoadGrammars,
    NewSeq,
    RunningSeq,
    Shutdown,
    StepPlan,
    StepResult,
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
                        grammar_key="json-0123abcd")
    return StepPlan(
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
    StepPlan(step_id=0, new_seqs=[], running=[], finished_ids=[]),
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


@pytest.mark.parametrize("kind", [0, 5, 9, 13, 99, -1, 2**40])
def test_rejects_unknown_kind(kind):
    err = _rejects(_raw(kind))
    assert "kind" in str(err)


@pytest.mark.parametrize("frame", [
    [Shutdown.KIND, 1],
    [InitKVCache.KIND],
    [InitKVCache.KIND, 1, 2],
    [WorkerError.KIND, 0, 0, "m"],
    [StepPlan.KIND, 1, [], []],
    [StepPlan.KIND, 1, [], [[1, 1]], []],  # RunningSeq with 2 of 3 fields
    [StepPlan.KIND, 1, [], [[1, 1, [2], [3]]], []],  # RunningSeq with 4 of 3 fields
    [StepPlan.KIND, 1, [[1, [1], 1, 0, 1, [0], [0.0] * 10]], [], []],  # WorkerSampling 10/11
    [StepPlan.KIND, 1, [[1, [1], 1, 0, 1, [0]]], [], []],  # NewSeq without its sampling
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
    ((4,), [5.0, 6.0]),  # finished_ids: float list where ints
    ((4,), [5, True]),  # bool inside an int list
    ((4,), [5, "6"]),
    ((4,), 5),  # an int where a list is expected
    ((2,), {"a": 1}),  # new_seqs not a list
    ((2, 0, 0), "1"),  # NewSeq.seq_id
    ((2, 0, 1), [1, 2, 3.5]),  # NewSeq.token_ids
    ((2, 0, 6), None),  # NewSeq.sampling missing
    ((2, 0, 6, 0), "0.0"),  # WorkerSampling.temperature: str where float
    ((2, 0, 6, 0), False),  # bool where float
    ((2, 0, 6, 2), 0.0),  # WorkerSampling.top_k: float where int
    ((2, 0, 6, 4), 1.5),  # WorkerSampling.seed: ?int
    ((2, 0, 6, 6), [1.0]),  # WorkerSampling.stop_token_ids
    ((3, 0, 1), True),  # RunningSeq.num_new_tokens: bool where int
    ((3, 1, 2), "11"),  # RunningSeq.new_block_ids
    ((3, 1, 2), [11.0]),  # RunningSeq.new_block_ids: a float among ints
])
def test_rejects_wrong_field_types(path, value):
    _rejects(_mutated(path, value))


@pytest.mark.parametrize("frame", [
    [InitKVCache.KIND, "5"],
    [InitKVCache.KIND, True],
    [InitKVCache.KIND, 5.0],
    [WorkerReady.KIND, 0, 1, 5, {}],  # stage: int where str
    [WorkerReady.KIND, 0, b"kv", 5, {}],  # bytes where str
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
    return StepPlan(
        step_id=123_456,
        new_seqs=[],
        running=[RunningSeq(seq_id=1000 + i, num_new_tokens=1,
                            new_block_ids=[60_000 + i] if with_block else [])
                 for i in range(n)],
        finished_ids=[],
    )


@pytest.mark.parametrize("with_block,limit", [(False, 7), (True, 10)])
def test_decode_plan_size_per_sequence(with_block, limit):
    n = 256
    plan = _decode_plan(n, with_block)
    data = encode(plan)
    per_seq = len(data) / n
    # Measured: 6 bytes/seq without a new block, 9 with one (uint16 ids); no token ids:
    # the workers keep the tokens they sample.
    assert per_seq <= limit, per_seq
    assert decode(data) == plan


def test_messages_are_slotted_dataclasses():
    for cls in (*MESSAGES.values(), NewSeq, RunningSeq, WorkerSampling):
        assert dataclasses.is_dataclass(cls)
        assert hasattr(cls, "__slots__")
