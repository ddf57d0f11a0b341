"""Triton fused MoE (nvllm/kernels/triton_moe.py) against a naive float32 reference: one
token at a time, one routed expert at a time, the formula of ``fused_moe``'s contract.

On CPU the kernels run under the Triton interpreter, so shapes stay tiny (H, I <= 64,
T <= 33, E <= 5); H and I are chosen off the tile sizes so every load and store is ragged.
On a GPU machine run with ``TRITON_INTERPRET=0`` to test the compiled kernels on CUDA.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton", reason="the Triton kernels need the triton package")

from nvllm.kernels import triton_moe as tm  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
if not INTERPRET and not torch.cuda.is_available():
    pytest.skip("TRITON_INTERPRET is not 1 and there is no CUDA device", allow_module_level=True)
DEVICE = torch.device("cpu" if INTERPRET else "cuda")


def reference_moe(x, w13, w2, topk_ids, topk_weights, expert_start=0):
    """The contract, literally, in float32 (returns float32)."""
    x, w13, w2 = x.float().cpu(), w13.float().cpu(), w2.float().cpu()
    ids, wts = topk_ids.cpu().tolist(), topk_weights.float().cpu()
    n_experts, i = w2.shape[0], w2.shape[2]
    out = torch.zeros(x.shape, dtype=torch.float32)
    for t in range(x.shape[0]):
        for k, gid in enumerate(ids[t]):
            e = gid - expert_start
            if not 0 <= e < n_experts:
                continue
            gate, up = w13[e, :i] @ x[t], w13[e, i:] @ x[t]
            out[t] += wts[t, k] * (w2[e] @ (torch.nn.functional.silu(gate) * up))
    return out


def make_case(t, h, i, e, k, dtype, seed, n_global=None, expert_start=0):
    """Inputs scaled so each output is O(1); ids drawn without repetition per token from
    n_global experts (default: the local ones)."""
    g = torch.Generator().manual_seed(seed)
    n_global = n_global or e
    x = torch.randn(t, h, generator=g)
    w13 = torch.randn(e, 2 * i, h, generator=g) * h ** -0.5
    w2 = torch.randn(e, h, i, generator=g) * i ** -0.5
    ids = torch.stack([torch.randperm(n_global, generator=g)[:k] for _ in range(t)])
    wts = torch.softmax(torch.randn(t, k, generator=g), dim=-1)
    cast = [a.to(dtype).to(DEVICE) for a in (x, w13, w2)]
    return (*cast, ids.to(DEVICE), wts.to(DEVICE), expert_start)


def check(case, dtype, atol, rtol=0.0):
    out = tm.fused_moe(*case)
    ref = reference_moe(*case)
    assert out.dtype == dtype and out.shape == ref.shape and out.device.type == DEVICE.type
    scale = ref.abs().max().clamp(min=1.0)
    err = (out.float().cpu() - ref).abs()
    assert (err <= atol * scale + rtol * ref.abs()).all(), f"max err {err.max():.3g}"
    return out, ref


# Tolerances relative to the output scale. fp32: exact fp32 dots, only summation order
# differs. 16-bit: inputs are exact in the reference too, so the error is the rounding of
# the SiLU-and-mul product (the down projection's input) plus the final rounding.
ATOL = {torch.float32: 1e-4, torch.bfloat16: 1e-2, torch.float16: 2e-3}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("t,h,i,e,k", [
    (1, 40, 24, 4, 2),     # decode: one token, blocks mostly sentinel padding
    (33, 48, 40, 5, 3),    # several blocks per expert, H and I off the 32-wide tiles
    (7, 64, 64, 3, 1),     # tile-aligned H and I, top-1
])
def test_matches_reference(t, h, i, e, k, dtype):
    check(make_case(t, h, i, e, k, dtype, seed=t + h), dtype, ATOL[dtype])


def test_expert_without_tokens_and_repeated_experts():
    # Expert 1 of 4 gets nothing; expert 0 takes 20 pairs (two blocks of 16, ragged).
    t, h, i, e = 20, 40, 24, 4
    case = list(make_case(t, h, i, e, 2, torch.float32, seed=3))
    case[3] = torch.tensor([[0, 2 + (n % 2)] for n in range(t)], device=DEVICE)
    check(case, torch.float32, ATOL[torch.float32])


def test_expert_parallel_slice_drops_other_ranks_experts():
    # This rank owns global experts 3..5 of 9; ids < 3 and >= 6 contribute nothing, and a
    # token routed only to other ranks gets an exact zero row.
    t, h, i, e, k = 17, 40, 24, 3, 3
    case = list(make_case(t, h, i, e, k, torch.float32, seed=5, n_global=9, expert_start=3))
    case[3][0] = torch.tensor([0, 7, 8])
    out, _ = check(case, torch.float32, ATOL[torch.float32])
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    # Some tokens do hit local experts (the check above is not vacuous).
    assert ((case[3] >= 3) & (case[3] < 6)).any()


def test_no_local_pairs_gives_zeros():
    case = list(make_case(5, 40, 24, 2, 2, torch.bfloat16, seed=7))
    case[3] = torch.tensor([[4, 5]] * 5, device=DEVICE)  # experts 4, 5: another rank's
    out = tm.fused_moe(*case[:5], expert_start=0)
    assert out.dtype == torch.bfloat16 and torch.equal(out, torch.zeros_like(out))


def test_token_chunks_and_int32_ids(monkeypatch):
    # Long inputs run in chunks of _CHUNK_TOKENS tokens (a ragged last one here); int32 ids
    # (what some routers produce) give the same result.
    case = list(make_case(11, 40, 24, 3, 2, torch.float32, seed=9))
    monkeypatch.setattr(tm, "_CHUNK_TOKENS", 4)
    out, _ = check(case, torch.float32, ATOL[torch.float32])
    case[3] = case[3].to(torch.int32)
    torch.testing.assert_close(tm.fused_moe(*case), out, rtol=0, atol=0)


def test_empty_and_bad_shapes():
    x, w13, w2, ids, wts, _ = make_case(3, 40, 24, 2, 2, torch.float32, seed=11)
    assert tm.fused_moe(x[:0], w13, w2, ids[:0], wts[:0]).shape == (0, 40)
    with pytest.raises(ValueError, match="do not agree"):
        tm.fused_moe(x, w13, w2[:, :, :-1], ids, wts)
    with pytest.raises(ValueError, match="topk_ids"):
        tm.fused_moe(x, w13, w2, ids[:, :1], wts)


def test_align_layout():
    # The sorted layout the kernels rely on: every block one expert, each expert's pairs in
    # token order, padded with the sentinel; other ranks' pairs absent.
    ids = torch.tensor([[2, 0], [0, 9], [2, 0]], device=DEVICE)
    sorted_ids, block_expert, n_padded = tm._align(ids, 0, 4, block_m=4)
    n = ids.numel()
    assert int(n_padded) == 8
    assert sorted_ids[:8].tolist() == [1, 2, 5, n, 0, 4, n, n]
    assert block_expert[:2].tolist() == [0, 2]
    assert (sorted_ids[8:] == n).all()


def test_the_triton_backend_dispatches_here_and_agrees_with_the_torch_path():
    """ops.fused_moe: the triton backend runs this kernel, the others the grouped torch
    path (kernels/moe.py); both fulfil one contract."""
    from nvllm.kernels import ops

    case = make_case(9, 40, 24, 5, 3, torch.float32, seed=21, n_global=7, expert_start=2)
    ref = reference_moe(*case)
    got = ops.fused_moe(*case, backend="triton")
    assert torch.allclose(got.float().cpu(), ref, atol=1e-4)
    torch_path = ops.fused_moe(*[a.cpu() if torch.is_tensor(a) else a for a in case],
                               backend="torch")
    assert torch.allclose(torch_path.float(), ref, atol=1e-4)
