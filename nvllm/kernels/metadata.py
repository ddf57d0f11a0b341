"""Per-step attention inputs, shared by every layer and every backend."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from nvllm.kernels.cpu_attention import PagedRows, StepViews


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
    # Without those copies, the CPU backend's paged decode rows (cpu_attention.paged_rows:
    # made by the step's first layer, False when the native kernel does not serve it).
    cpu_paged: PagedRows | bool | None = None

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_host)


def _to(a: np.ndarray, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    t = torch.from_numpy(np.ascontiguousarray(a)).to(dtype)  # no copy when dtypes agree
    return t if torch.device(device).type == "cpu" else t.to(device)


def metadata_from_arrays(slot_mapping: np.ndarray, cu_seqlens_q: np.ndarray,
                         seq_lens: np.ndarray, block_tables: np.ndarray,
                         device: torch.device | str = "cpu") -> AttentionMetadata:
    """Metadata over a step's numpy arrays (the worker's batch state builds them): on CPU
    the tensors share the arrays' memory, elsewhere each is one host-to-device copy.
    The caller must not change the arrays while the step runs."""
    cu_host = cu_seqlens_q.tolist()
    lens_host = seq_lens.tolist()
    q = np.diff(cu_seqlens_q)
    return AttentionMetadata(
        slot_mapping=_to(slot_mapping, torch.long, device),
        cu_seqlens_q=_to(cu_seqlens_q, torch.int32, device),
        seq_lens=_to(seq_lens, torch.int32, device),
        block_tables=_to(block_tables, torch.int32, device),
        max_seqlen_q=int(q.max()) if len(q) else 0,
        max_seqlen_k=max(lens_host, default=0),
        cu_seqlens_q_host=cu_host, seq_lens_host=lens_host)


def build_metadata(query_lens: list[int], context_lens: list[int], block_tables: list[list[int]],
                   block_size: int, device: torch.device | str = "cpu",
                   ) -> tuple[AttentionMetadata, torch.Tensor]:
    """Metadata for a batch where sequence i computes its last query_lens[i] tokens of a
    context of context_lens[i] tokens; returns it with the positions of the query tokens.
    (The model runner gets the same arrays from its batch state; tests and benchmarks
    use this.) Vectorised: no per-token Python."""
    q = np.asarray(query_lens, np.int64)
    ctx = np.asarray(context_lens, np.int64)
    width = max(len(t) for t in block_tables)
    tables = np.zeros((len(block_tables), width), np.int32)
    lens = np.fromiter((len(t) for t in block_tables), np.int64, len(block_tables))
    rows = np.repeat(np.arange(len(block_tables)), lens)
    cols = np.arange(int(lens.sum())) - np.repeat(np.cumsum(lens) - lens, lens)
    tables[rows, cols] = np.fromiter((b for t in block_tables for b in t), np.int32,
                                     len(rows))
    cu = np.zeros(len(q) + 1, np.int32)
    np.cumsum(q, out=cu[1:])
    seq_of = np.repeat(np.arange(len(q)), q)
    positions = ctx[seq_of] - q[seq_of] + np.arange(int(cu[-1])) - cu[:-1][seq_of]
    slots = tables[seq_of, positions // block_size].astype(np.int64) * block_size \
        + positions % block_size
    meta = metadata_from_arrays(slots, cu, ctx.astype(np.int32), tables, device)
    return meta, _to(positions, torch.long, device)
