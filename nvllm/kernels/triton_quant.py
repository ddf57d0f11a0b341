"""Triton weight-only quantized GEMMs: ``x W^T`` with x in the run dtype and W held as

- ``quant_matmul`` (W4A16 / W8A16): the engine's group formats (nvllm/worker/layers/
  quant.py) read as stored: int8 [N, K], or int4 [N, K / 2] in GGUF's nibble order (byte j
  of a group of 32 holds value j in its low nibble and value j + 16 in its high one), an
  fp16 scale per group of 32 and, in the ``+min`` formats, an fp16 min; value = scale * q
  (int8), scale * (q - 8) (int4), scale * q + min (either, with a min). AWQ / GPTQ
  checkpoints (4-bit, a scale and zero point per group of 128, packed eight to an int32
  in their own orders) are served by the same kernel once the loader repacks them into
  this layout (four groups of 32 sharing a scale; min = -scale * zero, exact as float32:
  mins are read as fp16 or float32, whichever they are); the kernel does not read their
  int32 packing.
- ``fp8_matmul`` (fp8 e4m3 weights, one float32 scale per output channel, as vLLM's
  ``--quantization fp8``): value = scale[n] * float(q). Triton's e4m3 type needs sm_89 or
  newer; the engine launches it on sm_90 (``FP8_MIN_ARCH``), else its callers take the
  reference path.

Numerics. ``quant_matmul`` dequantizes each weight in float32 (exact: a 4/8-bit integer
times an fp16 scale, plus an fp16 min, rounded once) and rounds it to x's dtype, which is
what the reference (``QuantizedWeight.dequantize(dtype=x.dtype)`` then ``torch.mm``)
multiplies; products accumulate in float32 ("ieee" dots for float32 x, not TF32) and the
output is rounded once. So the two agree up to float32 summation order.
``fp8_matmul`` multiplies x by the e4m3 values (exact in every run dtype) and applies the
channel's scale once to the float32 sum, where the reference rounds scale * q to x's dtype
first: in float32 they agree to summation order and one rounding, in 16-bit dtypes this
kernel is the more accurate of the two.

Tiles: one program per [BLOCK_M, BLOCK_N] output tile, walking K a few groups at a time.
Decode (M <= 16) uses 16-row tiles (tl.dot's minimum; the weight read dominates, so the
idle MMA rows cost nothing measurable on a memory-bound GEMV) and wide K steps; prefill
64-row tiles. On CPU these run only under the Triton interpreter (``TRITON_INTERPRET=1``
set before triton is imported), with small tiles that exercise the ragged-edge masks.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nvllm.kernels.triton_dot import dot_precision, dot_upcast, mma
from nvllm.kernels.triton_layer_ops import _cast

GROUP = 32  # values per scale (nvllm/worker/layers/quant.py's GROUP)
# The same, as a kernel may read a global. (Keep tensors on the left of arithmetic with
# it: under the interpreter constexpr + tensor stays a constexpr.)
_G = tl.constexpr(GROUP)
# Triton's float8e4nv (e4m3) exists from compute capability 8.9; sm_90 is the target that
# is compiled and checked ahead of time (nvllm/kernels/triton_aot.py).
FP8_MIN_ARCH = 89
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _config(m: int, dtype: torch.dtype, device: torch.device) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, GROUPS_PER_STEP, num_warps, num_stages) for M rows of x.

    16-bit x on a GPU: tensor-core tiles, decode 16 x 64 with 4 groups (128 values of K) per
    step so each program streams long runs of weight bytes, prefill 64 x 64 with 2 groups
    (3 stages: well under sm_80's shared memory). float32 dots are plain FMAs: small tiles.
    The interpreter's cost is per program and per loop step: small tiles, 2 groups a step
    so a K of an odd number of groups exercises the tail mask.
    """
    if device.type != "cuda":
        return 16, 32, 2, 4, 1
    if dtype == torch.float32:
        return (16 if m <= 16 else 32), 32, 1, 4, 2
    if m <= 16:
        return 16, 64, 4, 4, 3
    return 64, 64, 2, 4, 3


@triton.jit
def _dequant(q, s, mn, HAS_MIN: tl.constexpr, OFFSET: tl.constexpr, dtype: tl.constexpr):
    """scale * (q - OFFSET) (+ min) in float32, rounded once to dtype."""
    if HAS_MIN:
        w = q.to(tl.float32) * s.to(tl.float32) + mn.to(tl.float32)
    else:
        w = (q.to(tl.int32) - OFFSET).to(tl.float32) * s.to(tl.float32)
    return _cast(w, dtype)


@triton.jit
def _quant_matmul_kernel(
    x_ptr, stride_xm,            # x [M, K], unit stride on K
    q_ptr, stride_qn,            # int8 [N, K] or uint8 [N, K / 2] (GGUF nibble order)
    s_ptr, mn_ptr, stride_sn,    # scales fp16, mins fp16 or fp32: [N, K / 32] (HAS_MIN)
    out_ptr, stride_om,          # out [M, N] in x's dtype
    M, N, K,
    BITS: tl.constexpr, HAS_MIN: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUPS_PER_STEP: tl.constexpr,
    DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr,
):
    # Tiles are [K-step, BLOCK_N] (W^T's orientation, as tl.dot takes it). An int4 step is
    # two dots: the low nibbles of a group's 16 bytes are its values 0..15, the high ones
    # 16..31, so x is read as the matching two half-groups and no byte is loaded twice.
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < M
    col_mask = cols < N
    x_row = x_ptr + rows[:, None].to(tl.int64) * stride_xm
    q_col = q_ptr + cols[None, :].to(tl.int64) * stride_qn
    s_col = cols[None, :].to(tl.int64) * stride_sn
    n_groups = K // _G
    dtype = x_ptr.dtype.element_ty
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if BITS == 4:
        HALF: tl.constexpr = _G // 2
        j = tl.arange(0, GROUPS_PER_STEP * HALF)   # byte of the step
        g = j // HALF                               # its group within the step
        k_lo = g * _G + j % HALF                 # the value its low nibble holds
        for g0 in range(0, n_groups, GROUPS_PER_STEP):
            k_mask = (g0 + g) < n_groups
            w_mask = k_mask[:, None] & col_mask[None, :]
            b = tl.load(q_col + (j + g0 * HALF)[:, None], mask=w_mask, other=0)
            s = tl.load(s_ptr + s_col + (g0 + g)[:, None], mask=w_mask, other=0.0)
            mn = s
            if HAS_MIN:
                mn = tl.load(mn_ptr + s_col + (g0 + g)[:, None], mask=w_mask, other=0.0)
            x_mask = row_mask[:, None] & k_mask[None, :]
            x_lo = tl.load(x_row + (k_lo + g0 * _G)[None, :], mask=x_mask, other=0.0)
            x_hi = tl.load(x_row + (k_lo + g0 * _G + HALF)[None, :], mask=x_mask,
                           other=0.0)
            w_lo = _dequant(b & 0xF, s, mn, HAS_MIN, 8, dtype)
            w_hi = _dequant(b >> 4, s, mn, HAS_MIN, 8, dtype)
            acc = mma(x_lo, w_lo, acc, DOT_PRECISION, DOT_UPCAST)
            acc = mma(x_hi, w_hi, acc, DOT_PRECISION, DOT_UPCAST)
    else:
        kk = tl.arange(0, GROUPS_PER_STEP * _G)
        g = kk // _G
        for g0 in range(0, n_groups, GROUPS_PER_STEP):
            k_mask = (g0 + g) < n_groups
            w_mask = k_mask[:, None] & col_mask[None, :]
            q = tl.load(q_col + (kk + g0 * _G)[:, None], mask=w_mask, other=0)
            s = tl.load(s_ptr + s_col + (g0 + g)[:, None], mask=w_mask, other=0.0)
            mn = s
            if HAS_MIN:
                mn = tl.load(mn_ptr + s_col + (g0 + g)[:, None], mask=w_mask, other=0.0)
            x = tl.load(x_row + (kk + g0 * _G)[None, :],
                        mask=row_mask[:, None] & k_mask[None, :], other=0.0)
            acc = mma(x, _dequant(q, s, mn, HAS_MIN, 0, dtype), acc, DOT_PRECISION,
                       DOT_UPCAST)
    out = out_ptr + rows[:, None].to(tl.int64) * stride_om + cols[None, :]
    tl.store(out, _cast(acc, out_ptr.dtype.element_ty),
             mask=row_mask[:, None] & col_mask[None, :])


@triton.jit
def _fp8_matmul_kernel(
    x_ptr, stride_xm,            # x [M, K], unit stride on K
    w_ptr, stride_wn,            # float8_e4m3fn [N, K]
    s_ptr,                       # float32 [N]: one scale per output channel
    out_ptr, stride_om,          # out [M, N] in x's dtype
    M, N, K,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr,
):
    # The per-channel scale factors out of the sum over K: dots on the raw e4m3 values
    # (exact in x's dtype), one multiply per output.
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    row_mask = rows < M
    col_mask = cols < N
    x_ptrs = x_ptr + rows[:, None].to(tl.int64) * stride_xm + ks[None, :]
    w_ptrs = w_ptr + cols[None, :].to(tl.int64) * stride_wn + ks[:, None]
    dtype = x_ptr.dtype.element_ty
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = ks < K - k0
        x = tl.load(x_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_mask[:, None] & col_mask[None, :], other=0.0)
        acc = mma(x, w.to(tl.float32).to(dtype), acc, DOT_PRECISION, DOT_UPCAST)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    s = tl.load(s_ptr + cols, mask=col_mask, other=0.0)
    out = out_ptr + rows[:, None].to(tl.int64) * stride_om + cols[None, :]
    tl.store(out, _cast(acc * s[None, :], out_ptr.dtype.element_ty),
             mask=row_mask[:, None] & col_mask[None, :])


def _check_x(x: torch.Tensor, k: int) -> torch.Tensor:
    if x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"x must be [M, {k}], got {tuple(x.shape)}")
    if x.dtype not in DTYPES:
        raise ValueError(f"x must be float32, bfloat16 or float16, got {x.dtype}")
    return x if x.stride(1) == 1 else x.contiguous()


def quant_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                 mins: torch.Tensor | None, bits: int) -> torch.Tensor:
    """x [M, K] times W^T for W [N, K] held as (qweight, scales, mins) in one of the
    engine's group formats (the module docstring); returns [M, N] in x's dtype."""
    n, groups = scales.shape
    k = groups * GROUP
    if bits not in (4, 8):
        raise ValueError(f"bits must be 4 or 8, got {bits}")
    want = (n, k // 2 if bits == 4 else k)
    if tuple(qweight.shape) != want or (mins is not None and mins.shape != scales.shape):
        raise ValueError(f"qweight {tuple(qweight.shape)} (want {want}) / mins do not match "
                         f"scales {tuple(scales.shape)}")
    x = _check_x(x, k)
    out = torch.empty((x.shape[0], n), dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    qweight, scales = qweight.contiguous(), scales.contiguous()
    # Both contiguous [N, K / 32]: one row stride. (Without a min, scales stand in for the
    # pointer, never read.)
    mins = scales if mins is None else mins.contiguous()
    block_m, block_n, gps, warps, stages = _config(x.shape[0], x.dtype, x.device)
    grid = (triton.cdiv(x.shape[0], block_m), triton.cdiv(n, block_n))
    _quant_matmul_kernel[grid](
        x, x.stride(0), qweight, qweight.stride(0), scales, mins, scales.stride(0),
        out, out.stride(0), x.shape[0], n, k,
        BITS=bits, HAS_MIN=mins is not scales, BLOCK_M=block_m, BLOCK_N=block_n,
        GROUPS_PER_STEP=gps, DOT_PRECISION=dot_precision(x.dtype),
        DOT_UPCAST=dot_upcast(x.dtype, x.device), num_warps=warps, num_stages=stages,
    )
    return out


def fp8_matmul(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x [M, K] times W^T for W = scales[:, None] * weight, weight float8_e4m3fn [N, K] and
    scales float32 [N]; returns [M, N] in x's dtype."""
    n, k = weight.shape
    if weight.dtype != torch.float8_e4m3fn or scales.shape != (n,):
        raise ValueError(f"weight must be float8_e4m3fn [N, K] and scales [N]; got "
                         f"{weight.dtype} {tuple(weight.shape)}, {tuple(scales.shape)}")
    x = _check_x(x, k)
    out = torch.empty((x.shape[0], n), dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    weight, scales = weight.contiguous(), scales.to(torch.float32).contiguous()
    block_m, block_n, gps, warps, stages = _config(x.shape[0], x.dtype, x.device)
    grid = (triton.cdiv(x.shape[0], block_m), triton.cdiv(n, block_n))
    _fp8_matmul_kernel[grid](
        x, x.stride(0), weight, weight.stride(0), scales, out, out.stride(0),
        x.shape[0], n, k, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=gps * GROUP,
        DOT_PRECISION=dot_precision(x.dtype), DOT_UPCAST=dot_upcast(x.dtype, x.device),
        num_warps=warps, num_stages=stages,
    )
    return out


def fp8_supported(device: torch.device) -> bool:
    """Whether ``fp8_matmul`` can run on this CUDA device (e4m3 needs sm_89+)."""
    if device.type != "cuda":
        return False
    major, minor = torch.cuda.get_device_capability(device)
    return major * 10 + minor >= FP8_MIN_ARCH
