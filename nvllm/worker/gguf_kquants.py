"""GGUF's K-quants (256-value super-blocks) repacked into the engine's groups of 32.

Decoding follows ggml's formulas (``gguf.quants``' Q2_K ... Q6_K): each super-block has an
fp16 ``d`` (and ``dmin``) and per-sub-block integer scales (and mins).

- Q4_K / Q5_K: 8 sub-blocks of 32, value = (d * sc) * q - (dmin * m), q 0..15 / 0..31.
  One sub-block is one engine group: scale = fp16(d * sc), min = fp16(-dmin * m), the
  same integers (``int4+min`` / ``int8+min``). d * sc (up to 17 significant bits) and
  dmin * m round to fp16: each value moves by at most 2^-11 of |d sc q| + |dmin m|.
- Q6_K / Q3_K: 16 sub-blocks of 16, value = (d * sc) * q, q in [-32, 31] / [-4, 3], sc a
  signed 8- / 6-bit integer. A group of 32 holds two sub-blocks with their own scales,
  which one int8 scale can hold exactly only when their ratio is small: the group's scale
  is S = fp16(d * sc_dom / k) for the sub-block with the larger |sc| (k = 4 / 32: its
  values are then k * q, exactly), and the other sub-block's values are rounded to
  the nearest multiple of S (error <= |S| / 2; |S| at a clamp to 127, when the two
  scales have opposite signs and equal size).
- Q2_K: 16 sub-blocks of 16, value = (d * sc) * q - (dmin * m), q 0..3: each group of
  32 is re-quantized asymmetrically to ``int8+min`` over its range (S = fp16(range /
  255), min = fp16(lowest + 128 S); error about S / 2).

The measured errors against ``gguf.quants.dequantize`` are in docs/quantization.md
(tests/worker/test_kquants.py holds them to those bounds). A chunk whose scales do not
fit fp16 (|d * sc| past 65504) is not repacked: the caller re-quantizes its float values.
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import Q4_K as GGUF_Q4_K

from nvllm.worker.layers.quant import GROUP, QuantFormat, pack_int4

Q = GGMLQuantizationType
QK = 256
KQUANT_TYPES = (Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K)
# Q6_K / Q3_K: the dominant sub-block's integers are multiplied by this in int8.
_SYM_SPREAD = {Q.Q6_K: 4, Q.Q3_K: 32}


def _f16(b: np.ndarray, at: int) -> np.ndarray:
    """An fp16 field of each super-block, as float32 [n, 1]."""
    return np.ascontiguousarray(b[:, at:at + 2]).view(np.float16).astype(np.float32)


def _decode_q45k(b: np.ndarray, qtype) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q4_K / Q5_K blocks [n, bytes] -> (q [n, 8, 32] uint8, d * sc [n, 8], dmin * m
    [n, 8]) in float32 (exact: fp16 times a 6-bit integer)."""
    n = b.shape[0]
    d, dmin = _f16(b, 0), _f16(b, 2)
    sc, m = GGUF_Q4_K.get_scale_min(np.ascontiguousarray(b[:, 4:16]))
    qs = b[:, 16:144] if qtype == Q.Q4_K else b[:, 48:176]
    q = (qs.reshape(n, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)) & 0xF
    q = q.reshape(n, 8, 32)
    if qtype == Q.Q5_K:
        qh = b[:, 16:48].reshape(n, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)
        q = q | ((qh & 1) << 4)
    return q, d * sc.astype(np.float32), dmin * m.astype(np.float32)


def _decode_sym16(b: np.ndarray, qtype) -> tuple[np.ndarray, np.ndarray]:
    """Q6_K / Q3_K blocks -> (q [n, 16, 16] signed, d * sc [n, 16] float32)."""
    n = b.shape[0]
    if qtype == Q.Q6_K:
        ql, qh = b[:, :128], b[:, 128:192]
        sc = b[:, 192:208].view(np.int8).astype(np.float32)
        d = _f16(b, 208)
        lo = (ql.reshape(n, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)) & 0xF
        hi = (qh.reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)) & 3
        q = (lo.reshape(n, 8, 32) | (hi.reshape(n, 8, 32) << 4)).astype(np.int16) - 32
    else:  # Q3_K: hmask[32] qs[64] scales[12] d
        hmask, qs, s = b[:, :32], b[:, 32:96], b[:, 96:108]
        d = _f16(b, 108)
        lsc = (s[:, :8].reshape(n, 1, 8) >> np.array([0, 4], np.uint8).reshape(1, 2, 1))
        hsc = (s[:, 8:].reshape(n, 1, 4) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 4, 1))
        sc = (lsc.reshape(n, 16) & 0xF) | ((hsc.reshape(n, 16) & 3) << 4)
        sc = sc.astype(np.float32) - 32
        ql = (qs.reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)) & 3
        qh = (hmask.reshape(n, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & 1
        q = ql.reshape(n, 8, 32).astype(np.int16) - ((qh ^ 1).astype(np.int16) << 2)
    return q.reshape(n, 16, 16), d * sc


def _decode_q2k(b: np.ndarray) -> np.ndarray:
    """Q2_K blocks -> their float32 values [n, 256], as ggml computes them."""
    n = b.shape[0]
    sc, qs = b[:, :16], b[:, 16:80]
    d, dmin = _f16(b, 80), _f16(b, 82)
    dl = (d * (sc & 0xF).astype(np.float32)).reshape(n, 16, 1)
    ml = (dmin * (sc >> 4).astype(np.float32)).reshape(n, 16, 1)
    q = (qs.reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)) & 3
    return (dl * q.reshape(n, 16, 16).astype(np.float32) - ml).reshape(n, QK)


def _fp16(x: np.ndarray) -> np.ndarray | None:
    """x rounded to fp16, or None where any value does not fit."""
    with np.errstate(over="ignore"):
        h = x.astype(np.float16)
    return h if np.isfinite(h).all() else None


def repack_kquant(raw: np.ndarray, qtype, fmt: QuantFormat
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None:
    """K-quant blocks [rows, bytes] as (qweight, scales, mins) of ``fmt``, or None where
    ``fmt`` cannot hold them (no min for a type with mins; 4 bits for more) or a scale
    overflows fp16."""
    rows = raw.shape[0]
    b = np.ascontiguousarray(raw).reshape(-1, GGML_QUANT_SIZES[qtype][1])
    if qtype in (Q.Q4_K, Q.Q5_K):
        if not fmt.has_min or (fmt.bits == 4 and qtype == Q.Q5_K):
            return None
        q, scale, dmin = _decode_q45k(b, qtype)
        s, m = _fp16(scale), _fp16(-dmin)
        if s is None or m is None:
            return None
        q = q.reshape(rows, -1)
        q = pack_int4(q) if fmt.bits == 4 else q.astype(np.int8)
        if fmt.min_bits == 32:
            m = m.astype(np.float32)
        return _out(q, s.reshape(rows, -1), m.reshape(rows, -1))
    if fmt.bits != 8:
        return None
    if qtype == Q.Q2_K:
        return _asym_int8(_decode_q2k(b).reshape(rows, -1), fmt) if fmt.has_min else None
    q, scale = _decode_sym16(b, qtype)
    q = q.reshape(-1, 2, 16).astype(np.float32)  # [groups, 2 sub-blocks, 16]
    scale = scale.reshape(-1, 2)
    dom = np.take_along_axis(scale, np.abs(scale).argmax(-1)[:, None], -1)  # [groups, 1]
    s = _fp16(dom / _SYM_SPREAD[qtype])
    if s is None:
        return None
    sf = s.astype(np.float32)
    v = scale[..., None] * q  # ggml's float32 values
    with np.errstate(divide="ignore", invalid="ignore"):
        q8 = np.where(sf[..., None] == 0, 0, np.rint(v / sf[..., None]))
    q8 = np.clip(q8, -128, 127).astype(np.int8).reshape(rows, -1)
    mins = np.zeros((rows, q8.shape[1] // GROUP),
                    np.float32 if fmt.min_bits == 32 else np.float16) if fmt.has_min else None
    return _out(q8, s.reshape(rows, -1), mins)


def _asym_int8(v: np.ndarray, fmt: QuantFormat):
    """Float32 values [rows, k] re-quantized per group of 32 to int8+min over each group's
    range."""
    rows = v.shape[0]
    g = v.reshape(rows, -1, GROUP)
    lo, hi = g.min(-1), g.max(-1)
    s = _fp16((hi - lo) / 255)
    if s is None:
        return None
    flat = s == 0  # one value (or a range under fp16's least step): q = 0, min = it
    s = np.where(flat, np.float16(1), s)
    m = _fp16(np.where(flat, lo, lo + 128 * s.astype(np.float32)))
    if m is None:
        return None
    q = np.rint((g - m.astype(np.float32)[..., None]) / s.astype(np.float32)[..., None])
    q = np.clip(q, -128, 127).astype(np.int8).reshape(rows, -1)
    return _out(q, s, m.astype(np.float32) if fmt.min_bits == 32 else m)


def _out(q: np.ndarray, s: np.ndarray, m: np.ndarray | None):
    return (torch.from_numpy(np.ascontiguousarray(q)), torch.from_numpy(np.ascontiguousarray(s)),
            None if m is None else torch.from_numpy(np.ascontiguousarray(m)))
