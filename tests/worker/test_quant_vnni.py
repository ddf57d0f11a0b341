"""The int8-activation op (nvllm/kernels/csrc/cpu_quant_vnni.cpp) and its dispatch.

The contract (tests/support/quant_acts.py states it with its bound): x's rows rounded to
int8 per group of 32 (dx = max|x| * (1/127)), times the dequantized weights, up to
float32 summation order. Tested on shapes whose K is not a multiple of 256 or of the
kernel's 4-group step, tp-sharded ones, 1..8 rows and a second pass of 8; whichever loop
this machine built (AVX-512 VNNI, AVX2 or the portable one). Greedy equality is not
promised with quantized activations: on a tiny model the logits are held to a KL and
top-1 bound against the same weights with float activations.
"""

from __future__ import annotations

import pytest
import torch

from nvllm.kernels import cpu_ops
from nvllm.worker.layers import quant
from nvllm.worker.layers.quant import INT4, INT4_MIN, INT4_MIN32, INT8, INT8_MIN
from tests.support.quant_acts import check_contract, kl_top1, tiny_model_logits, weight

pytestmark = pytest.mark.skipif(not cpu_ops.load(), reason="nvllm's CPU ops did not build")

FORMATS = [INT8, INT8_MIN, INT4, INT4_MIN, INT4_MIN32]


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a8_op_is_int8_rounded_x_times_dequantized_weights(fmt, dtype):
    check_contract(cpu_ops.quant_linear_a8, 127, fmt, dtype)


def test_dispatch_rule_and_the_off_switch(monkeypatch):
    """Up to A8_MAX_ROWS rows (where vectorized) matmul is the a8 op's result exactly,
    beyond it the float op's; off: always the float op; a bad value names the choices."""
    gen = torch.Generator().manual_seed(1)
    qw = weight(INT4_MIN, 24, 96, gen)
    limit = quant.A8_MAX_ROWS[4]
    for mode in ("int8", "off", "int8-always"):
        monkeypatch.setattr(quant, "_ACT", [])
        monkeypatch.setenv(quant.ACT_ENV, mode)
        for m in (1, limit, limit + 1):
            x = torch.randn(m, 96, generator=gen)
            a8 = mode == "int8-always" or (mode == "int8" and m <= limit
                                           and cpu_ops.quant_a8_vectorized())
            op = cpu_ops.quant_linear_a8 if a8 else cpu_ops.quant_linear
            assert torch.equal(qw.matmul(x), op(x, qw.qweight, qw.scales, qw.mins, 4)), \
                (mode, m)
    monkeypatch.setattr(quant, "_ACT", [])
    monkeypatch.setenv(quant.ACT_ENV, "yes")
    with pytest.raises(ValueError, match="auto, off, int8, int8-always, int16-always"):
        qw.matmul(torch.randn(1, 96))


@pytest.mark.parametrize("fmt", [INT8, INT4_MIN], ids=lambda f: f.name)
def test_tiny_model_logits_with_int8_activations(qwen3_h256, monkeypatch, fmt):
    """Every decoder linear of a tiny Qwen3 (hidden 256, MLP 512) held in ``fmt`` and run
    through ``matmul`` with x quantized per 32 (``int8-always``: every row), teacher-forced
    over 48 tokens. Against the same model with x rounded by round_x in torch and
    F.linear (what the op promises, composed through the layers): per-position KL <=
    0.02 nats, the same argmax on >= 95% of positions (measured: 5e-3, 100%). Against
    float activations (what quantizing x costs): mean KL <= 0.25, top-1 >= 80%
    (measured: int8 0.035 / 96%, int4+min 0.12 / 88%). Loose, because this random
    model's logits are far peakier than a trained one's (std ~17, the top token ~0.9;
    each linear's relative error is the expected ~0.6%): the real model's figures are
    scripts/quant_quality.py's (docs/quantization.md)."""
    monkeypatch.setattr(quant, "_ACT", ["int8-always"])
    logits = tiny_model_logits(qwen3_h256, fmt, 127)
    kl, top1 = kl_top1(logits["emulated"], logits["got"])
    assert float(kl.max()) <= 0.02 and top1 >= 0.95, (float(kl.max()), top1)
    kl, top1 = kl_top1(logits["ref"], logits["got"])
    assert float(kl.mean()) <= 0.25 and top1 >= 0.8, (float(kl.mean()), top1)
    assert float(kl.mean()) > 0  # x was quantized: the logits moved
