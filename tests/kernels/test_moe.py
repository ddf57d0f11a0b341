"""The grouped torch fused_moe against a naive per-(token, choice) loop."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from nvllm.kernels import ops
from nvllm.kernels.moe import fused_moe

T, H, INTER, E, K = 13, 16, 12, 5, 3


def naive(x, w13, w2, ids, weights, start):
    out = torch.zeros(x.shape, dtype=torch.float32)
    for t in range(ids.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j]) - start
            if 0 <= e < w13.shape[0]:
                gate, up = (w13[e].float() @ x[t].float()).chunk(2)
                out[t] += weights[t, j] * (w2[e].float() @ (F.silu(gate) * up))
    return out


def assert_close_f32(got: torch.Tensor, want: torch.Tensor) -> None:
    """Float32 grouped vs per-token: the same sums in other orders (other GEMM shapes, so
    other CPU kernels: AVX2, AVX-512, AMX blockings). Any order of an n-term float32 sum is
    within n*eps*sum|terms| of the exact one (Higham's gamma_n); the chain is the gate/up
    sums (H terms), the down sums (INTER) and the top-K (+ the ranks' sum), with terms of
    the order of the largest output: n*eps*max|want| on any x86-64 CPU."""
    tol = (H + INTER + K + 1) * torch.finfo(torch.float32).eps * float(want.abs().max())
    torch.testing.assert_close(got, want, rtol=0, atol=tol)


def inputs(seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).to(dtype)
    w13 = (torch.randn(E, 2 * INTER, H, generator=g) / H ** 0.5).to(dtype)
    w2 = (torch.randn(E, H, INTER, generator=g) / INTER ** 0.5).to(dtype)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    weights = torch.rand(T, K, generator=g)
    return x, w13, w2, ids, weights


def test_grouped_equals_per_token_loop():
    x, w13, w2, ids, weights = inputs()
    got = fused_moe(x, w13, w2, ids, weights, 0)
    assert got.dtype == torch.float32 and got.shape == (T, H)
    assert_close_f32(got, naive(x, w13, w2, ids, weights, 0))
    torch.testing.assert_close(ops.fused_moe(x, w13, w2, ids, weights, 0, "cpu"), got)


@pytest.mark.parametrize("split", [1, 3, 4])
def test_expert_ranges_contribute_only_their_own_and_sum_to_the_whole(split):
    """Expert parallelism: ranks holding [0, split) and [split, E) add up to all experts."""
    x, w13, w2, ids, weights = inputs(1)
    lo = fused_moe(x, w13[:split], w2[:split], ids, weights, 0)
    hi = fused_moe(x, w13[split:], w2[split:], ids, weights, split)
    assert_close_f32(lo, naive(x, w13[:split], w2[:split], ids, weights, 0))
    assert_close_f32(lo + hi, fused_moe(x, w13, w2, ids, weights, 0))
    untouched = ~((ids >= split).any(dim=1))  # tokens routed to no expert of `hi`
    assert untouched.any() or split == 1
    assert (hi[untouched] == 0).all()


def test_no_local_pairs_or_no_local_experts_give_zeros():
    x, w13, w2, ids, weights = inputs(2)
    assert (fused_moe(x, w13[:2], w2[:2], ids, weights, E) == 0).all()
    assert (fused_moe(x, w13[:0], w2[:0], ids, weights, 0) == 0).all()


def test_bfloat16_keeps_the_dtype_and_accumulates_in_float32():
    x, w13, w2, ids, weights = inputs(3, torch.bfloat16)
    got = fused_moe(x, w13, w2, ids, weights, 0)
    assert got.dtype == torch.bfloat16
    ref = naive(x, w13, w2, ids, weights, 0)
    torch.testing.assert_close(got.float(), ref, rtol=3e-2, atol=3e-2)
