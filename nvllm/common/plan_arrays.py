"""Step plans with their bulk by reference: token ids, block tables and running-sequence
columns in a shared-memory ring (``nvllm.common.transport``), the msgpack plan carrying
only ``ArrayRef``s.

``pack`` moves a plan's lists into one reservation, CSR style (all new sequences' token
ids in one int32 array plus offsets, block tables likewise) and turns running sequences
into columns (ids, tokens to compute, new block ids as CSR), so neither side spends
per-record msgpack work on them. ``unpack`` on a worker rebuilds the ordinary plan,
copying out of the ring (nothing keeps a view), before the step's first collective: so
rank 0's result for a step means every rank is done with its region, and the leader
acknowledges the region's generation then.
"""

from __future__ import annotations

import itertools
import logging

import numpy as np

from nvllm.common import worker_protocol
from nvllm.common.transport import ArrayReader, ArrayWriter, BadRef, RingFull

logger = logging.getLogger(__name__)

# A plan with fewer ids than this and fewer sequences than MIN_BULK_SEQS goes as plain
# lists: then a region and its ack cost more than msgpack does (measured crossover for
# decode plans: about 40 sequences; docs/benchmarks.md, "Plan transport").
MIN_BULK_BYTES = 16 << 10
MIN_BULK_SEQS = 48
NUM_ARRAYS = 8


def bulk_bytes(plan: worker_protocol.StepPlan) -> int:
    n = sum(len(s.token_ids) + len(s.block_table) + 1 for s in plan.new_seqs)
    return 4 * (n + sum(3 + len(r.new_block_ids) for r in plan.running))


def pack(plan: worker_protocol.StepPlan, writer: ArrayWriter) -> int:
    """Move the plan's lists into the ring (in place: the plan then carries refs).
    Returns the region's generation to acknowledge, or 0 if the plan stays as lists
    (small, or the ring is full: acknowledgements are not arriving)."""
    size = bulk_bytes(plan)
    if size < MIN_BULK_BYTES and len(plan.new_seqs) + len(plan.running) < MIN_BULK_SEQS:
        return 0
    if size > writer.capacity // 2:  # two plans are in flight with async scheduling
        return 0
    new, run = plan.new_seqs, plan.running
    columns = [[s.token_ids for s in new], [s.block_table for s in new],
               [r.new_block_ids for r in run]]
    specs = []
    for lists in columns[:2]:
        specs += [((sum(map(len, lists)),), "int32"), ((len(lists) + 1,), "int32")]
    specs += [((len(run),), "int64"), ((len(run),), "int32"),
              ((sum(map(len, columns[2])),), "int32"), ((len(run) + 1,), "int32")]
    try:
        res = writer.reserve(specs, timeout_s=0.0)
    except RingFull:
        logger.warning("plan ring full (workers have not acknowledged older plans): "
                       "sending step %d inline", plan.step_id)
        return 0
    a = res.arrays

    def csr(vals: np.ndarray, off: np.ndarray, lists: list[list[int]]) -> None:
        vals[:] = list(itertools.chain.from_iterable(lists))  # one C-level conversion
        off[0] = 0
        np.cumsum([len(x) for x in lists], out=off[1:])

    csr(a[0], a[1], columns[0])
    csr(a[2], a[3], columns[1])
    a[4][:] = [r.seq_id for r in run]
    a[5][:] = [r.num_new_tokens for r in run]
    csr(a[6], a[7], columns[2])
    refs = res.commit()
    for s in new:
        s.token_ids, s.block_table = [], []
    plan.running = []
    plan.bulk = [r.encode() for r in refs]
    return res.generation


def unpack(plan: worker_protocol.StepPlan, reader: ArrayReader) -> None:
    """Rebuild the plan's lists from its refs (in place). A ref that cannot be resolved,
    or arrays that do not fit the plan, raise ValueError naming the problem."""
    if plan.bulk is None:
        return
    if len(plan.bulk) != NUM_ARRAYS:
        raise ValueError(f"plan arrays: expected {NUM_ARRAYS} refs, got {len(plan.bulk)}")
    try:
        tok, tok_off, blk, blk_off, run_ids, run_n, run_blk, run_off = (
            reader.get(r).tolist() for r in plan.bulk)
    except BadRef as e:
        raise ValueError(f"plan arrays: {e}") from None
    new = plan.new_seqs

    def split(vals: list[int], off: list[int], n: int, what: str) -> list[list[int]]:
        if (len(off) != n + 1 or off[0] != 0 or off[-1] != len(vals)
                or any(b < a for a, b in zip(off, off[1:]))):
            raise ValueError(f"plan arrays: offsets of {what} do not fit {n} sequences")
        return [vals[a:b] for a, b in zip(off, off[1:])]

    for s, t, b in zip(new, split(tok, tok_off, len(new), "token ids"),
                       split(blk, blk_off, len(new), "block tables")):
        s.token_ids, s.block_table = t, b
    if len(run_n) != len(run_ids):
        raise ValueError("plan arrays: running columns of different lengths")
    plan.running = [worker_protocol.RunningSeq(i, n, b) for i, n, b in
                    zip(run_ids, run_n, split(run_blk, run_off, len(run_ids), "new blocks"))]
    plan.bulk = None
