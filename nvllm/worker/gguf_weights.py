"""GGUF tensors as HF checkpoint tensors, read lazily through ggml's own reader.

``gguf_tensors`` turns each tensor of a GGUF file (``gguf.GGUFReader``, memory-mapped)
into HF-named sources (``model.layers.3.self_attn.q_proj.weight``; a 3-D expert tensor
into one per expert) that present what ``safe_open(...).get_slice(name)`` does:
``get_shape()`` and ``src[tuple_of_slices]`` in HF layout. So every layer's
``weight_loader`` computes its own ranges as for safetensors, and reading a range touches
only the quant blocks covering it: whole rows for a row range; for a column range, the
32- or 256-value blocks that cover it (dequantized, then cut). llama.cpp permutes the rows
of Llama's Q and K projections within each head for its rope layout; a row range reads
the heads covering it and undoes that (as transformers does).

``PackedTensor`` is the description of the packed blocks a source reads from. A dense
parameter gets them dequantized (``gguf.quants.dequantize``) to float32 shard by shard,
cast to the run dtype by its copy; a quantized one (nvllm/worker/layers/quant.py) gets
``GGUFSlice.blocks`` of its shard, repacked by ``repack`` into its own format: exactly
for Q8_0, Q4_0, Q4_1, Q5_0, Q5_1; for the K-quants with their sub-block scales rounded
to fp16 (nvllm/worker/gguf_kquants.py), so no float copy of the tensor ever exists.
"""

from __future__ import annotations

import re
import struct
import sys
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch
from gguf import (
    GGML_QUANT_SIZES,
    GGMLQuantizationType,
    GGUFReader,
    GGUFValueType,
    ReaderTensor,
)
from gguf.quants import dequantize

from nvllm.worker.gguf_kquants import KQUANT_TYPES, repack_kquant

Q = GGMLQuantizationType
SUPPORTED_TYPES = (Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1,
                   Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K)
SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3", "qwen3moe")
# Architectures whose Q/K rows llama.cpp's converter permutes (LlamaModel.permute).
PERMUTED_QK = ("llama",)
# Block types a quantized layer holds exactly (see repack).
EXACT_TYPES = (Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1)
# ... and those it repacks at all: K-quants with fp16-rounded scales (gguf_kquants.py).
REPACKED_TYPES = EXACT_TYPES + KQUANT_TYPES

# GGUF tensor name (without "blk.N." and the ".weight"/".bias" suffix) -> HF module path
# (after "model.layers.N."). gguf's TensorNameMap maps the other way (tests check both
# agree).
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",
}
_EXPERT_NAMES = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj",
                 "ffn_down_exps": "down_proj"}
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm",
                 "output": "lm_head"}
_SKIPPED = ("rope_freqs",)  # HF computes rope frequencies from the config
_BLK = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")


def hf_name(gguf_name: str) -> tuple[str, bool] | None:
    """The HF name of a GGUF tensor (``{}`` in place of the expert index for 3-D expert
    tensors; the bool says so), or None for one HF models do not keep."""
    m = _BLK.match(gguf_name)
    if m:
        layer, base, kind = m.groups()
        if base in _EXPERT_NAMES:
            return f"model.layers.{layer}.mlp.experts.{{}}.{_EXPERT_NAMES[base]}.{kind}", True
        if base in _BLOCK_NAMES:
            return f"model.layers.{layer}.{_BLOCK_NAMES[base]}.{kind}", False
    else:
        base, _, kind = gguf_name.rpartition(".")
        if base in _GLOBAL_NAMES:
            return f"{_GLOBAL_NAMES[base]}.{kind}", False
        if base in _SKIPPED:
            return None
    raise ValueError(f"GGUF tensor {gguf_name} has no place in an HF model nvllm knows")


@dataclass(slots=True)
class PackedTensor:
    """A GGUF tensor's packed blocks, as stored: ``raw`` holds the bytes (memory-mapped;
    leading dims as in HF, the last one the packed bytes of a row) of ``qtype``, whose
    blocks hold ``block`` values in ``block_bytes`` bytes; ``shape`` is the HF shape."""

    name: str
    qtype: GGMLQuantizationType
    shape: tuple[int, ...]
    raw: np.ndarray
    block: int
    block_bytes: int

    @classmethod
    def of(cls, t: ReaderTensor) -> PackedTensor:
        qtype = GGMLQuantizationType(t.tensor_type)
        if qtype not in SUPPORTED_TYPES:
            raise ValueError(
                f"GGUF tensor {t.name} has type {qtype.name}, which nvllm cannot read; "
                f"supported: {', '.join(q.name for q in SUPPORTED_TYPES)}")
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))  # ggml: ne0 first
        block, block_bytes = GGML_QUANT_SIZES[qtype]
        raw = t.data.view(np.uint8).reshape(*shape[:-1], shape[-1] // block * block_bytes)
        return cls(t.name, qtype, shape, raw, block, block_bytes)

    def read(self, lead: tuple[slice, ...], c0: int, c1: int) -> np.ndarray:
        """Values [lead..., c0:c1] as float32: the covering blocks, dequantized, cut."""
        b0, b1 = c0 // self.block, -(-c1 // self.block)
        packed = np.ascontiguousarray(self.raw[(*lead, slice(b0 * self.block_bytes,
                                                             b1 * self.block_bytes))])
        values = dequantize(packed, self.qtype)
        off = b0 * self.block
        return values[..., c0 - off:c1 - off]

    def read_blocks(self, lead: tuple[slice, ...], c0: int, c1: int) -> np.ndarray:
        """The packed bytes of values [lead..., c0:c1], c0 and c1 on block boundaries."""
        if c0 % self.block or c1 % self.block:
            raise ValueError(f"GGUF tensor {self.name}: columns [{c0}, {c1}) are not whole "
                             f"blocks of {self.block}")
        bb = self.block_bytes
        return self.raw[(*lead, slice(c0 // self.block * bb, c1 // self.block * bb))]


class GGUFSlice:
    """One HF tensor read from a GGUF tensor: ``get_shape()`` and ``[slices]`` as
    safetensors' ``get_slice``. ``expert`` picks one expert of a 3-D tensor;
    ``permuted_heads`` (Llama's Q/K) is the head count whose rows llama.cpp permuted."""

    __slots__ = ("packed", "expert", "permuted_heads", "shape")

    def __init__(self, packed: PackedTensor, expert: int | None = None,
                 permuted_heads: int | None = None) -> None:
        self.packed = packed
        self.expert = expert
        self.permuted_heads = permuted_heads
        self.shape = packed.shape[1:] if expert is not None else packed.shape

    def get_shape(self) -> list[int]:
        return list(self.shape)

    def __getitem__(self, index) -> torch.Tensor:
        if not isinstance(index, tuple):
            index = (index,)
        if any(i is Ellipsis for i in index):
            at = index.index(Ellipsis)
            index = (*index[:at], *[slice(None)] * (len(self.shape) - len(index) + 1),
                     *index[at + 1:])
        index = (*index, *[slice(None)] * (len(self.shape) - len(index)))
        ranges = []
        for i, n in zip(index, self.shape):
            if not isinstance(i, slice):
                raise TypeError(f"GGUF tensor {self.packed.name}: index with slices, not {i!r}")
            start, stop, step = i.indices(n)
            if step != 1:
                raise ValueError(f"GGUF tensor {self.packed.name}: strided reads unsupported")
            ranges.append((start, max(start, stop)))
        (r0, r1), rest = ranges[0], ranges[1:]
        heads = self.permuted_heads
        if heads is not None:  # read the heads covering [r0, r1), un-permute, cut
            hd = self.shape[0] // heads
            h0, h1 = r0 // hd, -(-r1 // hd)
            out = self._read((h0 * hd, h1 * hd), rest)
            half = out.reshape(h1 - h0, hd // 2, 2, *out.shape[1:]).swapaxes(1, 2)
            out = half.reshape(out.shape)[r0 - h0 * hd:r1 - h0 * hd]
        else:
            out = self._read((r0, r1), rest)
        if not (out.flags.writeable and out.flags.c_contiguous):  # a view of the map
            out = np.array(out, order="C")
        return torch.from_numpy(out)

    def _read(self, first: tuple[int, int], rest: list[tuple[int, int]],
              blocks: bool = False) -> np.ndarray:
        ranges = [first, *rest]
        lead = tuple(slice(a, b) for a, b in ranges[:-1])
        if self.expert is not None:
            lead = (slice(self.expert, self.expert + 1), *lead)
        read = self.packed.read_blocks if blocks else self.packed.read
        out = read(lead, *ranges[-1])
        return out[0] if self.expert is not None else out

    def blocks(self, rows: tuple[int, int], cols: tuple[int, int]) -> np.ndarray:
        """The packed blocks of a 2-D tensor's [rows, cols] (cols on block boundaries),
        rows in HF order (Llama's Q/K un-permuted, whole rows moved): [rows, bytes]."""
        if len(self.shape) != 2:
            raise ValueError(f"GGUF tensor {self.packed.name}: blocks of 2-D tensors only")
        (r0, r1), heads = rows, self.permuted_heads
        if heads is None:
            return self._read((r0, r1), [cols], blocks=True)
        hd = self.shape[0] // heads
        h0, h1 = r0 // hd, -(-r1 // hd)
        out = self._read((h0 * hd, h1 * hd), [cols], blocks=True)
        half = out.reshape(h1 - h0, hd // 2, 2, out.shape[-1]).swapaxes(1, 2)
        return half.reshape(out.shape)[r0 - h0 * hd:r1 - h0 * hd]


def gguf_tensors(reader: GGUFReader, arch: str, num_heads: int, num_kv_heads: int
                 ) -> Iterator[tuple[str, GGUFSlice]]:
    """(HF name, source) for every tensor of one GGUF file (of a checkpoint of GGUF
    architecture ``arch``)."""
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"GGUF architecture {arch!r} is not supported; supported: "
                         f"{', '.join(SUPPORTED_ARCHITECTURES)}")
    for t in reader.tensors:
        named = hf_name(t.name)
        if named is None:
            continue
        name, per_expert = named
        packed = PackedTensor.of(t)
        if per_expert:
            for e in range(packed.shape[0]):
                yield name.format(e), GGUFSlice(packed, expert=e)
            continue
        heads = None
        if arch in PERMUTED_QK and ".self_attn.q_proj." in name:
            heads = num_heads
        elif arch in PERMUTED_QK and ".self_attn.k_proj." in name:
            heads = num_kv_heads
        yield name, GGUFSlice(packed, permuted_heads=heads)


def _f16(raw: np.ndarray, at: int) -> np.ndarray:
    return np.ascontiguousarray(raw[..., at:at + 2]).view(np.float16)[..., 0]


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[rows, blocks, 16] bytes -> [rows, blocks, 32] values 0..15 (GGUF's order)."""
    return np.concatenate([qs & 0xF, qs >> 4], axis=-1)


def _high_bits(qh: np.ndarray) -> np.ndarray:
    """Q5's [rows, blocks, 4] bytes of fifth bits -> [rows, blocks, 32] of 0 or 16."""
    bits = np.ascontiguousarray(qh).view("<u4")  # [rows, blocks, 1]
    return (((bits >> np.arange(32, dtype=np.uint32)) & 1) << 4).astype(np.uint8)


def repack(raw: np.ndarray, qtype: GGMLQuantizationType, fmt
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None:
    """GGUF blocks [rows, bytes] of ``qtype`` as (qweight, scales, mins) of ``fmt``
    (a nvllm.worker.layers.quant.QuantFormat), or None where ``fmt`` cannot hold them
    exactly (the caller dequantizes and re-quantizes). K-quants: nearly, see
    nvllm/worker/gguf_kquants.py."""
    if qtype in KQUANT_TYPES:
        return repack_kquant(raw, qtype, fmt)
    if qtype not in EXACT_TYPES:
        return None
    _, bb = GGML_QUANT_SIZES[qtype]
    rows = raw.shape[0]
    b = raw.reshape(rows, -1, bb)
    has_min = qtype in (Q.Q4_1, Q.Q5_1)
    if has_min and not fmt.has_min:
        return None
    d = _f16(b, 0)
    m = _f16(b, 2) if has_min else None
    if qtype in (Q.Q4_0, Q.Q4_1) and fmt.bits == 4:  # the same bytes
        q = np.ascontiguousarray(b[..., 4 if has_min else 2:]).reshape(rows, -1)
        if fmt.has_min and m is None:  # s (q - 8) = s q + (-8 s), exact in fp16
            m = (d * np.float16(-8)).astype(np.float16)
    else:
        if fmt.bits == 4:
            return None  # Q5 / Q8 values do not fit 4 bits
        if qtype == Q.Q8_0:
            v = b[..., 2:].view(np.int8).astype(np.int16)
        elif qtype in (Q.Q4_0, Q.Q4_1):
            v = _nibbles(b[..., 4 if has_min else 2:]).astype(np.int16)
            v = v if has_min else v - 8
        else:
            at = 4 if has_min else 2
            v = (_nibbles(b[..., at + 4:]) | _high_bits(b[..., at:at + 4])).astype(np.int16)
            v = v if has_min else v - 16
        q = v.astype(np.int8).reshape(rows, -1)
    if fmt.has_min and m is None:
        m = np.zeros_like(d)
    return (torch.from_numpy(np.ascontiguousarray(q)), torch.from_numpy(d),
            None if m is None else torch.from_numpy(m))


def read_gguf_field(reader: GGUFReader, key: str):
    field = reader.get_field(key)
    return None if field is None else field.contents()


class TensorReader(GGUFReader):
    """ggml's GGUFReader, but string arrays' contents are stepped over, not read: the
    tokenizer's vocabulary and merges (~100k strings, seconds through GGUFReader's
    per-string numpy views) are the leader's business (converted once, see
    nvllm/common/model_source.py); a worker needs the tensors and a few numbers. Such a
    field keeps its type and length, with no values. An array of numbers is one view (its
    ``parts[data[0]]``), not one per element."""

    def _get_field_parts(self, orig_offs: int, raw_type: int):
        if raw_type == GGUFValueType.ARRAY:
            itype = self._get(orig_offs, np.uint32)
            if itype[0] == GGUFValueType.STRING:
                alen = self._get(orig_offs + 4, np.uint64)
                fmt = ">Q" if (self.byte_order == "S") == (sys.byteorder == "little") else "<Q"
                offs = orig_offs + 12
                for _ in range(int(alen[0])):
                    offs += 8 + struct.unpack_from(fmt, self.data, offs)[0]
                return offs - orig_offs, [itype, alen], [], [GGUFValueType.ARRAY,
                                                             GGUFValueType.STRING]
            nptype = self.gguf_scalar_to_np.get(GGUFValueType(int(itype[0])))
            if nptype is not None:  # one view of the whole array, not one per element
                alen = self._get(orig_offs + 4, np.uint64)
                values = self._get(orig_offs + 12, nptype, int(alen[0]))
                return (12 + int(values.nbytes), [itype, alen, values], [2],
                        [GGUFValueType.ARRAY, GGUFValueType(int(itype[0]))])
        return super()._get_field_parts(orig_offs, raw_type)


def open_gguf(path: str) -> tuple[GGUFReader, str, int, int]:
    """A GGUF file's reader, architecture and (q, kv) head counts. Split files after the
    first carry no metadata: their heads come from the first (pass them on)."""
    try:
        reader: GGUFReader = TensorReader(path)
    except Exception:  # noqa: BLE001 (another gguf's internals: its own reader says why)
        reader = GGUFReader(path)
    arch = read_gguf_field(reader, "general.architecture")
    heads = read_gguf_field(reader, f"{arch}.attention.head_count") if arch else None
    kv = read_gguf_field(reader, f"{arch}.attention.head_count_kv") if arch else None
    return reader, arch, heads, kv or heads
