"""Quantized weights (nvllm/worker/layers/quant.py, nvllm/worker/quantize.py).

- GGUF's Q8_0/Q4_0/Q4_1/Q5_0/Q5_1 blocks repack into the engine formats exactly: every
  value of a row or column-group shard dequantizes to ggml's formula's float32 (random
  blocks, tests/worker/test_gguf_loader.py's transcription), and the formats that cannot
  hold a type say so.
- Round-to-nearest at load: each value within half a step of its group's scale, and
  quantizing the dequantized values again gives them back (the e2e test relies on it).
- The native op equals dequantize-then-matmul within float32 summation's bound.
- Tiny models written as GGUF in each type, at tp 1 and 2: each rank's quantized layers
  hold exactly the values the dense load dequantizes, and their forward matches
  F.linear on them; a tied head shares its embedding's blocks.
- The real file's weights, held quantized, take <= 1.15x the file's bytes.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from transformers import AutoConfig

from nvllm.common.model_source import ModelSource, resolve_model_source
from nvllm.kernels import cpu_ops
from nvllm.worker.gguf_weights import EXACT_TYPES, gguf_tensors, open_gguf, repack
from nvllm.worker.layers.linear import linear
from nvllm.worker.layers.quant import (
    GROUP,
    INT4,
    INT4_MIN,
    INT4_MIN32,
    INT8,
    INT8_MIN,
    QuantizedWeight,
    quantize,
    unpack_int,
)
from nvllm.worker.loader import load_weights
from nvllm.worker.models import MODEL_REGISTRY
from nvllm.worker.parallel import TPContext
from nvllm.worker.quantize import (
    AT_LOAD,
    load_quantized,
    quantize_model,
    share_tied_head,
    weight_bytes,
)
from tests.support.float_bounds import EPS32
from tests.support.gguf_files import write_split_gguf
from tests.worker.test_gguf_loader import random_tensor, write_gguf

# Which engine formats hold each type exactly (the first: what quantization=auto picks).
EXACT = {Q.Q8_0: [INT8, INT8_MIN], Q.Q4_0: [INT4, INT4_MIN, INT8, INT8_MIN],
         Q.Q4_1: [INT4_MIN, INT8_MIN], Q.Q5_0: [INT8, INT8_MIN], Q.Q5_1: [INT8_MIN]}
ALL = [INT8, INT8_MIN, INT4, INT4_MIN]


@pytest.mark.parametrize("qtype", EXACT_TYPES, ids=lambda q: q.name)
def test_gguf_blocks_repack_exactly(tmp_path, monkeypatch, qtype):
    from nvllm.worker import quantize as quantize_mod

    monkeypatch.setattr(quantize_mod, "ROW_CHUNK", 2)  # shards read in several chunks
    rng = np.random.default_rng(int(qtype))
    raw, ref = random_tensor(qtype, (6, 512), rng)
    path = tmp_path / "t.gguf"
    write_gguf(path, "qwen3", {"blk.0.ffn_up.weight": (qtype, raw)})
    reader, arch, heads, kv = open_gguf(str(path))
    [(_, src)] = list(gguf_tensors(reader, arch, heads, kv))
    for fmt in ALL:
        got = repack(src.blocks((0, 6), (0, 512)), qtype, fmt)
        assert (got is not None) == (fmt in EXACT[qtype]), (qtype.name, fmt.name)
    for fmt in EXACT[qtype]:
        rows = QuantizedWeight(fmt, 3, 512)  # a column-parallel shard: rows 2..4
        load_quantized(rows, src, 0, 2, 5, 0)
        np.testing.assert_array_equal(rows.dequantize().numpy(), ref[2:5], fmt.name)
        cols = QuantizedWeight(fmt, 6, 256)  # a row-parallel shard: columns 64..319
        load_quantized(cols, src, 1, 64, 320, 0)
        np.testing.assert_array_equal(cols.dequantize().numpy(), ref[:, 64:320], fmt.name)
    if INT4 not in EXACT[qtype]:  # int4 from the chunks' float values: as the whole's
        other = QuantizedWeight(INT4, 5, 512)
        load_quantized(other, src, 0, 1, 6, 0)
        want = QuantizedWeight(INT4, 5, 512)
        want.write(0, 0, *quantize(torch.from_numpy(ref[1:6]), INT4))
        assert torch.equal(other.dequantize(), want.dequantize())
    with pytest.raises(ValueError, match="whole groups"):
        load_quantized(QuantizedWeight(EXACT[qtype][0], 6, 32), src, 1, 16, 48, 0)


@pytest.mark.parametrize("fmt", ALL, ids=lambda f: f.name)
def test_round_to_nearest_is_within_half_a_step_and_idempotent(fmt):
    torch.manual_seed(0)
    w = torch.randn(16, 256) * torch.rand(16, 1)
    w[3, :GROUP] = 0  # an all-zero group
    qw = QuantizedWeight(fmt, 16, 256)
    qw.write(0, 0, *quantize(w, fmt))
    deq = qw.dequantize()
    step = qw.scales.float().repeat_interleave(GROUP, dim=1)
    assert bool(((deq - w).abs() <= step / 2 * (1 + 1e-3) + 1e-12).all())
    assert bool((deq[3, :GROUP] == 0).all())
    again = QuantizedWeight(fmt, 16, 256)
    again.write(0, 0, *quantize(deq, fmt))
    assert torch.equal(again.dequantize(), deq)
    if fmt.has_min:  # asymmetric: the step is the group's range / (2^bits - 1), not more
        g = (w + 3 * (torch.arange(16) % 2)[:, None]).view(16, -1, GROUP)  # offset rows too
        qw.write(0, 0, *quantize(g.view(16, 256), fmt))
        lo, hi = g.amin(-1), g.amax(-1)
        levels = (1 << fmt.bits) - 1
        # fp16 rounding of the scale (2^-10 relative, rounded up) and of the min (up to
        # 2^-11 |min|, shared by 127 steps in int8)
        slack = (lo.abs() + hi.abs()) * 2.0 ** -16 + 2.0 ** -24
        assert bool((qw.scales.float() <= (hi - lo) / levels * (1 + 2.0 ** -9) + slack).all())
        err = (qw.dequantize().view_as(g) - g).abs()
        assert bool((err <= qw.scales.float().unsqueeze(-1) / 2 * (1 + 1e-3) + 1e-7).all())


def _random_quantized(fmt, n: int, k: int, gen) -> QuantizedWeight:
    qw = QuantizedWeight(fmt, n, k)
    qw.write(0, 0, *quantize(torch.randn(n, k, generator=gen), fmt))
    if qw.mins is not None:  # non-zero mins, so they are exercised
        qw.mins.copy_(torch.randn(qw.mins.shape, generator=gen) * 0.05)
    return qw


def matmul_bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """float32 sums of k products, in any order: within k * eps * sum |x_i w_i| of the
    exact value (Higham's gamma_k; the dequantized values themselves are exact)."""
    return x.shape[1] * EPS32 * (x.abs().double() @ w.abs().double().t())


def split_abs(qw: QuantizedWeight) -> torch.Tensor:
    """|s q| + |m| per weight (m: the min, -8 s for int4 without one): what bounds the
    error of sums taken as s * (q . x) + m * sum(x), as the AVX2 decode loop takes them
    (its terms are these two parts; their sum, the weight, may be much smaller)."""
    fmt, (n, groups) = qw.fmt, qw.scales.shape
    q = unpack_int(qw.qweight, fmt).double().view(n, groups, GROUP)
    s = qw.scales.double().unsqueeze(-1)
    m = qw.mins.double().unsqueeze(-1) if qw.mins is not None else (
        -8 * s if fmt.bits == 4 else torch.zeros_like(s))
    return ((s * q).abs() + m.abs()).view(n, groups * GROUP)


@pytest.mark.skipif(not cpu_ops.load(), reason="nvllm's CPU ops did not build here")
# (int4+min32: float32 mins, AWQ / GPTQ's -z * scale; random ones no fp16 holds)
@pytest.mark.parametrize("fmt", [*ALL, INT4_MIN32], ids=lambda f: f.name)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_native_op_equals_dequantize_then_matmul(fmt, dtype):
    gen = torch.Generator().manual_seed(1)
    qw = _random_quantized(fmt, 41, 256, gen)  # 41: a last block of 2 columns; odd halves
    w = qw.dequantize().double()
    # Up to 4 rows: the in-register loop (two columns at a time at one row); 5 and more,
    # on AVX2: the buffered kernel, blocks of 4 rows and a remainder of 1-3, passes of 128
    # rows (133: a second pass of 5); past 8 rows, elsewhere: passes of up to 8.
    for m in (1, 2, 3, 4, 5, 6, 7, 8, 11, 16, 33, 133):
        x = torch.randn(m, 256, generator=gen).to(dtype)
        got = cpu_ops.quant_linear(x, qw.qweight, qw.scales, qw.mins, fmt.bits)
        assert got.dtype == dtype and got.shape == (m, 41)
        exact = x.double() @ w.t()
        bound = matmul_bound(x.float(), w.float())
        split = 2 * matmul_bound(x.float(), split_abs(qw).float())  # two sums, then one add
        if dtype == torch.bfloat16:  # plus the final rounding to bfloat16
            bound = bound + exact.abs() * 2.0 ** -8
            split = split + exact.abs() * 2.0 ** -8
        assert bool(((got.double() - exact).abs() <= torch.maximum(bound, split)).all()), \
            (fmt.name, m)
        # The fallback path dequantizes into x's dtype: in bfloat16 each weight is also
        # rounded (relative 2^-9), as a dense bfloat16 model's are.
        if dtype == torch.bfloat16:
            bound = bound + 2.0 ** -9 * (x.abs().double() @ w.abs().t())
        for native in (False, True):  # tiles dequantized by torch, or by the native op
            ref = qw.matmul_tiles(x, native)
            assert bool(((ref.double() - exact).abs() <= bound).all()), (fmt.name, m)
    for dt in (torch.float32, torch.bfloat16):  # the native dequantization: the same values
        assert torch.equal(cpu_ops.quant_dequantize(qw.qweight, qw.scales, qw.mins, fmt.bits,
                                                    dt), qw.dequantize(dtype=dt))


def _model(cfg, rank: int, tp: int):
    return MODEL_REGISTRY[cfg.architectures[0]](cfg, TPContext(rank, tp), torch.float32, 64,
                                                "torch")


def _gguf_source(model_dir: Path, arch: str, tmp_path: Path, qtype: Q) -> ModelSource:
    [path] = write_split_gguf(model_dir, arch, tmp_path, parts=1, quant=qtype)
    return ModelSource(str(path), "gguf", str(model_dir), str(model_dir), (str(path),))


@pytest.mark.parametrize("qtype", EXACT_TYPES, ids=lambda q: q.name)
@pytest.mark.parametrize("tp", [1, 2])
def test_gguf_model_layers_hold_the_dequantized_values(tiny, tmp_path, monkeypatch, qtype,
                                                       tp):
    """Every rank's quantized layers (the linears, the embedding and the head: all of
    the file's 2-D tensors) equal the dense load's dequantized values; linear() on them
    matches F.linear on those values within float32 summation's bound. Shards are read 5
    rows at a time, so chunks cut Llama's permuted Q/K heads (16 rows) anywhere."""
    from nvllm.worker import quantize as quantize_mod
    from nvllm.worker.layers import quant

    monkeypatch.setattr(quantize_mod, "ROW_CHUNK", 5)
    monkeypatch.setattr(quant, "_ACT", ["off"])  # float activations: the bound below
    model_dir = Path(tiny("llama"))
    source = _gguf_source(model_dir, "llama", tmp_path, qtype)
    cfg = AutoConfig.from_pretrained(model_dir)
    torch.manual_seed(0)
    for rank in range(tp):
        ours, dense = _model(cfg, rank, tp), _model(cfg, rank, tp)
        done = quantize_model(ours, source, "auto")
        # 2 layers x (qkv, o, gate_up, down), the embedding and the head
        assert len(done) == 10 and set(done.values()) == {EXACT[qtype][0].name}
        load_weights(ours, source, show_progress=False)
        load_weights(dense, source, show_progress=False)
        dense_mods = dict(dense.named_modules())
        for name in done:
            q, d = dict(ours.named_modules())[name], dense_mods[name]
            qw = q.packed if hasattr(q, "packed") else q.quant
            assert torch.equal(qw.dequantize(), d.weight), f"{qtype.name} {name} rank {rank}"
            if name == "embed_tokens":
                ids = torch.tensor([[0, 5], [cfg.vocab_size - 1, 7]])
                ids = ids.clamp(d.vocab_start, d.vocab_end - 1)
                assert torch.equal(q.partial(ids), d.partial(ids)) if tp == 1 else True
                continue
            x = torch.randn(3, d.weight.shape[1])
            exact = x.double() @ d.weight.double().t()
            got = linear(x, q)
            assert bool(((got.double() - exact).abs()
                         <= matmul_bound(x, d.weight)).all()), name


def test_float_checkpoint_quantized_at_load_and_uneven_groups_stay_dense(tiny):
    """int8/int4 on safetensors: the linears only (embedding and head stay dense), each
    rank's shard quantized as the whole tensor is (groups never straddle a shard); a
    row-parallel layer whose rank-local columns are not whole groups stays dense."""
    model_dir = Path(tiny("llama-9h3kv"))  # hidden 72, intermediate 131: no group fits
    source = resolve_model_source(str(model_dir))
    cfg = AutoConfig.from_pretrained(model_dir)
    assert quantize_model(_model(cfg, 0, 2), source, "int8") == {}
    model_dir = Path(tiny("qwen3"))
    source = resolve_model_source(str(model_dir))
    cfg = AutoConfig.from_pretrained(model_dir)
    for mode, fmt in AT_LOAD.items():
        for rank in range(2):
            ours, dense = _model(cfg, rank, 2), _model(cfg, rank, 2)
            done = quantize_model(ours, source, mode)
            assert set(done.values()) == {fmt.name} and len(done) == 8
            load_weights(ours, source, show_progress=False)
            load_weights(dense, source, show_progress=False)
            for name in done:
                q, d = dict(ours.named_modules())[name], dict(dense.named_modules())[name]
                want = QuantizedWeight(fmt, *d.weight.shape)
                want.write(0, 0, *quantize(d.weight, fmt))
                assert torch.equal(q.packed.dequantize(), want.dequantize()), name
    assert quantize_model(_model(cfg, 0, 1), source, "auto") == {}  # safetensors
    assert quantize_model(_model(cfg, 0, 1), source, "none") == {}


def test_auto_loads_dense_off_the_cpu_and_explicit_modes_hold(tiny, tmp_path):
    """The quantized kernels are CPU ones: on a GPU, `auto` keeps a GGUF file's weights
    dense (the reference path would dequantize every weight at every matmul); an explicit
    int8 is honoured (the layers are only planned here, nothing runs on the device)."""
    model_dir = Path(tiny("llama"))
    source = _gguf_source(model_dir, "llama", tmp_path, Q.Q8_0)
    cfg = AutoConfig.from_pretrained(model_dir)
    assert quantize_model(_model(cfg, 0, 1), source, "auto", "cuda") == {}
    assert len(quantize_model(_model(cfg, 0, 1), source, "auto", "cpu")) == 10
    assert len(quantize_model(_model(cfg, 0, 1), source, "int8", "cuda")) == 8


def test_tied_head_shares_the_embedding_blocks(tiny, tmp_path):
    model_dir = Path(tiny("llama3"))  # tie_word_embeddings
    source = _gguf_source(model_dir, "llama", tmp_path, Q.Q8_0)
    cfg = AutoConfig.from_pretrained(model_dir)
    for rank in range(2):
        model = _model(cfg, rank, 2)
        quantize_model(model, source, "auto")
        load_weights(model, source, show_progress=False)
        before = weight_bytes(model)
        x = torch.randn(2, cfg.hidden_size)
        logits = linear(x, model.lm_head)
        assert share_tied_head(model)
        assert model.lm_head.packed is model.embed_tokens.quant
        assert torch.equal(linear(x, model.lm_head), logits)
        assert before - weight_bytes(model) == model.embed_tokens.quant.nbytes()


def test_tied_head_shares_the_dense_embedding_at_load(tiny):
    """int8 at load keeps the embedding and a tied head dense: one parameter, read by
    both (not repacked for oneDNN, which would drop the copy the embedding reads)."""
    from nvllm.worker.layers.linear import pack_for_cpu

    model_dir = Path(tiny("llama3"))  # tie_word_embeddings
    source = resolve_model_source(str(model_dir))
    cfg = AutoConfig.from_pretrained(model_dir)
    for rank in range(2):
        model = _model(cfg, rank, 2)
        quantize_model(model, source, "int8")
        load_weights(model, source, show_progress=False)
        before = weight_bytes(model)
        x = torch.randn(2, cfg.hidden_size)
        logits = linear(x, model.lm_head)
        assert share_tied_head(model)
        assert model.lm_head.weight is model.embed_tokens.weight
        assert before - weight_bytes(model) == model.embed_tokens.weight.nbytes
        pack_for_cpu(model)
        assert model.lm_head.packed is None and model.embed_tokens.weight.numel() > 0
        assert torch.equal(linear(x, model.lm_head), logits)


def test_real_file_held_quantized_within_1_15x_of_its_size(smollm2):
    source = resolve_model_source(smollm2)
    cfg = AutoConfig.from_pretrained(source.config_dir)
    model = _model(cfg, 0, 1)
    done = quantize_model(model, source, "auto")
    load_weights(model, source, show_progress=False)
    assert share_tied_head(model)
    assert len(done) == 30 * 4 + 2
    assert set(done.values()) == {"int4+min", "int8"}  # Q4_1 linears, Q8_0 embedding
    ratio = weight_bytes(model) / os.path.getsize(smollm2)
    print(f"weight bytes / file bytes: {ratio:.3f}")
    assert ratio <= 1.15


def test_without_native_ops_matmul_takes_the_torch_reference(monkeypatch):
    """NVLLM_CPU_OPS=0 or no compiler: every row count goes through torch's
    dequantization and torch.mm, exactly matmul_tiles' torch path."""
    from nvllm.worker.layers import quant

    monkeypatch.setattr(quant, "_NATIVE", [False])
    gen = torch.Generator().manual_seed(2)
    qw = _random_quantized(INT4_MIN, 24, 64, gen)
    bias = torch.randn(24, generator=gen)
    for m in (1, 40):
        x = torch.randn(2, m, 64, generator=gen)
        want = torch.mm(x.view(-1, 64), qw.dequantize().t()) + bias
        assert torch.equal(qw.matmul(x, bias), want.view(2, m, 24))
