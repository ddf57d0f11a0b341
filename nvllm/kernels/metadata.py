"""Per-step attention inputs, shared by every layer and every backend."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from nvllm.kernels.cpu_attention import StepViews


def cdiv(a: int, b: int) -> int:
    """Ceiling division of non-negative ints (how many blocks of b hold a tokens). The
    kernels' own copy of nvllm.common.utils.cdiv: nvllm.kernels imports only itself."""
    return -(-a // b)


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
    # The CPU backend's views into each sequence's contiguous K/V (cpu_attention): set
    # by the model runner when it keeps those copies; ops.attention dispatches on it.
    cpu_kv: StepViews | None = None

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_host)


def build_metadata(query_lens: list[int], context_lens: list[int], block_tables: list[list[int]],
                   block_size: int, device: torch.device | str = "cpu",
                   ) -> tuple[AttentionMetadata, torch.Tensor]:
    """Metadata for a batch where sequence i computes its last query_lens[i] tokens of a
    context of context_lens[i] tokens; returns it with the positions of the query tokens.
    (The model runner builds the same thing incrementally; tests and benchmarks use this.)"""
    slots: list[int] = []
    positions: list[int] = []
    cu = [0]
    for n, ctx, table in zip(query_lens, context_lens, block_tables):
        for p in range(ctx - n, ctx):
            positions.append(p)
            slots.append(table[p // block_size] * block_size + p % block_size)
        cu.append(cu[-1] + n)
    width = max(len(t) for t in block_tables)
    padded = [t + [0] * (width - len(t)) for t in block_tables]
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
        cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(context_lens, dtype=torch.int32, device=device),
        block_tables=torch.tensor(padded, dtype=torch.int32, device=device),
        max_seqlen_q=max(query_lens), max_seqlen_k=max(context_lens),
        cu_seqlens_q_host=cu, seq_lens_host=list(context_lens))
    return meta, torch.tensor(positions, dtype=torch.long, device=device)
