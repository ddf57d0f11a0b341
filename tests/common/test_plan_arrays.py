"""Step plans by reference: pack moves a plan's lists into a shared-memory ring and
unpack rebuilds exactly the same plan; small plans, a full ring and oversized plans stay
as lists; anything a worker cannot resolve is a ValueError (the worker's InvalidPlan)."""

from __future__ import annotations

import copy
import random

import pytest

from nvllm.common import plan_arrays
from nvllm.common import worker_protocol as protocol
from nvllm.common.errors import ProtocolError
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
    return protocol.StepPlan(step, new, run, [5, 6])


@pytest.fixture
def ring():
    w = ArrayWriter(capacity_bytes=1 << 20, slot_bytes=4096, timeout_s=0.0)
    r = ArrayReader()
    yield w, r
    r.close()
    w.close()


def wire(plan: protocol.StepPlan) -> protocol.StepPlan:
    return protocol.decode(protocol.encode(plan))


def test_round_trip_through_the_ring(ring):
    w, r = ring
    plan = make_plan(3, num_new=40, num_run=200)
    want = copy.deepcopy(plan)
    gen = plan_arrays.pack(plan, w)
    assert gen > 0 and plan.bulk is not None and plan.running == []
    assert all(s.token_ids == [] and s.block_table == [] for s in plan.new_seqs)
    sent = wire(plan)
    assert len(protocol.encode(sent)) < 4000  # the ids stayed in the ring
    plan_arrays.unpack(sent, r)
    assert sent == want


def test_small_plans_stay_lists(ring):
    w, r = ring
    plan = make_plan(1, num_new=1, num_run=8, prompt=20)
    want = copy.deepcopy(plan)
    assert plan_arrays.pack(plan, w) == 0 and plan == want
    # Many sequences go by reference even when their ids are few (per-record msgpack
    # work is what a big decode plan costs).
    decode = make_plan(2, num_new=0, num_run=plan_arrays.MIN_BULK_SEQS, prompt=20)
    want = copy.deepcopy(decode)
    assert plan_arrays.bulk_bytes(decode) < plan_arrays.MIN_BULK_BYTES
    assert plan_arrays.pack(decode, w) > 0
    sent = wire(decode)
    plan_arrays.unpack(sent, r)
    assert sent == want


def test_full_ring_and_oversized_plans_stay_lists(ring, caplog):
    w, r = ring
    gens = []
    for step in range(8):  # ~170 KB each, never acknowledged: the 1 MiB ring fills up
        plan = make_plan(step, num_new=40, num_run=0, prompt=1000)
        gens.append(plan_arrays.pack(plan, w))
        if gens[-1] == 0:
            assert plan.bulk is None and len(plan.new_seqs[0].token_ids) == 1000
    assert gens[0] > 0 and 0 in gens and "plan ring full" in caplog.text
    w.acked_all(max(gens))  # acknowledged: room again
    assert plan_arrays.pack(make_plan(9, 40, 0, prompt=1000), w) > 0
    huge = make_plan(10, num_new=200, num_run=0, prompt=1000)  # 800 KB > half the ring
    assert plan_arrays.pack(huge, w) == 0 and huge.bulk is None


def test_bad_refs_and_bad_offsets_are_value_errors(ring):
    w, r = ring
    plan = make_plan(3, num_new=40, num_run=10)
    plan_arrays.pack(plan, w)
    short = wire(plan)
    short.bulk = short.bulk[:7]
    with pytest.raises(ValueError, match="expected 8 refs"):
        plan_arrays.unpack(short, r)
    lying = wire(plan)
    lying.new_seqs = lying.new_seqs[:-1]  # offsets describe one more sequence
    with pytest.raises(ValueError, match="offsets of token ids"):
        plan_arrays.unpack(lying, r)
    forged = wire(plan)
    forged.bulk[0][3] = "nvllm-tr-1-nosuchring"  # a ring that does not exist
    with pytest.raises(ValueError, match="plan arrays"):
        plan_arrays.unpack(forged, r)
    stale = wire(plan)
    stale.bulk[0][5] += 1  # a generation the ring never had there
    with pytest.raises(ValueError, match="plan arrays"):
        plan_arrays.unpack(stale, r)
    # Not a ref at all: refused by the protocol decoder already.
    with pytest.raises(ProtocolError, match="bulk"):
        protocol.decode(protocol.encode(protocol.StepPlan(1, [], [], [], [[1, 2]])))
