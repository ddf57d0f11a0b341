"""Per-step attention inputs, shared by every layer and every backend."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class AttentionMetadata:
    """KV cache layout per layer: ``[num_blocks, block_size, num_kv_heads, head_dim]`` for K
    and for V. Token p of a sequence lives in slot
    ``block_table[p // block_size] * block_size + p % block_size``."""

    slot_mapping: torch.Tensor  # [num_tokens] int64, -1 = skip (padding)
    cu_seqlens_q: torch.Tensor  # [num_seqs + 1] int32: query runs in the flat batch
    seq_lens: torch.Tensor  # [num_seqs] int32: context length after this step
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32, padded with 0
    max_seqlen_q: int
    max_seqlen_k: int
    # Host copies, so loops over sequences need no device syncs.
    cu_seqlens_q_host: list[int]
    seq_lens_host: list[int]

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_host)

    @property
    def is_decode_only(self) -> bool:
        return self.max_seqlen_q == 1
