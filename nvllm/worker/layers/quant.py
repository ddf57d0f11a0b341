"""Weight-only quantized storage for linear layers, embeddings and the LM head.

A quantized weight [N, K] is held in groups of ``GROUP`` = 32 consecutive values of a row
(GGUF's block size), each group with an fp16 ``scale`` and, in the ``+min`` formats, an
fp16 ``min`` (float32 in ``int4+min32``, AWQ / GPTQ checkpoints' zero points):

- ``int8``: ``qweight`` int8 [N, K]; value = scale * q (+ min).
- ``int4``: ``qweight`` uint8 [N, K / 2] in GGUF's nibble order (byte j of a group holds
  value j in its low nibble and value j + 16 in its high one); value = scale * (q - 8), or
  with a min, scale * q + min.

These are GGUF's Q8_0 (int8), Q4_0 (int4), Q4_1 (int4+min) exactly, block for block and
byte for byte, and Q5_0 / Q5_1 exactly as int8 (q - 16, and q with a min), at 34 bytes a
group instead of their 22 / 24. Nothing is lost by the repack: each stored value
dequantizes to the float32 that ``gguf.quants.dequantize`` gives. AWQ / GPTQ's
scale * (q - z) is ``int4+min32`` exactly (nvllm/worker/awq_gptq.py); GGUF's K-quants
repack with fp16-rounded scales (nvllm/worker/gguf_kquants.py).

``QuantizedWeight.matmul`` is x W^T: on CUDA the Triton W4A16 / W8A16 GEMM
(``nvllm/kernels/triton_quant.py``, reading these layouts as stored); on CPU, up to
``act_rows`` rows (decode, the default on AVX2 CPUs), x rounded to int16 per group of 32
and integer dot products (``csrc/cpu_quant_a16.cpp``; results move by x's rounding, at
most half of 1/32767 of the group's largest value per value); opt-in, x quantized to
int8 instead (``csrc/cpu_quant_vnni.cpp``, AVX-512 VNNI or AVX2: llama.cpp's Q8
activations); on CPUs with Intel AMX, from ``amx_min_rows`` rows (prompt steps and
batched decode), x split into two bfloat16s and AMX tiles (``csrc/cpu_quant_amx.cpp``;
16 of x's significant bits, at most 2^-17 of each value off); NVLLM_QUANT_ACTIVATIONS
chooses; else nvllm's native op
(``csrc/cpu_quant_linear.cpp``, integers in registers, float32 accumulation) for up to
``native_max_rows`` rows, else a tile of W's rows dequantized into x's dtype (one native
pass, or the torch reference ``dequantize`` without the native ops) and ``torch.mm``.
``quantize`` is round-to-nearest per group (asymmetric, over the group's range, in the
``+min`` formats), for float checkpoints quantized at load.

Measured (``scripts/bench_quant_linear.py --threads 1``, SmolLM2-135M's shapes, this
2-core AMD EPYC with AVX-512, microseconds, minimum of 5): at one row the native op reads
the 49152 x 576 LM head in 2.0 ms (int8 or int4+min) against 10.2 ms dense float32 and
6.6 ms dense bfloat16, and 3072 x 576 in 0.11-0.13 ms (dense 0.15). Its cost grows about
linearly with the rows (a dot-product kernel: ~2x a float32 GEMM's per-row cost), so the
tile path wins from ~8 rows with bfloat16 activations (bfloat16 GEMM: 3072 x 576 at 16
rows 0.62 ms against 1.08) and from ~16-32 with float32 (0.95 vs 1.04 ms at 16 rows, 1.94
vs 1.77 at 32): hence ``NATIVE_MAX_ROWS`` per dtype. The AVX2 build multiplies 5 rows and
more against a buffer of dequantized columns (register-blocked), 128 rows per pass over
W, which on a 2-core AMD EPYC beats the tiles up to 256 rows (a layer's four linears at
128 rows 0.82x the tiles' time, 256 rows 0.97x, 512 rows 1.07x) and holds no tile of
dequantized weights (~20 MiB a prompt step): ``BUFFERED_MAX_ROWS``.

The int8-activation op against the native one (``--decode --threads 1``, same
machine, heavily shared, minimum of 5; SmolLM2's shapes, float32 x): at one row int4+min
1.4-2.1x faster (3072 x 576: 79 against 150 us; the per-layer linears 211 against 393
us), int4 1.9-3.8x, int8 1.2-1.5x; at 8 rows int4+min 1.8-2.7x, int4 1.3-1.8x, int8
1.0-1.4x; at 4 rows int4 0.94-1.6x and int8 0.8-1.0x (the native op's 4-row pass is its
best). Hence ``A8_MAX_ROWS``: 8 rows for int4 formats, 2 for int8 (scripts/
bench_quant_linear.py --decode prints the speed-ups per shape and row count).

torch's own weight-only ops do not fit GGUF's blocks exactly: ``_weight_int8pack_mm`` has
one scale per output channel (Q8_0 has one per 32 values), and
``_weight_int4pack_mm_for_cpu`` takes its scales and zero points in the activations'
dtype, so with bfloat16 activations fp16 scales lose 3 bits (Q4_0 / Q4_1 are exact only
with float32 activations and scales). Where they run, their bfloat16 path is the fastest
at decode (int4: 0.10 ms for 3072 x 576 at one row, 1.5 ms for the LM head, ~20% under
ours), but their float32 path is 20-300x slower than everything else (3072 x 576 at one
row: int4 3.1 ms, int8 1.5 ms), so neither is used.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import torch

GROUP = 32
# Up to this many rows of x (by its dtype), the native op; beyond, dequantized tiles and
# torch.mm (the crossovers measured above). The AVX2 build's buffered kernel for many rows
# beats the tiles up to BUFFERED_MAX_ROWS in both dtypes (native_max_rows).
NATIVE_MAX_ROWS = {torch.float32: 16, torch.bfloat16: 6}
BUFFERED_MAX_ROWS = 256
# Up to this many rows of x (by the weight's bits), the int8-activation op
# (csrc/cpu_quant_vnni.cpp) where it is built with AVX-512 VNNI or AVX2: see act_rows.
A8_MAX_ROWS = {4: 8, 8: 2}
# From this many rows of x, the AMX op (csrc/cpu_quant_amx.cpp) under "auto" where it is
# usable. Measured (scripts/bench_quant_linear.py --step, SmolLM2-135M's shapes, 2 threads,
# 2-core Xeon with AMX): 2-3x the native float op at 16 rows and the dequantized tiles at
# 128, 1.5-2x the tiles at 2,048; at 8 rows even with the native op, at 1-4 rows 1.5-3x
# slower (each 16 x 32 tile step costs the same for 1 row of x as for 16).
AMX_MIN_ROWS = 8
# Up to this many rows, the int16-activation op (csrc/cpu_quant_a16.cpp) where it is
# built with its AVX2 loop: see act_rows. Measured (all of SmolLM2-135M's decode linears
# read from memory, 2 threads, AVX2 EPYC): 1.2-1.4x the float op at one row, 1.1x at two,
# even at four, slower from five (the float op's buffered kernel).
A16_MAX_ROWS = {4: 2, 8: 2}
# NVLLM_QUANT_ACTIVATIONS, how x meets quantized weights on CPU:
#   "auto" (the default): x rounded to int16 per group of 32 up to A16_MAX_ROWS rows
#     where that op's AVX2 loop is built (256x finer than int8, ~100x finer than
#     bfloat16: greedy output on the real model within the near-tie rule); on CPUs with
#     AMX, from AMX_MIN_ROWS rows, x split into two bfloat16s (16 significant bits, at
#     most 2^-17 of each value off; bfloat16 x exact) and AMX tiles; else float;
#   "off": activations stay in the run dtype everywhere, results equal dequantize-then-
#     matmul up to float32 summation order (what the greedy-equality tests rely on);
#   "int8": llama.cpp's int8 activations up to A8_MAX_ROWS rows where vectorized. Opt-in:
#     on the real model it changes greedy output beyond the near-tie rule
#     (docs/quantization.md, CPU kernels);
#   "int8-always", "int16-always", "bf16x2-always" (AMX only): every row count, for
#     measuring their quality teacher-forced (the first two slow on long prompts).
ACT_ENV = "NVLLM_QUANT_ACTIVATIONS"
ACT_MODES = ("auto", "off", "int8", "int8-always", "int16-always", "bf16x2-always")
# act_rows under the *-always modes: no row count is above it
EVERY_ROW = 1 << 62
# Rows of W dequantized at once on the tile path (a 4096 x 576 float32 tile is 9 MiB).
TILE_ROWS = 4096


@dataclass(frozen=True, slots=True)
class QuantFormat:
    """bits: 8 or 4; has_min: value = scale * q + min (else symmetric); min_bits: 16 (fp16
    mins, GGUF's) or 32 (float32: an AWQ / GPTQ zero point's -z * scale, which fp16
    rounds)."""

    bits: int
    has_min: bool
    min_bits: int = 16

    @property
    def name(self) -> str:
        mins = ("+min32" if self.min_bits == 32 else "+min") if self.has_min else ""
        return f"int{self.bits}{mins}"

    @property
    def min_dtype(self) -> torch.dtype:
        return torch.float32 if self.min_bits == 32 else torch.float16

    def packed_cols(self, k: int) -> int:
        return k if self.bits == 8 else k // 2


INT8 = QuantFormat(8, False)
INT8_MIN = QuantFormat(8, True)
INT4 = QuantFormat(4, False)
INT4_MIN = QuantFormat(4, True)
# AWQ / GPTQ: scale * (q - z) = scale * q + (-z * scale), exact with a float32 min.
INT4_MIN32 = QuantFormat(4, True, 32)


class QuantizedWeight:
    """One layer's quantized [n, k] weight: qweight, scales [n, k / 32] and mins (or None),
    the tensors the module registers (so ``.to`` and state_dict see them)."""

    __slots__ = ("fmt", "n", "k", "qweight", "scales", "mins")

    def __init__(self, fmt: QuantFormat, n: int, k: int, device=None) -> None:
        if k % GROUP:
            raise ValueError(f"cannot quantize a weight of {k} columns in groups of {GROUP}")
        self.fmt, self.n, self.k = fmt, n, k
        dtype = torch.int8 if fmt.bits == 8 else torch.uint8
        self.qweight = torch.zeros(n, fmt.packed_cols(k), dtype=dtype, device=device)
        self.scales = torch.zeros(n, k // GROUP, dtype=torch.float16, device=device)
        self.mins = (torch.zeros(n, k // GROUP, dtype=fmt.min_dtype, device=device)
                     if fmt.has_min else None)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size()
                   for t in (self.qweight, self.scales, self.mins) if t is not None)

    def write(self, row: int, col: int, q: torch.Tensor, scales: torch.Tensor,
              mins: torch.Tensor | None) -> None:
        """Store a block given in this format at rows [row, + its rows) and columns
        [col, + its groups * 32) (col a multiple of 32); a +min format without mins gets
        mins of 0."""
        if col % GROUP:
            raise ValueError(f"column offset {col} is not on a group of {GROUP}")
        rows = slice(row, row + q.shape[0])
        groups = slice(col // GROUP, col // GROUP + scales.shape[1])
        self.scales[rows, groups] = scales
        if self.mins is not None:
            self.mins[rows, groups] = mins if mins is not None else 0
        c0 = self.fmt.packed_cols(col)
        self.qweight[rows, c0:c0 + q.shape[1]] = q

    def dequantize(self, r0: int = 0, r1: int | None = None,
                   dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Rows [r0, r1) as float32 values (then cast to dtype): the reference."""
        r1 = self.n if r1 is None else r1
        return dequantize(self.fmt, self.qweight[r0:r1], self.scales[r0:r1],
                          None if self.mins is None else self.mins[r0:r1], dtype)

    def embedding(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows ``ids`` (any shape) dequantized, as F.embedding of the dequantized weight."""
        flat = ids.reshape(-1)
        rows = dequantize(self.fmt, self.qweight[flat], self.scales[flat],
                          None if self.mins is None else self.mins[flat], dtype)
        return rows.view(*ids.shape, self.k)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x W^T (+ bias) for x [..., k], in x's dtype."""
        x2 = x.reshape(-1, self.k)
        native = x2.device.type == "cpu" and x2.dtype in NATIVE_MAX_ROWS and _native()
        if triton_usable(x2):
            from nvllm.kernels import triton_quant

            out = triton_quant.quant_matmul(x2, self.qweight, self.scales, self.mins,
                                            self.fmt.bits)
        elif native and x2.shape[0] <= act_rows("a8", self.fmt):
            from nvllm.kernels import cpu_ops

            out = cpu_ops.quant_linear_a8(x2, self.qweight, self.scales, self.mins,
                                          self.fmt.bits)
        elif native and x2.shape[0] <= act_rows("a16", self.fmt):
            from nvllm.kernels import cpu_ops

            out = cpu_ops.quant_linear_a16(x2, self.qweight, self.scales, self.mins,
                                           self.fmt.bits)
        elif native and 0 < amx_min_rows() <= x2.shape[0]:
            from nvllm.kernels import cpu_ops

            out = cpu_ops.quant_linear_amx(x2, self.qweight, self.scales, self.mins,
                                           self.fmt.bits)
        elif native and x2.shape[0] <= native_max_rows(x2.dtype):
            from nvllm.kernels import cpu_ops

            out = cpu_ops.quant_linear(x2, self.qweight, self.scales, self.mins,
                                       self.fmt.bits)
        else:
            out = self.matmul_tiles(x2, native)
        if bias is not None:
            out = out + bias
        return out.view(*x.shape[:-1], self.n)

    def matmul_tiles(self, x2: torch.Tensor, native: bool = False) -> torch.Tensor:
        """Dequantize TILE_ROWS rows of W at a time into x's dtype (the native op's one
        pass, or the torch reference) and torch.mm them."""
        out = torch.empty(x2.shape[0], self.n, dtype=x2.dtype, device=x2.device)
        for r0 in range(0, self.n, TILE_ROWS):
            r1 = min(self.n, r0 + TILE_ROWS)
            if native:
                from nvllm.kernels import cpu_ops

                w = cpu_ops.quant_dequantize(self.qweight[r0:r1], self.scales[r0:r1],
                                             None if self.mins is None else self.mins[r0:r1],
                                             self.fmt.bits, x2.dtype)
            else:
                w = self.dequantize(r0, r1, x2.dtype)
            torch.mm(x2, w.t(), out=out[:, r0:r1])
        return out


_NATIVE: list[bool] = []
_TRITON: list[bool] = []
_BUFFERED: list[bool] = []
_ACT: list[str] = []  # the mode in effect, once asked (see act_mode)
_OPS: dict[str, bool] = {}  # which activation ops this build vectorizes (see _has_op)


def _has_op(op: str) -> bool:
    """Whether the native ops are loaded with op's fast loop: "a16" its AVX2 loop, "a8"
    its VNNI / AVX2 one, "amx" the AMX op at all; asked once."""
    if op not in _OPS:
        from nvllm.kernels import cpu_ops

        ask = {"a16": "quant_a16_vectorized", "a8": "quant_a8_vectorized",
               "amx": "quant_amx_usable"}[op]
        _OPS[op] = _native() and getattr(cpu_ops, ask)()
    return _OPS[op]


def act_mode() -> str:
    """NVLLM_QUANT_ACTIVATIONS (ACT_MODES; read once per process), with "auto" and
    "int8" turned "off" where none of their ops has a fast loop in this build (the
    portable loops are slower than the float op)."""
    if not _ACT:
        mode = os.environ.get(ACT_ENV, "auto")
        if mode not in ACT_MODES:
            raise ValueError(f"{ACT_ENV}={mode!r}; expected one of {', '.join(ACT_MODES)}")
        if mode == "auto" and not (_has_op("a16") or _has_op("amx")):
            mode = "off"
        elif mode == "int8" and not _has_op("a8"):
            mode = "off"
        elif mode == "bf16x2-always" and not _has_op("amx"):
            raise ValueError(f"{ACT_ENV}=bf16x2-always needs the AMX op, which this CPU or "
                             "build lacks (nvllm.kernels.cpu_ops.quant_amx_usable())")
        _ACT.append(mode)
    return _ACT[0]


# Per mode: the quantized-activation op it takes and up to how many rows by the weight's
# bits (None: every row count); "off" takes none.
_MODE_OPS = {"auto": ("a16", A16_MAX_ROWS), "int8": ("a8", A8_MAX_ROWS),
             "int8-always": ("a8", None), "int16-always": ("a16", None)}


def act_rows(op: str, fmt: QuantFormat) -> int:
    """Rows of x up to which ``matmul`` takes the int8 ("a8": the VNNI / AVX2 op) or the
    int16 ("a16") activation op for a weight in ``fmt`` (0: never), under the mode in
    effect (act_mode): A8_MAX_ROWS under ``int8`` and A16_MAX_ROWS under ``auto`` (where
    each was measured faster than the float op, docs/quantization.md), any row count
    under ``int8-always`` / ``int16-always``."""
    mode = act_mode()
    taken = _MODE_OPS.get(mode)
    if taken is None or taken[0] != op or (mode == "auto" and not _has_op("a16")):
        return 0
    return EVERY_ROW if taken[1] is None else taken[1].get(fmt.bits, 0)


def amx_min_rows() -> int:
    """Rows of x from which ``matmul`` takes the AMX op (0: never): AMX_MIN_ROWS under
    ``auto`` where it is usable, 1 under ``bf16x2-always``."""
    mode = act_mode()
    if mode == "bf16x2-always":
        return 1
    return AMX_MIN_ROWS if mode == "auto" and _has_op("amx") else 0


def describe_cpu_routes() -> str:
    """Which op ``matmul`` takes by row count on this CPU and build, under the mode in
    effect (float32 x): what a worker logs once at load."""
    mode = act_mode()
    if not _native():
        return f"{ACT_ENV}={mode}: dequantized tiles and torch.mm (no native CPU ops)"
    fmt = INT4_MIN
    parts = []
    if a8 := act_rows("a8", fmt):
        parts.append("x in int8 " + ("at every row count" if a8 == EVERY_ROW
                                      else f"up to {a8} rows (int4; int8: {act_rows('a8', INT8)})"))
    if a16 := act_rows("a16", fmt):
        parts.append("x in int16 " + ("at every row count" if a16 == EVERY_ROW
                                       else f"up to {a16} rows"))
    amx = amx_min_rows()
    if amx:
        parts.append("AMX (x as two bfloat16s) " + ("at every row count" if amx == 1
                                                    else f"from {amx} rows"))
    if amx != 1:
        rest = (f"the float op up to {native_max_rows(torch.float32)} rows, dequantized "
                "tiles beyond")
        parts.append(f"else {rest}" if parts else rest)
    return f"{ACT_ENV}={mode}: " + "; ".join(parts)


def native_max_rows(dtype: torch.dtype) -> int:
    """Rows of x up to which ``matmul`` takes the native op (float32 / bfloat16 x on CPU):
    BUFFERED_MAX_ROWS where the op was built with its buffered kernel (AVX2: measured
    1.5-4x faster than the tiles at 32 and 64 rows on SmolLM2's shapes, both dtypes,
    1.2x at 128, even at 256),
    else NATIVE_MAX_ROWS by dtype."""
    if not _BUFFERED:
        from nvllm.kernels import cpu_ops

        _BUFFERED.append(_native() and cpu_ops.quant_linear_buffered())
    return BUFFERED_MAX_ROWS if _BUFFERED[0] else NATIVE_MAX_ROWS[dtype]


def triton_usable(x: torch.Tensor) -> bool:
    """Whether x (a CUDA tensor of a dtype the Triton kernels take) goes through
    ``nvllm/kernels/triton_quant.py``: Triton installed, asked once; elsewhere the
    reference path."""
    if x.device.type != "cuda" or x.dtype not in (torch.float32, torch.bfloat16,
                                                  torch.float16):
        return False
    if not _TRITON:
        try:
            import nvllm.kernels.triton_quant  # noqa: F401
        except ImportError:
            _TRITON.append(False)
        else:
            _TRITON.append(True)
    return _TRITON[0]


def _native() -> bool:
    """Whether the native op is usable (nvllm's CPU ops built and loaded), asked once."""
    if not _NATIVE:
        from nvllm.kernels import cpu_ops

        _NATIVE.append(cpu_ops.load() and hasattr(torch.ops.nvllm_cpu, "quant_linear"))
    return _NATIVE[0]


def dequantize(fmt: QuantFormat, qweight: torch.Tensor, scales: torch.Tensor,
               mins: torch.Tensor | None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Rows of a quantized weight as their float32 values (scale * q + min, computed in
    float32: the products are exact), cast to dtype."""
    n, groups = scales.shape
    q = unpack_int(qweight, fmt).float()
    if not fmt.has_min and fmt.bits == 4:
        q = q - 8
    w = q.view(n, groups, GROUP) * scales.float().unsqueeze(-1)
    if mins is not None:
        w = w + mins.float().unsqueeze(-1)
    return w.view(n, groups * GROUP).to(dtype)


def unpack_int(qweight: torch.Tensor, fmt: QuantFormat) -> torch.Tensor:
    """The stored integers [n, k] (int8 as stored; int4 as its nibbles 0..15, uint8)."""
    if fmt.bits == 8:
        return qweight
    n, cols = qweight.shape
    b = qweight.view(n, cols // (GROUP // 2), GROUP // 2)
    return torch.cat([b & 0xF, b >> 4], dim=-1).view(n, cols * 2)


def pack_int4(q: np.ndarray) -> np.ndarray:
    """Nibbles 0..15 [n, k] (uint8) into GGUF's order, [n, k / 2]."""
    g = q.reshape(q.shape[0], -1, GROUP)
    return (g[..., :GROUP // 2] | (g[..., GROUP // 2:] << 4)).reshape(q.shape[0], -1)


def quantize(w: torch.Tensor, fmt: QuantFormat
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Round-to-nearest per group of 32 into ``fmt``: (qweight, scales, mins or None).

    Symmetric formats: scale = absmax / 127 (int8) or / 7 (int4), rounded to fp16 before
    dividing so the stored scale is the one the integers were rounded against. ``+min``
    formats: asymmetric over the group's range, as GGUF's Q4_1 / Q5_1 quantize (see
    ``quantize_min``); every value within half a step of its group's stored scale."""
    if fmt.has_min:
        return quantize_min(w, fmt)
    n, k = w.shape
    g = w.float().reshape(n, k // GROUP, GROUP)
    qmax = 127 if fmt.bits == 8 else 7
    s = (g.abs().amax(-1) / qmax).to(torch.float16)
    s = torch.where(s == 0, torch.ones_like(s), s)  # an all-zero group: q = 0, any scale
    q = torch.round(g / s.float().unsqueeze(-1)).clamp(-qmax - (fmt.bits == 4), qmax)
    q = q.reshape(n, k)
    if fmt.bits == 8:
        return q.to(torch.int8), s, None
    packed = pack_int4((q + 8).to(torch.uint8).numpy())
    return torch.from_numpy(packed), s, None


def _fp16_up(x: torch.Tensor) -> torch.Tensor:
    """The least fp16 >= x (x >= 0, float32), as float32."""
    h = x.to(torch.float16)
    h = torch.where(h.float() < x, torch.nextafter(h, torch.full_like(h, 65504)), h)
    return h.float()


def _fp16_down(x: torch.Tensor) -> torch.Tensor:
    """The greatest fp16 <= x (float32), as float32."""
    h = x.to(torch.float16)
    h = torch.where(h.float() > x, torch.nextafter(h, torch.full_like(h, -65504)), h)
    return h.float()


def quantize_min(w: torch.Tensor, fmt: QuantFormat
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric round-to-nearest per group of 32 (a ``+min`` format), llama.cpp's Q4_1
    rule widened to int8: the group's [lo, hi] in 2^bits - 1 steps, scale = (hi - lo) /
    15 or / 255, value = scale * q + min.

    Why asymmetric: a group's values rarely straddle zero evenly, and a symmetric grid
    spends the levels on the far side of zero on nothing (up to half of them); at the same
    bits this grid's step is (hi - lo) / 255 against absmax / 127.

    Rounding the scale and min to fp16 must not push a value off the grid's ends (it
    would clamp, with an error past half a step): the min is rounded down and the scale
    up until the grid covers [lo, hi], so every value is within half a step of its
    stored scale (plus float32 rounding), and no value clamps. int8 stores q - 128 (value
    = scale * q8 + min, min = the grid's start + 128 scale, rounded down likewise)."""
    n, k = w.shape
    g = w.float().reshape(n, k // GROUP, GROUP)
    lo, hi = g.amin(-1), g.amax(-1)
    levels = (1 << fmt.bits) - 1
    floor = torch.tensor(2.0 ** -24)  # fp16's least step: an all-equal group gets q = 0
    if fmt.bits == 4:
        m = _fp16_down(lo)
        s = torch.maximum(_fp16_up((hi - m) / levels), floor)
        q = torch.round((g - m.unsqueeze(-1)) / s.unsqueeze(-1)).clamp(0, levels)
        packed = pack_int4(q.reshape(n, k).to(torch.uint8).numpy())
        return torch.from_numpy(packed), s.half(), m.to(fmt.min_dtype)
    s = torch.maximum(_fp16_up((hi - lo) / levels), floor)
    m = _fp16_down(lo + 128 * s)  # the value of q8 = 0
    # m <= lo + 128 s covers lo; widen s where rounding m down left hi past q8 = 127
    s = torch.maximum(s, _fp16_up((hi - m) / 127))
    q = torch.round((g - m.unsqueeze(-1)) / s.unsqueeze(-1)).clamp(-128, 127)
    return q.reshape(n, k).to(torch.int8), s.half(), m.to(fmt.min_dtype)
