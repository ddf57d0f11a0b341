"""fp8 (e4m3) weights with one float32 scale per output channel: ``quantization=fp8``, a
float checkpoint's linear layers quantized at load, as vLLM's ``--quantization fp8`` does
(its per-channel variant).

Value of a stored weight: ``scale[n] * float(q[n, k])``, q in ``torch.float8_e4m3fn``
(3 mantissa bits, largest 448) and ``scale[n] = absmax(W[n, :]) / 448`` over the whole
row of the checkpoint tensor, so a row's largest value maps to 448 and the others round
to nearest. The absmax is taken over the full row even where a rank holds only some of
its columns (row-parallel layers under tensor parallelism): every rank then holds the
values a single rank would, and the result does not depend on the tp size.

``Fp8Weight`` has ``QuantizedWeight``'s interface (``fmt``, ``n``, ``k``, ``qweight``,
``scales``, ``mins``, ``nbytes``, ``write``, ``dequantize``, ``matmul``), so layers and
the loader treat both alike. ``matmul``: on a CUDA device with Triton and sm_89+ the fused
kernel (``nvllm/kernels/triton_quant.py:fp8_matmul``), elsewhere the reference: a tile of
W's rows dequantized into x's dtype and ``torch.mm`` (torch converts e4m3 on any device).
That reference is what the CPU runs: fp8 on CPU is for measuring fp8's quality, not speed
(each step dequantizes every weight).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nvllm.worker.layers.quant import triton_usable

FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
# Rows of W dequantized at once on the reference path.
TILE_ROWS = 4096


@dataclass(frozen=True, slots=True)
class Fp8Format:
    """The fp8 format (one instance, ``FP8``); bits / has_min as QuantFormat has them."""

    bits: int = 8
    has_min: bool = False

    @property
    def name(self) -> str:
        return "fp8"


FP8 = Fp8Format()


def quantize_fp8(w: torch.Tensor, absmax: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(q float8_e4m3fn [n, k], scales float32 [n]) of w [n, k]: scale = absmax / 448 per
    row (``absmax`` given: the full rows' when w is some of their columns), q = w / scale
    rounded to nearest e4m3, clamped to +-448 against a scale that rounded down."""
    wf = w.float()
    amax = wf.abs().amax(1) if absmax is None else absmax.float()
    s = amax / FP8_MAX
    s = torch.where(s == 0, torch.ones_like(s), s)  # an all-zero row: q = 0, any scale
    q = (wf / s.unsqueeze(1)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, s


class Fp8Weight:
    """One layer's fp8 [n, k] weight: qweight float8_e4m3fn [n, k] and scales float32
    [n], the tensors the module registers."""

    __slots__ = ("fmt", "n", "k", "qweight", "scales", "mins")

    def __init__(self, n: int, k: int, device=None) -> None:
        self.fmt, self.n, self.k, self.mins = FP8, n, k, None
        self.qweight = torch.zeros(n, k, dtype=torch.float8_e4m3fn, device=device)
        self.scales = torch.ones(n, dtype=torch.float32, device=device)

    def nbytes(self) -> int:
        return self.qweight.numel() + self.scales.numel() * 4

    def write(self, row: int, col: int, q: torch.Tensor, scales: torch.Tensor,
              mins: None = None) -> None:
        """Store q [r, c] at rows [row, + r) and columns [col, + c), with those rows'
        scales (the full rows' scales: equal for every column block of a row)."""
        self.scales[row:row + q.shape[0]] = scales
        self.qweight[row:row + q.shape[0], col:col + q.shape[1]] = q

    def dequantize(self, r0: int = 0, r1: int | None = None,
                   dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Rows [r0, r1) as float32 values scale * q (then cast to dtype): the reference."""
        r1 = self.n if r1 is None else r1
        w = self.qweight[r0:r1].float() * self.scales[r0:r1].unsqueeze(1)
        return w.to(dtype)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x W^T (+ bias) for x [..., k], in x's dtype."""
        x2 = x.reshape(-1, self.k)
        if _use_triton(x2):
            from nvllm.kernels import triton_quant

            out = triton_quant.fp8_matmul(x2, self.qweight, self.scales)
        else:
            out = self.matmul_tiles(x2)
        if bias is not None:
            out = out + bias
        return out.view(*x.shape[:-1], self.n)

    def matmul_tiles(self, x2: torch.Tensor) -> torch.Tensor:
        """The reference: TILE_ROWS rows of W at a time dequantized into x's dtype and
        torch.mm'd."""
        out = torch.empty(x2.shape[0], self.n, dtype=x2.dtype, device=x2.device)
        for r0 in range(0, self.n, TILE_ROWS):
            r1 = min(self.n, r0 + TILE_ROWS)
            torch.mm(x2, self.dequantize(r0, r1, x2.dtype).t(), out=out[:, r0:r1])
        return out

    def load(self, src, dim: int, start: int, end: int, dst_off: int,
             row_chunk: int) -> None:
        """A shard of a 2-D checkpoint tensor (rows [start, end) when dim is 0, else
        columns) into this weight at dst_off along dim, row_chunk rows at a time: an fp8
        checkpoint's e4m3 values and scales as stored (nvllm/worker/fp8_checkpoint.py),
        else quantized (a column shard reads its rows whole for their absmax)."""
        shape = list(src.get_shape() if hasattr(src, "get_shape") else src.shape)
        if len(shape) != 2:
            raise ValueError(f"an fp8 layer loads 2-D tensors, not {shape}")
        n, k = shape
        if (k != self.k) if dim == 0 else (n != self.n or end - start > self.k):
            raise ValueError(f"a [{n}, {k}] tensor does not fit a [{self.n}, {self.k}] fp8 "
                             "weight")
        r_start, r_end = (start, end) if dim == 0 else (0, n)
        own = getattr(src, "fp8_rows", None)  # an fp8 checkpoint: its bytes as they are
        cols = (0, k) if dim == 0 else (start, end)
        for a in range(r_start, r_end, row_chunk):
            b = min(r_end, a + row_chunk)
            at = (dst_off + a - r_start, 0) if dim == 0 else (a, dst_off)
            if own is not None:
                q, s = own((a, b), cols)
                self.write(*at, q.to(self.qweight.device), s.to(self.scales.device))
                continue
            rows = torch.as_tensor(src[a:b, 0:k]).float()
            part = rows if dim == 0 else rows[:, start:end]
            q, s = quantize_fp8(part, rows.abs().amax(1))
            self.write(*at, q.to(self.qweight.device), s.to(self.scales.device))


_FP8_ARCH: dict[int, bool] = {}


def _use_triton(x: torch.Tensor) -> bool:
    """The Triton kernel for a CUDA x on an sm_89+ device with Triton installed (asked
    once per device)."""
    if not triton_usable(x):
        return False
    index = x.device.index if x.device.index is not None else torch.cuda.current_device()
    if index not in _FP8_ARCH:
        from nvllm.kernels import triton_quant

        _FP8_ARCH[index] = triton_quant.fp8_supported(torch.device("cuda", index))
    return _FP8_ARCH[index]
