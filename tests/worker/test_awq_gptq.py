"""AWQ / GPTQ checkpoints (nvllm/worker/awq_gptq.py), written by the test's own packer
(tests/support/int4_checkpoints.py) from random float weights:

- a packed tensor reads (any row / column range, as a dense parameter would) and repacks
  (int4+min32, int8: shards of rows and of whole 32-column groups) to exactly the
  reference's scale * (q - z);
- tiny models (AWQ at tp 2, GPTQ at tp 1): every rank's quantized linear holds exactly
  the values the dequantized float checkpoint loads (embedding and head stay dense), and
  the layers
  multiply within float32 summation's bound of F.linear on those values;
- what cannot be read says why (act-order g_idx, 8 bits, unknown methods).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import AutoConfig

from nvllm.common.model_source import resolve_model_source
from nvllm.worker.awq_gptq import Int4CheckpointConfig, PackedInt4Slice, checkpoint_quant_config
from nvllm.worker.layers.linear import linear
from nvllm.worker.layers.quant import INT4_MIN32, INT8, INT8_MIN, QuantizedWeight
from nvllm.worker.loader import load_weights
from nvllm.worker.quantize import load_quantized, quantize_model
from tests.support.int4_checkpoints import (
    dequantize_ref,
    pack_awq,
    pack_gptq,
    quantize_rtn,
    write_int4_checkpoint,
)
from tests.worker.test_quant import _model, matmul_bound

N, K, G = 40, 512, 128


def _packed_tensor(tmp_path: Path, method: str, g_idx: torch.Tensor | None = None):
    """A [N, K] weight packed as ``method`` in a file: (open file, slice, reference)."""
    w = torch.randn(N, K, generator=torch.Generator().manual_seed(1))
    q, z, s = quantize_rtn(w, G, zmin=0 if method == "awq" else 1)
    parts = pack_awq(q, z, s) if method == "awq" else pack_gptq(q, z, s, G)
    if g_idx is not None:
        parts["g_idx"] = g_idx
    save_file({f"l.{k}": v for k, v in parts.items()}, tmp_path / "t.safetensors")
    f = safe_open(str(tmp_path / "t.safetensors"), framework="pt")
    cfg = Int4CheckpointConfig(method, G, 0 if method == "awq" else 1)
    get = {k: f.get_slice(f"l.{k}") for k in parts}
    src = PackedInt4Slice("l", cfg, get["qweight"], get["qzeros"], get["scales"],
                          get.get("g_idx"))
    return f, src, dequantize_ref(q, z, s, G)


@pytest.mark.parametrize("method", ["awq", "gptq"])
def test_packed_tensor_reads_and_repacks_exactly(tmp_path, monkeypatch, method):
    from nvllm.worker import quantize as quantize_mod

    monkeypatch.setattr(quantize_mod, "ROW_CHUNK", 7)  # shards read in several chunks
    f, src, ref = _packed_tensor(tmp_path, method)
    with f:
        assert src.get_shape() == [N, K]
        assert torch.equal(src[:], ref)
        for rows, cols in [((3, 37), (0, K)), ((0, N), (96, 448)), ((5, 6), (33, 70))]:
            assert torch.equal(src[rows[0]:rows[1], cols[0]:cols[1]],
                               ref[rows[0]:rows[1], cols[0]:cols[1]])
        for fmt in (INT4_MIN32, INT8, INT8_MIN):
            rows = QuantizedWeight(fmt, 34, K)
            load_quantized(rows, src, 0, 3, 37, 0)  # output rows cut inside an int32
            assert torch.equal(rows.dequantize(), ref[3:37]), fmt.name
            cols = QuantizedWeight(fmt, N, 352)
            load_quantized(cols, src, 1, 96, 448, 0)  # input cut inside a group of 128
            assert torch.equal(cols.dequantize(), ref[:, 96:448]), fmt.name


def test_unreadable_checkpoints_say_why(tmp_path):
    g_idx = torch.arange(K, dtype=torch.int32).flip(0) // G  # act-order: not k // G
    with pytest.raises(ValueError, match="desc_act=False"):
        _packed_tensor(tmp_path, "gptq", g_idx)
    for qcfg, match in [({"quant_method": "gptq", "bits": 8, "group_size": 128}, "4-bit"),
                        ({"quant_method": "bitsandbytes"}, "awq and gptq"),
                        ({"quant_method": "awq", "bits": 4, "version": "gemv"}, "GEMM"),
                        ({"quant_method": "gptq", "bits": 4, "checkpoint_format": "marlin"},
                         "marlin")]:
        (tmp_path / "config.json").write_text(json.dumps({"quantization_config": qcfg}))
        with pytest.raises(ValueError, match=match):
            checkpoint_quant_config(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(
        {"quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": -1,
                                 "checkpoint_format": "gptq_v2"}}))
    assert checkpoint_quant_config(tmp_path) == Int4CheckpointConfig("gptq", 0, 0)


# (AWQ at tp 1: tests/e2e/test_quantization.py runs it through the engine.)
@pytest.mark.parametrize("method,tp", [("awq", 2), ("gptq", 1)])
def test_model_layers_hold_the_reference_values(qwen3_h256, tmp_path, monkeypatch, method,
                                                tp):
    """Each rank's quantized linears equal the dequantized float checkpoint's shards
    (o_proj's and down_proj's input split at tp 2 cuts groups of 128 on 32-column
    boundaries); the embedding and the head are float in the checkpoint and stay dense.
    Float activations (NVLLM_QUANT_ACTIVATIONS=off), for the float32 sums' bound."""
    from nvllm.worker.layers import quant

    monkeypatch.setattr(quant, "_ACT", ["off"])
    packed, deq = write_int4_checkpoint(qwen3_h256, tmp_path / method, method)
    source, deq_source = resolve_model_source(packed), resolve_model_source(deq)
    cfg = AutoConfig.from_pretrained(packed)
    torch.manual_seed(0)
    for rank in range(tp):
        ours, dense = _model(cfg, rank, tp), _model(cfg, rank, tp)
        done = quantize_model(ours, source, "auto")
        # 2 layers x (qkv, o, gate_up, down)
        assert len(done) == 8 and set(done.values()) == {"int4+min32"}, done
        load_weights(ours, source, show_progress=False)
        load_weights(dense, deq_source, show_progress=False)
        dense_mods = dict(dense.named_modules())
        for name in done:
            q, d = dict(ours.named_modules())[name], dense_mods[name]
            assert torch.equal(q.packed.dequantize(), d.weight), f"{name} rank {rank}"
            x = torch.randn(3, d.weight.shape[1])
            err = (linear(x, q).double() - x.double() @ d.weight.double().t()).abs()
            assert bool((err <= matmul_bound(x, d.weight)).all()), name
        # dense (quantization=none) loads the same values from the packed checkpoint
        plain = _model(cfg, rank, tp)
        load_weights(plain, source, show_progress=False)
        for name, p in plain.named_parameters():
            assert torch.equal(p, dict(dense.named_parameters())[name]), name


def test_awq_scale_products_need_float32_mins():
    """Why int4+min32: -z * scale rounded to fp16 is not the checkpoint's value for most
    groups (so an fp16 min would move weights), in float32 it always is."""
    s = torch.randn(4096).abs().half().float() * 0.01
    z = torch.randint(0, 16, (4096,)).float()
    exact = -z * s
    assert torch.equal(exact.float(), (-z.double() * s.double()).float())
    inexact = (exact.half().float() != exact).float().mean()
    assert inexact > 0.3, float(inexact)
    np.testing.assert_array_equal(exact.numpy(), (-z * s).numpy())
