"""A step plan as the columns the worker's batch state reads: one numpy array per field,
variable-length fields as CSR (a flat array plus offsets; list i is
``flat[offsets[i]:offsets[i + 1]]``)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

from nvllm.common import worker_protocol


def _csr(lists: list) -> tuple[np.ndarray, np.ndarray]:
    offsets = np.zeros(len(lists) + 1, np.int64)
    np.cumsum([len(x) for x in lists], out=offsets[1:])
    flat = np.fromiter(itertools.chain.from_iterable(lists), np.int64, int(offsets[-1]))
    return flat, offsets


def _col(values) -> np.ndarray:
    return np.fromiter(values, np.int64)


@dataclass(slots=True)
class PlanColumns:
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

    @classmethod
    def of(cls, plan: worker_protocol.StepPlan) -> PlanColumns:
        """The plan's columns (int64: a value out of range is caught by validation, not
        wrapped). Raises ValueError for an int that does not fit 64 bits."""
        new, run = plan.new_seqs, plan.running
        try:
            return cls(
                _col(s.seq_id for s in new), _col(s.num_prompt_tokens for s in new),
                _col(s.num_computed_tokens for s in new), _col(s.num_new_tokens for s in new),
                *_csr([s.token_ids for s in new]), *_csr([s.block_table for s in new]),
                _col(r.seq_id for r in run), _col(r.num_new_tokens for r in run),
                *_csr([r.new_block_ids for r in run]))
        except OverflowError as e:
            raise ValueError(f"step {plan.step_id}: {e}") from None
