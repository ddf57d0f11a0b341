"""Rounding bounds for float32 results compared with a float64 (or another float32)
computation of the same thing, derived from the magnitudes of what is summed: they hold on
any x86-64 CPU torch supports, whatever order its kernels sum in (AVX2, AVX-512, AMX
blockings; nvllm's native ops built with -march=native), and they scale with the
quantities compared instead of fixing an absolute number."""

from __future__ import annotations

import torch

EPS32 = torch.finfo(torch.float32).eps


def attention_bound(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float,
                    window: int | None = None) -> float:
    """How far float32 attention of q [n, heads, d] over keys/values [ctx, kv_heads, d] may
    be from the exact one, from rounding alone (GQA: query head h reads KV head
    h // (heads // kv_heads)).

    Each score is a d-term dot product: in any order within d*eps*S of the exact one, S the
    largest scale * sum_d |q_d k_d| (Higham's gamma_n). A score off by delta changes its
    softmax weight by a relative 2*delta at most (the weight and the normaliser both
    move). The weighted sum of the m visible values (m <= min(ctx, window)) adds m*eps*max|v|
    at most. So |out - exact| <= eps * max|v| * (2*d*S + 2*m)."""
    d, ctx = q.shape[2], keys.shape[0]
    m = min(ctx, window or ctx)
    kk = keys.abs().double().repeat_interleave(q.shape[1] // keys.shape[1], dim=1)
    s = float((q.abs().double().transpose(0, 1) @ kk.permute(1, 2, 0)).max()) * scale
    return EPS32 * float(values.abs().max()) * (2 * d * s + 2 * m)
