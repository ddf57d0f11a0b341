"""GGUF K-quants held quantized (nvllm/worker/gguf_kquants.py): random valid blocks of
each type repack into the engine's groups of 32 within the documented bound of
``gguf.quants.dequantize`` (docs/quantization.md: fp16 rounding of each sub-block's
scale and min for Q4_K / Q5_K; Q6_K / Q3_K / Q2_K re-quantized per 32), shards cutting a
256-value super-block included; a tiny model written with mixed K-quant tensors loads
every linear, the embedding and the head quantized, each within that bound of the dense
load's values on both ranks of tp 2."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize
from transformers import AutoConfig

from nvllm.common.model_source import resolve_model_source
from nvllm.worker.gguf_kquants import KQUANT_TYPES, repack_kquant
from nvllm.worker.layers.quant import GROUP, INT4, INT4_MIN, INT8, INT8_MIN, QuantizedWeight
from nvllm.worker.loader import load_weights
from nvllm.worker.quantize import quantize_model
from tests.support.float_bounds import EPS32
from tests.support.gguf_files import KQUANT_MIX, random_kquant_blocks, write_kquant_gguf
from tests.worker.test_quant import _model

# type -> the formats it repacks into (the first: its own, what quantization=auto picks)
HOLDS = {Q.Q4_K: [INT4_MIN, INT8_MIN], Q.Q5_K: [INT8_MIN], Q.Q6_K: [INT8, INT8_MIN],
         Q.Q3_K: [INT8, INT8_MIN], Q.Q2_K: [INT8_MIN]}
HALF_ULP16 = 2.0 ** -11  # fp16 rounding, relative


def error_bound(qtype, qw: QuantizedWeight, ref: np.ndarray) -> np.ndarray:
    """The documented bound on |repacked - ggml| per value, from what qw stores: Q4_K /
    Q5_K: half an fp16 ulp of scale * q and of min (|scale q| <= |value| + |min|);
    Q6_K / Q3_K: |S| (half a step, a whole one at a clamp) plus fp16's rounding of S
    times up to 128 (2^-4 |S|); Q2_K: 3/4 |S| (fp16's rounding of S moves the range's
    top) + half an ulp of the min; plus float32's."""
    s = qw.scales.float().repeat_interleave(GROUP, 1).numpy()
    m = (qw.mins.float().repeat_interleave(GROUP, 1).numpy() if qw.mins is not None
         else np.zeros_like(s))
    a = np.abs(ref)
    if qtype in (Q.Q4_K, Q.Q5_K):
        bound = HALF_ULP16 * (a + 2 * np.abs(m)) * (1 + 2 * HALF_ULP16)
    elif qtype in (Q.Q6_K, Q.Q3_K):
        bound = np.abs(s) * (1 + 2.0 ** -4)
    else:
        bound = 0.75 * np.abs(s) + HALF_ULP16 * np.abs(m)
    return bound + 4 * EPS32 * (a + np.abs(m))


@pytest.mark.parametrize("qtype", KQUANT_TYPES, ids=lambda q: q.name)
def test_kquant_blocks_repack_within_bound(qtype):
    rng = np.random.default_rng(int(qtype))
    raw = random_kquant_blocks(qtype, 16, 1024, rng)
    ref = dequantize(raw, qtype)
    for fmt in HOLDS[qtype]:
        qw = QuantizedWeight(fmt, 16, 1024)
        qw.write(0, 0, *repack_kquant(raw, qtype, fmt))
        err = np.abs(qw.dequantize().numpy() - ref)
        assert (err <= error_bound(qtype, qw, ref)).all(), (fmt.name, err.max())
        assert err.max() > 0  # (the bound is not vacuous: these types are not exact)
    for fmt in {INT4, INT4_MIN, INT8, INT8_MIN} - set(HOLDS[qtype]):
        assert repack_kquant(raw, qtype, fmt) is None, fmt.name


def test_scales_past_fp16_are_not_repacked():
    raw = random_kquant_blocks(Q.Q6_K, 2, 256, np.random.default_rng(0))
    raw[:, 208:210] = np.full((2, 1), 60000, np.float16).view(np.uint8)  # d * sc / 4 > 65504
    raw[:, 192:208] = 127
    assert repack_kquant(raw, Q.Q6_K, INT8) is None




LAYER_TYPES = {"qkv_proj": [Q.Q4_K, Q.Q6_K], "o_proj": [Q.Q3_K], "gate_up_proj": [Q.Q2_K, Q.Q5_K],
               "down_proj": [Q.Q6_K], "embed_tokens": [Q.Q4_K], "lm_head": [Q.Q6_K]}


# (tp 2 cuts what tp 1 reads whole; tests/e2e/test_quantization.py runs tp 1.)
@pytest.mark.parametrize("tp", [2])
def test_kquant_model_layers_within_bound(qwen3_h256, tmp_path, tp):
    """Every layer quantized in the join of its tensors' formats (q/k Q4_K + v Q6_K:
    int8+min), each rank's values within the bound of the dense load's (o_proj's input
    cut mid super-block at tp 2)."""
    path = tmp_path / "k.gguf"
    write_kquant_gguf(qwen3_h256, path, KQUANT_MIX, np.random.default_rng(0))
    source = resolve_model_source(path)
    cfg = AutoConfig.from_pretrained(qwen3_h256)
    want = {"qkv_proj": "int8+min", "o_proj": "int8", "gate_up_proj": "int8+min",
            "down_proj": "int8", "embed_tokens": "int4+min", "lm_head": "int8"}
    for rank in range(tp):
        ours, dense = _model(cfg, rank, tp), _model(cfg, rank, tp)
        done = quantize_model(ours, source, "auto")
        assert {n: want[n.rsplit(".", 1)[-1]] for n in done} == done and len(done) == 10
        load_weights(ours, source, show_progress=False)
        load_weights(dense, source, show_progress=False)
        dense_mods = dict(dense.named_modules())
        for name in done:
            q, d = dict(ours.named_modules())[name], dense_mods[name]
            qw = q.packed if hasattr(q, "packed") else q.quant
            ref = d.weight.numpy()
            err = np.abs(qw.dequantize().numpy() - ref)
            # each row within its own type's bound: the largest of the layer's types'
            bound = np.max([error_bound(t, qw, ref) for t in LAYER_TYPES[name.rsplit(".", 1)[-1]]],
                           axis=0)
            assert (err <= bound).all(), (name, err.max())
            assert torch.isfinite(qw.dequantize()).all()
