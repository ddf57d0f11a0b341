"""Mixture-of-experts feed-forward, torch path: the step's (token, expert) pairs grouped by
expert, one gate/up and one down matmul per active local expert.

Grouping instead of a loop over tokens keeps the matmuls as large as the routing allows
(a decode step of 64 tokens and top-2 over 8 experts gives ~16 rows per expert, not 64
one-row calls). Experts outside ``[expert_start, expert_start + E_local)`` belong to
another rank (expert parallelism) and contribute nothing here: the caller's all-reduce
adds them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F


def fused_moe(x: torch.Tensor, w13, w2, topk_ids: torch.Tensor,
              topk_weights: torch.Tensor, expert_start: int,
              linear: Callable[[torch.Tensor, Any], torch.Tensor] = F.linear) -> torch.Tensor:
    """sum_k topk_weights[t, k] * down_e(silu(gate_e x_t) * up_e x_t), e = topk_ids[t, k],
    over this rank's experts only.

    x [T, H]; w13 [E_local, 2*I, H] (gate rows, then up rows); w2 [E_local, H, I];
    topk_ids [T, K] int64 global expert ids; topk_weights [T, K] float32. Returns [T, H] in
    x.dtype; the weighted sum is accumulated in float32 (each expert's matmuls run in the
    weights' dtype, as HF's do). ``linear(x, w13[e])``: F.linear, or for experts held
    quantized (w13 / w2 sequences of per-expert weights) a matmul of their own.
    """
    num_tokens, k = topk_ids.shape
    num_local = len(w13)
    out = torch.zeros(num_tokens, x.shape[1], dtype=torch.float32, device=x.device)
    flat = topk_ids.reshape(-1) - expert_start
    pairs = ((flat >= 0) & (flat < num_local)).nonzero().squeeze(1)
    if num_local == 0 or pairs.numel() == 0:
        return out.to(x.dtype)
    experts, order = flat[pairs].sort(stable=True)
    pairs = pairs[order]
    tokens = pairs // k
    weights = topk_weights.reshape(-1)[pairs].to(torch.float32)
    xs = x[tokens]
    ys = torch.empty(pairs.numel(), x.shape[1], dtype=torch.float32, device=x.device)
    start = 0
    for e, n in enumerate(torch.bincount(experts, minlength=num_local).tolist()):
        if n:
            gate, up = linear(xs[start:start + n], w13[e]).chunk(2, dim=-1)
            ys[start:start + n] = linear(F.silu(gate) * up, w2[e])
            start += n
    out.index_add_(0, tokens, ys * weights[:, None])
    return out.to(x.dtype)
