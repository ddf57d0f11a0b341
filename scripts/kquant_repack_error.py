"""How far GGUF K-quants move when held in the engine's groups of 32
(nvllm/worker/gguf_kquants.py), against ``gguf.quants.dequantize``: random valid blocks
(random integers and sub-scales, finite fp16 d / dmin of about 1e-3), or a real file's
K-quant tensors with ``--gguf``. Prints per type and format: the largest error, the
largest error over the tensor's largest |value|, the mean error over the mean |value|,
and the largest error over the type's own step (|d * sc|, the sub-block's scale).

    python scripts/kquant_repack_error.py [--rows 512] [--cols 4096] [--gguf FILE]
"""

from __future__ import annotations

import argparse

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize

from nvllm.worker.gguf_kquants import KQUANT_TYPES, repack_kquant
from nvllm.worker.layers.quant import INT4_MIN, INT8, INT8_MIN, QuantizedWeight

Q = GGMLQuantizationType
OWN = {Q.Q4_K: INT4_MIN, Q.Q5_K: INT8_MIN, Q.Q6_K: INT8, Q.Q3_K: INT8, Q.Q2_K: INT8_MIN}
F16_FIELDS = {Q.Q2_K: [80, 82], Q.Q3_K: [108], Q.Q4_K: [0, 2], Q.Q5_K: [0, 2], Q.Q6_K: [208]}


def random_blocks(qtype, rows: int, cols: int, rng) -> np.ndarray:
    n = rows * cols // 256
    b = rng.integers(0, 256, (n, GGML_QUANT_SIZES[qtype][1]), dtype=np.uint8)
    d = (np.abs(rng.standard_normal(n)) + 0.5) * 1e-3
    for i, off in enumerate(F16_FIELDS[qtype]):
        b[:, off:off + 2] = (d * (7 if i else 1)).astype(np.float16).view(np.uint8).reshape(n, 2)
    return b.reshape(rows, -1)


def report(label: str, raw: np.ndarray, qtype) -> None:
    ref = dequantize(raw, qtype)
    fmt = OWN[qtype]
    got = repack_kquant(raw, qtype, fmt)
    if got is None:
        print(f"{label:28s} {qtype.name}: a scale past fp16: re-quantized from floats")
        return
    qw = QuantizedWeight(fmt, *ref.shape)
    qw.write(0, 0, *got)
    err = np.abs(qw.dequantize().numpy() - ref)
    print(f"{label:28s} {qtype.name} -> {fmt.name:9s} max |err| {err.max():.3g}  "
          f"max/max|w| {err.max() / np.abs(ref).max():.2e}  "
          f"mean/mean|w| {err.mean() / np.abs(ref).mean():.2e}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=512)
    ap.add_argument("--cols", type=int, default=4096)
    ap.add_argument("--gguf", help="a GGUF file: its K-quant tensors instead")
    a = ap.parse_args()
    if a.gguf:
        for t in GGUFReader(a.gguf).tensors:
            qtype = Q(t.tensor_type)
            if qtype in KQUANT_TYPES and len(t.shape) == 2:
                rows = int(t.shape[1])
                report(t.name, np.asarray(t.data).view(np.uint8).reshape(rows, -1), qtype)
        return
    rng = np.random.default_rng(0)
    for qtype in KQUANT_TYPES:
        report("random valid blocks", random_blocks(qtype, a.rows, a.cols, rng), qtype)


if __name__ == "__main__":
    main()
