"""Step plans by reference: pack moves a plan's columns into a shared-memory ring and a
worker reads the same arrays back (``plan_arrays.columns``) as from an inline plan; small
plans, a full ring and oversized plans stay inline; anything a worker cannot resolve is a
ValueError (the worker's InvalidPlan)."""

from __future__ import annotations

import copy
import random

import numpy as np
import pytest

from nvllm.common import plan_arrays
from nvllm.common import worker_protocol as protocol
from nvllm.common.transport import ArrayReader, ArrayWriter


def make_plan(step: int, num_new: int, num_run: int, prompt: int = 300,
              seed: int = 0) -> protocol.StepPlan:
    rng = random.Random(seed)
    sampling = protocol.WorkerSampling(temperature=0.5, seed=7)
    new = [protocol.NewSeq(i, [rng.randrange(150_000) for _ in range(prompt + i)],
                           prompt, 16 * (i % 3), prompt + i - 16 * (i % 3),
                           [rng.randrange(40_000) for _ in range(-(-(prompt + i) // 16))],
                           sampling) for i in range(num_new)]
    run = [protocol.RunningSeq(1000 + i, 1 + i % 2, [rng.randrange(40_000)] * (i % 3))
           for i in range(num_run)]
    return protocol.StepPlan.of(step, new, run, [5, 6])


@pytest.fixture
def ring():
    w = ArrayWriter(capacity_bytes=1 << 20, slot_bytes=4096, timeout_s=0.0)
    r = ArrayReader()
    yield w, r
    r.close()
    w.close()


def wire(plan: protocol.StepPlan) -> protocol.StepPlan:
    return protocol.decode(protocol.encode(plan))


def same_columns(a: plan_arrays.PlanColumns, b: plan_arrays.PlanColumns) -> bool:
    return all(np.array_equal(getattr(a, f), getattr(b, f)) and
               getattr(a, f).dtype == getattr(b, f).dtype
               for f in plan_arrays.PlanColumns.__slots__)


def in_ring(plan: protocol.StepPlan) -> bool:
    return all(not isinstance(getattr(getattr(plan, s), f), bytes)
               for s, f, _ in plan_arrays.COLUMNS)


def test_round_trip_through_the_ring(ring):
    w, r = ring
    plan = make_plan(3, num_new=40, num_run=200)
    want = plan_arrays.columns(copy.deepcopy(plan), None)
    gen = plan_arrays.pack(plan, w)
    assert gen > 0 and in_ring(plan)
    sent = wire(plan)
    assert len(protocol.encode(sent)) < 4000  # the ids stayed in the ring
    assert same_columns(plan_arrays.columns(sent, r), want)
    assert sent.new_cols.sampling == plan.new_cols.sampling and sent.finished_ids == [5, 6]


def test_small_plans_stay_inline(ring):
    w, r = ring
    plan = make_plan(1, num_new=1, num_run=8, prompt=20)
    want = copy.deepcopy(plan)
    assert plan_arrays.pack(plan, w) == 0 and plan == want
    # A big decode plan too: inline columns cost nothing per sequence.
    decode = make_plan(2, num_new=0, num_run=256, prompt=20)
    want = copy.deepcopy(decode)
    assert plan_arrays.pack(decode, w) == 0 and decode == want
    # Past the byte threshold, by reference, however few the sequences.
    prefill = make_plan(3, num_new=2, num_run=0, prompt=plan_arrays.MIN_BULK_BYTES // 8)
    want = plan_arrays.columns(copy.deepcopy(prefill), None)
    assert plan_arrays.pack(prefill, w) > 0
    assert same_columns(plan_arrays.columns(wire(prefill), r), want)


def test_full_ring_and_oversized_plans_stay_inline(ring, caplog):
    w, r = ring
    gens = []
    for step in range(8):  # ~170 KB each, never acknowledged: the 1 MiB ring fills up
        plan = make_plan(step, num_new=40, num_run=0, prompt=1000)
        gens.append(plan_arrays.pack(plan, w))
        if gens[-1] == 0:
            assert not in_ring(plan) and len(plan.new_seqs[0].token_ids) == 1000
    assert gens[0] > 0 and 0 in gens and "plan ring full" in caplog.text
    w.acked_all(max(gens))  # acknowledged: room again
    assert plan_arrays.pack(make_plan(9, 40, 0, prompt=1000), w) > 0
    huge = make_plan(10, num_new=200, num_run=0, prompt=1000)  # 800 KB > half the ring
    assert plan_arrays.pack(huge, w) == 0 and not in_ring(huge)


def test_bad_refs_and_bad_offsets_are_value_errors(ring):
    w, r = ring
    plan = make_plan(3, num_new=40, num_run=10)
    plan_arrays.pack(plan, w)
    lying = wire(plan)
    lying.new_cols.sampling = lying.new_cols.sampling[:-1]  # one sequence fewer
    with pytest.raises(ValueError, match="different lengths"):
        plan_arrays.columns(lying, r)
    swapped = wire(plan)  # a column of the wrong dtype
    swapped.new_cols.token_ids = swapped.new_cols.seq_ids
    with pytest.raises(ValueError, match="expected int32"):
        plan_arrays.columns(swapped, r)
    forged = wire(plan)
    forged.new_cols.token_ids[3] = "nvllm-tr-1-nosuchring"  # a ring that does not exist
    with pytest.raises(ValueError, match="plan column"):
        plan_arrays.columns(forged, r)
    stale = wire(plan)
    stale.new_cols.token_ids[5] += 1  # a generation the ring never had there
    with pytest.raises(ValueError, match="plan column"):
        plan_arrays.columns(stale, r)
    with pytest.raises(ValueError, match="no ring here"):
        plan_arrays.columns(wire(plan), None)
    not_a_ref = wire(plan)
    not_a_ref.running_cols.seq_ids = [1, 2]
    with pytest.raises(ValueError, match="plan column"):
        plan_arrays.columns(not_a_ref, r)
