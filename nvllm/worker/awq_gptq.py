"""AWQ and GPTQ checkpoints (HF safetensors, 4-bit) as HF ``.weight`` sources.

Both store a linear layer's weight W [N, K] (HF's [out, in]) transposed and packed eight
4-bit values to an int32, with one fp16 scale and one 4-bit zero point per ``group_size``
consecutive input columns (rows of W^T), value = scale * (q - z):

- AWQ (AutoAWQ's GEMM layout): ``qweight`` int32 [K, N / 8] packed along the output, the
  eight columns of an int32 in the order [0, 2, 4, 6, 1, 3, 5, 7] (column j at nibble
  ``AWQ_REVERSE_ORDER[j]``); ``qzeros`` int32 [K / G, N / 8] packed the same way;
  ``scales`` [K / G, N].
- GPTQ (AutoGPTQ / GPTQ-for-LLaMa): ``qweight`` int32 [K / 8, N] packed along the input
  (row 8i + j at nibble j); ``qzeros`` int32 [K / G, N / 8] packed along the output in
  order; ``scales`` [K / G, N]; ``g_idx`` [K] (each input row's group). The original
  ("gptq", v1) checkpoint format stores z - 1 (z = nibble + 1, 1..16); ``gptq_v2`` stores z.

``packed_int4_tensors`` groups a module's tensors into one ``PackedInt4Slice`` named
``<module>.weight`` that reads like safetensors' ``get_slice`` of W (float32 values of any
[rows, cols] range, read from only the int32 words covering it), so a dense parameter
(``quantization=none``, a GPU, a layer left dense) loads it as any float tensor; a
quantized layer (nvllm/worker/quantize.py) calls ``repack`` for its shard instead:
``int4+min32`` (the same nibbles in GGUF's order, min = -z * scale in float32: exact) or
``int8`` (q - z: exact). Group sizes are multiples of 32, so every engine group of 32
lies inside one checkpoint group and takes its scale: a shard may cut the input anywhere
on 32 columns, and the output anywhere.

Not read (a clear error): bits other than 4, AWQ's GEMV layout, AWQ without zero points,
GPTQ's act-order (``desc_act`` with a ``g_idx`` that is not k // group_size: the groups
are not consecutive columns), GPTQ's Marlin or other repacked checkpoint formats.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open

from nvllm.worker.layers.quant import GROUP, QuantFormat, pack_int4
from nvllm.worker.sharding import window_2d

AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)  # column j of 8 -> its nibble in the int32
PACK = 8  # 4-bit values per int32


@dataclass(frozen=True, slots=True)
class Int4CheckpointConfig:
    """method: "awq" or "gptq"; group_size: input columns per scale (-1 in the config:
    all of them, stored as 0 here); zero_offset: added to each stored zero point (1 for
    GPTQ's v1 format)."""

    method: str
    group_size: int
    zero_offset: int


def checkpoint_quant_config(model_dir: str | Path) -> Int4CheckpointConfig | None:
    """The AWQ / GPTQ config of an HF checkpoint folder (config.json's
    ``quantization_config``, else quantize_config.json), None for a float checkpoint;
    a ValueError naming the fix for one nvllm cannot read."""
    d = Path(model_dir)
    cfg = None
    if (d / "config.json").is_file():
        cfg = json.loads((d / "config.json").read_text()).get("quantization_config")
    if cfg is None and (d / "quantize_config.json").is_file():
        cfg = json.loads((d / "quantize_config.json").read_text())
        cfg.setdefault("quant_method", "gptq")
    if cfg is None:
        return None
    method = str(cfg.get("quant_method", "")).lower()
    if method == "fp8":
        return None  # nvllm/worker/fp8_checkpoint.py reads it
    if method not in ("awq", "gptq"):
        raise ValueError(f"{d}: quantization_config.quant_method={method!r} is not supported; "
                         "nvllm reads 4-bit awq and gptq checkpoints, fp8 ones (or a float / "
                         "GGUF one)")
    bits = cfg.get("bits", cfg.get("w_bit"))
    if bits != 4:
        raise ValueError(f"{d}: a {bits}-bit {method} checkpoint; nvllm reads 4-bit only")
    group = int(cfg.get("group_size", cfg.get("q_group_size", 128)))
    if group != -1 and (group <= 0 or group % GROUP):
        raise ValueError(f"{d}: group_size {group} is not a multiple of {GROUP}")
    if method == "awq":
        version = str(cfg.get("version", "gemm")).lower()
        if version != "gemm" or not cfg.get("zero_point", True):
            raise ValueError(f"{d}: AWQ version={version!r}, zero_point="
                             f"{cfg.get('zero_point', True)}; nvllm reads the GEMM layout "
                             "with zero points (AutoAWQ's default)")
        offset = 0
    else:
        meta = cfg.get("meta") or {}
        fmt = str(cfg.get("checkpoint_format") or meta.get("checkpoint_format")
                  or "gptq").lower()
        if fmt not in ("gptq", "gptq_v2"):
            raise ValueError(f"{d}: GPTQ checkpoint_format {fmt!r}; nvllm reads 'gptq' and "
                             "'gptq_v2' (re-save a Marlin / other repacked checkpoint as gptq)")
        offset = 1 if fmt == "gptq" else 0
    return Int4CheckpointConfig(method, 0 if group == -1 else group, offset)


def _nibbles(words: torch.Tensor, awq_order: bool = False) -> torch.Tensor:
    """int32 [..., P] -> its 8 nibbles each, [..., P * 8] (uint8 0..15): value j is nibble
    j, or with ``awq_order`` nibble AWQ_REVERSE_ORDER[j]. Through the bytes (little-endian:
    byte i holds nibbles 2i and 2i + 1), in numpy (torch's uint8 stack / index_select are
    5-10x slower here)."""
    b = np.ascontiguousarray(words.numpy()).view(np.uint8)  # [..., P * 4]
    v = np.empty((*b.shape, 2), np.uint8)
    np.bitwise_and(b, 0xF, out=v[..., 0])
    np.right_shift(b, 4, out=v[..., 1])
    v = v.reshape(*words.shape, PACK)
    if awq_order:  # nibbles 0-3 hold values 0, 2, 4, 6; nibbles 4-7 hold 1, 3, 5, 7
        v = v.reshape(*words.shape, 2, 4).swapaxes(-1, -2)
    return torch.from_numpy(np.ascontiguousarray(v).reshape(*words.shape[:-1], -1))


class PackedInt4Slice:
    """One AWQ / GPTQ linear weight as HF's W [N, K]: ``get_shape()``, ``[rows, cols]``
    (float32 values) and ``repack`` (a shard in an engine format)."""

    __slots__ = ("name", "cfg", "qweight", "qzeros", "scales", "shape", "group",
                 "qtype_name")

    def __init__(self, name: str, cfg: Int4CheckpointConfig, qweight, qzeros, scales,
                 g_idx=None) -> None:
        self.name, self.cfg = name, cfg
        self.qweight, self.qzeros, self.scales = qweight, qzeros, scales
        n = scales.get_shape()[1]
        k = qweight.get_shape()[0] * (PACK if cfg.method == "gptq" else 1)
        self.shape = (n, k)
        self.group = cfg.group_size or k
        self.qtype_name = cfg.method.upper()
        if k % self.group:
            raise ValueError(f"{name}: {k} input columns are not whole groups of {self.group}")
        if g_idx is not None:
            g = g_idx[:]
            if not torch.equal(g.long(), torch.arange(k) // self.group):
                raise ValueError(
                    f"{name}: GPTQ act-order checkpoint (g_idx reorders the input columns "
                    "into groups); nvllm holds groups of consecutive columns only: "
                    "quantize with desc_act=False, or load the float model")

    def get_shape(self) -> list[int]:
        return list(self.shape)

    def _parts(self, rows: tuple[int, int], cols: tuple[int, int]
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(q, z, scale) of W[rows, groups covering cols]: q [R, groups * G] uint8, z
        [R, groups] int16 and scale [R, groups] (the checkpoint's dtype)."""
        (r0, r1), (c0, c1) = rows, cols
        g0, g1 = c0 // self.group, -(-c1 // self.group)
        k0, k1 = g0 * self.group, g1 * self.group
        p0, p1 = r0 // PACK, -(-r1 // PACK)  # int32 words covering the output rows
        cut = slice(r0 - p0 * PACK, r1 - p0 * PACK)
        awq = self.cfg.method == "awq"
        if awq:
            q = _nibbles(self.qweight[k0:k1, p0:p1], awq)[:, cut].t()
        else:  # [K/8 words, R]: nibble j of word i is input 8i + j
            q = _nibbles(self.qweight[k0 // PACK:k1 // PACK, r0:r1].t())
        z = _nibbles(self.qzeros[g0:g1, p0:p1], awq)[:, cut]
        z = z.t().to(torch.int16) + self.cfg.zero_offset
        return q.contiguous(), z, self.scales[g0:g1, r0:r1].t()

    def __getitem__(self, index) -> torch.Tensor:
        (r0, r1), (c0, c1) = window_2d(index, self.shape, self.name)
        q, z, s = self._parts((r0, r1), (c0, c1))
        r, g = z.shape
        # (q - z) * scale: exact in float32 (numpy: 3x torch's uint8/int16 ops here)
        v = q.numpy().reshape(r, g, -1).astype(np.float32) - z.numpy()[..., None]
        v *= s.float().numpy()[..., None]
        lead = c0 - c0 // self.group * self.group
        return torch.from_numpy(np.ascontiguousarray(v.reshape(r, -1)[:, lead:lead + c1 - c0]))

    def repack(self, rows: tuple[int, int], cols: tuple[int, int], fmt: QuantFormat
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None:
        """W[rows, cols] (cols on groups of 32) as (qweight, scales, mins) of ``fmt`` where
        that is exact (int4+min32; int8 and int8+min), else None (the caller quantizes
        the float values)."""
        q, z, s = self._parts(rows, cols)
        lead = cols[0] - cols[0] // self.group * self.group
        q = q[:, lead:lead + cols[1] - cols[0]].contiguous()
        per = self.group // GROUP  # engine groups per checkpoint group
        g0, g1 = lead // GROUP, (lead + cols[1] - cols[0]) // GROUP
        s = s.repeat_interleave(per, dim=1)[:, g0:g1].contiguous()
        z = z.repeat_interleave(per, dim=1)[:, g0:g1]
        if s.dtype != torch.float16:  # fp16 is the engine's scale: exact only if it holds
            s16 = s.to(torch.float16)
            if not torch.equal(s16.to(s.dtype), s):
                return None
            s = s16
        if fmt.bits == 4 and fmt.has_min and fmt.min_bits == 32:
            packed = torch.from_numpy(pack_int4(q.numpy()))
            return packed, s, -(z.float() * s.float())  # -z * scale: exact in float32
        if fmt.bits == 8:  # q - z in [-16, 15]
            v = (q.to(torch.int16).view(q.shape[0], -1, GROUP) - z.unsqueeze(-1)).to(torch.int8)
            mins = torch.zeros_like(s) if fmt.has_min else None
            return v.view(q.shape), s, mins
        return None


@contextmanager
def packed_int4_tensors(files: list[str], cfg: Int4CheckpointConfig
                        ) -> Iterator[Iterator[tuple[str, object]]]:
    """All files of an AWQ / GPTQ checkpoint at once (a module's tensors may sit in
    different shards): (HF name, lazy source) pairs, each module's qweight / qzeros /
    scales (/ g_idx) as one ``<module>.weight`` PackedInt4Slice."""
    with ExitStack() as stack:
        handles = [stack.enter_context(safe_open(f, framework="pt", device="cpu"))
                   for f in files]
        where = {name: h for h in handles for name in h.keys()}
        yield _grouped(where, cfg)


def _grouped(where: dict, cfg: Int4CheckpointConfig) -> Iterator[tuple[str, object]]:
    def get(name: str):
        if name not in where:
            raise KeyError(f"{cfg.method} checkpoint lacks {name}")
        return where[name].get_slice(name)

    for name in where:
        base, _, kind = name.rpartition(".")
        if kind in ("qzeros", "scales", "g_idx") and f"{base}.qweight" in where:
            continue  # read with its qweight
        if kind == "qweight":
            g_idx = get(f"{base}.g_idx") if f"{base}.g_idx" in where else None
            yield f"{base}.weight", PackedInt4Slice(
                base, cfg, get(name), get(f"{base}.qzeros"), get(f"{base}.scales"), g_idx)
        else:
            yield name, get(name)

