"""nvllm's native CPU layer ops (cpu_ops: csrc/cpu_layer_ops.cpp) against their reference
twins, on contiguous and strided rows, in float32 and bfloat16."""

from __future__ import annotations

import pytest
import torch

from nvllm.kernels import cpu_ops, ops, reference

pytestmark = pytest.mark.skipif(not cpu_ops.load(), reason="nvllm's CPU ops are not built")

DTYPES = [torch.float32, torch.bfloat16]


def _close(got: torch.Tensor, want: torch.Tensor, n: int = 1) -> None:
    """n: the longest float32 sum behind each output (rms_norm: the row's length)."""
    assert got.dtype == want.dtype and got.shape == want.shape
    if got.dtype == torch.bfloat16:
        # The same roundings in the same places: at most one bfloat16 step apart where
        # float32 sums in another order land across a rounding boundary.
        torch.testing.assert_close(got.float(), want.float(), atol=1e-2, rtol=1.6e-2)
        assert (got != want).float().mean() < 0.02
    else:
        # The native op (built with -march=native -ffast-math: AVX2 or AVX-512 vector
        # widths, so other summation orders on other CPUs) and the reference round the
        # same operations. An n-term sum of positive terms (rms_norm's mean of squares), in
        # any order, is within n*eps of the exact one, relatively, and the rsqrt and the
        # products add a few eps: rtol (n + 8)*eps holds on any x86-64 CPU. Element-wise
        # ops keep 1e-5 (84 eps: fast-math exp is a few ulp) and atol 1e-5 for rotary's
        # two-term sums near 0 (inputs are randn: about 10 eps*|q|).
        rtol = max(1e-5, (n + 8) * torch.finfo(torch.float32).eps)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=rtol)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(7, 64), (1, 512), (33, 1408)])
def test_rms_norm(dtype, shape):
    g = torch.Generator().manual_seed(shape[0])
    x = (torch.randn(shape, generator=g) * 3).to(dtype)
    r = torch.randn(shape, generator=g).to(dtype)
    w = (torch.rand(shape[-1], generator=g) + 0.5).to(dtype)
    _close(cpu_ops.rms_norm(x, w, 1e-6), reference.rms_norm(x, w, 1e-6), shape[-1])
    for got, want in zip(cpu_ops.fused_add_rms_norm(x, r, w, 1e-6),
                         reference.fused_add_rms_norm(x, r, w, 1e-6)):
        _close(got, want, shape[-1])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rms_norm_of_strided_heads(dtype):
    """Qwen3's q_norm/k_norm: per-head rows of a view into the fused qkv output."""
    g = torch.Generator().manual_seed(3)
    qkv = torch.randn(5, (8 + 2 * 2) * 32, generator=g).to(dtype)
    q = qkv[:, :8 * 32].view(5, 8, 32)
    k = qkv[:, 8 * 32:10 * 32].view(5, 2, 32)
    w = (torch.rand(32, generator=g) + 0.5).to(dtype)
    for t in (q, k):
        assert not t.is_contiguous()
        _close(cpu_ops.rms_norm(t, w, 1e-6), reference.rms_norm(t, w, 1e-6), 32)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows,d", [(1, 1408), (9, 64), (40, 100)])
def test_silu_and_mul(dtype, rows, d):
    x = (torch.randn(rows, 2 * d, generator=torch.Generator().manual_seed(d)) * 4).to(dtype)
    _close(cpu_ops.silu_and_mul(x), reference.silu_and_mul(x))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("d", [32, 64, 128])
def test_rotary(dtype, d):
    g = torch.Generator().manual_seed(d)
    tokens, heads, kv_heads, max_pos = 6, 4, 2, 300
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    freqs = torch.outer(torch.arange(max_pos).float(), inv)
    emb = torch.cat((freqs, freqs), -1)
    cos, sin = emb.cos().contiguous(), emb.sin().contiguous()
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * d, generator=g).to(dtype)
    q = qkv[:, :heads * d].view(tokens, heads, d)
    k = qkv[:, heads * d:(heads + kv_heads) * d].view(tokens, kv_heads, d)
    pos = torch.tensor([0, 1, 7, 128, 299, 5])
    for got, want in zip(cpu_ops.rotary_embedding(pos, q, k, cos, sin),
                         reference.rotary_embedding(pos, q, k, cos, sin)):
        _close(got, want)


def test_auto_backend_on_cpu_is_the_native_one():
    cpu = torch.device("cpu")
    assert ops.resolve_backend("auto", cpu) == "cpu"
    assert ops.resolve_backend("torch", cpu) == "torch"
    x = torch.randn(3, 16)
    w = torch.ones(16)
    _close(ops.rms_norm(x, w, 1e-6, "cpu"), ops.rms_norm(x, w, 1e-6, "torch"), 16)
