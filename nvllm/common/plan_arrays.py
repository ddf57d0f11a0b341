"""A step plan's columns, inline or in the shared-memory ring, and how a worker reads them.

A plan's integer data are columns (worker_protocol.NewSeqs, RunningSeqs): raw bytes
inline, or, for big plans on one host, regions of a shared-memory ring
(``nvllm.common.transport``) that the plan names by ``ArrayRef``. ``pack`` moves a built
plan's columns into one ring reservation (same dtypes, same layout: one form either way);
``columns`` gives a worker every column as a numpy array, checked against the others
(lengths, CSR offsets), whichever way it came. Ring columns are views: the worker copies
them into its batch state before the step's first collective, so rank 0's result for a
step means every rank is done with its region, and the leader acknowledges the region's
generation then.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np

from nvllm.common import worker_protocol
from nvllm.common.transport import ArrayReader, ArrayWriter, BadRef, RingFull
from nvllm.common.worker_protocol import ID_DTYPE, INT_DTYPE, Column

logger = logging.getLogger(__name__)

# A plan with fewer column bytes than this stays inline: then a region and its ack cost
# more than the bytes do. Inline columns cost no per-sequence work, so the count of
# sequences does not matter (scripts/bench_plan_transport.py: a 256-sequence decode plan,
# 4 KiB, is faster inline; prefill plans of 18 KB inline and 71 KB by reference).
MIN_BULK_BYTES = 32 << 10

# (struct attribute, field, dtype) of every column, in ring order.
_NEW = (("seq_ids", ID_DTYPE), ("num_prompt_tokens", INT_DTYPE),
        ("num_computed_tokens", INT_DTYPE), ("num_new_tokens", INT_DTYPE),
        ("token_ids", INT_DTYPE), ("token_offsets", INT_DTYPE), ("block_ids", INT_DTYPE),
        ("block_offsets", INT_DTYPE))
_RUN = (("seq_ids", ID_DTYPE), ("num_new_tokens", INT_DTYPE), ("new_block_ids", INT_DTYPE),
        ("new_block_offsets", INT_DTYPE), ("spec_token_ids", INT_DTYPE),
        ("spec_offsets", INT_DTYPE))
COLUMNS = tuple(("new_cols", f, dt) for f, dt in _NEW) + tuple(
    ("running_cols", f, dt) for f, dt in _RUN)
NUM_ARRAYS = len(COLUMNS)


def _inline_bytes(col: Column) -> int:
    return len(col) if isinstance(col, bytes) else 0


def bulk_bytes(plan: worker_protocol.StepPlan) -> int:
    """The bytes of the plan's inline columns."""
    return sum(_inline_bytes(getattr(getattr(plan, s), f)) for s, f, _ in COLUMNS)


def pack(plan: worker_protocol.StepPlan, writer: ArrayWriter) -> int:
    """Move the plan's inline columns into the ring (in place: the plan then carries
    refs). Returns the region's generation to acknowledge, or 0 if the plan stays inline
    (small, or the ring is full: acknowledgements are not arriving)."""
    size = bulk_bytes(plan)
    if size < MIN_BULK_BYTES:
        return 0
    if size > writer.capacity // 2:  # two plans are in flight with async scheduling
        return 0
    cols = [getattr(getattr(plan, s), f) for s, f, _ in COLUMNS]
    if not all(isinstance(c, bytes) for c in cols):
        return 0
    specs = [((len(c) // dt.itemsize,), dt.name) for c, (_, _, dt) in zip(cols, COLUMNS)]
    try:
        res = writer.reserve(specs, timeout_s=0.0)
    except RingFull:
        logger.warning("plan ring full (workers have not acknowledged older plans): "
                       "sending step %d inline", plan.step_id)
        return 0
    for a, c, (_, _, dt) in zip(res.arrays, cols, COLUMNS):
        a[:] = np.frombuffer(c, dt)
    for ref, (s, f, _) in zip(res.commit(), COLUMNS):
        setattr(getattr(plan, s), f, ref.encode())
    return res.generation


@dataclass(slots=True)
class PlanColumns:
    """Every column of a plan as a numpy array (int64 ids, int32 the rest)."""

    new_ids: np.ndarray
    new_num_prompt: np.ndarray
    new_num_computed: np.ndarray
    new_num_new: np.ndarray
    new_tokens: np.ndarray  # CSR with new_token_offsets
    new_token_offsets: np.ndarray
    new_blocks: np.ndarray  # CSR with new_block_offsets
    new_block_offsets: np.ndarray
    run_ids: np.ndarray
    run_num_new: np.ndarray
    run_blocks: np.ndarray  # CSR with run_block_offsets
    run_block_offsets: np.ndarray
    run_spec: np.ndarray  # draft tokens, CSR with run_spec_offsets (n + 1 always)
    run_spec_offsets: np.ndarray


def _array(col: Column, dt: np.dtype, reader: ArrayReader | None, what: str) -> np.ndarray:
    if isinstance(col, bytes):
        if len(col) % dt.itemsize:
            raise ValueError(f"plan column {what}: {len(col)} bytes of {dt.name}")
        return np.frombuffer(col, dt)
    if reader is None:
        raise ValueError(f"plan column {what}: a ring reference, and no ring here")
    try:
        a = reader.get(col)
    except BadRef as e:
        raise ValueError(f"plan column {what}: {e}") from None
    if a.dtype != dt or a.ndim != 1:
        raise ValueError(f"plan column {what}: {a.dtype}{list(a.shape)}, expected {dt.name}")
    return a


def _check_csr(off: np.ndarray, n: int, flat: np.ndarray, what: str) -> None:
    if (len(off) != n + 1 or off[0] != 0 or off[-1] != len(flat)
            or (n and bool((np.diff(off) < 0).any()))):
        raise ValueError(f"plan arrays: offsets of {what} do not fit {n} sequences")


def columns(plan: worker_protocol.StepPlan, reader: ArrayReader | None) -> PlanColumns:
    """The plan's columns as arrays (views of the frame or the ring), checked for shape:
    equal lengths per group, CSR offsets that fit. ValueError says what is wrong."""
    arrs = [_array(getattr(getattr(plan, s), f), dt, reader, f"{s}.{f}")
            for s, f, dt in COLUMNS]
    c = PlanColumns(*arrs)
    n, r = len(c.new_ids), len(c.run_ids)
    if not (len(c.new_num_prompt) == len(c.new_num_computed) == len(c.new_num_new) == n
            == len(plan.new_cols.sampling)):
        raise ValueError("plan arrays: new-sequence columns of different lengths")
    if len(c.run_num_new) != r:
        raise ValueError("plan arrays: running columns of different lengths")
    _check_csr(c.new_token_offsets, n, c.new_tokens, "token ids")
    _check_csr(c.new_block_offsets, n, c.new_blocks, "block tables")
    _check_csr(c.run_block_offsets, r, c.run_blocks, "new blocks")
    if len(c.run_spec_offsets) == 1 and not len(c.run_spec):  # no drafts (or an old frame)
        c.run_spec_offsets = np.zeros(r + 1, INT_DTYPE)
    _check_csr(c.run_spec_offsets, r, c.run_spec, "draft tokens")
    return c
