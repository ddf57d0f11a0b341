"""GGUF loading, per tensor.

The real file (SmolLM2-135M-Instruct, Q4_1 + Q8_0 + F32): every tensor, whole and as each
rank's shard at tp 1, 2 and 3, equals the matching slice of transformers' own dequantized
state dict (Q/K un-permuted). Small files written here with gguf.GGUFWriter cover the
other types, against a numpy transcription of ggml's per-type block formula (random
blocks), not the loader's path (gguf.quants.dequantize).
"""

from __future__ import annotations

import functools

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from transformers import AutoConfig

from nvllm.common.model_source import gguf_files, resolve_model_source
from nvllm.worker import gguf_weights
from nvllm.worker.gguf_weights import (
    _BLOCK_NAMES,
    _EXPERT_NAMES,
    _GLOBAL_NAMES,
    SUPPORTED_TYPES,
    GGUFSlice,
    PackedTensor,
    gguf_tensors,
    open_gguf,
)
from nvllm.worker.loader import load_tensors, load_weights
from nvllm.worker.models import MODEL_REGISTRY
from nvllm.worker.parallel import TPContext
from tests.support.gguf_files import tiny_for_gguf, write_split_gguf
from tests.support.hf_ref import hf_model


@functools.cache
def hf_state(path: str) -> dict[str, torch.Tensor]:
    return {k: v.detach() for k, v in hf_model(path).state_dict().items()}


@functools.cache
def real_sources(path: str):
    reader, arch, heads, kv = open_gguf(path)
    return reader, list(gguf_tensors(reader, arch, heads, kv))


def test_every_tensor_has_its_hf_name_and_shape(smollm2):
    """(Values: the tp tests below, every tensor at tp=1 whole.) The reader that steps
    over the tokenizer's strings finds the tensors GGUFReader does."""
    reader, sources = real_sources(smollm2)
    ref = hf_state(smollm2)
    assert len(sources) == 272  # 30 layers x 9 + token_embd + output_norm (tied head)
    assert {n for n, _ in sources} == set(ref) - {"lm_head.weight"}
    for name, src in sources:
        assert list(src.get_shape()) == list(ref[name].shape), name
    full = gguf.GGUFReader(smollm2)
    assert [(t.name, t.tensor_type, t.data_offset, t.n_bytes) for t in reader.tensors] == \
        [(t.name, t.tensor_type, t.data_offset, t.n_bytes) for t in full.tensors]
    assert reader.data_offset == full.data_offset


def _model(path, cfg, rank, tp):
    return MODEL_REGISTRY[cfg.architectures[0]](cfg, TPContext(rank, tp), torch.float32, 64,
                                                "torch")


@pytest.mark.parametrize("tp", [1, 2, 3])
def test_each_rank_shard_equals_the_slice_of_transformers_state_dict(smollm2, tp,
                                                                     monkeypatch):
    """Each rank's parameters, loaded from the .gguf, equal the same model loaded from
    transformers' dequantized state dict through the same layers (whatever ranges they
    ask for); and every read touches only the blocks covering what was asked (its rows,
    the quant blocks at a column range's edges, the heads at a permuted row range's)."""
    source = resolve_model_source(smollm2)
    cfg = AutoConfig.from_pretrained(source.config_dir)
    _, sources = real_sources(smollm2)
    reads: list[list[int]] = []  # per shard read: [bytes read, bytes asked, allowance]
    real_read, real_get = PackedTensor.read, GGUFSlice.__getitem__

    def counting_read(self, lead, c0, c1):
        b0, b1 = c0 // self.block, -(-c1 // self.block)
        rows = self.raw[lead].size // self.raw.shape[-1]
        reads[-1][0] += rows * (b1 - b0) * self.block_bytes
        return real_read(self, lead, c0, c1)

    def counting_get(self, index):
        reads.append([0, 0, 0])
        out = real_get(self, index)
        p = self.packed
        rows = out.numel() // max(1, out.shape[-1])
        reads[-1][1] = out.numel() * p.block_bytes // p.block
        reads[-1][2] = rows * 2 * p.block_bytes  # a block cut at each column edge
        if self.permuted_heads:  # a head cut at each row edge
            reads[-1][2] += 2 * (self.shape[0] // self.permuted_heads) * p.raw.shape[-1]
        return out

    monkeypatch.setattr(PackedTensor, "read", counting_read)
    monkeypatch.setattr(GGUFSlice, "__getitem__", counting_get)
    for rank in range(tp):
        reads.clear()
        ours, ref = _model(smollm2, cfg, rank, tp), _model(smollm2, cfg, rank, tp)
        params = dict(ours.named_parameters())
        assert load_tensors(ours, sources) == set(params)
        load_tensors(ref, hf_state(smollm2).items())
        for (name, p), q in zip(params.items(), ref.parameters()):
            assert torch.equal(p, q), f"rank {rank}/{tp}: {name}"
        assert reads and all(got <= asked + slack for got, asked, slack in reads), \
            [r for r in reads if r[0] > r[1] + r[2]][:3]


def test_load_weights_logs_time_and_peak_memory(smollm2, caplog):
    source = resolve_model_source(smollm2)
    cfg = AutoConfig.from_pretrained(source.config_dir)
    caplog.set_level("INFO", logger="nvllm.worker.loader")
    load_weights(_model(smollm2, cfg, 0, 3), source, show_progress=False)
    assert "loaded in" in caplog.text and "peak RSS" in caplog.text


# ---- small written files: the types the real file lacks --------------------------------


def _f16(b: np.ndarray) -> np.ndarray:
    return b.view(np.float16).astype(np.float32)


def _scale_min_k4(scales: np.ndarray, j: int) -> tuple[np.ndarray, np.ndarray]:
    """ggml's get_scale_min_k4 over blocks (scales: [n, 12] uint8)."""
    s = scales.astype(np.int32)
    if j < 4:
        return s[:, j] & 63, s[:, j + 4] & 63
    return ((s[:, j + 4] & 0xF) | ((s[:, j - 4] >> 6) << 4),
            (s[:, j + 4] >> 4) | ((s[:, j] >> 6) << 4))


def ggml_reference(qtype: Q, blocks: np.ndarray) -> np.ndarray:
    """Values of [n, block_bytes] uint8 blocks of `qtype`, transcribed from ggml's
    dequantize_row_* (ggml-quants.c) one type at a time."""
    n = blocks.shape[0]
    if qtype == Q.F32:
        return blocks.view(np.float32).reshape(n, -1)
    if qtype == Q.F16:
        return _f16(blocks).reshape(n, -1)
    if qtype == Q.BF16:
        return (blocks.view(np.uint16).astype(np.uint32) << 16).view(np.float32).reshape(n, -1)
    if qtype == Q.Q8_0:
        return _f16(blocks[:, :2]) * blocks[:, 2:].view(np.int8).astype(np.float32)
    if qtype in (Q.Q4_0, Q.Q4_1):
        d = _f16(blocks[:, :2])
        qs = blocks[:, 2:] if qtype == Q.Q4_0 else blocks[:, 4:]
        q = np.concatenate([qs & 0xF, qs >> 4], axis=1).astype(np.float32)
        return (q - 8) * d if qtype == Q.Q4_0 else q * d + _f16(blocks[:, 2:4])
    if qtype in (Q.Q5_0, Q.Q5_1):
        d = _f16(blocks[:, :2])
        o = 2 if qtype == Q.Q5_0 else 4
        qh = blocks[:, o:o + 4].copy().view(np.uint32)  # [n, 1], little-endian
        qs = blocks[:, o + 4:].astype(np.uint32)
        j = np.arange(16, dtype=np.uint32)
        xh0 = ((qh >> j) << 4) & 0x10
        xh1 = (qh >> (j + 12)) & 0x10
        q = np.concatenate([(qs & 0xF) | xh0, (qs >> 4) | xh1], axis=1).astype(np.float32)
        return (q - 16) * d if qtype == Q.Q5_0 else q * d + _f16(blocks[:, 2:4])
    if qtype in (Q.Q4_K, Q.Q5_K):
        d, dmin = _f16(blocks[:, 0:2]), _f16(blocks[:, 2:4])
        scales = blocks[:, 4:16]
        qh = blocks[:, 16:48].astype(np.int32) if qtype == Q.Q5_K else None
        ql = blocks[:, 48:176] if qtype == Q.Q5_K else blocks[:, 16:144]
        ql = ql.astype(np.int32)
        out = np.empty((n, 256), np.float32)
        for k, j in enumerate(range(0, 256, 64)):
            q = ql[:, 32 * k:32 * k + 32]
            for half in (0, 1):
                sc, m = _scale_min_k4(scales, 2 * k + half)
                v = (q & 0xF) if half == 0 else (q >> 4)
                if qh is not None:
                    v = v + np.where(qh & (1 << (2 * k + half)), 16, 0)
                out[:, j + 32 * half:j + 32 * half + 32] = (d * sc[:, None]) * v \
                    - dmin * m[:, None]
        return out
    if qtype == Q.Q6_K:
        ql, qh = blocks[:, :128].astype(np.int32), blocks[:, 128:192].astype(np.int32)
        sc = blocks[:, 192:208].view(np.int8).astype(np.float32)
        d = _f16(blocks[:, 208:210])
        out = np.empty((n, 256), np.float32)
        for h in (0, 1):
            lo, hi, s, y = ql[:, 64 * h:64 * h + 64], qh[:, 32 * h:32 * h + 32], sc[:, 8 * h:], \
                128 * h
            for l in range(32):  # noqa: E741 (ggml's name)
                i = l // 16
                q1 = ((lo[:, l] & 0xF) | (((hi[:, l] >> 0) & 3) << 4)) - 32
                q2 = ((lo[:, l + 32] & 0xF) | (((hi[:, l] >> 2) & 3) << 4)) - 32
                q3 = ((lo[:, l] >> 4) | (((hi[:, l] >> 4) & 3) << 4)) - 32
                q4 = ((lo[:, l + 32] >> 4) | (((hi[:, l] >> 6) & 3) << 4)) - 32
                out[:, y + l] = d[:, 0] * s[:, i] * q1
                out[:, y + l + 32] = d[:, 0] * s[:, i + 2] * q2
                out[:, y + l + 64] = d[:, 0] * s[:, i + 4] * q3
                out[:, y + l + 96] = d[:, 0] * s[:, i + 6] * q4
        return out
    if qtype in (Q.Q2_K, Q.Q3_K):
        return _ggml_reference_q23k(qtype, blocks)
    raise AssertionError(qtype)


def _ggml_reference_q23k(qtype: Q, blocks: np.ndarray) -> np.ndarray:
    """dequantize_row_q2_K / dequantize_row_q3_K: two halves of 128 values, each four
    2-bit planes of 32 (16 values per scale); Q3_K's high bit (hmask) set means no -4."""
    n = blocks.shape[0]
    out = np.empty((n, 256), np.float32)
    if qtype == Q.Q2_K:
        sc, qs = blocks[:, :16].astype(np.int32), blocks[:, 16:80].astype(np.int32)
        d, dmin = _f16(blocks[:, 80:82]), _f16(blocks[:, 82:84])
    else:
        hm, qs = blocks[:, :32].astype(np.int32), blocks[:, 32:96].astype(np.int32)
        d = _f16(blocks[:, 108:110])
        aux = blocks[:, 96:108].copy().view(np.uint32).astype(np.int64)  # [n, 3]
        k1, k2 = 0x03030303, 0x0F0F0F0F
        a0, a1, tmp = aux[:, 0], aux[:, 1], aux[:, 2]
        words = np.stack([(a0 & k2) | (((tmp >> 0) & k1) << 4),
                          (a1 & k2) | (((tmp >> 2) & k1) << 4),
                          ((a0 >> 4) & k2) | (((tmp >> 4) & k1) << 4),
                          ((a1 >> 4) & k2) | (((tmp >> 6) & k1) << 4)], axis=1)
        sc = words.astype(np.uint32).view(np.int8).astype(np.int32) - 32  # [n, 16]
    i, m = 0, 1
    for half in (0, 1):
        q = qs[:, 32 * half:32 * half + 32]
        for j in range(4):
            shift = 2 * j
            for part in (0, 1):
                v = (q[:, 16 * part:16 * part + 16] >> shift) & 3
                at = slice(128 * half + 32 * j + 16 * part, 128 * half + 32 * j + 16 * part + 16)
                if qtype == Q.Q2_K:
                    out[:, at] = (d * (sc[:, i:i + 1] & 0xF)) * v - dmin * (sc[:, i:i + 1] >> 4)
                else:
                    h = hm[:, 16 * part:16 * part + 16]
                    out[:, at] = (d * sc[:, i:i + 1]) * (v - np.where(h & m, 0, 4))
                i += 1
            if qtype == Q.Q3_K:
                m <<= 1
    return out


# Where each type keeps its float16 scale fields (random bytes there could be inf/NaN).
_F16_FIELDS = {Q.Q8_0: [0], Q.Q4_0: [0], Q.Q4_1: [0, 2], Q.Q5_0: [0], Q.Q5_1: [0, 2],
               Q.Q4_K: [0, 2], Q.Q5_K: [0, 2], Q.Q6_K: [208], Q.Q2_K: [80, 82], Q.Q3_K: [108]}


def random_tensor(qtype: Q, shape: tuple[int, ...], rng) -> tuple[np.ndarray, np.ndarray]:
    """(packed bytes [*shape[:-1], row_bytes], reference float32 values [*shape])."""
    block, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    n_blocks = int(np.prod(shape)) // block
    if qtype in (Q.F32, Q.F16, Q.BF16):
        values = rng.standard_normal(int(np.prod(shape))).astype(np.float32)
        dtype = {Q.F32: np.float32, Q.F16: np.float16, Q.BF16: np.uint16}[qtype]
        raw = (values.view(np.uint32) >> 16).astype(np.uint16) if qtype == Q.BF16 \
            else values.astype(dtype)
        blocks = raw.view(np.uint8).reshape(n_blocks, nbytes)
    else:
        blocks = rng.integers(0, 256, (n_blocks, nbytes), dtype=np.uint8)
        for off in _F16_FIELDS[qtype]:
            scale = (rng.standard_normal(n_blocks) * 0.05).astype(np.float16)
            blocks[:, off:off + 2] = scale.view(np.uint8).reshape(n_blocks, 2)
    ref = ggml_reference(qtype, blocks).reshape(shape)
    return blocks.reshape(*shape[:-1], -1), ref


def write_gguf(path, arch: str, tensors: dict[str, tuple[Q, np.ndarray]],
               heads: int = 4, kv_heads: int = 2) -> None:
    w = gguf.GGUFWriter(str(path), arch)
    w.add_uint32(f"{arch}.attention.head_count", heads)
    w.add_uint32(f"{arch}.attention.head_count_kv", kv_heads)
    for name, (qtype, raw) in tensors.items():
        w.add_tensor(name, raw, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


# Row and column ranges a shard may ask for: whole, aligned, and cutting blocks.
RANGES = [(slice(None), slice(None)), (slice(1, 3), slice(None)),
          (slice(None), slice(0, 256)), (slice(None), slice(37, 300)),
          (slice(2, 5), slice(255, 257)), (slice(0, 1), slice(500, 512))]


@pytest.mark.parametrize("qtype", SUPPORTED_TYPES, ids=lambda q: q.name)
def test_type_reads_equal_ggml_formula(tmp_path, qtype):
    rng = np.random.default_rng(int(qtype))
    raw, ref = random_tensor(qtype, (6, 512), rng)
    path = tmp_path / "t.gguf"
    write_gguf(path, "qwen3", {"blk.0.ffn_up.weight": (qtype, raw)})
    reader, arch, heads, kv = open_gguf(str(path))
    [(name, src)] = list(gguf_tensors(reader, arch, heads, kv))
    assert name == "model.layers.0.ffn_up.weight".replace("ffn_up", "mlp.up_proj")
    assert src.get_shape() == [6, 512]
    for rows, cols in RANGES:
        np.testing.assert_array_equal(src[rows, cols].numpy(), ref[rows, cols],
                                      err_msg=f"{qtype.name} [{rows}, {cols}]")


def test_llama_qk_rows_are_unpermuted_for_any_row_range(tmp_path):
    """llama.cpp's convert_hf_to_gguf permutes Q/K rows per head; any HF row range reads
    back the original rows (ranges cutting heads and blocks included)."""
    rng = np.random.default_rng(0)
    heads, kv, hd, cols = 4, 2, 8, 64
    q = rng.standard_normal((heads * hd, cols)).astype(np.float32)
    k = rng.standard_normal((kv * hd, cols)).astype(np.float32)

    def permute(w, n_head):  # llama.cpp: LlamaModel.permute
        return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]) \
            .swapaxes(1, 2).reshape(w.shape)

    path = tmp_path / "l.gguf"
    write_gguf(path, "llama", {"blk.0.attn_q.weight": (Q.F32, permute(q, heads)),
                               "blk.0.attn_k.weight": (Q.F32, permute(k, kv))}, heads, kv)
    reader, arch, h, k_heads = open_gguf(str(path))
    srcs = dict(gguf_tensors(reader, arch, h, k_heads))
    for name, want in (("q_proj", q), ("k_proj", k)):
        src = srcs[f"model.layers.0.self_attn.{name}.weight"]
        for a, b in [(0, want.shape[0]), (3, 13), (8, 16), (5, 6), (0, 12)]:
            np.testing.assert_array_equal(src[a:b, 17:50].numpy(), want[a:b, 17:50])


def test_moe_experts_read_one_at_a_time(tmp_path):
    rng = np.random.default_rng(1)
    raw, ref = random_tensor(Q.Q4_K, (3, 4, 256), rng)
    path = tmp_path / "m.gguf"
    write_gguf(path, "qwen3moe", {"blk.2.ffn_down_exps.weight": (Q.Q4_K, raw)})
    reader, arch, heads, kv = open_gguf(str(path))
    srcs = dict(gguf_tensors(reader, arch, heads, kv))
    assert list(srcs) == [f"model.layers.2.mlp.experts.{e}.down_proj.weight" for e in range(3)]
    for e in range(3):
        src = srcs[f"model.layers.2.mlp.experts.{e}.down_proj.weight"]
        assert src.get_shape() == [4, 256]
        np.testing.assert_array_equal(src[1:3, 100:200].numpy(), ref[e, 1:3, 100:200])


def test_unreadable_type_and_architecture_are_named(tmp_path):
    rng = np.random.default_rng(2)
    path = tmp_path / "iq4.gguf"
    write_gguf(path, "llama", {"blk.0.ffn_up.weight": (
        Q.IQ4_NL, rng.integers(0, 256, (2, 18), dtype=np.uint8))})
    reader, arch, heads, kv = open_gguf(str(path))
    with pytest.raises(ValueError, match=r"blk\.0\.ffn_up\.weight has type IQ4_NL.*Q4_K"):
        list(gguf_tensors(reader, arch, heads, kv))
    with pytest.raises(ValueError, match=r"'phi3' is not supported.*qwen3moe"):
        list(gguf_tensors(reader, "phi3", heads, kv))


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "qwen3moe"])
def test_name_map_agrees_with_gguf_tensor_name_map(arch):
    tmap = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], 2)
    for g, h in _GLOBAL_NAMES.items():
        assert tmap.get_name(h) == g
    for g, h in {**_BLOCK_NAMES, **{k: f"mlp.experts.{v}" for k, v in _EXPERT_NAMES.items()}
                 }.items():
        got = tmap.get_name(f"model.layers.1.{h}")
        if got is not None:  # the architecture has this tensor
            assert got == f"blk.1.{g}", (arch, h)
    assert gguf_weights.hf_name("blk.1.attn_q.bias") == \
        ("model.layers.1.self_attn.q_proj.bias", False)


def test_split_files_are_found_in_order(tmp_path):
    for i in (1, 2, 3):
        (tmp_path / f"m-{i:05d}-of-00003.gguf").write_bytes(b"")
    names = [p.name for p in gguf_files(tmp_path / "m-00002-of-00003.gguf")]
    assert names == [f"m-{i:05d}-of-00003.gguf" for i in (1, 2, 3)]
    (tmp_path / "m-00003-of-00003.gguf").unlink()
    with pytest.raises(FileNotFoundError, match="m-00003-of-00003"):
        gguf_files(tmp_path / "m-00001-of-00003.gguf")


# ---- architectures and split files: tiny checkpoints written as GGUF -------------------


@pytest.mark.parametrize("preset,arch", [("llama", "llama"), ("qwen2", "qwen2"),
                                         ("qwen3", "qwen3"), ("qwen3-moe", "qwen3moe")])
def test_architectures_from_split_gguf_load_like_safetensors(tiny, tmp_path, preset, arch):
    """Each rank (tp 2) of a model loaded from llama.cpp-style split GGUF files equals the
    same rank loaded from the HF checkpoint they were written from."""
    from pathlib import Path

    from nvllm.common.model_source import ModelSource

    model_dir = Path(tiny(preset))
    paths = write_split_gguf(model_dir, arch, tmp_path)
    files = gguf_files(paths[1])  # any split names them all
    assert files == paths
    source = ModelSource(str(paths[0]), "gguf", str(model_dir), str(model_dir),
                         tuple(map(str, files)))
    cfg = AutoConfig.from_pretrained(model_dir)
    for rank in range(2):
        ours, ref = _model(None, cfg, rank, 2), _model(None, cfg, rank, 2)
        load_weights(ours, source, show_progress=False)
        load_weights(ref, model_dir, show_progress=False)
        for (name, p), q in zip(ours.named_parameters(), ref.parameters()):
            assert torch.equal(p, q), f"{preset} rank {rank}: {name}"


@pytest.mark.parametrize("preset,arch", [("llama", "llama"), ("qwen2", "qwen2"),
                                         ("qwen3", "qwen3"),
                                         ("qwen3-moe-all-sparse", "qwen3moe")])
def test_gguf_metadata_gives_the_checkpoint_facts(tiny, tmp_path, monkeypatch, preset, arch):
    """A tiny checkpoint written as one GGUF file with its metadata: the config and
    tokenizer nvllm converts from it say what the HF folder says."""
    from transformers import AutoTokenizer

    from nvllm.common.config import EngineConfig

    monkeypatch.setenv("NVLLM_GGUF_DIR", str(tmp_path / "cache"))
    model_dir = tiny_for_gguf(tiny, tmp_path, preset)
    [path] = write_split_gguf(model_dir, arch, tmp_path, parts=1, metadata=True)
    ours = EngineConfig(str(path), device="cpu").finalize().model_info
    want = EngineConfig(str(model_dir), device="cpu").finalize().model_info
    ours.torch_dtype = want.torch_dtype  # GGUF keeps no "run" dtype
    assert ours == want
    tok, ref = (AutoTokenizer.from_pretrained(d) for d in
                (resolve_model_source(path).tokenizer, model_dir))
    text = "<|im_start|>user\nThe capital of France?<|im_end|>"
    assert tok(text).input_ids == ref(text).input_ids
