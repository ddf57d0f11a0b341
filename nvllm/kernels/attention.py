"""Paged attention: one dispatch point, a pure-torch reference that runs anywhere.

KV cache layout per layer: ``[num_blocks, block_size, num_kv_heads, head_dim]`` for K
and for V. A token at position p of a sequence lives in slot
``block_table[p // block_size] * block_size + p % block_size``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

BACKENDS = ("auto", "torch", "triton")


@dataclass(slots=True)
class AttentionMetadata:
    """Per-step inputs of attention, built once per step and shared by every layer."""

    slot_mapping: torch.Tensor  # [num_tokens] int64, -1 = skip (padding)
    cu_seqlens_q: torch.Tensor  # [num_seqs + 1] int32: query runs in the flat batch
    seq_lens: torch.Tensor  # [num_seqs] int32: context length after this step
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32, padded with 0
    max_seqlen_q: int
    max_seqlen_k: int
    # Host copies, so the torch reference loops without device syncs.
    cu_seqlens_q_host: list[int]
    seq_lens_host: list[int]


def resolve_backend(backend: str, device: torch.device) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"attention backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "triton":
        raise NotImplementedError(
            "the Triton attention kernels are not built yet; use attention_backend='torch'")
    return "torch"


def store_kvcache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                  v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                  backend: str = "torch") -> None:
    """Write this step's K/V [T, kv_heads, d] into the paged cache at slot_mapping."""
    kc = k_cache.view(-1, *k_cache.shape[2:])
    vc = v_cache.view(-1, *v_cache.shape[2:])
    valid = slot_mapping >= 0
    if bool(valid.all()):
        kc.index_copy_(0, slot_mapping, k)
        vc.index_copy_(0, slot_mapping, v)
    else:
        kc.index_copy_(0, slot_mapping[valid], k[valid])
        vc.index_copy_(0, slot_mapping[valid], v[valid])


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float, backend: str = "torch") -> torch.Tensor:
    """Causal attention of each query run over its sequence's cached context.

    q: [T, heads, d]; query token j of a run of n tokens for a sequence whose context
    is L tokens sits at position L - n + j and sees keys 0..L - n + j.
    """
    return _paged_attention_torch(q, k_cache, v_cache, meta, scale)


def _paged_attention_torch(q, k_cache, v_cache, meta: AttentionMetadata, scale: float):
    num_heads, head_dim = q.shape[1], q.shape[2]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.empty_like(q)
    cu = meta.cu_seqlens_q_host
    for i, ctx in enumerate(meta.seq_lens_host):
        s, e = cu[i], cu[i + 1]
        n = e - s
        nblk = -(-ctx // block_size)
        blocks = meta.block_tables[i, :nblk].long()
        k = k_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:ctx]
        v = v_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:ctx]
        if group > 1:
            k = k.repeat_interleave(group, dim=1)
            v = v.repeat_interleave(group, dim=1)
        qi = q[s:e].transpose(0, 1).unsqueeze(0)  # [1, H, n, d]
        ki = k.transpose(0, 1).unsqueeze(0)
        vi = v.transpose(0, 1).unsqueeze(0)
        if n == 1:
            o = F.scaled_dot_product_attention(qi, ki, vi, scale=scale)
        elif n == ctx:
            o = F.scaled_dot_product_attention(qi, ki, vi, is_causal=True, scale=scale)
        else:
            pos_q = torch.arange(ctx - n, ctx, device=q.device)
            mask = torch.arange(ctx, device=q.device)[None, :] <= pos_q[:, None]
            o = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, scale=scale)
        out[s:e] = o.squeeze(0).transpose(0, 1)
    return out
