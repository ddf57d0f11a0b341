"""The matrix product every nvllm Triton kernel takes (attention, fused MoE, quantized
GEMMs): fp32 accumulation, exact fp32 products for fp32 inputs, and the interpreter's
bfloat16 workaround. One place, so the kernels agree on what a dot computes."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def dot_precision(dtype: torch.dtype) -> str:
    # fp32 inputs: exact fp32 products ("ieee"), not TF32, so fp32 runs match the reference
    # tightly (fp32 is the debugging / parity dtype; bf16/fp16 use tensor cores regardless).
    return "ieee" if dtype == torch.float32 else "tf32"


def dot_upcast(dtype: torch.dtype, device: torch.device) -> bool:
    # The Triton interpreter's tl.dot multiplies bf16 operands as their raw uint16 bit patterns
    # (triton 3.x), so under the interpreter (CPU tensors) bf16 operands are widened to fp32
    # first: bf16 -> fp32 is exact and a bf16 MMA also accumulates exact products in fp32, so
    # the result is what the GPU computes. Never set for CUDA tensors.
    return dtype == torch.bfloat16 and device.type != "cuda"


@triton.jit
def mma(a, b, acc, DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr):
    """acc + a @ b in fp32 (acc may be None); see dot_upcast for DOT_UPCAST."""
    if DOT_UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc, input_precision=DOT_PRECISION)
