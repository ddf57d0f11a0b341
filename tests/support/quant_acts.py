"""What the tests of the quantized-activation ops share (tests/worker/test_quant_vnni.py:
x in int8; tests/worker/test_quant_a16.py: x in int16): weights, inputs, x rounded as
the ops round it, the contract check, and a tiny model's logits run through them.

The contract of both ops: x's rows are rounded per group of 32 (dx = max|x| * (1/qmax),
qx = round(x * (1/dx)) to nearest, all in float32; a tie either way), and the op returns
the dequantized weights W times those values, xq = dx * qx, up to float32 summation
order. So against the float reference W x:

    |y - W x| <= sum_g (dx_g / 2) * sum_{j in g} |W_nj|   (x's rounding, at most half a step)
               + K * eps32 * sum_j |xq_j| (|d q_nj| + |m_n|)   (float32 sums, Higham)

(+ bfloat16's final rounding for bfloat16 outputs).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F

from nvllm.worker.layers.quant import QuantizedWeight, dequantize, quantize
from tests.support.float_bounds import EPS32

# (N, K): 3 groups (a partial step for int4 and int8), SmolLM2's 576 (18 groups, not a
# multiple of 256 or of 8 groups), its tp-2 row-parallel shards of 576 and 1536 columns,
# one group, and exactly eight.
SHAPES = [(40, 96), (33, 576), (24, 288), (16, 768), (5, 32), (9, 256)]
ROWS = (1, 2, 3, 5, 8, 11)  # 11: a second pass of up to 8 rows


def weight(fmt, n: int, k: int, gen) -> QuantizedWeight:
    qw = QuantizedWeight(fmt, n, k)
    qw.write(0, 0, *quantize(torch.randn(n, k, generator=gen) * 0.05, fmt))
    if qw.mins is not None:  # non-zero mins, so their term is exercised
        qw.mins.copy_(torch.randn(qw.mins.shape, generator=gen) * 0.01)
    return qw


def round_x(x: torch.Tensor, qmax: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x's rounded values dx * qx, dx per value, whether the value is within float
    rounding of a tie: -ffast-math builds may round those either way) as the ops do."""
    g = x.float().reshape(x.shape[0], -1, 32)
    d = g.abs().amax(-1, keepdim=True) * torch.tensor(1 / qmax, dtype=torch.float32)
    inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    scaled = g * inv
    q = torch.round(scaled).clamp(-qmax, qmax)
    tie = ((scaled.abs() - scaled.abs().floor() - 0.5).abs() < 1e-4).reshape(x.shape)
    return (q * d).reshape(x.shape), d.expand_as(g).reshape(x.shape), tie


def sample_x(m: int, k: int, dtype, gen) -> torch.Tensor:
    x = torch.randn(m, k, generator=gen)
    if k > 32:
        x[0, 32:64] = 0  # an all-zero group: dx = 0
    x[-1, :32] *= 100  # a large one
    return x.to(dtype)


def check_contract(op: Callable, qmax: int, fmt, dtype, seed: int = 0) -> None:
    """op(x, qweight, scales, mins, bits) holds the module docstring's bounds on every
    shape and row count."""
    gen = torch.Generator().manual_seed(seed)
    for n, k in SHAPES:
        qw = weight(fmt, n, k, gen)
        w = qw.dequantize().double()
        # |d q| + |m| per value: what the float32 sums' terms are made of
        no_min = dequantize(fmt, qw.qweight, qw.scales, None).abs().double()
        terms = no_min + (0 if qw.mins is None else
                          qw.mins.double().abs().repeat_interleave(32, dim=1))
        for m in ROWS:
            x = sample_x(m, k, dtype, gen)
            got = op(x, qw.qweight, qw.scales, qw.mins, fmt.bits)
            assert got.dtype == dtype and got.shape == (m, n)
            xq, dx, tie = round_x(x, qmax)
            sums = k * EPS32 * (xq.abs().double() @ terms.t())
            exact_q = xq.double() @ w.t()
            # a tie rounded the other way: one step of dx on that value
            sums = sums + (dx * tie).double() @ w.abs().t()
            if dtype == torch.bfloat16:
                sums = sums + exact_q.abs() * 2.0 ** -8
            err = (got.double() - exact_q).abs()
            assert bool((err <= sums).all()), (fmt.name, n, k, m, float(err.max()))
            rounding = (dx.double() / 2 * (1 + 1e-5)) @ w.abs().t()
            err = (got.double() - x.double() @ w.t()).abs()
            assert bool((err <= rounding + sums).all()), (fmt.name, n, k, m)


def kl_top1(ref: torch.Tensor, got: torch.Tensor) -> tuple[torch.Tensor, float]:
    kl = (ref.exp() * (ref - got)).sum(-1)
    return kl, float((ref.argmax(-1) == got.argmax(-1)).double().mean())


def tiny_model_logits(path, fmt, qmax: int) -> dict[str, torch.Tensor]:
    """Every decoder linear of the tiny HF model at ``path`` held in ``fmt``,
    teacher-forced over 48 tokens, as log-softmaxed logits: "ref" (F.linear, float x),
    "emulated" (x rounded by round_x in torch, then F.linear: what the op promises,
    composed through the layers) and "got" (``QuantizedWeight.matmul``, under whatever
    NVLLM_QUANT_ACTIVATIONS mode the caller set)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    held = []
    for mod in model.modules():
        if isinstance(mod, torch.nn.Linear) and mod is not model.lm_head:
            qw = QuantizedWeight(fmt, *mod.weight.shape)
            qw.write(0, 0, *quantize(mod.weight.detach(), fmt))
            mod.weight.data = qw.dequantize()
            held.append((mod, qw))
    assert len(held) == 7 * model.config.num_hidden_layers
    ids = torch.randint(0, model.config.vocab_size, (1, 48),
                        generator=torch.Generator().manual_seed(2))

    def run(forward) -> torch.Tensor:
        for mod, qw in held:
            mod.forward = functools.partial(forward, mod, qw)
        with torch.no_grad():
            return model(ids).logits[0].double().log_softmax(-1)

    return {
        "ref": run(lambda mod, qw, x: F.linear(x, mod.weight)),
        "emulated": run(lambda mod, qw, x: F.linear(
            round_x(x.reshape(-1, x.shape[-1]), qmax)[0].view(x.shape), mod.weight)),
        "got": run(lambda mod, qw, x: qw.matmul(x)),
    }
