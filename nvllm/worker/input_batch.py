"""The worker's batch state: every held sequence's tokens and block table in persistent
numpy arrays, one row per sequence (vLLM V1's InputBatch and BlockTable idea).

A step plan changes the state in place (``InputBatch.apply``): finished sequences free
their rows, new ones fill a free row, running ones append their new blocks. The same
call returns the step's flat arrays (``StepBatch``: positions, slot_mapping, input ids,
the step's block-table rows, which rows sample), computed with numpy indexing, so no
step walks its tokens in Python and no block table is rebuilt from lists. The model
runner turns them into tensors; ``tests/support/fake_workers.py`` runs the same state
without a model, so the leader's tests exercise the workers' real bookkeeping.

Torch-free on purpose: the arrays are what both the CPU path (``torch.from_numpy``,
no copy) and the CUDA path (one host-to-device copy each) start from.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from nvllm.common import worker_protocol
from nvllm.common.plan_arrays import PlanColumns, columns
from nvllm.common.step_rule import samples_after_step
from nvllm.common.transport import ArrayReader


class InvalidPlan(ValueError):
    """A step plan that cannot be executed; the worker's state is left as it was."""


@dataclass(slots=True)
class StepBatch:
    """One step's inputs, sequences in plan order (new, then running). ``i`` below is a
    sequence's index in the step, ``t`` a token's index in the flat batch."""

    seq_ids: np.ndarray  # [n] int64
    rows: np.ndarray  # [n] int64: each sequence's row in the InputBatch
    num_new: int  # the first num_new sequences are the plan's new ones
    start: np.ndarray  # [n] int64: tokens computed before this step
    query_lens: np.ndarray  # [n] int32: tokens computed this step
    cu_seqlens_q: np.ndarray  # [n + 1] int32: sequence i's tokens are t in cu[i]..cu[i+1]
    seq_lens: np.ndarray  # [n] int32: context length after this step
    block_tables: np.ndarray  # [n, width] int32: the rows' tables, width = longest one
    positions: np.ndarray  # [T] int64
    input_ids: np.ndarray  # [T] int64
    slot_mapping: np.ndarray  # [T] int64
    sample_idx: np.ndarray  # [s] int64: the i that sample this step, in order
    # The hidden rows whose logits the step needs: sampling sequence j's are
    # logits_indices[logits_offsets[j]:logits_offsets[j + 1]], its last 1 + spec_lens[j]
    # tokens (one, its last, unless it verifies drafts).
    logits_indices: np.ndarray  # [sum(1 + spec_lens)] int64
    spec_lens: np.ndarray | None = None  # [s] int64: drafts each sampling sequence verifies
    logits_offsets: np.ndarray | None = None  # [s + 1] int64

    @property
    def num_seqs(self) -> int:
        return len(self.seq_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.positions)


class InputBatch:
    """Held sequences by row. Capacities grow on demand (doubling), so callers size them
    for the usual case: the model runner for max_num_seqs x max_model_len, and a row is
    never reallocated mid-step."""

    def __init__(self, max_num_seqs: int, max_model_len: int, max_blocks_per_seq: int,
                 block_size: int, vocab_size: int, num_blocks: int) -> None:
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.num_blocks = num_blocks  # of the KV cache: block ids are below it
        rows = max(max_num_seqs, 1)
        self.token_ids = np.zeros((rows, max(max_model_len, 1)), np.int32)
        self.block_table = np.zeros((rows, max(max_blocks_per_seq, 1)), np.int32)
        self.num_tokens = np.zeros(rows, np.int64)  # prompt + generated, per row
        self.num_prompt_tokens = np.zeros(rows, np.int64)
        self.num_computed_tokens = np.zeros(rows, np.int64)
        self.num_blocks_per_row = np.zeros(rows, np.int64)
        self.sampling: list[worker_protocol.WorkerSampling | None] = [None] * rows
        self.row_of: dict[int, int] = {}  # seq id -> row
        self._free = list(range(rows - 1, -1, -1))  # pop() takes the lowest row

    def __len__(self) -> int:
        return len(self.row_of)

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self.row_of

    def tokens(self, row: int) -> np.ndarray:
        """The row's known tokens (a view, valid until the next apply/append)."""
        return self.token_ids[row, :self.num_tokens[row]]

    def blocks(self, row: int) -> np.ndarray:
        return self.block_table[row, :self.num_blocks_per_row[row]]

    # ---- validation -------------------------------------------------------------------

    def validate(self, plan: worker_protocol.StepPlan, cols: PlanColumns
                 ) -> tuple[np.ndarray, np.ndarray]:
        """Reject a plan this state cannot execute, before touching anything. Plans come
        from the leader only, so a bad one is a bug (or a forged frame): raising here,
        instead of indexing out of the KV cache or the embedding table, lets the worker
        answer with an error and stay as it was. Returns the running sequences' rows and
        their draft counts."""
        dropped = set(plan.finished_ids)
        new_ids, run_ids = cols.new_ids.tolist(), cols.run_ids.tolist()
        if len(set(new_ids).union(run_ids)) < len(new_ids) + len(run_ids):
            seen: set[int] = set()
            dup = next(s for s in new_ids + run_ids if s in seen or seen.add(s))
            raise InvalidPlan(f"sequence {dup} appears twice in step {plan.step_id}")
        row_of = self.row_of
        for sid in new_ids:
            if sid in row_of and sid not in dropped:
                raise InvalidPlan(f"new sequence {sid} is already held")
        for sid in run_ids:
            if sid in dropped or sid not in row_of:
                raise InvalidPlan(f"running sequence {sid} is not held by this worker")
        run_rows = np.fromiter((row_of[s] for s in run_ids), np.int64, len(run_ids))
        if new_ids:
            self._check_new(cols)
        if len(cols.run_blocks):
            self._check_ids(cols.run_ids, cols.run_blocks, cols.run_block_offsets, None)
        spec = np.diff(cols.run_spec_offsets).astype(np.int64)
        known = self.num_tokens[run_rows]
        if len(cols.run_spec):
            self._check_drafts(cols, run_rows, spec)
        self._check_ranges(cols.run_ids, known + spec,
                           self.num_blocks_per_row[run_rows] + np.diff(cols.run_block_offsets),
                           self.num_computed_tokens[run_rows], cols.run_num_new)
        return run_rows, spec

    def _check_drafts(self, cols: PlanColumns, run_rows: np.ndarray, spec: np.ndarray) -> None:
        """Drafts go only to decoding rows (one known token left to compute), which then
        compute it and every draft; their ids must be in the vocabulary."""
        bad = (cols.run_spec < 0) | (cols.run_spec >= self.vocab_size)
        if bad.any():
            i = int(np.searchsorted(cols.run_spec_offsets, np.argmax(bad), side="right")) - 1
            raise InvalidPlan(f"sequence {int(cols.run_ids[i])}: draft token id outside the "
                              f"vocabulary (0..{self.vocab_size - 1})")
        has = spec > 0
        decoding = (self.num_computed_tokens[run_rows] == self.num_tokens[run_rows] - 1)
        bad = has & (~decoding | (cols.run_num_new.astype(np.int64) != 1 + spec))
        if bad.any():
            i = int(np.argmax(bad))
            raise InvalidPlan(f"sequence {int(cols.run_ids[i])}: {int(spec[i])} draft(s) on a "
                              f"row that is not decoding or computes "
                              f"{int(cols.run_num_new[i])} token(s)")

    def _check_new(self, cols: PlanColumns) -> None:
        lens = np.diff(cols.new_token_offsets)
        bad = ~((cols.new_num_prompt > 0) & (cols.new_num_prompt <= lens))
        if bad.any():
            i = int(np.argmax(bad))
            raise InvalidPlan(f"sequence {int(cols.new_ids[i])}: "
                              f"{int(cols.new_num_prompt[i])} prompt tokens of {int(lens[i])}")
        self._check_ids(cols.new_ids, cols.new_blocks, cols.new_block_offsets,
                        (cols.new_tokens, cols.new_token_offsets))
        self._check_ranges(cols.new_ids, lens, np.diff(cols.new_block_offsets),
                           cols.new_num_computed, cols.new_num_new)

    def _check_ids(self, ids: np.ndarray, blocks: np.ndarray, block_off: np.ndarray,
                   tokens: tuple[np.ndarray, np.ndarray] | None) -> None:
        if tokens is not None:
            toks, tok_off = tokens
            bad = (toks < 0) | (toks >= self.vocab_size)
            if bad.any():
                sid = ids[np.searchsorted(tok_off, np.argmax(bad), side="right") - 1]
                raise InvalidPlan(f"sequence {int(sid)}: token id outside the vocabulary "
                                  f"(0..{self.vocab_size - 1})")
        bad = (blocks < 0) | (blocks >= self.num_blocks)
        if bad.any():
            sid = ids[np.searchsorted(block_off, np.argmax(bad), side="right") - 1]
            raise InvalidPlan(f"sequence {int(sid)}: block id outside the KV cache "
                              f"(0..{self.num_blocks - 1})")

    def _check_ranges(self, ids: np.ndarray, num_tokens: np.ndarray, num_blocks: np.ndarray,
                      computed: np.ndarray, n: np.ndarray) -> None:
        bs = self.block_size
        computed, n = computed.astype(np.int64), n.astype(np.int64)  # no int32 wrap-around
        end = computed + n
        bad = (n < 1) | (computed < 0) | (end > num_tokens) | (-(-end // bs) > num_blocks)
        if bad.any():
            i = int(np.argmax(bad))
            raise InvalidPlan(f"sequence {int(ids[i])}: tokens {int(computed[i])}.."
                              f"{int(end[i])} of {int(num_tokens[i])} with "
                              f"{int(num_blocks[i])} block(s) of {bs}")

    # ---- changing the state -----------------------------------------------------------

    def apply(self, plan: worker_protocol.StepPlan, reader: ArrayReader | None = None
              ) -> StepBatch:
        """Validate the whole plan (InvalidPlan, state untouched), then apply it in place
        and return the step's arrays. The scheduled sequences' computed counts advance
        by the step's tokens; sampled tokens come later, through append_sampled (or
        append_verified, for rows that verified drafts: their drafts are written after
        their known tokens here, not counted as known).
        `reader`: the plan ring, for plans whose columns live there (copied into the
        rows here: nothing keeps a view of the ring)."""
        try:
            cols = columns(plan, reader)
        except ValueError as e:
            raise InvalidPlan(str(e)) from None
        run_rows, spec = self.validate(plan, cols)
        for sid in plan.finished_ids:
            self.free(sid)
        new_rows = self._add_new(cols, plan)
        self._append_blocks(run_rows, cols.run_blocks, cols.run_block_offsets)
        if len(cols.run_spec):
            self._write_drafts(run_rows, cols.run_spec, cols.run_spec_offsets)
        rows = np.concatenate([new_rows, run_rows])
        q = np.concatenate([cols.new_num_new, cols.run_num_new]).astype(np.int32)
        spec_all = np.concatenate([np.zeros(len(new_rows), np.int64), spec])
        return self._step(np.concatenate([cols.new_ids, cols.run_ids]), rows, q,
                          len(cols.new_ids), spec_all)

    def free(self, seq_id: int) -> None:
        row = self.row_of.pop(seq_id, None)
        if row is not None:
            self.sampling[row] = None
            self._free.append(row)

    def _take_row(self) -> int:
        if not self._free:
            self._grow_rows()
        return self._free.pop()

    def _add_new(self, cols: PlanColumns, plan: worker_protocol.StepPlan) -> np.ndarray:
        n = len(cols.new_ids)
        rows = np.empty(n, np.int64)
        if not n:
            return rows
        for j, sid in enumerate(cols.new_ids.tolist()):
            rows[j] = self.row_of[sid] = self._take_row()
            self.sampling[rows[j]] = plan.new_cols.sampling[j]
        lens = np.diff(cols.new_token_offsets)
        nblk = np.diff(cols.new_block_offsets)
        self._ensure_width(int(lens.max()), int(nblk.max()))
        self.token_ids[np.repeat(rows, lens), _ranks(cols.new_token_offsets)] = cols.new_tokens
        self.block_table[np.repeat(rows, nblk), _ranks(cols.new_block_offsets)] = cols.new_blocks
        self.num_tokens[rows] = lens
        self.num_prompt_tokens[rows] = cols.new_num_prompt
        self.num_computed_tokens[rows] = cols.new_num_computed
        self.num_blocks_per_row[rows] = nblk
        return rows

    def _append_blocks(self, rows: np.ndarray, blocks: np.ndarray, offsets: np.ndarray) -> None:
        if not len(blocks):
            return
        k = np.diff(offsets)
        self._ensure_width(0, int((self.num_blocks_per_row[rows] + k).max()))
        self.block_table[np.repeat(rows, k),
                         np.repeat(self.num_blocks_per_row[rows], k) + _ranks(offsets)] = blocks
        self.num_blocks_per_row[rows] += k

    def append_sampled(self, rows: np.ndarray, tokens: np.ndarray) -> None:
        """Each row's sampled token becomes its last known one (every rank appends the
        group's tokens itself, so the next plan need not carry them)."""
        if not len(rows):
            return
        rows = np.asarray(rows, np.int64)
        self._ensure_width(int(self.num_tokens[rows].max()) + 1, 0)
        self.token_ids[rows, self.num_tokens[rows]] = tokens
        self.num_tokens[rows] += 1

    def append_verified(self, rows: np.ndarray, counts: np.ndarray, tokens: np.ndarray,
                        spec_lens: np.ndarray) -> None:
        """Rows that verified drafts (spec_lens[j] each; 0: a plain sampling row): row j
        takes counts[j] tokens (its accepted drafts, then the target's own; tokens is flat),
        and its computed count falls back to cover only the accepted drafts: the KV of
        rejected ones is stale and the next step overwrites it."""
        if not len(rows):
            return
        rows = np.asarray(rows, np.int64)
        counts = np.asarray(counts, np.int64)
        spec_lens = np.asarray(spec_lens, np.int64)
        if ((counts < 1) | (counts > 1 + spec_lens)).any():
            raise ValueError("a row emits 1 + at most its drafts tokens")
        off = np.zeros(len(rows) + 1, np.int64)
        np.cumsum(counts, out=off[1:])
        self._ensure_width(int((self.num_tokens[rows] + counts).max()), 0)
        self.token_ids[np.repeat(rows, counts),
                       np.repeat(self.num_tokens[rows], counts) + _ranks(off)] = tokens
        self.num_tokens[rows] += counts
        self.num_computed_tokens[rows] -= spec_lens - (counts - 1)

    def _write_drafts(self, rows: np.ndarray, spec: np.ndarray, offsets: np.ndarray) -> None:
        k = np.diff(offsets).astype(np.int64)
        self._ensure_width(int((self.num_tokens[rows] + k).max()), 0)
        self.token_ids[np.repeat(rows, k), np.repeat(self.num_tokens[rows], k)
                       + _ranks(offsets)] = spec

    # ---- the step's arrays ------------------------------------------------------------

    def _step(self, seq_ids: np.ndarray, rows: np.ndarray, q: np.ndarray, num_new: int,
              spec: np.ndarray) -> StepBatch:
        bs = self.block_size
        start = self.num_computed_tokens[rows].copy()
        end = start + q
        cu = np.zeros(len(rows) + 1, np.int32)
        np.cumsum(q, out=cu[1:])
        seq_of = np.repeat(np.arange(len(rows)), q)  # each token's sequence index
        positions = start[seq_of] + np.arange(int(cu[-1])) - cu[:-1][seq_of]
        tok_rows = rows[seq_of]
        slots = (self.block_table[tok_rows, positions // bs].astype(np.int64) * bs
                 + positions % bs)
        width = int(self.num_blocks_per_row[rows].max()) if len(rows) else 0
        # A row verifying d drafts samples once its drafts are computed too (the leader's
        # rule counts the known tokens only: its computed count advances by 1 there).
        sample_idx = np.flatnonzero(samples_after_step(end, self.num_tokens[rows] + spec))
        self.num_computed_tokens[rows] = end
        last = cu[1:][sample_idx].astype(np.int64) - 1
        spec_s = spec[sample_idx]
        if spec_s.any():
            loff = np.zeros(len(sample_idx) + 1, np.int64)
            np.cumsum(1 + spec_s, out=loff[1:])
            logits_indices = np.repeat(last - spec_s, 1 + spec_s) + _ranks(loff)
        else:
            loff = np.arange(len(sample_idx) + 1, dtype=np.int64)
            logits_indices = last
        return StepBatch(
            seq_ids=seq_ids.astype(np.int64), rows=rows, num_new=num_new, start=start,
            query_lens=q,
            cu_seqlens_q=cu, seq_lens=end.astype(np.int32),
            block_tables=self.block_table[rows, :width], positions=positions,
            input_ids=self.token_ids[tok_rows, positions].astype(np.int64),
            slot_mapping=slots, sample_idx=sample_idx,
            logits_indices=logits_indices, spec_lens=spec_s, logits_offsets=loff)

    # ---- capacity ---------------------------------------------------------------------

    def _grow_rows(self) -> None:
        old = len(self.num_tokens)
        for name in ("token_ids", "block_table", "num_tokens", "num_prompt_tokens",
                     "num_computed_tokens", "num_blocks_per_row"):
            a = getattr(self, name)
            grown = np.zeros((2 * old, *a.shape[1:]), a.dtype)
            grown[:old] = a
            setattr(self, name, grown)
        self.sampling += [None] * old
        self._free = list(range(2 * old - 1, old - 1, -1)) + self._free

    def _ensure_width(self, tokens: int, blocks: int) -> None:
        for name, need in (("token_ids", tokens), ("block_table", blocks)):
            a = getattr(self, name)
            if need > a.shape[1]:
                grown = np.zeros((a.shape[0], max(need, 2 * a.shape[1])), a.dtype)
                grown[:, :a.shape[1]] = a
                setattr(self, name, grown)


def _ranks(offsets: np.ndarray) -> np.ndarray:
    """For CSR offsets: each element's index within its own list (0, 1, .. per list)."""
    total = int(offsets[-1])
    return np.arange(total) - np.repeat(offsets[:-1], np.diff(offsets))
