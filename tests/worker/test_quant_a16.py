"""The int16-activation op (nvllm/kernels/csrc/cpu_quant_a16.cpp), its dispatch (the
default on CPUs where its AVX2 loop is built: NVLLM_QUANT_ACTIVATIONS=auto), and what it
does to a model's logits.

The contract (tests/support/quant_acts.py states it with its bound): x's rows rounded to
int16 per group of 32 (dx = max|x| * (1/32767)), times the dequantized weights, up to
float32 summation order. Tested on shapes whose K is one group, exactly eight, or not a
multiple of eight groups (the loop's scalar tail), tp-sharded ones, 1..8 rows and a
second pass of 8; whichever loop this machine built (AVX2, or the portable one).
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
def test_a16_op_is_int16_rounded_x_times_dequantized_weights(fmt, dtype):
    check_contract(cpu_ops.quant_linear_a16, 32767, fmt, dtype)


def test_a16_is_far_finer_than_int8():
    """The point of int16: on the same weights and x, its distance from float x W^T is a
    small fraction of the int8 op's (x's rounding step is 1/258 of int8's)."""
    gen = torch.Generator().manual_seed(3)
    qw = weight(INT4_MIN, 64, 576, gen)
    x = torch.randn(2, 576, generator=gen)
    ref = x.double() @ qw.dequantize().double().t()
    args = (qw.qweight, qw.scales, qw.mins, 4)
    e16 = (cpu_ops.quant_linear_a16(x, *args).double() - ref).abs().max()
    e8 = (cpu_ops.quant_linear_a8(x, *args).double() - ref).abs().max()
    assert e16 < e8 / 30, (float(e16), float(e8))


def test_dispatch_rule_default_and_off(monkeypatch):
    """auto (the default): up to A16_MAX_ROWS rows matmul is the a16 op's result exactly
    where its AVX2 loop is built, else (and beyond, below the AMX op's rows) the float
    op's; off: always the float op; int16-always: the a16 op at every row count. auto
    stays auto where the a16 loop or the AMX op is built, else it is off."""
    gen = torch.Generator().manual_seed(1)
    qw = weight(INT4_MIN, 24, 96, gen)
    limit = quant.A16_MAX_ROWS[4]
    monkeypatch.delenv(quant.ACT_ENV, raising=False)
    for mode in (None, "off", "int16-always"):
        monkeypatch.setattr(quant, "_ACT", [])
        if mode is not None:
            monkeypatch.setenv(quant.ACT_ENV, mode)
        for m in (1, limit, limit + 1):
            x = torch.randn(m, 96, generator=gen)
            a16 = mode == "int16-always" or (mode is None and m <= limit
                                             and cpu_ops.quant_a16_vectorized())
            op = cpu_ops.quant_linear_a16 if a16 else cpu_ops.quant_linear
            assert torch.equal(qw.matmul(x), op(x, qw.qweight, qw.scales, qw.mins, 4)), \
                (mode, m)
        fast = cpu_ops.quant_a16_vectorized() or cpu_ops.quant_amx_usable()
        assert quant.act_mode() == (mode or ("auto" if fast else "off"))


@pytest.mark.parametrize("fmt", [INT8, INT4_MIN], ids=lambda f: f.name)
def test_tiny_model_logits_with_int16_activations(qwen3_h256, monkeypatch, fmt):
    """A tiny Qwen3's decoder linears in ``fmt`` through ``matmul`` with x rounded to int16
    at every row (``int16-always``), teacher-forced over 48 tokens (as
    tests/worker/test_quant_vnni.py holds int8). Against x rounded in torch and F.linear
    (float32 sums in another order, through a model whose logits are far peakier than a
    trained one's): per-position KL <= 1e-4 nats, the same argmax everywhere (measured:
    <= 3.3e-6, 100%). Against float activations: max KL <= 1e-4, mean <= 1e-5, top-1 >=
    98% (measured: max <= 4.7e-6, mean 4.5e-7, 100%; int8 activations: mean 0.036-0.05,
    top-1 92-96%)."""
    monkeypatch.setattr(quant, "_ACT", ["int16-always"])
    logits = tiny_model_logits(qwen3_h256, fmt, 32767)
    kl, top1 = kl_top1(logits["emulated"], logits["got"])
    assert float(kl.max()) <= 1e-4 and top1 == 1.0, (float(kl.max()), top1)
    kl, top1 = kl_top1(logits["ref"], logits["got"])
    assert float(kl.max()) <= 1e-4 and float(kl.mean()) <= 1e-5 and top1 >= 0.98, \
        (float(kl.max()), float(kl.mean()), top1)
    assert float(kl.mean()) > 0  # x was rounded: the logits moved
