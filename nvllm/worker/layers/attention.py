"""Attention over the paged KV cache: stores this step's K/V, then attends."""

from __future__ import annotations

import torch
from torch import nn

from nvllm.kernels import ops
from nvllm.kernels.metadata import AttentionMetadata


class Attention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 backend: str, window: int | None = None) -> None:
        """window: this layer's sliding window (query i sees keys j with i - j < window),
        None for full attention."""
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = scale
        self.backend = backend
        self.window = window
        # Set by the model runner once the cache is allocated; layer_idx is this layer's
        # place in caches that hold every layer (the CPU backend's per-sequence copies).
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)
        self.layer_idx = 0

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        return ops.attention(q, k, v, self.k_cache, self.v_cache, meta, self.scale,
                             self.backend, self.layer_idx, self.window)
