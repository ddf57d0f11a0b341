#!/usr/bin/env python
"""GPU check of the Triton quantized GEMMs (nvllm/kernels/triton_quant.py), run by
device_check.sh.

At Llama-3.1-8B's MLP shapes (gate/up 28672 x 4096, down 4096 x 14336), bfloat16
activations, for int8, int4, int4+min (fp16 and float32 mins) and (sm_89+) fp8 weights: the
max error of the kernel against a float32 matmul of the dequantized weights (exit 1 past
the tolerance), then median times at M = 1, 16, 256 rows next to dense bfloat16
``torch.mm`` of the same (dequantized) weights and the reference path (dequantize into
tiles, then torch.mm), with the weight bytes per second at one row. Timings are printed,
never asserted. Under a minute.

    python scripts/quant_check.py [--rows 1 16 256]
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("TRITON_INTERPRET", "0")

import torch  # noqa: E402
from bench_kernels import bench  # noqa: E402  (scripts/ is on sys.path when run)

SHAPES = {"gate_up": (28672, 4096), "down": (4096, 14336)}
TOL = 1e-2  # relative to the reference's max magnitude (bfloat16 output rounding and sums)


def make(fmt_name: str, n: int, k: int):
    """(weight object, its dequantized bfloat16 values) for one format, on the GPU."""
    from nvllm.worker.layers.fp8 import Fp8Weight, quantize_fp8
    from nvllm.worker.layers.quant import INT4, INT4_MIN, INT8, QuantizedWeight, quantize

    g = torch.Generator().manual_seed(n + k)
    w = torch.randn(n, k, generator=g) * k ** -0.5
    if fmt_name == "fp8":
        qw = Fp8Weight(n, k)
        qw.write(0, 0, *quantize_fp8(w))
        qw.qweight, qw.scales = qw.qweight.cuda(), qw.scales.cuda()
    else:
        fmt = {"int8": INT8, "int4": INT4, "int4+min": INT4_MIN,
               "int4+min32": INT4_MIN}[fmt_name]
        qw = QuantizedWeight(fmt, n, k)
        qw.write(0, 0, *quantize(w, fmt))
        if qw.mins is not None:  # float32 mins for int4+min32 (AWQ / GPTQ's)
            mins = torch.randn(qw.mins.shape, generator=g) * 1e-3
            qw.mins = mins if fmt_name.endswith("32") else mins.half()
        qw.qweight, qw.scales = qw.qweight.cuda(), qw.scales.cuda()
        qw.mins = None if qw.mins is None else qw.mins.cuda()
    return qw, qw.dequantize(dtype=torch.bfloat16)


def check(shape: str, fmt: str, n: int, k: int, rows: list[int]) -> bool:
    """Error and times of one format at one shape, printed; False past the tolerance."""
    qw, dense = make(fmt, n, k)
    ok = True
    for m in rows:
        x = torch.randn(m, k, device="cuda").bfloat16()
        out = qw.matmul(x)
        ref = x.float() @ dense.float().t()
        scale = ref.abs().max().clamp(min=1.0).item()
        err = (out.float() - ref).abs().max().item()
        good = err <= TOL * scale
        ok &= good
        tri = bench(lambda x=x: qw.matmul(x))
        mm = bench(lambda x=x: x @ dense.t())
        tiles = bench(lambda x=x: qw.matmul_tiles(x))
        print(f"{shape:7} {fmt:8} M={m:4} N={n} K={k}: err {err:.3g} (tol "
              f"{TOL * scale:.3g}) {'ok' if good else 'FAIL'}; triton {tri * 1e6:.0f} us "
              f"({qw.nbytes() / tri / 1e9:.0f} GB/s of weights), dense bf16 mm "
              f"{mm * 1e6:.0f} us ({mm / tri:.2f}x), reference path {tiles * 1e6:.0f} us "
              f"({tiles / tri:.2f}x)")
    return ok


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 16, 256])
    a = p.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device", file=sys.stderr)
        return 2
    from nvllm.kernels.triton_quant import fp8_supported
    from nvllm.worker.layers.quant import triton_usable

    torch.backends.cuda.matmul.allow_tf32 = False
    if not triton_usable(torch.zeros(1, device="cuda", dtype=torch.bfloat16)):
        print("triton not importable: QuantizedWeight.matmul would take the reference path",
              file=sys.stderr)
        return 1
    formats = ["int8", "int4", "int4+min", "int4+min32"]
    if fp8_supported(torch.device("cuda")):
        formats.append("fp8")
    ok = True
    for shape, (n, k) in SHAPES.items():
        for fmt in formats:
            ok &= check(shape, fmt, n, k, a.rows)
            torch.cuda.empty_cache()
    print("quant check:", "PASSED" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
