"""Torch reference twins: each defines what its kernel must compute (and runs anywhere).

Numerics follow HF transformers (RMSNorm in float32, rotary in the input dtype), so the
engine with these ops matches HF token for token in float32.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from nvllm.kernels.metadata import AttentionMetadata, cdiv


def store_kvcache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                  v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write K/V [T, kv_heads, d] into the paged cache at slot_mapping; -1 is skipped."""
    kc = k_cache.view(-1, *k_cache.shape[2:])
    vc = v_cache.view(-1, *v_cache.shape[2:])
    k, v = k.to(kc.dtype), v.to(kc.dtype)  # a bfloat16 cache under float32: rounded here
    valid = slot_mapping >= 0
    if bool(valid.all()):
        kc.index_copy_(0, slot_mapping, k)
        vc.index_copy_(0, slot_mapping, v)
    else:
        kc.index_copy_(0, slot_mapping[valid], k[valid])
        vc.index_copy_(0, slot_mapping[valid], v[valid])


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float,
                    window: int | None = None) -> torch.Tensor:
    """Causal attention of each query run over its sequence's cached context.

    q: [T, heads, d]; query token j of a run of n tokens for a sequence whose context
    is L tokens sits at position L - n + j and sees keys 0..L - n + j. GQA: query head h
    reads KV head h // (heads // kv_heads). With a sliding ``window`` (None: full), the
    query at position i sees only keys j with i - j < window (HF's mask), and blocks
    wholly before the run's first visible key are never read: the leader may have given
    them back (nvllm/leader/kv_cache_manager.py).
    """
    def kv_of(i: int, first: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        first -= first % k_cache.shape[1]  # whole blocks
        return (*gather_kv(k_cache, v_cache, meta, i, first), first)

    return attend_runs(q, meta, scale, kv_of, window=window)


def window_start(ctx: int, n: int, window: int | None) -> int:
    """The first key position any of a run's n queries (the last n of ctx positions)
    sees; 0 without a window."""
    return max(0, ctx - n - window + 1) if window else 0


def gather_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
              i: int, first: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequence i's context K and V from position `first` (a multiple of the block size)
    on, gathered from its blocks, each [1, kv_heads, ctx - first, d]."""
    block_size, num_kv_heads, head_dim = k_cache.shape[1:]
    ctx = meta.seq_lens_host[i]
    blocks = meta.block_tables[i, first // block_size:cdiv(ctx, block_size)].long()
    k = k_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:ctx - first]
    v = v_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:ctx - first]
    return k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)


def attend_runs(q: torch.Tensor, meta: AttentionMetadata, scale: float,
                kv_of: Callable[[int, int], tuple[torch.Tensor, torch.Tensor, int]],
                lens: list[int] | None = None, window: int | None = None) -> torch.Tensor:
    """SDPA of each sequence's query run over the K/V that kv_of(i, first) returns
    ([1, kv_heads, ctx - f, d] each, and f <= first: the position of their first key;
    first is the run's window_start). Shared with the CPU
    backend, which only changes where the K/V are read from, so both compute the same
    values bit for bit."""
    cu = meta.cu_seqlens_q_host
    if lens is None:
        lens = [cu[i + 1] - cu[i] for i in range(meta.num_seqs)]
    # Each sequence's queries as one [1, H, n, d] view, split from one transpose.
    qs = q.transpose(0, 1).unsqueeze(0).split(lens, dim=2)
    outs = []
    for i, ctx in enumerate(meta.seq_lens_host):
        if lens[i] == 0:
            continue
        ki, vi, first = visible_kv(kv_of, i, ctx, lens[i], window)
        outs.append(attend_run(qs[i], ki, vi, ctx, scale, window, first))
    if not outs:
        return torch.empty_like(q)
    return torch.cat(outs, dim=2)[0].transpose(0, 1)  # [T, H, d]


def visible_kv(kv_of: Callable[[int, int], tuple[torch.Tensor, torch.Tensor, int]], i: int,
               ctx: int, n: int, window: int | None
               ) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Sequence i's K/V from its run's first visible key on (and that key's position):
    exactly those, wherever kv_of reads them from, so every path computes the same bits."""
    first = window_start(ctx, n, window)
    ki, vi, f = kv_of(i, first)
    if first > f:
        ki, vi = ki[:, :, first - f:], vi[:, :, first - f:]
    return ki, vi, first


def attend_run(qi: torch.Tensor, ki: torch.Tensor, vi: torch.Tensor, ctx: int,
               scale: float, window: int | None = None, first: int = 0) -> torch.Tensor:
    """SDPA of one sequence's n queries ([1, H, n, d], the last n of its ctx positions)
    over its K/V of positions first..ctx - 1 ([1, kv_heads, ctx - first, d] each), causal
    and within `window`; returns [1, H, n, d]."""
    n = qi.shape[2]
    if ki.dtype != qi.dtype:  # a bfloat16 cache under float32: read back exactly
        ki, vi = ki.to(qi.dtype), vi.to(qi.dtype)
    # enable_gqa reads each KV head once for its query group instead of materializing
    # repeat_interleave copies: same result bit for bit, 4-5x faster on CPU.
    gqa = qi.shape[1] != ki.shape[1]
    if n == 1:
        if window and ctx - window > first:  # a window only moves the first visible key
            ki, vi = ki[:, :, ctx - window - first:], vi[:, :, ctx - window - first:]
        return F.scaled_dot_product_attention(qi, ki, vi, scale=scale, enable_gqa=gqa)
    qi = qi.contiguous()  # a head-major copy: ~15% faster prefill attention
    if n == ctx and not window:
        return F.scaled_dot_product_attention(qi, ki, vi, is_causal=True, scale=scale,
                                              enable_gqa=gqa)
    pos_q = torch.arange(ctx - n, ctx, device=qi.device)[:, None]
    pos_k = torch.arange(first, ctx, device=qi.device)[None, :]
    mask = pos_k <= pos_q
    if window:
        mask &= pos_q - pos_k < window
    return F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, scale=scale,
                                          enable_gqa=gqa)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * x / rms(x), computed in float32 and cast back before the weight (as HF)."""
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual); the sum is taken in the input dtype."""
    s = x + residual
    return rms_norm(s, weight, eps), s


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rotary_embedding(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                     cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox-style rotary. q [T, H, d], k [T, KH, d]; cos/sin caches [max_pos, d] (float32,
    the two halves equal, any frequency scaling such as Llama-3's already applied)."""
    c = cos[positions].unsqueeze(1).to(q.dtype)
    s = sin[positions].unsqueeze(1).to(q.dtype)
    return q * c + _rotate_half(q) * s, k * c + _rotate_half(k) * s


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for x = [..., 2 * d] holding [gate | up]."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
