"""Triton quantized GEMMs (nvllm/kernels/triton_quant.py) against the torch reference:
the engine's group formats (int8, int8+min, int4, int4+min) against
``QuantizedWeight.dequantize`` then a matmul, and fp8 e4m3 with per-channel scales against
``Fp8Weight.dequantize`` then a matmul. On CPU the kernels run under the Triton
interpreter; on a GPU (scripts/device_check.sh) the same tests run on CUDA.

Shapes: M in {1, 5, 33} (one 16-row tile, a ragged one, three tiles), N = 40 (a full
and a ragged column tile), K = 96 (three groups: the interpreter's 2-group steps end on
a masked half step)."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from nvllm.kernels import triton_quant  # noqa: E402
from nvllm.worker.layers.fp8 import Fp8Weight, quantize_fp8  # noqa: E402
from nvllm.worker.layers.quant import (  # noqa: E402
    INT4,
    INT4_MIN,
    INT8,
    INT8_MIN,
    QuantizedWeight,
    quantize,
)
from tests.support.float_bounds import EPS32  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"
N, K = 40, 96
ROWS = (1, 5, 33)
# Unit roundoff of each output dtype (its final rounding).
ULP = {torch.float32: EPS32, torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}


def _quantized(fmt, gen) -> QuantizedWeight:
    qw = QuantizedWeight(fmt, N, K)
    qw.write(0, 0, *quantize(torch.randn(N, K, generator=gen), fmt))
    if qw.mins is not None:  # non-zero mins, so they are exercised
        qw.mins.copy_(torch.randn(qw.mins.shape, generator=gen) * 0.05)
    qw.qweight, qw.scales = qw.qweight.to(DEVICE), qw.scales.to(DEVICE)
    qw.mins = None if qw.mins is None else qw.mins.to(DEVICE)
    return qw


def _bound(x: torch.Tensor, w: torch.Tensor, exact: torch.Tensor,
           dtype: torch.dtype) -> torch.Tensor:
    """K * eps32 * sum |x w| (float32 sums in any order) plus the output's rounding."""
    return K * EPS32 * (x.abs().double() @ w.abs().t()) + exact.abs() * ULP[dtype]


# Every format in float32 and bfloat16; float16 (the same code as bfloat16 but for the
# rounding) with the int8 and int4 paths, one with a min.
CASES = [(f, d) for d in (torch.float32, torch.bfloat16) for f in (INT8, INT8_MIN, INT4,
                                                                    INT4_MIN)]
CASES += [(INT8, torch.float16), (INT4_MIN, torch.float16)]


@pytest.mark.parametrize("fmt,dtype", CASES, ids=lambda c: getattr(c, "name", str(c)))
def test_quant_matmul_equals_dequantize_then_matmul(fmt, dtype):
    """Both multiply x by the weights dequantized into x's dtype (the same roundings), so
    they differ by float32 summation order and the output's rounding at most."""
    gen = torch.Generator().manual_seed(fmt.bits * 2 + fmt.has_min)
    qw = _quantized(fmt, gen)
    w = qw.dequantize(dtype=dtype).double()  # what both multiply by
    for m in ROWS:
        x = torch.randn(m, K, generator=gen).to(dtype=dtype, device=DEVICE)
        got = triton_quant.quant_matmul(x, qw.qweight, qw.scales, qw.mins, fmt.bits)
        assert got.dtype == dtype and got.shape == (m, N)
        exact = x.double() @ w.t()
        bound = _bound(x, w, exact, dtype)
        assert bool(((got.double() - exact).abs() <= bound).all()), (fmt.name, m)
        ref = qw.matmul_tiles(x)  # the reference path on any device (on CUDA, cuBLAS may
        # also reduce 16-bit products in 16 bits: one more output rounding per term)
        ref_bound = 2 * bound + (ULP[dtype] * (x.abs().double() @ w.abs().t())
                                 if DEVICE == "cuda" else 0)
        assert bool(((got.double() - ref.double()).abs() <= ref_bound).all()), (fmt.name, m)


def test_quant_matmul_reads_float32_mins():
    """float32 mins (AWQ / GPTQ's -scale * zero, which fp16 would round) are read as such."""
    gen = torch.Generator().manual_seed(6)
    qw = _quantized(INT4_MIN, gen)
    qw.mins = (qw.mins.float() + torch.rand(qw.mins.shape, generator=gen).to(DEVICE)
               * 1e-4)  # values fp16 cannot hold
    w = qw.dequantize().double()
    x = torch.randn(5, K, generator=gen).to(DEVICE)
    got = triton_quant.quant_matmul(x, qw.qweight, qw.scales, qw.mins, 4)
    exact = x.double() @ w.t()
    assert bool(((got.double() - exact).abs() <= _bound(x, w, exact, torch.float32)).all())
    fp16_mins = triton_quant.quant_matmul(x, qw.qweight, qw.scales, qw.mins.half(), 4)
    assert not torch.equal(got, fp16_mins)


def test_quant_matmul_reads_strided_rows_and_checks_shapes():
    gen = torch.Generator().manual_seed(7)
    qw = _quantized(INT4, gen)
    x = torch.randn(5, 2 * K, generator=gen).to(DEVICE)[:, :K]  # a row stride of 2K
    want = triton_quant.quant_matmul(x.contiguous(), qw.qweight, qw.scales, None, 4)
    assert torch.equal(triton_quant.quant_matmul(x, qw.qweight, qw.scales, None, 4), want)
    assert triton_quant.quant_matmul(x[:0], qw.qweight, qw.scales, None, 4).shape == (0, N)
    with pytest.raises(ValueError, match="want"):
        triton_quant.quant_matmul(x, qw.qweight, qw.scales, None, 8)
    with pytest.raises(ValueError, match=r"x must be \[M, 96\]"):
        triton_quant.quant_matmul(x[:, :64], qw.qweight, qw.scales, None, 4)


@pytest.mark.skipif(DEVICE == "cuda" and not triton_quant.fp8_supported(torch.device(DEVICE)),
                    reason="Triton's e4m3 needs sm_89+")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_fp8_matmul_equals_dequantize_then_matmul(dtype):
    """The kernel multiplies by the exact e4m3 values and scales the float32 sum; the
    reference rounds scale * q to x's dtype first (in bfloat16, relative 2^-9 per
    weight), so its bound adds that rounding."""
    gen = torch.Generator().manual_seed(8)
    fw = Fp8Weight(N, K)
    w = torch.randn(N, K, generator=gen) * torch.rand(N, 1, generator=gen)
    w[3] = 0  # an all-zero channel
    fw.write(0, 0, *quantize_fp8(w))
    fw.qweight, fw.scales = fw.qweight.to(DEVICE), fw.scales.to(DEVICE)
    exact_w = fw.dequantize().double()  # scale * q, float32 (as the kernel's final scale)
    for m in ROWS:
        x = torch.randn(m, K, generator=gen).to(dtype=dtype, device=DEVICE)
        got = triton_quant.fp8_matmul(x, fw.qweight, fw.scales)
        assert got.dtype == dtype and got.shape == (m, N)
        exact = x.double() @ exact_w.t()
        # float32 sums and the scale multiply (one more rounding of the sum)
        bound = _bound(x, exact_w, exact, dtype) + EPS32 * exact.abs()
        assert bool(((got.double() - exact).abs() <= bound).all()), m
        assert bool((got[:, 3] == 0).all())
        ref = fw.matmul_tiles(x)
        ref_bound = 2 * bound + ULP[dtype] / 2 * (x.abs().double() @ exact_w.abs().t())
        assert bool(((got.double() - ref.double()).abs() <= ref_bound).all()), m
