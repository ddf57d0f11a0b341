"""The shared-memory all-reduce of local CPU ranks (nvllm/worker/shm_allreduce.py) on real
processes: results are the rank-order sum bit for bit, over many rounds with the ranks
drifting apart; tensors over the slot go through gloo; the micro-batch overlap still gives
the synchronous results; a peer that dies or stalls is an error, not a hang; a rank that
cannot map the segment keeps every rank on gloo; no segment outlives its setup."""

from __future__ import annotations

import functools
import os

import pytest
from dist_ranks import (
    run_ranks,
    shm_not_everywhere,
    shm_overlap_vs_sync,
    shm_peer_dies,
    shm_rounds,
)

from nvllm.common.shm_segments import new_segment_name, unlink_segment
from nvllm.worker.shm_allreduce import supported_here

pytestmark = pytest.mark.skipif(not supported_here(), reason="x86 with POSIX shm only")


@pytest.fixture
def name():
    n = new_segment_name("ar")
    yield n
    assert not os.path.exists(f"/dev/shm/{n}"), "attach must unlink the segment"
    unlink_segment(n)


@pytest.mark.parametrize("world", [2, 3])
def test_rank_order_sum_bit_for_bit_over_many_rounds(tmp_path, name, world):
    slot = 8192  # floats: sizes at the limit go through shared memory, beyond it gloo
    got = run_ranks(functools.partial(shm_rounds, name=name, rounds=300, slot_floats=slot),
                    world, str(tmp_path), timeout_s=300)
    for r in got:
        assert r["exact"] and r["gone"]
        assert r["via_shm"] > 200 and r["via_gloo"] > 50
    assert len({r["digest"] for r in got}) == 1, "the ranks' results differ"


def test_overlapped_micro_batches_through_shared_memory(tmp_path, name):
    assert run_ranks(functools.partial(shm_overlap_vs_sync, name=name), 2,
                     str(tmp_path)) == [True, True]


@pytest.mark.parametrize("how", ["exit", "stall"])
def test_a_missing_peer_is_an_error_not_a_hang(tmp_path, name, how):
    r0, r1 = run_ranks(functools.partial(shm_peer_dies, name=name, how=how), 2,
                       str(tmp_path), timeout_s=60)
    assert r1 == "left"
    waited, msg = r0.split(" ", 1)
    if how == "exit":  # seen by the pid check, long before the 20 s timeout
        assert "rank 1" in msg and "died" in msg and float(waited) < 15, r0
    else:
        assert "waited" in msg and "step_timeout_s" in msg and 1.5 <= float(waited) < 3.5, r0


def test_a_rank_that_cannot_map_it_keeps_all_on_gloo(tmp_path, name):
    other = new_segment_name("ar")
    got = run_ranks(functools.partial(shm_not_everywhere, name=name, other=other), 2,
                    str(tmp_path))
    assert got == [[True, False, [3.0] * 4]] * 2
