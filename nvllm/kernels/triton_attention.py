"""Triton kernels for the paged KV cache: store, decode (split-K) and extend attention.

Semantics are defined by the torch twins in ``reference.py``; these kernels must match them.

KV cache layout per layer: ``[num_blocks, block_size, num_kv_heads, head_dim]`` for K and for
V. Token p of a sequence lives in block ``block_table[p // block_size]`` at row
``p % block_size``. Every kernel gathers keys by position through the block table, so a tile of
``BLOCK_N`` keys may span several cache blocks (or part of one): each key row is a contiguous
``head_dim`` vector, so loads stay coalesced whatever the block size.

Numerics: dot products accumulate in fp32, the softmax runs online in fp32 in the base-2
domain (``exp2`` with ``log2(e)`` folded into the scale, which is what the hardware computes
natively), and every division by the softmax denominator is guarded so fully masked rows
(padding, empty splits, zero-length contexts) give 0, never NaN. Outputs have q's dtype.

head_dim: any size (tested: 64, 80, 96, 128, 256). The kernels pad it to ``BLOCK_D`` = the next
power of two (at least 16, the smallest ``tl.dot`` operand) with masked loads, so 64 and 128 run
natively and 80 or 96 run with 128-wide tiles whose padding lanes hold zeros (zeros add nothing
to q.k nor to p@v).

On CPU the kernels run under the Triton interpreter: ``TRITON_INTERPRET=1`` must be set in the
environment before this module (or triton) is imported.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from nvllm.kernels.metadata import AttentionMetadata
from nvllm.kernels.triton_dot import dot_precision, dot_upcast, mma

_LOG2E = 1.4426950408889634

# Decode split heuristic (see _choose_num_splits).
_MIN_TOKENS_PER_SPLIT = 256
_MAX_SPLITS = 64
_DEFAULT_SM_COUNT = 132  # H100 / H200


def _block_d(head_dim: int) -> int:
    return max(16, triton.next_power_of_2(head_dim))


# Tile configurations, chosen by compiling for sm_90 (H100/H200) and reading the register /
# spill counts (no spills, <= ~190 registers per thread); not yet tuned by benchmarks.
# fp32 inputs take exact fp32 dots (FMA, no tensor cores), which need far smaller tiles.
def _decode_config(block_d: int, fp32: bool) -> tuple[int, int]:
    """(BLOCK_N, num_warps) of the decode kernel."""
    if fp32:
        return (16, 4) if block_d <= 128 else (16, 8)
    # 64 keys x 128 dims: K and V tiles of 16 KiB (bf16), ~115 registers with 4 warps.
    return (64, 4) if block_d <= 128 else (32, 4)


def _extend_config(block_d: int, group: int, fp32: bool) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps) of the extend kernel."""
    if fp32:
        block_m, block_n, num_warps = (32, 16, 4) if block_d <= 128 else (16, 16, 4)
    else:
        # 128 query rows x 64 keys over two warpgroups (8 warps): the usual FA2 tile on
        # Hopper; head_dim 256 halves both to stay out of spills.
        block_m, block_n, num_warps = (128, 64, 8) if block_d <= 128 else (64, 32, 8)
    # At least the group, so one tile holds every query head of its KV head.
    return max(block_m, triton.next_power_of_2(group)), block_n, num_warps


def _check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError("k_cache / v_cache must both be [num_blocks, block_size, "
                         f"num_kv_heads, head_dim], got {tuple(k_cache.shape)} and "
                         f"{tuple(v_cache.shape)}")
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("the KV cache's head_dim must be contiguous (stride 1)")


def _inner_contiguous(x: torch.Tensor) -> torch.Tensor:
    # The kernels assume stride 1 along head_dim (one contiguous vector per row); other
    # strides (e.g. q/k/v as views into a fused qkv projection) are passed through.
    return x if x.stride(-1) == 1 else x.contiguous()


# --------------------------------------------------------------------------------------------
# store_kvcache
# --------------------------------------------------------------------------------------------


@triton.jit
def _store_kvcache_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcb, stride_kcs, stride_kch,
    stride_vcb, stride_vcs, stride_vch,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, PAGE_SIZE: tl.constexpr,
):
    # One program per token: copies all its KV heads ([BLOCK_H, BLOCK_D] tile) for K and V.
    tok = tl.program_id(0)
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    # slot -1 marks padding (e.g. CUDA-graph batch padding): masked out rather than an early
    # return, so the program stays branch-free; the masked loads/stores cost nothing. (The
    # head bound carries the validity: a scalar bool & a block mask trips the interpreter.)
    num_valid_heads = tl.where(slot >= 0, NUM_KV_HEADS, 0)
    blk = slot // PAGE_SIZE
    row = slot % PAGE_SIZE
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < num_valid_heads) & (offs_d[None, :] < HEAD_DIM)

    tok64 = tok.to(tl.int64)
    k = tl.load(k_ptr + tok64 * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :],
                mask=mask)
    v = tl.load(v_ptr + tok64 * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :],
                mask=mask)
    kc = k_cache_ptr + blk * stride_kcb + row * stride_kcs
    vc = v_cache_ptr + blk * stride_vcb + row * stride_vcs
    tl.store(kc + offs_h[:, None] * stride_kch + offs_d[None, :],
             k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(vc + offs_h[:, None] * stride_vch + offs_d[None, :],
             v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kvcache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                  v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write K/V [T, kv_heads, d] into the paged cache at slot_mapping; -1 is skipped."""
    _check_cache(k_cache, v_cache)
    num_tokens, num_kv_heads, head_dim = k.shape
    if v.shape != k.shape or tuple(k_cache.shape[2:]) != (num_kv_heads, head_dim):
        raise ValueError(f"k {tuple(k.shape)} / v {tuple(v.shape)} do not fit the cache "
                         f"{tuple(k_cache.shape)}")
    if slot_mapping.shape[0] != num_tokens:
        raise ValueError(f"slot_mapping has {slot_mapping.shape[0]} entries for "
                         f"{num_tokens} tokens")
    if num_tokens == 0:
        return
    k, v = _inner_contiguous(k), _inner_contiguous(v)
    block_h = triton.next_power_of_2(num_kv_heads)
    block_d = triton.next_power_of_2(head_dim)
    _store_kvcache_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        BLOCK_H=block_h, BLOCK_D=block_d, PAGE_SIZE=k_cache.shape[1],
        num_warps=4 if block_h * block_d >= 1024 else 1,
    )


# --------------------------------------------------------------------------------------------
# Shared inner loop: online softmax over a range of keys gathered through a block table.
# --------------------------------------------------------------------------------------------


@triton.jit
def _attend_range(
    q, m_i, l_i, acc, q_pos,
    k_cache_ptr, v_cache_ptr, bt_row_ptr, kv_head,
    kv_start, kv_end, window,
    stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
    qk_scale,
    CAUSAL: tl.constexpr, SLIDING: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr, DOT_PRECISION: tl.constexpr,
    DOT_UPCAST: tl.constexpr,
):
    """Fold keys [kv_start, kv_end) into the running (m_i, l_i, acc) of the rows of q.

    q: [ROWS, BLOCK_D] (scores in log2 units after qk_scale); m_i, l_i: [ROWS] fp32;
    acc: [ROWS, BLOCK_D] fp32. With CAUSAL, row r sees only keys at positions <= q_pos[r],
    and with SLIDING too only those > q_pos[r] - window.
    """
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    for start in range(kv_start, kv_end, BLOCK_N):
        pos = start + offs_n
        n_mask = pos < kv_end
        # Physical row of each key: one block-table entry per key (cached: BLOCK_N / PAGE_SIZE
        # distinct entries), int64 so huge caches do not overflow the offset arithmetic.
        blk = tl.load(bt_row_ptr + pos // PAGE_SIZE, mask=n_mask, other=0).to(tl.int64)
        row = (pos % PAGE_SIZE).to(tl.int64)
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(k_cache_ptr + (blk * stride_kcb + row * stride_kcs
                                   + kv_head * stride_kch)[:, None] + offs_d[None, :],
                    mask=kv_mask, other=0.0)
        s = mma(q, tl.trans(k), None, DOT_PRECISION, DOT_UPCAST) * qk_scale
        keep = n_mask[None, :]
        if CAUSAL:
            keep = keep & (pos[None, :] <= q_pos[:, None])
            if SLIDING:
                keep = keep & (pos[None, :] > q_pos[:, None] - window)
        s = tl.where(keep, s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row that has seen no key yet has m_new == -inf; subtracting -inf from -inf is NaN,
        # so shift by 0 instead (every exp2 below is then exp2(-inf) = 0 for that row).
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)

        v = tl.load(v_cache_ptr + (blk * stride_vcb + row * stride_vcs
                                   + kv_head * stride_vch)[:, None] + offs_d[None, :],
                    mask=kv_mask, other=0.0)
        # p in the cache dtype for the tensor-core p@v (as flash attention does); fp32 stays fp32.
        acc = mma(p.to(v.dtype), v, acc * alpha[:, None], DOT_PRECISION, DOT_UPCAST)
        m_i = m_new
    return m_i, l_i, acc


# --------------------------------------------------------------------------------------------
# Decode: one query token per sequence, split-K (flash-decoding) + a reduction kernel.
# --------------------------------------------------------------------------------------------


@triton.jit
def _decode_split_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr,
    out_ptr, part_m_ptr, part_l_ptr, part_acc_ptr,
    qk_scale, num_splits, window,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_bt,
    stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
    NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, BLOCK_G: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    PAGE_SIZE: tl.constexpr, DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr,
    WRITE_OUT: tl.constexpr,
):
    # Grid (num_seqs, num_kv_heads, num_splits). One program = all GROUP query heads that share
    # one KV head (rows of a [BLOCK_G, BLOCK_D] tile, BLOCK_G >= 16 for tl.dot), so each K/V
    # tile is loaded once per group, over one contiguous chunk of the context.
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    ctx = tl.load(seq_lens_ptr + seq)
    # A sliding window (window > 0) only moves the first visible key; the blocks before it
    # are never read (the leader may have given them back).
    lo = tl.maximum(ctx - window, 0) if window > 0 else 0

    # Chunk of this split: the visible keys cut into num_splits pieces, rounded up to whole
    # BLOCK_N tiles (so only the last tile of the last chunk is ragged). Trailing splits of a
    # short context can be empty: they write m = -inf, l = 0 and the reduction ignores them.
    split_len = tl.cdiv(tl.cdiv(ctx - lo, num_splits), BLOCK_N) * BLOCK_N
    kv_start = lo + split * split_len
    kv_end = tl.minimum(kv_start + split_len, ctx)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    heads = kv_head * GROUP + offs_g
    g_mask = offs_g < GROUP
    qd_mask = g_mask[:, None] & (offs_d[None, :] < HEAD_DIM)
    q = tl.load(q_ptr + seq.to(tl.int64) * stride_qt + heads[:, None] * stride_qh
                + offs_d[None, :], mask=qd_mask, other=0.0)

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    m_i, l_i, acc = _attend_range(
        q, m_i, l_i, acc, offs_g,  # q_pos unused (not causal: the one query sees everything)
        k_cache_ptr, v_cache_ptr, block_tables_ptr + seq * stride_bt, kv_head,
        kv_start, kv_end, window,
        stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
        qk_scale,
        CAUSAL=False, SLIDING=False, HEAD_DIM=HEAD_DIM, BLOCK_D=BLOCK_D, BLOCK_N=BLOCK_N,
        PAGE_SIZE=PAGE_SIZE, DOT_PRECISION=DOT_PRECISION, DOT_UPCAST=DOT_UPCAST,
    )

    if WRITE_OUT:
        # Single split: normalize and write the output directly (no reduction launch).
        o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(out_ptr + seq.to(tl.int64) * stride_ot + heads[:, None] * stride_oh
                 + offs_d[None, :], o.to(out_ptr.dtype.element_ty), mask=qd_mask)
    else:
        # Partials, fp32, laid out [num_seqs, NUM_HEADS, num_splits] (+ [HEAD_DIM] for acc);
        # m in log2 units, acc unnormalized.
        part = (seq * NUM_HEADS + heads).to(tl.int64) * num_splits + split
        tl.store(part_m_ptr + part, m_i, mask=g_mask)
        tl.store(part_l_ptr + part, l_i, mask=g_mask)
        tl.store(part_acc_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=qd_mask)


@triton.jit
def _decode_reduce_kernel(
    out_ptr, part_m_ptr, part_l_ptr, part_acc_ptr, num_splits,
    stride_ot, stride_oh,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    # Grid (num_seqs, num_heads): merge the num_splits partial softmaxes of one query head.
    seq = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < num_splits
    d_mask = offs_d < HEAD_DIM
    part = (seq * NUM_HEADS + head).to(tl.int64) * num_splits + offs_s
    m = tl.load(part_m_ptr + part, mask=s_mask, other=float("-inf"))
    sum_exp = tl.load(part_l_ptr + part, mask=s_mask, other=0.0)
    acc = tl.load(part_acc_ptr + part[:, None] * HEAD_DIM + offs_d[None, :],
                  mask=s_mask[:, None] & d_mask[None, :], other=0.0)
    m_max = tl.max(m, 0)
    # All splits empty (zero-length context): shift by 0 so the weights are 0, not NaN.
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.exp2(m - m_max)  # empty splits: exp2(-inf) = 0
    l_tot = tl.sum(w * sum_exp, 0)
    o = tl.sum(w[:, None] * acc, 0) / tl.where(l_tot == 0.0, 1.0, l_tot)
    tl.store(out_ptr + seq.to(tl.int64) * stride_ot + head * stride_oh + offs_d,
             o.to(out_ptr.dtype.element_ty), mask=d_mask)


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _choose_num_splits(num_seqs: int, num_kv_heads: int, max_seqlen_k: int,
                       device: torch.device) -> int:
    """Split the context only when (seq, kv head) programs alone cannot fill the GPU.

    Target ~2 programs per SM. Each split keeps at least _MIN_TOKENS_PER_SPLIT keys so the
    partial write + reduction stays small next to the attention work; short contexts get 1.
    """
    if max_seqlen_k < 2 * _MIN_TOKENS_PER_SPLIT:
        return 1
    sms = _DEFAULT_SM_COUNT
    if device.type == "cuda":
        sms = _sm_count(device.index if device.index is not None
                        else torch.cuda.current_device())
    base = num_seqs * num_kv_heads
    target = 2 * sms
    if base >= target:
        return 1
    splits = min(triton.cdiv(target, base), max_seqlen_k // _MIN_TOKENS_PER_SPLIT, _MAX_SPLITS)
    return max(1, splits)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                     num_splits: int | None = None, max_seqlen_k: int | None = None,
                     window: int | None = None) -> torch.Tensor:
    """One query token per sequence: q [num_seqs, heads, d] -> out [num_seqs, heads, d].

    Row i attends to keys 0..seq_lens[i]-1 of sequence i (block_tables[i]), the last
    `window` of them with a sliding window. num_splits=None
    picks the split count from the shape (max_seqlen_k, default: the block-table capacity, an
    upper bound that needs no device sync); pass it explicitly to force split-K.
    """
    _check_cache(k_cache, v_cache)
    num_seqs, num_heads, head_dim = q.shape
    _, page_size, num_kv_heads, cache_head_dim = k_cache.shape
    if cache_head_dim != head_dim or num_heads % num_kv_heads != 0:
        raise ValueError(f"q {tuple(q.shape)} does not fit the cache {tuple(k_cache.shape)}")
    if seq_lens.shape[0] != num_seqs or block_tables.shape[0] != num_seqs:
        raise ValueError("decode_attention needs one query token per sequence")
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if num_seqs == 0:
        return out
    q = _inner_contiguous(q)
    group = num_heads // num_kv_heads
    if max_seqlen_k is None:
        max_seqlen_k = block_tables.shape[1] * page_size
    if window:
        max_seqlen_k = min(max_seqlen_k, window)
    if num_splits is None:
        num_splits = _choose_num_splits(num_seqs, num_kv_heads, max_seqlen_k, q.device)
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    block_d = _block_d(head_dim)
    block_n, num_warps = _decode_config(block_d, q.dtype == torch.float32)
    write_out = num_splits == 1
    if write_out:
        part_m = part_l = part_acc = out  # unused placeholders
    else:
        part_m = torch.empty((num_seqs, num_heads, num_splits), dtype=torch.float32,
                             device=q.device)
        part_l = torch.empty_like(part_m)
        part_acc = torch.empty((num_seqs, num_heads, num_splits, head_dim),
                               dtype=torch.float32, device=q.device)
    _decode_split_kernel[(num_seqs, num_kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, seq_lens,
        out, part_m, part_l, part_acc,
        scale * _LOG2E, num_splits, window or 0,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        NUM_HEADS=num_heads, GROUP=group, BLOCK_G=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_N=block_n, PAGE_SIZE=page_size,
        DOT_PRECISION=dot_precision(q.dtype), DOT_UPCAST=dot_upcast(q.dtype, q.device),
        WRITE_OUT=write_out, num_warps=num_warps, num_stages=2,
    )
    if not write_out:
        _decode_reduce_kernel[(num_seqs, num_heads)](
            out, part_m, part_l, part_acc, num_splits,
            out.stride(0), out.stride(1),
            NUM_HEADS=num_heads, HEAD_DIM=head_dim, BLOCK_D=block_d,
            # Power-of-two tile over the splits; only a handful of distinct compilations.
            BLOCK_S=triton.next_power_of_2(num_splits), num_warps=4,
        )
    return out


# --------------------------------------------------------------------------------------------
# Extend / prefill: variable-length query runs over their paged context, causal.
# --------------------------------------------------------------------------------------------


@triton.jit
def _find_seq(cu_seqlens_q_ptr, tile, num_seqs, Q_PER_TILE: tl.constexpr):
    """The sequence that owns flat tile `tile`.

    Sequence i owns tiles [cu[i] // Q_PER_TILE + i, cu[i+1] // Q_PER_TILE + i + 1), at least
    cdiv(n_i, Q_PER_TILE) of them; the start key is strictly increasing in i, so a binary search
    finds the largest i whose start is <= tile. Done on the device: no host-side tile table.
    """
    lo: tl.int32 = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        start = tl.load(cu_seqlens_q_ptr + mid) // Q_PER_TILE + mid
        if start <= tile:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


# num_seqs is not specialized: a batch of one sequence would otherwise make it the constant 1,
# and the binary search reassigns a loop-carried variable initialized from it.
@triton.jit(do_not_specialize=["num_seqs"])
def _extend_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr,
    cu_seqlens_q_ptr, seq_lens_ptr, block_tables_ptr,
    num_seqs, qk_scale, window,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_bt,
    stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
    GROUP: tl.constexpr, Q_PER_TILE: tl.constexpr, BLOCK_M: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    PAGE_SIZE: tl.constexpr, DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr,
    SLIDING: tl.constexpr,
):
    # Grid (num_tiles, num_kv_heads), tiles flattened over the whole mixed batch.
    # A tile packs Q_PER_TILE consecutive query tokens x the GROUP query heads of one KV head
    # into its BLOCK_M rows (row r = token r // GROUP, head r % GROUP). K/V tiles are thus
    # loaded once per KV-head group, and a decode row (n = 1) still fills GROUP rows instead of
    # one of BLOCK_M; for prefill the K/V traffic equals that of one program per query head.
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = _find_seq(cu_seqlens_q_ptr, tile, num_seqs, Q_PER_TILE)
    q_start = tl.load(cu_seqlens_q_ptr + seq)
    n = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    tok0 = (tile - (q_start // Q_PER_TILE + seq)) * Q_PER_TILE
    if tok0 >= n:  # spare tile of this sequence (the flat grid over-allocates <= 1 per seq)
        return
    ctx = tl.load(seq_lens_ptr + seq)
    prefix = ctx - n  # cached tokens before this run; query j sits at position prefix + j

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    tok = tok0 + offs_m // GROUP
    heads = kv_head * GROUP + offs_m % GROUP
    row_mask = (offs_m < Q_PER_TILE * GROUP) & (tok < n)
    qd_mask = row_mask[:, None] & (offs_d[None, :] < HEAD_DIM)
    q_rows = (q_start + tok).to(tl.int64)
    q = tl.load(q_ptr + q_rows[:, None] * stride_qt + heads[:, None] * stride_qh
                + offs_d[None, :], mask=qd_mask, other=0.0)
    q_pos = prefix + tok

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    # Keys up to the last query of the tile (causal); the new tokens' K/V are already in the
    # cache (store_kvcache ran first), so prefix and new keys come through the block table alike.
    kv_end = prefix + tl.minimum(tok0 + Q_PER_TILE, n)
    # From the first key the tile's first query sees (a window; else 0): blocks before it
    # are never read (the leader may have given them back).
    kv_start = tl.maximum(prefix + tok0 - window + 1, 0) if SLIDING else 0
    m_i, l_i, acc = _attend_range(
        q, m_i, l_i, acc, q_pos,
        k_cache_ptr, v_cache_ptr, block_tables_ptr + seq * stride_bt, kv_head,
        kv_start, kv_end, window,
        stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
        qk_scale,
        # The causal mask is applied on every tile (a few ALU ops next to two dots) rather than
        # splitting the loop into an unmasked body and a masked diagonal: simpler, same result.
        CAUSAL=True, SLIDING=SLIDING, HEAD_DIM=HEAD_DIM, BLOCK_D=BLOCK_D, BLOCK_N=BLOCK_N,
        PAGE_SIZE=PAGE_SIZE, DOT_PRECISION=DOT_PRECISION, DOT_UPCAST=DOT_UPCAST,
    )
    o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(out_ptr + q_rows[:, None] * stride_ot + heads[:, None] * stride_oh
             + offs_d[None, :], o.to(out_ptr.dtype.element_ty), mask=qd_mask)


def extend_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     meta: AttentionMetadata, scale: float,
                     window: int | None = None) -> torch.Tensor:
    """Causal attention of each query run (cu_seqlens_q) over its cached context, one launch
    for a whole mixed batch (decode rows, chunks after a cached prefix, full prefills);
    within a sliding `window` if given."""
    _check_cache(k_cache, v_cache)
    num_tokens, num_heads, head_dim = q.shape
    _, page_size, num_kv_heads, cache_head_dim = k_cache.shape
    if cache_head_dim != head_dim or num_heads % num_kv_heads != 0:
        raise ValueError(f"q {tuple(q.shape)} does not fit the cache {tuple(k_cache.shape)}")
    if meta.cu_seqlens_q_host[-1] != num_tokens:
        raise ValueError(f"cu_seqlens_q ends at {meta.cu_seqlens_q_host[-1]}, "
                         f"q has {num_tokens} tokens")
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    num_seqs = meta.num_seqs
    if num_tokens == 0 or num_seqs == 0:
        return out
    q = _inner_contiguous(q)
    group = num_heads // num_kv_heads
    block_d = _block_d(head_dim)
    block_m, block_n, num_warps = _extend_config(block_d, group,
                                                 q.dtype == torch.float32)
    q_per_tile = block_m // group
    # Flat tile count: every sequence gets cdiv(n, Q_PER_TILE) tiles, plus at most one spare.
    num_tiles = num_tokens // q_per_tile + num_seqs
    _extend_kernel[(num_tiles, num_kv_heads)](
        q, k_cache, v_cache, out,
        meta.cu_seqlens_q, meta.seq_lens, meta.block_tables,
        num_seqs, scale * _LOG2E, window or 0,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), meta.block_tables.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        GROUP=group, Q_PER_TILE=q_per_tile, BLOCK_M=block_m,
        HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_N=block_n,
        PAGE_SIZE=page_size, DOT_PRECISION=dot_precision(q.dtype),
        DOT_UPCAST=dot_upcast(q.dtype, q.device), SLIDING=bool(window),
        num_warps=num_warps, num_stages=2,
    )
    return out


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float,
                    window: int | None = None) -> torch.Tensor:
    """Same semantics as ``reference.paged_attention``: decode kernel for a pure-decode batch
    (one token per sequence), else the extend kernel for the whole (mixed) batch."""
    if meta.max_seqlen_q == 1 and q.shape[0] == meta.num_seqs:
        return decode_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, scale,
                                max_seqlen_k=meta.max_seqlen_k, window=window)
    return extend_attention(q, k_cache, v_cache, meta, scale, window)
