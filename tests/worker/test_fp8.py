"""fp8 weights (nvllm/worker/layers/fp8.py): e4m3 values with one float32 scale per output
channel, quantized at load by ``quantization=fp8``.

- quantize_fp8: each value within half an e4m3 step of the original (relative 2^-4, or
  the subnormal step near zero), a row's absmax maps to 448, quantizing the dequantized
  values again gives them back (the e2e test relies on it).
- the reference matmul equals dequantize-then-matmul.
- loading: a column shard's scales are its full rows' (tp-invariant values); a tiny
  model's linear layers load as fp8 at tp 1 and 2 and hold the values the whole tensors
  quantize to.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig

from nvllm.common.model_source import resolve_model_source
from nvllm.worker.layers.fp8 import FP8_MAX, Fp8Weight, quantize_fp8
from nvllm.worker.layers.linear import linear
from nvllm.worker.loader import load_weights
from nvllm.worker.models import MODEL_REGISTRY
from nvllm.worker.parallel import TPContext
from nvllm.worker.quantize import quantize_model, weight_bytes
from tests.support.float_bounds import EPS32


def test_quantize_fp8_rounds_to_nearest_e4m3_and_is_idempotent():
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(16, 200, generator=gen) * torch.rand(16, 1, generator=gen) * 10
    w[2] = 0
    q, s = quantize_fp8(w)
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32 and s.shape == (16,)
    qf = q.float()
    assert bool((qf.abs().amax(1)[w.abs().amax(1) > 0] == FP8_MAX).all())
    assert bool((qf[2] == 0).all())
    # e4m3: 3 mantissa bits (half a step: relative 2^-4), subnormal step 2^-9
    err = (qf * s.unsqueeze(1) - w).abs()
    assert bool((err <= (w.abs() * 2.0 ** -4 + 2.0 ** -10 * s.unsqueeze(1)) * 1.001).all())
    fw = Fp8Weight(16, 200)
    fw.write(0, 0, q, s)
    deq = fw.dequantize()
    again = Fp8Weight(16, 200)
    again.write(0, 0, *quantize_fp8(deq))
    assert torch.equal(again.dequantize(), deq)


def test_reference_matmul_equals_dequantize_then_matmul():
    gen = torch.Generator().manual_seed(1)
    fw = Fp8Weight(50, 70)  # no group constraint on K
    fw.write(0, 0, *quantize_fp8(torch.randn(50, 70, generator=gen)))
    bias = torch.randn(50, generator=gen)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(2, 3, 70, generator=gen).to(dtype)
        got = fw.matmul(x, bias.to(dtype))
        want = torch.nn.functional.linear(x, fw.dequantize(dtype=dtype), bias.to(dtype))
        assert got.shape == (2, 3, 50) and got.dtype == dtype
        w = fw.dequantize(dtype=dtype).double()
        bound = 70 * EPS32 * (x.abs().double() @ w.abs().t()) + 1e-6
        if dtype == torch.bfloat16:  # the product and the bias added: two roundings
            bound = bound + (x.abs().double() @ w.abs().t() + bias.abs()) * 2.0 ** -7
        assert bool(((got.double() - want.double()).abs() <= bound).all()), dtype


def test_column_shard_takes_its_full_rows_scales():
    gen = torch.Generator().manual_seed(2)
    src = torch.randn(9, 64, generator=gen)
    src[:, 40:] *= 5  # the rows' absmax lies outside the first shard's columns
    whole = Fp8Weight(9, 64)
    whole.load(src, 0, 0, 9, 0, row_chunk=4)
    q, s = quantize_fp8(src)
    assert torch.equal(whole.scales, s) and torch.equal(whole.qweight.float(), q.float())
    for start, end in ((0, 40), (40, 64)):  # two ranks' row-parallel shards
        part = Fp8Weight(9, end - start)
        part.load(src, 1, start, end, 0, row_chunk=4)
        assert torch.equal(part.dequantize(), whole.dequantize()[:, start:end])
    with pytest.raises(ValueError, match="does not fit"):
        Fp8Weight(9, 32).load(src, 0, 0, 9, 0, row_chunk=4)


@pytest.mark.parametrize("tp", [1, 2])
def test_model_linears_load_as_fp8(tiny, tp):
    """quantization=fp8 makes every linear layer fp8 (the embedding and the head stay
    dense); each rank holds the whole tensors' quantized values, and its layers compute
    F.linear of them."""
    model_dir = tiny("qwen3")
    source = resolve_model_source(model_dir)
    cfg = AutoConfig.from_pretrained(model_dir)
    tensors = {}
    for f in Path(model_dir).glob("*.safetensors"):
        tensors.update(load_file(f))
    for rank in range(tp):
        model = MODEL_REGISTRY[cfg.architectures[0]](cfg, TPContext(rank, tp), torch.float32,
                                                     64, "torch")
        dense_bytes = weight_bytes(model)
        done = quantize_model(model, source, "fp8")
        assert set(done.values()) == {"fp8"}
        assert len(done) == 4 * cfg.num_hidden_layers  # qkv, o, gate_up, down
        load_weights(model, source, show_progress=False)
        assert weight_bytes(model) < dense_bytes
        down = model.layers[0].mlp.down_proj
        fw = down.packed
        assert isinstance(fw, Fp8Weight)
        full = tensors["model.layers.0.mlp.down_proj.weight"].float()
        k = fw.k
        want = Fp8Weight(*full.shape)
        want.write(0, 0, *quantize_fp8(full))
        assert torch.equal(fw.dequantize(), want.dequantize()[:, rank * k:(rank + 1) * k])
        x = torch.randn(3, k)
        torch.testing.assert_close(linear(x, down), x @ fw.dequantize().t())
