"""Tensor-parallel plumbing on real gloo process groups: micro-batches whose all-reduces
overlap compute give exactly the synchronous results; rank 0's sampled tokens reach
every rank; how a step is cut into micro-batches."""

from __future__ import annotations

import pytest
from dist_ranks import broadcast_tokens, overlap_vs_sync, run_ranks

from nvllm.worker.model_runner import micro_batch_ranges


@pytest.mark.parametrize("world", [2, 3])
def test_overlapped_passes_equal_synchronous_ones(tmp_path, world):
    assert run_ranks(overlap_vs_sync, world, str(tmp_path)) == [True] * world


def test_broadcast_from_first_reaches_every_rank(tmp_path):
    assert run_ranks(broadcast_tokens, 2, str(tmp_path)) == [[11, 22, 33]] * 2


@pytest.mark.parametrize("query_lens,min_tokens,want", [
    ([1] * 10, 4, [(0, 5), (5, 10)]),  # decodes: half the sequences each
    ([100, 1, 1, 1], 4, [(0, 1), (1, 4)]),  # a long prefill alone
    ([1, 1, 1, 100], 4, [(0, 3), (3, 4)]),
    ([10, 1, 10], 1, [(0, 1), (1, 3)]),
    ([5, 5], 20, [(0, 2)]),  # below the threshold: one batch
    ([300], 1, [(0, 1)]),  # one sequence cannot be split
])
def test_micro_batch_ranges(query_lens, min_tokens, want):
    got = micro_batch_ranges(query_lens, min_tokens)
    assert got == want
    assert got[0][0] == 0 and got[-1][1] == len(query_lens)
