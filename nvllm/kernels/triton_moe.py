"""Triton fused mixture-of-experts MLP: SwiGLU experts as two grouped GEMMs over tokens
sorted by expert (the vLLM / SGLang ``fused_moe`` design, smaller).

``fused_moe`` computes, for every token t, the sum over its routed (t, k) pairs whose global
expert id falls in this rank's slice ``[expert_start, expert_start + E_local)`` of
``topk_weights[t, k] * w2[e] @ (silu(w13[e, :I] @ x[t]) * (w13[e, I:] @ x[t]))``; pairs routed
to other ranks' experts contribute nothing (expert parallelism: the ranks' partial outputs are
summed by the caller's all-reduce). Its torch twin, with the same signature, is
``nvllm/kernels/moe.py``.

Steps (per chunk of at most ``_CHUNK_TOKENS`` tokens, which bounds the scratch memory):

1. align (torch, no host sync, so it can be captured in a CUDA graph): the T*K (token, k)
   pairs are sorted by local expert and each expert's run is padded to a multiple of
   ``BLOCK_M`` with the sentinel T*K, so every ``BLOCK_M`` block of the sorted list belongs
   to one expert (``block_expert``). Blocks past the padded total (the grid is sized for the
   worst case) return at once; an expert with no pairs gets no block at all.
2. ``_moe_gate_up_kernel``: per (block, column tile) the gate and up tiles of the same
   columns of ``x[tokens] @ w13[e]^T``, then SiLU-and-mul in the epilogue, so only the
   [pairs, I] product (not the [pairs, 2I] one) is written; rows in sorted order.
3. ``_moe_down_kernel``: that product times ``w2[e]^T``, scaled by the pair's routing weight
   and scattered to the pair's own row of a float32 [T*K, H] buffer (pairs of other ranks'
   experts keep its zeros).
4. the sum over k (torch), in float32, rounded once to x's dtype.

Numerics: fp32 accumulation throughout; fp32 inputs use exact fp32 dots ("ieee", not TF32).
For 16-bit inputs the gate/up products stay in fp32 through SiLU-and-mul and are rounded once
(the torch twin rounds each projection and then silu(gate)), the SiLU-and-mul product is
rounded to x's dtype before the down projection (as any bf16 MLP does: it is that GEMM's
input), the down projection and the weighted sum over k stay fp32. So 16-bit outputs agree
with the twin to a few units in the last place, fp32 ones to summation order.

Sizes: any T, K, E_local, H, I (H and I need not be multiples of the tiles: loads and stores
are masked); the sum over k is per token, in a fixed order, so results do not depend on what
else is in the batch beyond summation order inside the GEMM tiles.

On CPU the kernels run only under the Triton interpreter (``TRITON_INTERPRET=1`` set before
triton is imported).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nvllm.kernels.triton_dot import dot_precision, dot_upcast, mma
from nvllm.kernels.triton_layer_ops import _cast

# Tokens per pass: bounds the scratch buffers ([T*K, I] intermediate in x's dtype and the
# [T*K, H] float32 pair outputs) on long prefills; the GEMMs are saturated long before.
_CHUNK_TOKENS = 4096


def _config(n_pairs: int, n_experts: int, dtype: torch.dtype,
            device: torch.device) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) for one launch pair.

    BLOCK_M follows the expected pairs per expert: decode batches give each expert a handful
    of rows, and a 64-row tile would be mostly sentinel padding (vLLM's default configs make
    the same switch). 16-bit tiles are sized for the tensor cores (bf16 64x64x64, three
    stages: ~72 KiB of shared memory, under sm_80's and sm_90's limits); fp32 dots are plain
    FMAs and take small tiles. The interpreter runs the small ones: its cost is per program
    and per loop step, and the small tiles exercise the ragged-edge masking in tests.
    """
    per_expert = n_pairs / max(n_experts, 1)
    if dtype == torch.float32 or device.type != "cuda":
        return (16 if per_expert <= 16 else 32), 32, 32, 4, 2
    return (16 if per_expert <= 32 else 64), 64, 64, 4, 3


def _align(topk_ids: torch.Tensor, expert_start: int, n_experts: int,
           block_m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sorted_ids, block_expert, n_padded) for the pairs of topk_ids [T, K].

    sorted_ids [max_blocks * block_m] int32: pair indices t*K + k grouped by local expert,
    each expert's run padded to a multiple of block_m with the sentinel T*K (also filling the
    tail past n_padded). block_expert [max_blocks] int32: the local expert of each block.
    n_padded [1] int32: the padded length actually used. max_blocks is the worst case
    (every expert's run ragged), so shapes depend only on (T, K, E_local) and nothing here
    reads a device value back to the host.
    """
    n = topk_ids.numel()
    dev = topk_ids.device
    local = topk_ids.reshape(-1).to(torch.int64) - expert_start
    key = torch.where((local >= 0) & (local < n_experts), local, n_experts)  # E: not ours
    order = torch.argsort(key, stable=True)
    counts = torch.zeros(n_experts + 1, dtype=torch.int64, device=dev)
    counts.scatter_add_(0, key, torch.ones_like(key))
    counts = counts[:n_experts]
    padded = (counts + block_m - 1) // block_m * block_m
    pad_end = torch.cumsum(padded, 0)
    pad_start, cnt_start = pad_end - padded, torch.cumsum(counts, 0) - counts

    max_blocks = triton.cdiv(n, block_m) + min(n_experts, n)
    sorted_key = key[order]
    e = sorted_key.clamp(max=n_experts - 1)
    pos = pad_start[e] + torch.arange(n, device=dev) - cnt_start[e]
    # Pairs of other ranks' experts all land in one extra slot, dropped below.
    pos = torch.where(sorted_key < n_experts, pos, max_blocks * block_m)
    sorted_ids = torch.full((max_blocks * block_m + 1,), n, dtype=torch.int32, device=dev)
    sorted_ids[pos] = order.to(torch.int32)
    # Block b starts at row b*block_m; its expert is the number of runs ending at or before
    # it (empty experts end where they start and are skipped). Blocks past the end get
    # E_local, clamped: they are never computed.
    starts = torch.arange(max_blocks, device=dev, dtype=torch.int64) * block_m
    block_expert = torch.searchsorted(pad_end, starts, right=True).clamp_(max=n_experts - 1)
    return (sorted_ids[:-1], block_expert.to(torch.int32),
            pad_end[-1:].to(torch.int32))


@triton.jit
def _block_tile(pid_m, pid_n, sorted_ids_ptr, block_expert_ptr, n_pairs, n_cols,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """One program's tile: its sorted rows, their (token, k) pairs and which are real (not
    sentinel padding), the block's expert, and its columns (of n_cols) with their mask."""
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_ids_ptr + rows)
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    return rows, pair, pair < n_pairs, expert, cols, cols < n_cols


@triton.jit
def _moe_gate_up_kernel(
    x_ptr, stride_xt,                 # x [T, H], unit stride on H
    w_ptr, stride_we, stride_wn,      # w13 [E, 2I, H], unit stride on H
    inter_ptr,                        # out: silu(gate) * up, [max_rows, I] contiguous, sorted
    sorted_ids_ptr, block_expert_ptr, n_padded_ptr,
    n_pairs, H, INTER,               # INTER: I, the expert intermediate size
    TOP_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr,
):
    # Grid (blocks, I tiles): axis 0 varies fastest, so the programs running together are
    # consecutive blocks of mostly the same expert on the same weight columns (weight tiles
    # are re-read from L2, not HBM). Gate and up columns j and I + j go to the same program
    # so SiLU-and-mul needs no second pass.
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(n_padded_ptr):
        return
    rows, pair, row_mask, expert, cols, col_mask = _block_tile(
        pid_m, pid_n, sorted_ids_ptr, block_expert_ptr, n_pairs, INTER, BLOCK_M, BLOCK_N)
    tok = (pair // TOP_K).to(tl.int64)
    ks = tl.arange(0, BLOCK_K)

    a_ptrs = x_ptr + tok[:, None] * stride_xt + ks[None, :]
    # [BLOCK_K, BLOCK_N] tiles of w13[e]^T: rows j (gate) and I + j (up).
    g_ptrs = w_ptr + expert * stride_we + cols[None, :].to(tl.int64) * stride_wn + ks[:, None]
    u_ptrs = g_ptrs + INTER * stride_wn
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        k_mask = ks < H - k0
        a = tl.load(a_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        b_mask = k_mask[:, None] & col_mask[None, :]
        g = tl.load(g_ptrs, mask=b_mask, other=0.0)
        u = tl.load(u_ptrs, mask=b_mask, other=0.0)
        acc_g = mma(a, g, acc_g, DOT_PRECISION, DOT_UPCAST)
        acc_u = mma(a, u, acc_u, DOT_PRECISION, DOT_UPCAST)
        a_ptrs += BLOCK_K
        g_ptrs += BLOCK_K
        u_ptrs += BLOCK_K

    h = acc_g * tl.sigmoid(acc_g) * acc_u
    out = inter_ptr + rows[:, None].to(tl.int64) * INTER + cols[None, :]
    tl.store(out, _cast(h, inter_ptr.dtype.element_ty),
             mask=row_mask[:, None] & col_mask[None, :])


@triton.jit
def _moe_down_kernel(
    inter_ptr,                        # silu(gate) * up, [max_rows, I] contiguous, sorted
    w_ptr, stride_we, stride_wn,      # w2 [E, H, I], unit stride on I
    out_ptr,                          # out: float32 [n_pairs, H] contiguous, row = pair
    weights_ptr,                      # routing weights, float32 [n_pairs]
    sorted_ids_ptr, block_expert_ptr, n_padded_ptr,
    n_pairs, H, INTER,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr,
):
    # Grid (blocks, H tiles), ordered as in _moe_gate_up_kernel. Each pair's row is written
    # by exactly one program per column tile (no atomics: the sum over k is a separate,
    # fixed-order pass).
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(n_padded_ptr):
        return
    rows, pair, row_mask, expert, cols, col_mask = _block_tile(
        pid_m, pid_n, sorted_ids_ptr, block_expert_ptr, n_pairs, H, BLOCK_M, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)

    # Sentinel rows were never written by the first kernel: mask them here too.
    a_ptrs = inter_ptr + rows[:, None].to(tl.int64) * INTER + ks[None, :]
    b_ptrs = w_ptr + expert * stride_we + cols[None, :].to(tl.int64) * stride_wn + ks[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, INTER, BLOCK_K):
        k_mask = ks < INTER - k0
        a = tl.load(a_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_mask[:, None] & col_mask[None, :], other=0.0)
        acc = mma(a, b, acc, DOT_PRECISION, DOT_UPCAST)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K

    wt = tl.load(weights_ptr + pair, mask=row_mask, other=0.0)
    out = out_ptr + pair[:, None].to(tl.int64) * H + cols[None, :]
    tl.store(out, acc * wt[:, None], mask=row_mask[:, None] & col_mask[None, :])


def _check(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor,
           topk_weights: torch.Tensor) -> None:
    if x.dim() != 2 or w13.dim() != 3 or w2.dim() != 3:
        raise ValueError(f"x must be [T, H], w13 [E, 2I, H], w2 [E, H, I]; got "
                         f"{tuple(x.shape)}, {tuple(w13.shape)}, {tuple(w2.shape)}")
    n_experts, two_i, h = w13.shape
    if h != x.shape[1] or two_i % 2 or w2.shape != (n_experts, h, two_i // 2):
        raise ValueError(f"shapes do not agree: x {tuple(x.shape)}, w13 {tuple(w13.shape)}, "
                         f"w2 {tuple(w2.shape)} (want w13 [E, 2I, H], w2 [E, H, I])")
    if n_experts == 0:
        raise ValueError("w13 / w2 hold no experts")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != x.shape[0] \
            or topk_weights.shape != topk_ids.shape:
        raise ValueError(f"topk_ids / topk_weights must both be [T={x.shape[0]}, K]; got "
                         f"{tuple(topk_ids.shape)} and {tuple(topk_weights.shape)}")
    if topk_ids.dtype.is_floating_point or topk_ids.dtype == torch.bool:
        raise ValueError(f"topk_ids must be integer, got {topk_ids.dtype}")
    if not (x.dtype == w13.dtype == w2.dtype):
        raise ValueError(f"x, w13 and w2 must share a dtype, got {x.dtype}, {w13.dtype}, "
                         f"{w2.dtype}")


def _unit_inner(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor,
              topk_weights: torch.Tensor, expert_start: int = 0) -> torch.Tensor:
    """SwiGLU experts of this rank's expert slice applied to x [T, H]; returns [T, H] in
    x's dtype (see the module docstring for the exact sum and the numerics).

    w13 [E_local, 2I, H] holds gate_proj rows 0..I-1 and up_proj rows I..2I-1 per expert,
    w2 [E_local, H, I] down_proj; topk_ids [T, K] global expert ids, topk_weights [T, K]
    routing weights; local expert e is global id expert_start + e. Ids outside the slice
    contribute nothing (a token none of whose experts are local gets zeros). Ids are not
    otherwise checked on the device.
    """
    _check(x, w13, w2, topk_ids, topk_weights)
    t, h = x.shape
    n_experts, i = w2.shape[0], w2.shape[2]
    k = topk_ids.shape[1]
    out = torch.empty((t, h), dtype=x.dtype, device=x.device)
    if t == 0 or h == 0:
        return out
    if k == 0 or i == 0:
        return out.zero_()
    x, w13, w2 = _unit_inner(x), _unit_inner(w13), _unit_inner(w2)
    weights = topk_weights.to(torch.float32)
    precision, upcast = dot_precision(x.dtype), dot_upcast(x.dtype, x.device)

    for s in range(0, t, _CHUNK_TOKENS):
        xs, ids = x[s:s + _CHUNK_TOKENS], topk_ids[s:s + _CHUNK_TOKENS]
        ws = weights[s:s + _CHUNK_TOKENS].reshape(-1).contiguous()
        n_pairs = ids.numel()
        block_m, block_n, block_k, warps, stages = _config(n_pairs, n_experts, x.dtype,
                                                          x.device)
        sorted_ids, block_expert, n_padded = _align(ids, expert_start, n_experts, block_m)
        n_blocks = block_expert.numel()
        inter = torch.empty((sorted_ids.numel(), i), dtype=x.dtype, device=x.device)
        _moe_gate_up_kernel[(n_blocks, triton.cdiv(i, block_n))](
            xs, xs.stride(0), w13, w13.stride(0), w13.stride(1), inter,
            sorted_ids, block_expert, n_padded, n_pairs, h, i,
            TOP_K=k, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
            DOT_PRECISION=precision, DOT_UPCAST=upcast,
            num_warps=warps, num_stages=stages,
        )
        pair_out = torch.zeros((n_pairs, h), dtype=torch.float32, device=x.device)
        _moe_down_kernel[(n_blocks, triton.cdiv(h, block_n))](
            inter, w2, w2.stride(0), w2.stride(1), pair_out, ws,
            sorted_ids, block_expert, n_padded, n_pairs, h, i,
            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
            DOT_PRECISION=precision, DOT_UPCAST=upcast,
            num_warps=warps, num_stages=stages,
        )
        out[s:s + xs.shape[0]] = pair_out.view(xs.shape[0], k, h).sum(1)
    return out
