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
lives in the same block budget. It holds draft KV for every token the target computed:
after the target's forward of each step, ``run`` runs the draft over the same input
rows (prefill chunks, recomputes after preemption or a worker restart, decodes, verify
rows), writing at the same slots. Prefix-cache hits share blocks that hold both models'
KV, since every step that wrote one wrote the other. Rejected drafts leave stale KV in
both caches past the computed tokens, which later steps overwrite.

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

from nvllm.common.config import EngineConfig, ModelInfo
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
        from transformers import AutoConfig

        spec = SpeculativeConfig.from_dict(config.speculative_config)
        source = resolve_model_source(spec.model)
        self.info = ModelInfo.from_pretrained(source.config_dir)
        hf_config = AutoConfig.from_pretrained(source.config_dir)
        self.device, self.dtype = device, dtype
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

    def block_bytes(self, block_size: int) -> int:
        """The draft's KV bytes per block (its layers, at the target's block size)."""
        return (2 * len(self.model.layers) * block_size * self.num_kv_heads * self.head_dim
                * self.dtype.itemsize)

    def init_kv_cache(self, num_blocks: int, block_size: int) -> None:
        """The draft's paged cache, indexed by the target's block ids."""
        self.kv_cache = torch.zeros(2, len(self.model.layers), num_blocks, block_size,
                                    self.num_kv_heads, self.head_dim, dtype=self.dtype,
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
        step's tokens, at the target's slots, then (k > 0) up to k greedy drafts for each
        sampling row whose sequence is in `asked` (the plan's draft_seq_ids; [] for the
        others), each cut where its blocks or max_model_len end. None when k is 0.

        `merge`: a row whose newest token directly follows the step's tokens (a decode, a
        finished prefill, a verify row that accepted every draft) gets that token appended
        to its run in the step's forward, so its first draft comes from that forward and
        the decode loop has one step fewer (k forwards per step instead of k + 1)."""
        samp = step.sample_idx
        if not k or not len(samp):
            self._forward(step.input_ids, step.positions, step.slot_mapping,
                          step.cu_seqlens_q, step.seq_lens, step.block_tables)
            return None
        bs = batch.block_size
        rows = step.rows[samp]
        pos0 = batch.num_tokens[rows] - 1  # each newest token: its KV is not written yet
        room = np.minimum(batch.num_blocks_per_row[rows] * bs, self.max_model_len) - pos0
        ask = np.isin(step.seq_ids[samp], np.asarray(asked, np.int64))
        kk = np.where(ask, np.clip(room, 0, k), 0)
        joined = (kk > 0) & (pos0 == step.seq_lens[samp]) & merge
        out = np.zeros((len(rows), k), np.int64)
        done = np.zeros(len(rows), np.int64)  # drafts made per row
        cur = batch.token_ids[rows, pos0].astype(np.int64)  # each row's next input
        mi = samp[joined]  # the step's sequences that get their newest token appended
        r, p = rows[joined], pos0[joined]
        at = step.cu_seqlens_q[mi + 1]  # after each one's run in the flat arrays
        q = step.query_lens.astype(np.int64)
        q[mi] += 1
        cu = np.zeros(len(q) + 1, np.int32)
        np.cumsum(q, out=cu[1:])
        lens = step.seq_lens.copy()
        lens[mi] += 1
        hidden = self._forward(
            np.insert(step.input_ids, at, cur[joined]), np.insert(step.positions, at, p),
            np.insert(step.slot_mapping, at, self._slots(batch, r, p)), cu, lens,
            batch.block_table[step.rows, :cdiv(int(lens.max()), bs)])
        if len(mi):
            idx = torch.from_numpy(cu[mi + 1].astype(np.int64) - 1).to(hidden.device)
            tok = self.model.compute_logits(hidden[idx]).argmax(-1).cpu().numpy()
            out[joined, 0] = cur[joined] = tok
            done[joined] = 1
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

    @staticmethod
    def _slots(batch: InputBatch, rows: np.ndarray, pos: np.ndarray) -> np.ndarray:
        bs = batch.block_size
        return batch.block_table[rows, pos // bs].astype(np.int64) * bs + pos % bs

    def _forward(self, input_ids: np.ndarray, positions: np.ndarray, slots: np.ndarray,
                 cu: np.ndarray, lens: np.ndarray, tables: np.ndarray) -> torch.Tensor:
        meta = metadata_from_arrays(slots, cu, lens.astype(np.int32), tables, self.device)
        return self.model(self._tensor(input_ids), self._tensor(positions), meta)
