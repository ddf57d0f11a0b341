"""The AMX op (nvllm/kernels/csrc/cpu_quant_amx.cpp), its dispatch (under the default
NVLLM_QUANT_ACTIVATIONS=auto, from AMX_MIN_ROWS rows where it is usable), and what it
does to a model's logits.

The contract: float32 x split into xh = bf16(x) and xl = bf16(x - xh) (each to nearest
even; bfloat16 x: xh = x, xl = 0), the weights' integers times xh + xl summed in float32
per group, each group's scale applied in float32, plus each group's min times the float32
sum of x. So against that computed exactly (float64):

    |y - y_split| <= K * eps32 * sum_j |x_j| (|d q_nj| + |m_n|) * (1 + 2^-7)   (float32 sums)

and against the float reference x W^T, x's split adds at most 2^-17 |x_j| |d q_nj| per
value (+ bfloat16's final rounding for bfloat16 outputs). Tested on the shapes the other
activation ops are (tests/support/quant_acts.py), output columns not a multiple of 16, and
1 to 130 rows (a tile of 16 rows partly filled; 128-row passes and one more).
"""

from __future__ import annotations

import pytest
import torch

from nvllm.kernels import cpu_ops
from nvllm.worker.layers import quant
from nvllm.worker.layers.quant import INT4, INT4_MIN, INT4_MIN32, INT8, INT8_MIN, dequantize
from tests.support.float_bounds import EPS32
from tests.support.quant_acts import SHAPES, kl_top1, sample_x, tiny_model_logits, weight

AMX = cpu_ops.quant_amx_usable()
needs_amx = pytest.mark.skipif(not AMX, reason="no AMX on this CPU (or the ops did not build)")

FORMATS = [INT8, INT8_MIN, INT4, INT4_MIN, INT4_MIN32]
ROWS = (1, 8, 15, 16, 17, 33, 130)


def split_x(x: torch.Tensor) -> torch.Tensor:
    """xh + xl as the op forms them (float64)."""
    xf = x.float()
    xh = xf.bfloat16().float()
    xl = (xf - xh).bfloat16().float()
    return xh.double() + xl.double()


@needs_amx
@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_amx_op_is_split_x_times_dequantized_weights(fmt, dtype):
    gen = torch.Generator().manual_seed(0)
    for n, k in SHAPES:
        qw = weight(fmt, n, k, gen)
        no_min = dequantize(fmt, qw.qweight, qw.scales, None).double()
        mins = (torch.zeros(n, k // 32, dtype=torch.float64) if qw.mins is None
                else qw.mins.double())
        terms = no_min.abs() + mins.abs().repeat_interleave(32, dim=1)
        for m in ROWS:
            x = sample_x(m, k, dtype, gen)
            got = cpu_ops.quant_linear_amx(x, qw.qweight, qw.scales, qw.mins, fmt.bits)
            assert got.dtype == dtype and got.shape == (m, n)
            xs = x.double().reshape(m, -1, 32).sum(-1)
            split = split_x(x) @ no_min.t() + xs @ mins.t()
            sums = k * EPS32 * (1 + 2.0 ** -7) * (x.abs().double() @ terms.t())
            if dtype == torch.bfloat16:
                sums = sums + split.abs() * 2.0 ** -8
            err = (got.double() - split).abs()
            assert bool((err <= sums).all()), (fmt.name, n, k, m, float(err.max()))
            exact = x.double() @ (no_min + mins.repeat_interleave(32, dim=1)).t()
            bound = sums + 2.0 ** -17 * (x.abs().double() @ no_min.abs().t())
            assert bool(((got.double() - exact).abs() <= bound).all()), (fmt.name, n, k, m)


@needs_amx
def test_bfloat16_x_is_exact_up_to_sums():
    """bfloat16 x needs no low half: the op's result then differs from dequantize-then-
    matmul only by the float32 sums' order (what the greedy-equality tests of a bfloat16
    run rely on), far inside the float32 split's bound."""
    gen = torch.Generator().manual_seed(5)
    qw = weight(INT4_MIN, 48, 576, gen)
    x = torch.randn(16, 576, generator=gen).bfloat16()
    got = cpu_ops.quant_linear_amx(x.float(), qw.qweight, qw.scales, qw.mins, 4)
    ref = x.double() @ qw.dequantize().double().t()
    scale = x.abs().double() @ qw.dequantize().abs().double().t()
    assert float(((got.double() - ref).abs() / scale).max()) < 576 * EPS32


@needs_amx
def test_dispatch_from_amx_min_rows(monkeypatch):
    """auto: from AMX_MIN_ROWS rows matmul is the AMX op's result exactly, below it the
    int16 op's (up to A16_MAX_ROWS, its AVX2 loop built) or the float op's; off: never
    the AMX op; bf16x2-always: the AMX op at every row count."""
    gen = torch.Generator().manual_seed(1)
    qw = weight(INT4_MIN, 40, 96, gen)
    args = (qw.qweight, qw.scales, qw.mins, 4)
    limit = quant.AMX_MIN_ROWS
    monkeypatch.delenv(quant.ACT_ENV, raising=False)
    for mode in (None, "off", "bf16x2-always"):
        monkeypatch.setattr(quant, "_ACT", [])
        if mode is not None:
            monkeypatch.setenv(quant.ACT_ENV, mode)
        for m in (1, limit - 1, limit, 3 * limit):
            x = torch.randn(m, 96, generator=gen)
            amx = mode == "bf16x2-always" or (mode is None and m >= limit)
            a16 = (mode is None and m <= quant.A16_MAX_ROWS[4]
                   and cpu_ops.quant_a16_vectorized())
            want = (cpu_ops.quant_linear_amx(x, *args) if amx
                    else cpu_ops.quant_linear_a16(x, *args) if a16
                    else cpu_ops.quant_linear(x, *args))
            if mode == "off" and m > quant.native_max_rows(x.dtype):
                want = qw.matmul_tiles(x, True)
            assert torch.equal(qw.matmul(x), want), (mode, m)


def test_bf16x2_always_without_amx_says_so(monkeypatch):
    """Where the AMX op is not usable, asking for it at every row count is an error that
    names the reason (auto then keeps the other ops: off where none is built)."""
    monkeypatch.setattr(quant, "_OPS", {"amx": False, "a16": False, "a8": False})
    monkeypatch.setattr(quant, "_ACT", [])
    monkeypatch.setenv(quant.ACT_ENV, "bf16x2-always")
    with pytest.raises(ValueError, match="needs the AMX op"):
        quant.act_mode()
    monkeypatch.setattr(quant, "_ACT", [])
    monkeypatch.setenv(quant.ACT_ENV, "auto")
    assert quant.act_mode() == "off" and quant.amx_min_rows() == 0


def test_usable_only_with_the_cpu_flags():
    """The op reports itself usable only on a CPU with AMX-TILE and AMX-BF16 (built with
    -march=native there); elsewhere the library still loads and says no."""
    if not cpu_ops.load():
        pytest.skip("nvllm's CPU ops did not build")
    flags = cpu_ops._cpu_flags().split()
    if cpu_ops.quant_amx_usable():
        assert "amx_tile" in flags and "amx_bf16" in flags
    elif "amx_bf16" not in flags:
        with pytest.raises(RuntimeError, match="no AMX"):
            cpu_ops.quant_linear_amx(torch.zeros(1, 32), torch.zeros(16, 32, dtype=torch.int8),
                                     torch.ones(16, 1, dtype=torch.float16), None, 8)


@needs_amx
@pytest.mark.parametrize("fmt", [INT8, INT4_MIN], ids=lambda f: f.name)
def test_tiny_model_logits_with_bf16x2_activations(qwen3_h256, monkeypatch, fmt):
    """A tiny Qwen3's decoder linears in ``fmt`` through ``matmul`` with x split into two
    bfloat16s at every row (``bf16x2-always``), teacher-forced over 48 tokens, against
    float activations: max KL <= 1e-4, mean <= 1e-5, the same argmax everywhere (as
    tests/worker/test_quant_a16.py holds int16; measured: max 9.9e-8 / 5.6e-7, mean
    6.2e-9 / 3.1e-8 for int8 / int4+min, against int16's 6.0e-6 / 5.0e-6 and 4.8e-7 /
    5.3e-7)."""
    monkeypatch.setattr(quant, "_ACT", ["bf16x2-always"])
    logits = tiny_model_logits(qwen3_h256, fmt, 32767)
    kl, top1 = kl_top1(logits["ref"], logits["got"])
    assert float(kl.max()) <= 1e-4 and float(kl.mean()) <= 1e-5 and top1 == 1.0, \
        (float(kl.max()), float(kl.mean()), top1)
    assert float(kl.mean()) > 0  # x was split: the logits moved


def test_worker_log_names_the_routes(monkeypatch):
    """What a worker logs at load names each op the mode takes on this build, with its
    row limits: AMX's where it is usable, none of them under off."""
    if not cpu_ops.load():
        pytest.skip("nvllm's CPU ops did not build")
    monkeypatch.setattr(quant, "_ACT", ["auto"])
    text = quant.describe_cpu_routes()
    assert ("AMX" in text) == AMX and (f"from {quant.AMX_MIN_ROWS} rows" in text) == AMX
    assert ("int16" in text) == cpu_ops.quant_a16_vectorized()
    monkeypatch.setattr(quant, "_ACT", ["off"])
    text = quant.describe_cpu_routes()
    assert "AMX" not in text and "int16" not in text and text.startswith(
        f"{quant.ACT_ENV}=off: the float op up to")
