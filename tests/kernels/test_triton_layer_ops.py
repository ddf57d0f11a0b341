"""Triton layer ops (RMSNorm, fused add + RMSNorm, rotary, SiLU-and-mul) against their torch
reference twins. On CPU the kernels run under the Triton interpreter."""

from __future__ import annotations

import os

# Must be set before triton is first imported, or kernels would need a GPU.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from transformers import LlamaConfig  # noqa: E402

from nvllm.kernels import ops, reference  # noqa: E402
from nvllm.kernels import triton_layer_ops as tlo  # noqa: E402
from nvllm.worker.layers.rotary import RotaryEmbedding, compute_inv_freq  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"
EPS = 1e-6
DTYPES = [torch.float32, torch.bfloat16, torch.float16]

# fp32 kernels differ from the reference only in summation order (norms) or not at all
# (rotary, up to FMA contraction on GPU). For 16-bit outputs allow ~2 ulp: rotary and
# SiLU-and-mul round once from fp32 where the reference rounds after each op.
TOL = {
    torch.float32: dict(rtol=2e-6, atol=2e-6),
    torch.bfloat16: dict(rtol=1.6e-2, atol=1e-2),
    torch.float16: dict(rtol=2e-3, atol=2e-3),
}


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def randn(*shape, dtype=torch.float32, seed=0, scale=1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=gen(seed)) * scale).to(dtype=dtype, device=DEVICE)


def assert_close(actual, expected, dtype):
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    torch.testing.assert_close(actual, expected, **TOL[dtype])


def qkv_views(t, heads, kv_heads, d, dtype, seed=0):
    """q, k as the attention layer makes them: strided views of one fused qkv output."""
    qkv = randn(t, (heads + 2 * kv_heads) * d, dtype=dtype, seed=seed)
    q, k, _ = qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
    q, k = q.view(-1, heads, d), k.view(-1, kv_heads, d)
    assert not q.is_contiguous() and not k.is_contiguous()
    return q, k


# --- RMSNorm ---------------------------------------------------------------------------

ROW_SHAPES = [(1, 64), (7, 96), (13, 128), (3, 1000)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows,hidden", ROW_SHAPES)
def test_rms_norm_rows(rows, hidden, dtype):
    x = randn(rows, hidden, dtype=dtype, seed=1, scale=3.0)
    w = randn(hidden, dtype=dtype, seed=2)
    out, ref = tlo.rms_norm(x, w, EPS), reference.rms_norm(x, w, EPS)
    assert_close(out, ref, dtype)
    assert_mostly_bit_identical(out, ref)


def assert_mostly_bit_identical(out, ref):
    # Same roundings as the reference (fp32 -> dtype before the weight, then once after it):
    # 16-bit outputs match bit for bit except where the fp32 summation order flips one.
    if out.dtype != torch.float32:
        assert (out == ref).float().mean() > 0.98


def test_rms_norm_eps_and_zero_rows():
    # Tiny activations, where eps matters, and an all-zero row (eps keeps it finite).
    x = randn(4, 96, seed=18, scale=1e-3)
    x[2] = 0.0
    w = randn(96, seed=19)
    out = tlo.rms_norm(x, w, 1e-5)
    assert torch.isfinite(out).all() and torch.equal(out[2], torch.zeros_like(out[2]))
    assert_close(out, reference.rms_norm(x, w, 1e-5), torch.float32)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows,hidden", ROW_SHAPES)
def test_fused_add_rms_norm_rows(rows, hidden, dtype):
    x = randn(rows, hidden, dtype=dtype, seed=3)
    r = randn(rows, hidden, dtype=dtype, seed=4, scale=4.0)
    w = randn(hidden, dtype=dtype, seed=5)
    x0, r0 = x.clone(), r.clone()
    out, summed = tlo.fused_add_rms_norm(x, r, w, EPS)
    ref_out, ref_sum = reference.fused_add_rms_norm(x, r, w, EPS)
    assert_close(out, ref_out, dtype)
    assert_mostly_bit_identical(out, ref_out)
    # The new residual stream is the correctly rounded sum, bit-identical to torch's (in
    # bf16 this checks the kernel's round-to-nearest-even; the interpreter would truncate).
    assert torch.equal(summed, ref_sum)
    # Functional, like the reference: the inputs are left alone.
    assert torch.equal(x, x0) and torch.equal(r, r0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("d", [128, 80])
def test_rms_norm_per_head_on_strided_qkv_views(d, dtype):
    # Qwen3 q_norm / k_norm: [T, heads, head_dim] views of the qkv output, several rows per
    # program (ragged last tile) and strides that no 2-D view can express.
    q, k = qkv_views(11, 4, 2, d, dtype, seed=6)
    w = randn(d, dtype=dtype, seed=7)
    for x in (q, k):
        out = tlo.rms_norm(x, w, EPS)
        assert out.is_contiguous()
        assert_close(out, reference.rms_norm(x, w, EPS), dtype)


def test_rms_norm_other_layouts():
    w = randn(96, seed=8)
    cases = {
        "1d": randn(96, seed=9),
        "4d": randn(2, 3, 5, 96, seed=10),
        "4d strided": randn(2, 3, 5, 2 * 96, seed=11)[..., :96],
        "last dim strided": randn(96, 6, seed=12).t(),
        "many short rows": randn(37, 96, seed=13),
    }
    for name, x in cases.items():
        torch.testing.assert_close(tlo.rms_norm(x, w, EPS), reference.rms_norm(x, w, EPS),
                                   **TOL[torch.float32], msg=name)


def test_rms_norm_mixed_dtypes_and_empty():
    # fp32 weight on bf16 activations promotes like the reference (weight * x.to(bf16)).
    x = randn(4, 64, dtype=torch.bfloat16, seed=14)
    w = randn(64, seed=15)
    assert_close(tlo.rms_norm(x, w, EPS), reference.rms_norm(x, w, EPS), torch.bfloat16)
    empty = torch.empty(0, 64, device=DEVICE)
    out, summed = tlo.fused_add_rms_norm(empty, empty, w, EPS)
    assert out.shape == summed.shape == (0, 64)


def test_rms_norm_large_values_do_not_overflow():
    # fp16 inputs whose squares overflow fp16: the variance must be accumulated in fp32.
    x = randn(3, 128, dtype=torch.float16, seed=16, scale=2000.0)
    w = randn(128, dtype=torch.float16, seed=17)
    out = tlo.rms_norm(x, w, EPS)
    assert torch.isfinite(out).all()
    assert_close(out, reference.rms_norm(x, w, EPS), torch.float16)


# --- Rotary ----------------------------------------------------------------------------

MAX_POS = 256
# Unsorted and repeated positions, including 0 and the last cached one.
POSITIONS = [5, 0, 255, 5, 17, 3, 3, 128, 1]


def rope_cache(head_dim: int, rope_scaling: dict | None = None):
    """cos/sin exactly as the engine builds them (HF inv_freq, optional scaling)."""
    cfg = LlamaConfig(hidden_size=head_dim * 4, head_dim=head_dim, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=MAX_POS,
                      rope_theta=500000.0, rope_scaling=rope_scaling)
    inv_freq, scaling = compute_inv_freq(cfg, head_dim)
    rope = RotaryEmbedding(head_dim, MAX_POS, inv_freq, scaling).to(DEVICE)
    return rope.cos, rope.sin


LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 64}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("d,heads,kv_heads", [(64, 4, 4), (128, 4, 2), (80, 3, 1), (96, 6, 2)])
def test_rotary_gqa_strided(d, heads, kv_heads, dtype):
    cos, sin = rope_cache(d, LLAMA3)
    positions = torch.tensor(POSITIONS, device=DEVICE)
    q, k = qkv_views(len(POSITIONS), heads, kv_heads, d, dtype, seed=d)
    q0, k0 = q.clone(), k.clone()
    q_out, k_out = tlo.rotary_embedding(positions, q, k, cos, sin)
    q_ref, k_ref = reference.rotary_embedding(positions, q, k, cos, sin)
    # fp32: the kernel's fp32 math is the reference's math, so near bit-exact.
    assert_close(q_out, q_ref, dtype)
    assert_close(k_out, k_ref, dtype)
    assert torch.equal(q, q0) and torch.equal(k, k0)


def test_rotary_yarn_scaled_cache_and_int32_positions():
    # yarn scales cos/sin by attention_scaling != 1; positions may arrive as int32.
    cos, sin = rope_cache(64, {"rope_type": "yarn", "factor": 4.0,
                               "original_max_position_embeddings": 64})
    positions = torch.tensor(POSITIONS, dtype=torch.int32, device=DEVICE)
    q = randn(len(POSITIONS), 2, 64, seed=20)
    k = randn(len(POSITIONS), 1, 64, seed=21)
    for a, b in zip(tlo.rotary_embedding(positions, q, k, cos, sin),
                    reference.rotary_embedding(positions.long(), q, k, cos, sin)):
        assert_close(a, b, torch.float32)


def test_rotary_follows_reference_formula_for_any_cache():
    # Random caches (halves not equal): the kernel reads both halves like the reference.
    cos, sin = randn(16, 32, seed=22), randn(16, 32, seed=23)
    positions = torch.tensor([15, 2, 2, 0], device=DEVICE)
    q, k = randn(4, 2, 32, seed=24), randn(4, 2, 32, seed=25)
    for a, b in zip(tlo.rotary_embedding(positions, q, k, cos, sin),
                    reference.rotary_embedding(positions, q, k, cos, sin)):
        assert_close(a, b, torch.float32)
    empty = torch.empty(0, 2, 32, device=DEVICE)
    pos0 = torch.empty(0, dtype=torch.long, device=DEVICE)
    assert all(t.shape == (0, 2, 32) for t in tlo.rotary_embedding(pos0, empty, empty, cos, sin))


# --- SiLU-and-mul ----------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows,d", [(1, 1), (5, 77), (3, 1000), (2, 1500)])
def test_silu_and_mul(rows, d, dtype):
    x = randn(rows, 2 * d, dtype=dtype, seed=d, scale=4.0)
    assert_close(tlo.silu_and_mul(x), reference.silu_and_mul(x), dtype)


@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")
def test_silu_and_mul_leading_dims_and_strided_rows():
    x = randn(2, 3, 2 * 50, seed=30, scale=4.0)
    assert_close(tlo.silu_and_mul(x), reference.silu_and_mul(x), torch.float32)
    rows = randn(8, 2 * 50, seed=31)[::2]  # a row-strided view: read in place
    assert_close(tlo.silu_and_mul(rows), reference.silu_and_mul(rows), torch.float32)
    # Extreme gates: silu saturates to 0 / identity without NaNs.
    g = torch.tensor([[-1e4, -100.0, 0.0, 100.0, 3.0, 2.0, 2.0, 2.0]], device=DEVICE)
    assert_close(tlo.silu_and_mul(g), reference.silu_and_mul(g), torch.float32)


# --- Dispatch --------------------------------------------------------------------------


def test_ops_dispatch_to_triton():
    x, r, w = randn(3, 64, seed=40), randn(3, 64, seed=41), randn(64, seed=42)
    torch.testing.assert_close(ops.rms_norm(x, w, EPS, "triton"), ops.rms_norm(x, w, EPS))
    for a, b in zip(ops.fused_add_rms_norm(x, r, w, EPS, "triton"),
                    ops.fused_add_rms_norm(x, r, w, EPS)):
        torch.testing.assert_close(a, b)
    cos, sin = rope_cache(16)
    pos = torch.tensor([2, 0, 9], device=DEVICE)
    q, k = randn(3, 4, 16, seed=43), randn(3, 2, 16, seed=44)
    for a, b in zip(ops.rotary_embedding(pos, q, k, cos, sin, "triton"),
                    ops.rotary_embedding(pos, q, k, cos, sin)):
        torch.testing.assert_close(a, b)
    torch.testing.assert_close(ops.silu_and_mul(x, "triton"), ops.silu_and_mul(x))


# --- Rounding --------------------------------------------------------------------------


def test_bf16_cast_rounds_to_nearest_even():
    import triton
    import triton.language as tl

    @triton.jit
    def cast_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
        i = tl.arange(0, BLOCK)
        x = tl.load(x_ptr + i, mask=i < n)
        tl.store(out_ptr + i, tlo._cast(x, out_ptr.dtype.element_ty), mask=i < n)

    ulp = 2.0 ** -7  # bf16 spacing at 1.0
    x = torch.tensor([1.0 + ulp / 2, 1.0 + 1.5 * ulp, 1.0 + ulp / 2 + 2 ** -20,  # ties, above
                      -(1.0 + 1.5 * ulp), 3.4e38, float("inf"), -float("inf"), 1e-40, -0.0,
                      0.1, -123.456, float("nan")], device=DEVICE)
    out = torch.empty(x.shape, dtype=torch.bfloat16, device=DEVICE)
    cast_kernel[(1,)](x, out, x.numel(), BLOCK=16)
    expected = x.to(torch.bfloat16)
    assert torch.equal(out[:-1].view(torch.int16), expected[:-1].view(torch.int16))
    assert out[-1].isnan()
