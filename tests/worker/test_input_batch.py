"""The worker's batch state: plans validate whole before anything changes, the step's
arrays match a per-token reference, rows are reused, and the sampling rule is the one the
leader uses."""

from __future__ import annotations

import copy
import re

import numpy as np
import pytest

from nvllm.common import worker_protocol as protocol
from nvllm.common.step_rule import samples_after_step
from nvllm.worker.input_batch import InputBatch, InvalidPlan

BS = 4


def make(rows: int = 4, width: int = 16) -> InputBatch:
    return InputBatch(rows, width, width // BS, BS, vocab_size=1000, num_blocks=32)


def new(sid, tokens, blocks, computed=0, n=None, prompt=None):
    n = len(tokens) - computed if n is None else n
    return protocol.NewSeq(sid, list(tokens), prompt or len(tokens), computed, n, list(blocks),
                           protocol.WorkerSampling())


def plan(step, new_seqs=(), running=(), finished=()):
    return protocol.StepPlan.of(step, list(new_seqs), list(running), list(finished))


def snapshot(b: InputBatch):
    return (copy.deepcopy(b.row_of), b.token_ids.copy(), b.block_table.copy(),
            b.num_tokens.copy(), b.num_computed_tokens.copy(), b.num_blocks_per_row.copy(),
            list(b._free))


def same(a, b) -> bool:
    return all(np.array_equal(x, y) if isinstance(x, np.ndarray) else x == y
               for x, y in zip(a, b))


def reference(tables, starts, qs):
    """Per token, as the old per-token loop did it."""
    pos, slots = [], []
    for table, s, q in zip(tables, starts, qs):
        for p in range(s, s + q):
            pos.append(p)
            slots.append(table[p // BS] * BS + p % BS)
    return pos, slots


def test_step_arrays_match_the_reference():
    b = make()
    step = b.apply(plan(1, [new(7, range(10, 19), [5, 9, 2], computed=4, n=3),
                            new(8, [1, 2], [11])]))
    pos, slots = reference([[5, 9, 2], [11]], [4, 0], [3, 2])
    assert step.positions.tolist() == pos and step.slot_mapping.tolist() == slots
    assert step.input_ids.tolist() == [14, 15, 16, 1, 2]
    assert step.cu_seqlens_q.tolist() == [0, 3, 5] and step.seq_lens.tolist() == [7, 2]
    assert step.block_tables.tolist() == [[5, 9, 2], [11, 0, 0]]
    # Seq 7 stops short of its 9 tokens: only seq 8 samples, from its last token's row.
    assert step.sample_idx.tolist() == [1] and step.logits_indices.tolist() == [4]
    rows = step.rows[step.sample_idx]
    b.append_sampled(rows, np.array([42]))
    assert b.tokens(b.row_of[8]).tolist() == [1, 2, 42]
    # Decode: seq 8 computes its sampled token, seq 7 its last prefill chunk + a block.
    step = b.apply(plan(2, running=[protocol.RunningSeq(7, 2, []),
                                    protocol.RunningSeq(8, 1, [3])]))
    pos, slots = reference([[5, 9, 2], [11]], [7, 2], [2, 1])
    assert step.positions.tolist() == pos and step.slot_mapping.tolist() == slots
    assert step.input_ids.tolist() == [17, 18, 42]
    assert step.sample_idx.tolist() == [0, 1] and step.logits_indices.tolist() == [1, 2]
    assert b.blocks(b.row_of[8]).tolist() == [11, 3]


@pytest.mark.parametrize("words,bad", [
    ("appears twice", plan(9, [new(1, [1], [0]), new(1, [2], [1])])),
    ("already held", plan(9, [new(3, [1], [0])])),
    ("not held", plan(9, running=[protocol.RunningSeq(99, 1, [])])),
    ("not held", plan(9, running=[protocol.RunningSeq(3, 1, [])], finished=[3])),
    ("outside the vocabulary", plan(9, [new(1, [1, 1000], [0])])),
    ("outside the vocabulary", plan(9, [new(1, [-1], [0])])),
    ("outside the KV cache", plan(9, [new(1, [1], [32])])),
    ("outside the KV cache", plan(9, running=[protocol.RunningSeq(3, 1, [-1])])),
    ("block(s) of 4", plan(9, [new(1, list(range(1, 10)), [0])])),
    ("block(s) of 4", plan(9, [new(1, [1, 2], [0], n=3)])),
    ("block(s) of 4", plan(9, [new(1, [1, 2], [0], n=0)])),
    ("block(s) of 4", plan(9, running=[protocol.RunningSeq(3, 2, [])])),
    ("prompt tokens", plan(9, [new(1, [1, 2], [0], prompt=3)])),
])
def test_each_rejection_leaves_the_state_as_it_was(words, bad):
    b = make()
    b.apply(plan(1, [new(3, [1, 2, 3], [4])]))
    before = snapshot(b)
    # A valid part in front: nothing of it may be applied either.
    bad = plan(bad.step_id, [new(50, [5, 6], [7]), *bad.new_seqs], bad.running,
               bad.finished_ids)
    with pytest.raises(InvalidPlan, match=re.escape(words)):
        b.apply(bad)
    assert same(snapshot(b), before)


def _corrupt(field: str, value) -> protocol.StepPlan:
    p = plan(9, [new(50, [5, 6], [7])], [protocol.RunningSeq(3, 1, [])])
    group, name = field.split(".")
    setattr(getattr(p, group), name, value)
    return p


@pytest.mark.parametrize("words,bad", [
    ("bytes of int32", _corrupt("new_cols.token_ids", b"\x01\x02\x03")),
    ("offsets of token ids", _corrupt("new_cols.token_offsets", np.array(
        [0, 3], np.int32).tobytes())),
    ("offsets of new blocks", _corrupt("running_cols.new_block_offsets", b"")),
    ("different lengths", _corrupt("running_cols.num_new_tokens", b"")),
    ("different lengths", _corrupt("new_cols.sampling", [])),
    ("no ring here", _corrupt("new_cols.block_ids", [1, "int32", [1], "x", 0, 1])),
])
def test_malformed_columns_are_invalid_plans(words, bad):
    b = make()
    b.apply(plan(1, [new(3, [1, 2, 3], [4])]))
    before = snapshot(b)
    with pytest.raises(InvalidPlan, match=re.escape(words)):
        b.apply(bad)
    assert same(snapshot(b), before)


def test_rows_are_reused_and_grow_on_demand():
    b = make(rows=2, width=4)
    b.apply(plan(1, [new(1, [1, 2], [0]), new(2, [3], [1])]))
    r1 = b.row_of[1]
    # Finishing seq 1 frees its row; seq 3 takes it, with a longer prompt than the width.
    step = b.apply(plan(2, [new(3, range(100, 109), [2, 3, 4])], finished=[1]))
    assert b.row_of[3] == r1 and 1 not in b
    assert b.tokens(r1).tolist() == list(range(100, 109))
    assert step.input_ids.tolist() == list(range(100, 109))
    # A third held sequence beyond the 2 preallocated rows.
    b.apply(plan(3, [new(4, [7], [5])]))
    assert len(b) == 3 and b.tokens(b.row_of[2]).tolist() == [3]


def test_a_finished_sequence_can_come_back_in_the_same_plan():
    """Preempted and resumed: the plan drops it and sends it whole again."""
    b = make()
    b.apply(plan(1, [new(1, [1, 2], [0])]))
    step = b.apply(plan(2, [new(1, [1, 2, 9], [6], computed=0)], finished=[1]))
    assert step.input_ids.tolist() == [1, 2, 9] and b.blocks(b.row_of[1]).tolist() == [6]


def test_an_empty_plan():
    step = make().apply(plan(1))
    assert step.num_seqs == 0 and step.num_tokens == 0 and step.cu_seqlens_q.tolist() == [0]


def test_sampling_rule_is_shared():
    assert samples_after_step(5, 5) and not samples_after_step(4, 5)
    got = samples_after_step(np.array([5, 4]), np.array([5, 5]))
    assert got.tolist() == [True, False]
