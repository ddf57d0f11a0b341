"""The draft model of draft-model speculative decoding, on rank 0.

Where it runs. The whole draft model lives on rank 0 (a single-rank TPContext): rank 0
alone samples, verifies and reports drafts, so a replica on every rank would compute the
same drafts tp times over, and sharding a small draft would put an all-reduce per layer
on every draft token (a draft's point is to be cheaper than the target). The other ranks
finish their step and wait for the next plan meanwhile. What it costs is rank 0's memory:
its KV bytes per block include the draft's layers (``block_bytes``), so the engine's block
count, the smallest any rank fits, accounts for them. A draft too big for one device
would want sharding like the target; that is not built.

Its KV cache. The draft's paged cache has the target's block ids and slot mapping: the
leader's block table serves both, so there is no second block manager and the draft's KV
lives in the same block budget. The draft runs only where it drafts: a step whose plan
asks no drafts (speculation off at this batch size, every sequence paused for low
acceptance, ``disable_by_batch_size``) runs no draft forward at all, and in a step that
does, ``run`` computes the draft's KV for the rows that draft after it (and prefill
chunks that directly follow their draft KV), at the target's slots. Per row it keeps how
far its draft KV is right (``draft_computed``); a row that drafts again after steps
without the draft is caught up first, in the same forward: a draft-only prefill of its
missing known tokens, all rows' catch-ups sharing one step's token budget (a row cut
short drafts nothing this step and continues in the next). The positions are inside
the row's blocks already (the target computed them), so no slot is reserved for it.
Prefix hits: a hit block holds the target's KV, the draft's only if the draft filled it
(``block_full``, per block id: set when a row's draft KV passes the block's end, cleared
whenever the target writes the block); a new or resumed sequence's draft KV starts after
its leading hit blocks the draft filled, and is caught up from there (never behind the
target's sliding window, whose blocks the leader may have given back). Rejected drafts
leave stale KV in both caches past the computed tokens, which later steps overwrite.

Drafting (``run``, after that pass): for each sequence that sampled and that the plan
lists (``StepPlan.draft_seq_ids``: not paused for low acceptance), k greedy decode steps
from its newest token (position p, not computed yet), batched over the sequences; step i
writes the draft's KV at position p + i. Where p directly follows the step's tokens (most
rows), the newest token joins the step's draft pass, which then gives the first draft:
k draft forwards per step in all. Those slots lie past the step's tokens: the scheduler
reserves them (lookahead slots), and drafting stops where a sequence's blocks end (or at
max_model_len), so nothing is written outside its own blocks. The next step's draft
forward rewrites p onwards with the tokens actually verified.
"""

from __future__ import annotations

import numpy as np
import torch

from nvllm.common.config import EngineConfig, ModelInfo, kv_cache_dtype
from nvllm.common.hf_config import load_hf_config
from nvllm.common.model_source import resolve_model_source
from nvllm.common.speculative import SpeculativeConfig
from nvllm.kernels.metadata import cdiv, metadata_from_arrays
from nvllm.worker.input_batch import InputBatch, StepBatch
from nvllm.worker.layers.linear import pack_for_cpu
from nvllm.worker.loader import load_weights
from nvllm.worker.models import MODEL_REGISTRY
from nvllm.worker.parallel import TPContext


class DraftRunner:
    def __init__(self, config: EngineConfig, device: torch.device, dtype: torch.dtype,
                 backend: str) -> None:
        spec = SpeculativeConfig.from_dict(config.speculative_config)
        source = resolve_model_source(spec.model)
        self.info = ModelInfo.from_pretrained(source.config_dir)
        hf_config = load_hf_config(source.config_dir)
        self.device, self.dtype = device, dtype
        self.kv_dtype = kv_cache_dtype(config)
        self.max_model_len = max(config.max_model_len, 1)
        with torch.device(device):
            self.model = MODEL_REGISTRY[self.info.architecture](
                hf_config, TPContext(), dtype, self.max_model_len, backend,
                self.info.layer_windows)
        self.load_stats = load_weights(self.model, source, show_progress=False)
        self.model.eval()
        if device.type == "cpu" and config.cpu_onednn_linear:
            pack_for_cpu(self.model)
        attn0 = self.model.layers[0].self_attn
        self.num_kv_heads, self.head_dim = attn0.num_kv_heads, attn0.head_dim
        self.kv_cache: torch.Tensor | None = None
        # Blocks every layer of the draft wholly holds the KV of (target-written blocks
        # lose it until the draft fills them again): a prefix hit on them needs no
        # catch-up.
        self.block_full = np.zeros(0, bool)
        self.draft_computed = np.zeros(0, np.int64)  # per InputBatch row: its draft KV's end
        self.catch_up_budget = max(config.max_num_batched_tokens, 1)
        # The target's window when every layer slides (the leader gives back blocks behind
        # it): a catch-up never writes there.
        self.window = config.model_info.kv_window if config.model_info else None

    def block_bytes(self, block_size: int) -> int:
        """The draft's KV bytes per block (its layers, at the target's block size)."""
        return (2 * len(self.model.layers) * block_size * self.num_kv_heads * self.head_dim
                * self.kv_dtype.itemsize)

    def init_kv_cache(self, num_blocks: int, block_size: int) -> None:
        """The draft's paged cache, indexed by the target's block ids."""
        self.block_full = np.zeros(num_blocks, bool)
        self.kv_cache = torch.zeros(2, len(self.model.layers), num_blocks, block_size,
                                    self.num_kv_heads, self.head_dim, dtype=self.kv_dtype,
                                    device=self.device)
        for i, layer in enumerate(self.model.layers):
            layer.self_attn.attn.k_cache = self.kv_cache[0, i]
            layer.self_attn.attn.v_cache = self.kv_cache[1, i]
            layer.self_attn.attn.layer_idx = i

    def _tensor(self, a: np.ndarray) -> torch.Tensor:
        t = torch.from_numpy(np.ascontiguousarray(a))
        return t if self.device.type == "cpu" else t.to(self.device)

    def run(self, step: StepBatch, batch: InputBatch, asked: list[int], k: int,
            merge: bool = True) -> list[list[int]] | None:
        """After the target's step (its tokens appended to `batch`): the draft's KV for the
        rows that draft after it (caught up first where they fell behind), then (k > 0)
        up to k greedy drafts for each sampling row whose sequence is in `asked` (the
        plan's draft_seq_ids; [] for the others), each cut where its blocks or
        max_model_len end. None when k is 0, and then no draft forward runs at all.

        `merge`: a row whose newest token directly follows the step's tokens (a decode, a
        finished prefill, a verify row that accepted every draft) gets that token appended
        to its run in the step's forward, so its first draft comes from that forward and
        the decode loop has one step fewer (k forwards per step instead of k + 1)."""
        self._admit(step, batch)
        if len(step.slot_mapping):  # what the target wrote, the draft holds no longer
            self.block_full[step.slot_mapping // batch.block_size] = False
        samp = step.sample_idx
        ask = np.zeros(step.num_seqs, bool)
        if k:
            ask[samp] = np.isin(step.seq_ids[samp], np.asarray(asked, np.int64))
        if not ask.any():
            return None if not k else [[] for _ in samp]
        c0, e, full = self._pass_ranges(step, batch, ask)
        bs = batch.block_size
        rows = step.rows[samp]
        pos0 = batch.num_tokens[rows] - 1  # each newest token: its KV is not written yet
        room = np.minimum(batch.num_blocks_per_row[rows] * bs, self.max_model_len) - pos0
        kk = np.where(ask[samp] & full[samp], np.clip(room, 0, k), 0)
        joined = np.zeros(step.num_seqs, bool)
        joined[samp] = (kk > 0) & (pos0 == step.seq_lens[samp]) & merge
        out = np.zeros((len(rows), k), np.int64)
        done = np.zeros(len(rows), np.int64)  # drafts made per row
        cur = batch.token_ids[rows, pos0].astype(np.int64)  # each row's next input
        first = self._pass(step, batch, c0, e, joined)
        jrow = joined[samp]
        if jrow.any():
            out[jrow, 0] = cur[jrow] = first
            done[jrow] = 1
        inc = np.flatnonzero(e > c0)
        self._advance(batch, step.rows[inc], c0[inc],
                      np.where(full[inc], batch.num_computed_tokens[step.rows[inc]], e[inc]))
        while True:  # one decode step for every row with drafts still to make
            act = np.flatnonzero(done < kk)
            if not len(act):
                break
            r, pos = rows[act], pos0[act] + done[act]
            lens = (pos + 1).astype(np.int32)
            hidden = self._forward(cur[act], pos, self._slots(batch, r, pos),
                                   np.arange(len(act) + 1, dtype=np.int32), lens,
                                   batch.block_table[r, :cdiv(int(lens.max()), bs)])
            tok = self.model.compute_logits(hidden).argmax(-1).cpu().numpy()
            out[act, done[act]] = cur[act] = tok
            done[act] += 1
        return [out[j, :kk[j]].tolist() for j in range(len(rows))]

    def _admit(self, step: StepBatch, batch: InputBatch) -> None:
        """The plan's new sequences (first admissions, and re-admissions after preemption
        or a worker restart): the draft holds their KV for the leading prefix-hit blocks
        it had filled whole, nothing else (a hit means the target's KV exists, which the
        draft's need not: it skips steps in which nobody drafts)."""
        if len(self.draft_computed) < len(batch.num_tokens):
            grown = np.zeros(len(batch.num_tokens), np.int64)
            grown[:len(self.draft_computed)] = self.draft_computed
            self.draft_computed = grown
        bs = batch.block_size
        for i in range(step.num_new):
            row = int(step.rows[i])
            full = self.block_full[batch.block_table[row, :int(step.start[i]) // bs]]
            lead = len(full) if full.all() else int(np.argmin(full))
            self.draft_computed[row] = lead * bs

    def _pass_ranges(self, step: StepBatch, batch: InputBatch, ask: np.ndarray
                     ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per step sequence, the positions c0..e the draft's pass computes (e == c0:
        none) and whether they reach the step's end. A sequence that drafts after this
        step gets its missing KV first (a draft-only prefill from where its draft KV ends,
        all of it sharing one step's token budget in plan order; one cut short drafts
        nothing this step and catches up further in the next); a prefill chunk that
        directly follows its draft KV joins the pass (it would be caught up later
        otherwise); other rows (not drafting, or behind) are skipped."""
        start = step.start.astype(np.int64)
        end = step.seq_lens.astype(np.int64)
        c0 = self.draft_computed[step.rows].copy()
        if self.window is not None:  # blocks wholly behind the window may be given back
            c0 = np.maximum(c0, np.maximum(start - self.window + 1, 0)
                            // batch.block_size * batch.block_size)
        sampling = np.zeros(step.num_seqs, bool)
        sampling[step.sample_idx] = True
        behind = np.where(ask, start - c0, 0)
        took = np.minimum(behind, np.maximum(
            self.catch_up_budget - (np.cumsum(behind) - behind), 0))
        full = (ask & (took == behind)) | (~sampling & (c0 == start))
        e = np.where(full, end, np.where(ask, c0 + took, c0))
        return c0, e, full

    def _pass(self, step: StepBatch, batch: InputBatch, c0: np.ndarray, e: np.ndarray,
              joined: np.ndarray) -> np.ndarray:
        """One draft forward over each sequence's positions c0..e (catch-up tokens from
        its known tokens, the step's own from the step's inputs: a verify row's drafts
        were overwritten since), plus the newest token of the `joined` ones; returns
        those tokens' greedy next tokens (the first drafts)."""
        inc = np.flatnonzero((e > c0) | joined)
        lens = (e - c0 + joined)[inc]
        cu = np.zeros(len(inc) + 1, np.int32)
        np.cumsum(lens, out=cu[1:])
        of = np.repeat(np.arange(len(inc)), lens)
        pos = c0[inc][of] + np.arange(int(cu[-1])) - cu[:-1][of]
        rows = step.rows[inc][of]
        ids = batch.token_ids[rows, pos].astype(np.int64)  # catch-up, and joined tokens
        s0 = step.start[inc][of]
        mine = (pos >= s0) & (pos < step.seq_lens[inc][of])
        ids[mine] = step.input_ids[step.cu_seqlens_q[inc][of][mine] + pos[mine] - s0[mine]]
        seq_lens = (e + joined)[inc].astype(np.int32)
        hidden = self._forward(ids, pos, self._slots(batch, rows, pos), cu, seq_lens,
                               batch.block_table[step.rows[inc],
                                                 :cdiv(int(seq_lens.max()), batch.block_size)])
        j = np.flatnonzero(joined[inc])
        if not len(j):
            return np.zeros(0, np.int64)
        idx = torch.from_numpy(cu[j + 1].astype(np.int64) - 1).to(hidden.device)
        return self.model.compute_logits(hidden[idx]).argmax(-1).cpu().numpy()

    def _advance(self, batch: InputBatch, rows: np.ndarray, c0: np.ndarray,
                 upto: np.ndarray) -> None:
        """The draft's KV is right for positions c0..upto of these rows now (a verify
        row's up to its accepted drafts): its blocks filled whole may serve prefix hits."""
        self.draft_computed[rows] = upto
        bs = batch.block_size
        first, last = c0 // bs, upto // bs  # whole blocks first..last - 1
        n = np.maximum(last - first, 0)
        if n.any():
            off = np.zeros(len(n) + 1, np.int64)
            np.cumsum(n, out=off[1:])
            col = np.repeat(first, n) + np.arange(int(off[-1])) - np.repeat(off[:-1], n)
            self.block_full[batch.block_table[np.repeat(rows, n), col]] = True

    @staticmethod
    def _slots(batch: InputBatch, rows: np.ndarray, pos: np.ndarray) -> np.ndarray:
        bs = batch.block_size
        return batch.block_table[rows, pos // bs].astype(np.int64) * bs + pos % bs

    def _forward(self, input_ids: np.ndarray, positions: np.ndarray, slots: np.ndarray,
                 cu: np.ndarray, lens: np.ndarray, tables: np.ndarray) -> torch.Tensor:
        meta = metadata_from_arrays(slots, cu, lens.astype(np.int32), tables, self.device)
        return self.model(self._tensor(input_ids), self._tensor(positions), meta)
