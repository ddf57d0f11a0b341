"""Triton kernels for the per-layer elementwise / row ops: RMSNorm (plain and fused with the
residual add), neox rotary embedding and SiLU-and-mul.

Each wrapper computes what its twin in ``reference.py`` computes and, like it, returns new
tensors (contiguous, same shape as the reference result). On CPU they run only under the
Triton interpreter (``TRITON_INTERPRET=1`` set before ``triton`` is imported).

Numerics, relative to the reference:

* RMSNorm: float32 variance and scaling, the normalized value rounded to the input dtype
  before the weight multiply (as HF / the reference); the weight product is taken in
  float32 and rounded once, which is exactly what torch does for 16-bit dtypes (the product
  of two 16-bit floats is exact in float32). Only the order of the sum of squares differs,
  so outputs agree to an ulp or so (bf16 outputs are in practice bit-identical).
* fused add: the residual sum is rounded to its dtype before it is normalized and stored,
  as the reference does (float32 add then one rounding gives the correctly rounded 16-bit
  sum, so the stored residual is bit-identical to torch's).
* rotary: float32 math and one rounding at the end. The reference casts cos/sin to the
  input dtype and rounds after every multiply and add; in float32 the two agree (up to FMA
  contraction on GPU), in bf16/fp16 this kernel is the more accurate one and they differ
  by about one unit in the last place.
* SiLU-and-mul: float32 math and one rounding (the reference rounds silu(gate) first).
* every fp32 -> bf16 rounding is round-to-nearest-even, done by hand (``_cast``) because the
  Triton interpreter would otherwise truncate.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Norm programs hold whole rows in registers. Past ~16K elements a row spills (slower, still
# correct); past this limit refuse rather than compile a huge block. Real hidden sizes are
# <= 16K.
_MAX_ROW_BLOCK = 65536
# Norms over short rows (per-head q/k norm: head_dim 64-256) pack several rows into one
# program so each program still moves a reasonable tile (~this many elements).
_NORM_TILE_ELEMS = 2048
_ELEMWISE_BLOCK = 1024


def _num_warps(tile_elems: int) -> int:
    # ~512 elements per warp (16 per thread): enough loads in flight per thread without
    # spilling; 1 warp for a 128-wide head row, 8 for a 4096 hidden row, 16 at most.
    return max(1, min(16, tile_elems // 512))


def _as_rows3(x: torch.Tensor) -> torch.Tensor:
    """A [A, B, D] view of x (last dim D) with unit stride on D, copying only if needed.

    Two leading levels with their own strides let the kernels read the usual
    non-contiguous inputs in place, e.g. q/k as ``qkv.split(...)[i].view(T, H, d)``
    (strides (qkv_width, d, 1)), which no 2-D view can describe.
    """
    if x.stride(-1) != 1 and x.shape[-1] > 1:
        x = x.contiguous()
    if x.dim() == 1:
        return x.view(1, 1, x.shape[0])
    if x.dim() == 2:
        return x.unsqueeze(0)
    if x.dim() == 3:
        return x
    try:  # more leading dims: merge all but the innermost one when the strides allow
        return x.view(-1, x.shape[-2], x.shape[-1])
    except RuntimeError:
        return x.contiguous().view(-1, x.shape[-2], x.shape[-1])


def _row_block(d: int) -> int:
    block = triton.next_power_of_2(d)
    if block > _MAX_ROW_BLOCK:
        raise ValueError(f"row length {d} exceeds the single-block norm limit "
                         f"({_MAX_ROW_BLOCK})")
    return block


@triton.jit
def _cast(x, dtype: tl.constexpr):
    """Round fp32 x to dtype to nearest-even, the same on a GPU and in the interpreter.

    GPUs round fp32 -> bf16 to nearest, but the Triton interpreter truncates (and its
    "rtne" mode does not carry into the exponent), which would bias every bf16 output
    toward zero on CPU and break the bit-exact residual sum. So bf16 rounds by hand with
    the usual integer trick (what cvt.rn.bf16.f32 computes); fp16/fp32 casts are already
    round-to-nearest everywhere. Costs a few integer ops in memory-bound kernels.
    """
    if dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits += 0x7FFF + ((bits >> 16) & 1)
        rounded = (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
        return tl.where(x != x, x.to(tl.bfloat16), rounded)  # NaN stays NaN
    else:
        return x.to(dtype)


# --------------------------------------------------------------------------- RMSNorm


@triton.jit
def _rms_norm_kernel(
    x_ptr, x_sa, x_sb,          # input viewed as [A, B, D], unit stride on D
    r_ptr, r_sa, r_sb,          # residual, same view (read only when HAS_RESIDUAL)
    w_ptr,                      # weight [D], contiguous
    out_ptr,                    # normalized output, contiguous [A*B, D]
    sum_ptr,                    # x + residual, contiguous [A*B, D] (HAS_RESIDUAL only)
    n_rows, B, D, eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK_ROWS: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # Each program normalizes BLOCK_ROWS whole rows (1 for hidden-size rows, several for
    # per-head rows); the row never leaves registers between the reduction and the scale.
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = tl.arange(0, BLOCK_D)
    row_mask = rows < n_rows
    col_mask = cols < D
    mask = row_mask[:, None] & col_mask[None, :]

    # int64 before the stride products: T * qkv_width can pass 2**31 on long prompts.
    rows64 = rows.to(tl.int64)
    a, b = rows64 // B, rows64 % B
    x_off = (a * x_sa + b * x_sb)[:, None] + cols[None, :]
    x = tl.load(x_ptr + x_off, mask=mask, other=0.0)
    dense_off = rows64[:, None] * D + cols[None, :]

    if HAS_RESIDUAL:
        r_off = (a * r_sa + b * r_sb)[:, None] + cols[None, :]
        r = tl.load(r_ptr + r_off, mask=mask, other=0.0)
        # Add in fp32 and round once to the sum's dtype: the reference normalizes the
        # rounded sum, and the rounded sum is the new residual stream.
        s = _cast(x.to(tl.float32) + r.to(tl.float32), sum_ptr.dtype.element_ty)
        tl.store(sum_ptr + dense_off, s, mask=mask)
        x = s

    xf = x.to(tl.float32)
    # Masked lanes load 0, so they add nothing to the sum of squares; divide by the true D.
    mean_sq = tl.sum(xf * xf, axis=1) / D
    # IEEE sqrt and division (not the approximate rsqrt): once per row, so free, and it
    # keeps fp32 within an ulp or two of torch.rsqrt.
    rstd = tl.math.div_rn(1.0, tl.sqrt_rn(mean_sq + eps))
    # Round the normalized value to the input dtype before the weight, as HF does.
    y = _cast(xf * rstd[:, None], x.dtype).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    out = _cast(y * w[None, :], out_ptr.dtype.element_ty)
    tl.store(out_ptr + dense_off, out, mask=mask)


def _launch_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    d = x.shape[-1]
    if weight.shape != (d,):
        raise ValueError(f"weight shape {tuple(weight.shape)} does not match last dim {d}")
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"residual shape {tuple(residual.shape)} != x shape "
                         f"{tuple(x.shape)}")
    sum_dtype = x.dtype if residual is None else torch.promote_types(x.dtype, residual.dtype)
    out = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, sum_dtype),
                      device=x.device)
    summed = None if residual is None else torch.empty(x.shape, dtype=sum_dtype,
                                                       device=x.device)
    n_rows = x.numel() // d if d else 0
    if n_rows == 0 or d == 0:
        return out, summed

    x3 = _as_rows3(x)
    r3 = x3 if residual is None else _as_rows3(residual)
    block_d = _row_block(d)
    block_rows = min(max(1, _NORM_TILE_ELEMS // block_d), triton.next_power_of_2(n_rows))
    grid = (triton.cdiv(n_rows, block_rows),)
    _rms_norm_kernel[grid](
        x3, x3.stride(0), x3.stride(1),
        r3, r3.stride(0), r3.stride(1),
        weight.contiguous(), out, out if summed is None else summed,
        n_rows, x3.shape[1], d, eps,
        HAS_RESIDUAL=residual is not None,
        BLOCK_ROWS=block_rows, BLOCK_D=block_d,
        num_warps=_num_warps(block_rows * block_d),
    )
    return out, summed


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * x / rms(x) over the last dim of x (any leading shape, strided views ok)."""
    return _launch_rms_norm(x, None, weight, eps)[0]


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual) in one pass over the row."""
    out, summed = _launch_rms_norm(x, residual, weight, eps)
    return out, summed


# ---------------------------------------------------------------------- rotary (neox)


@triton.jit
def _rotate_heads(src_ptr, s_t, s_h, dst_ptr, n_heads, tok,
                  c1, c2, s1, s2, heads, cols,
                  HEAD_DIM: tl.constexpr):
    # Neox style: the head splits into halves x1 = x[:d/2], x2 = x[d/2:];
    # out = [x1*cos1 - x2*sin1, x2*cos2 + x1*sin2] (rotate_half(x) = [-x2, x1]).
    HALF: tl.constexpr = HEAD_DIM // 2
    mask = (heads < n_heads)[:, None] & (cols < HALF)[None, :]
    src = src_ptr + tok * s_t + heads[:, None] * s_h + cols[None, :]
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    o1 = x1 * c1[None, :] - x2 * s1[None, :]
    o2 = x2 * c2[None, :] + x1 * s2[None, :]
    dst = dst_ptr + (tok * n_heads + heads[:, None]) * HEAD_DIM + cols[None, :]
    tl.store(dst, _cast(o1, dst_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + HALF, _cast(o2, dst_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(
    pos_ptr, pos_stride,
    cos_ptr, sin_ptr, cs_stride,          # caches [max_pos, HEAD_DIM], unit last stride
    q_ptr, q_st, q_sh, q_out_ptr, n_q_heads,
    k_ptr, k_st, k_sh, k_out_ptr, n_k_heads,
    HEAD_DIM: tl.constexpr,
    BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_HALF: tl.constexpr,
):
    # One program per token rotates all its q heads and k heads in a single launch, so
    # the cos/sin row is fetched once and shared by every head (and by q and k).
    tok = tl.program_id(0).to(tl.int64)
    HALF: tl.constexpr = HEAD_DIM // 2
    cols = tl.arange(0, BLOCK_HALF)
    col_mask = cols < HALF

    pos = tl.load(pos_ptr + tok * pos_stride).to(tl.int64)
    cs = pos * cs_stride + cols
    # Both halves are read (not assumed equal) so this is exactly the reference formula.
    c1 = tl.load(cos_ptr + cs, mask=col_mask, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + cs + HALF, mask=col_mask, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + cs, mask=col_mask, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + cs + HALF, mask=col_mask, other=0.0).to(tl.float32)

    _rotate_heads(q_ptr, q_st, q_sh, q_out_ptr, n_q_heads, tok, c1, c2, s1, s2,
                  tl.arange(0, BLOCK_HQ), cols, HEAD_DIM)
    _rotate_heads(k_ptr, k_st, k_sh, k_out_ptr, n_k_heads, tok, c1, c2, s1, s2,
                  tl.arange(0, BLOCK_HK), cols, HEAD_DIM)


def _heads_view(x: torch.Tensor, name: str) -> torch.Tensor:
    if x.dim() != 3:
        raise ValueError(f"{name} must be [tokens, heads, head_dim], got {tuple(x.shape)}")
    return x if x.stride(-1) == 1 else x.contiguous()


def rotary_embedding(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                     cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox rotary of q [T, H, d] and k [T, KH, d] at positions [T] (cos/sin [max_pos, d]).

    Positions are not bounds-checked on the device (the reference's indexing raises);
    the caller guarantees 0 <= position < max_pos.
    """
    q, k = _heads_view(q, "q"), _heads_view(k, "k")
    t, n_q, d = q.shape
    if k.shape[0] != t or k.shape[2] != d:
        raise ValueError(f"k shape {tuple(k.shape)} does not match q shape {tuple(q.shape)}")
    if d % 2:
        raise ValueError(f"head_dim must be even for neox rotary, got {d}")
    if cos.shape != sin.shape or cos.dim() != 2 or cos.shape[1] != d:
        raise ValueError(f"cos/sin must both be [max_pos, {d}], got {tuple(cos.shape)} "
                         f"and {tuple(sin.shape)}")
    if positions.shape != (t,):
        raise ValueError(f"positions must be [{t}], got {tuple(positions.shape)}")
    if cos.stride() != sin.stride() or cos.stride(-1) != 1:
        cos, sin = cos.contiguous(), sin.contiguous()
    n_k = k.shape[1]
    # Output dtypes as the reference: the caches are cast to q's dtype, so k * cos promotes.
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=torch.promote_types(k.dtype, q.dtype), device=k.device)
    if t == 0:
        return q_out, k_out

    block_half = triton.next_power_of_2(d // 2)
    block_hq, block_hk = triton.next_power_of_2(n_q), triton.next_power_of_2(max(n_k, 1))
    _rotary_kernel[(t,)](
        positions, positions.stride(0),
        cos, sin, cos.stride(0),
        q, q.stride(0), q.stride(1), q_out, n_q,
        k, k.stride(0), k.stride(1), k_out, n_k,
        HEAD_DIM=d, BLOCK_HQ=block_hq, BLOCK_HK=block_hk, BLOCK_HALF=block_half,
        num_warps=_num_warps(2 * block_hq * block_half),
    )
    return q_out, k_out


# ------------------------------------------------------------------------ SiLU-and-mul


@triton.jit
def _silu_and_mul_kernel(x_ptr, x_stride, out_ptr, D, BLOCK: tl.constexpr):
    # Grid (rows, column blocks): purely elementwise, so the tile size is free of the row
    # length and long intermediate rows spread over many programs.
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < D
    gate = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * x_stride + D + cols, mask=mask, other=0.0).to(tl.float32)
    out = gate * tl.sigmoid(gate) * up
    tl.store(out_ptr + row * D + cols, _cast(out, out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for x = [..., 2 * d] holding [gate | up]; returns [..., d]."""
    two_d = x.shape[-1]
    if two_d % 2:
        raise ValueError(f"last dim must be even ([gate | up]), got {two_d}")
    d = two_d // 2
    out = torch.empty((*x.shape[:-1], d), dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    if x.stride(-1) != 1:
        x = x.contiguous()
    try:  # rows of [gate | up]: a strided 2-D view (e.g. a row slice) needs no copy
        x2 = x.view(-1, two_d)
    except RuntimeError:
        x2 = x.reshape(-1, two_d)
    block = min(_ELEMWISE_BLOCK, triton.next_power_of_2(d))
    grid = (x2.shape[0], triton.cdiv(d, block))
    _silu_and_mul_kernel[grid](x2, x2.stride(0), out, d, BLOCK=block,
                               num_warps=_num_warps(block))
    return out
