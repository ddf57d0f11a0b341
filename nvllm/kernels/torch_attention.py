"""The torch backend's paged attention: the reference, with decode rows batched.

Looping over sequences in Python (the reference twin) costs a few kernel launches per
sequence, which dominates decode on CPU. Decode rows (one query token) of a step are
gathered into one padded [B, L] batch and attended in a single SDPA call; prefill chunks
keep the per-sequence path. Padding keys are masked out, so the result equals the
reference up to float summation order.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from nvllm.kernels import reference
from nvllm.kernels.metadata import AttentionMetadata


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float) -> torch.Tensor:
    cu = meta.cu_seqlens_q_host
    decode = [i for i in range(meta.num_seqs) if cu[i + 1] - cu[i] == 1]
    if len(decode) < 2:
        return reference.paged_attention(q, k_cache, v_cache, meta, scale)
    out = torch.empty_like(q)
    if len(decode) < meta.num_seqs:  # prefill chunks: the reference, one sequence at a time
        others = [i for i in range(meta.num_seqs) if cu[i + 1] - cu[i] != 1]
        _per_sequence(q, k_cache, v_cache, meta, scale, others, out)
    _decode_batched(q, k_cache, v_cache, meta, scale, decode, out)
    return out


def _per_sequence(q, k_cache, v_cache, meta, scale, rows, out) -> None:
    cu = meta.cu_seqlens_q_host
    for i in rows:
        s, e = cu[i], cu[i + 1]
        sub = AttentionMetadata(
            slot_mapping=meta.slot_mapping[s:e], cu_seqlens_q=meta.cu_seqlens_q[:2] * 0,
            seq_lens=meta.seq_lens[i:i + 1], block_tables=meta.block_tables[i:i + 1],
            max_seqlen_q=e - s, max_seqlen_k=meta.seq_lens_host[i],
            cu_seqlens_q_host=[0, e - s], seq_lens_host=[meta.seq_lens_host[i]])
        out[s:e] = reference.paged_attention(q[s:e], k_cache, v_cache, sub, scale)


def _decode_batched(q, k_cache, v_cache, meta, scale, rows, out) -> None:
    cu = meta.cu_seqlens_q_host
    block_size, num_kv_heads, head_dim = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    num_heads = q.shape[1]
    lens = [meta.seq_lens_host[i] for i in rows]
    nblk = -(-max(lens) // block_size)
    idx = torch.tensor(rows, device=q.device)
    tables = meta.block_tables[idx, :nblk].long()  # [B, nblk]
    k = k_cache[tables].reshape(len(rows), nblk * block_size, num_kv_heads, head_dim)
    v = v_cache[tables].reshape(len(rows), nblk * block_size, num_kv_heads, head_dim)
    ctx = torch.tensor(lens, device=q.device)
    mask = torch.arange(nblk * block_size, device=q.device)[None, :] < ctx[:, None]  # [B, L]
    # Slots past a context hold whatever an earlier sequence left (even NaN): zero them,
    # since a masked score still multiplies its value.
    keep = mask[:, :, None, None]
    k = k.masked_fill(~keep, 0)
    v = v.masked_fill(~keep, 0)
    group = num_heads // num_kv_heads
    if group > 1:
        k = k.repeat_interleave(group, dim=2)
        v = v.repeat_interleave(group, dim=2)
    qi = q[[cu[i] for i in rows]].unsqueeze(2)  # [B, H, 1, d]
    o = F.scaled_dot_product_attention(qi, k.transpose(1, 2), v.transpose(1, 2),
                                       attn_mask=mask[:, None, None, :], scale=scale)
    out[[cu[i] for i in rows]] = o.squeeze(2)
