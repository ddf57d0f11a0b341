"""The native CPU decode kernel's runs of several new tokens per sequence (speculative
verify rows, short prompt chunks) alone: stores, causal and windowed attention against
SDPA under a mask built here, bit-identity with decoding token by token, the fused qkv
call, and the bounds it refuses. (The CPU backend routing them: test_cpu_attention.py.)"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from nvllm.kernels import cpu_ops


def _query_run_case(dtype: torch.dtype, heads: int, kv_heads: int, d: int, seed: int):
    """A step for the kernel's query runs: sequences with 1, 5, 1, 9, 17 and 2 new tokens
    (a new one-token prompt, verify rows, a decode, a whole 9-token prompt, the longest
    run, a short one after a long context) between rows of other sequences (1, 8, 18,
    36)."""
    g = torch.Generator().manual_seed(seed)
    qlens, lens = [1, 5, 1, 9, 17, 2], [1, 12, 40, 9, 70, 300]
    rows = [0, 2, 7, 9, 19, 37]
    tokens = 39
    bufs = [torch.randn(3, 2, kv_heads, n + 3, d, generator=g).to(dtype) for n in lens]
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * d, generator=g).to(dtype)
    slots = torch.randperm(64, generator=g)[:sum(qlens)]
    slots[[3, 20]] = -1  # not stored in the paged cache
    return qlens, lens, rows, bufs, qkv, slots.tolist()


def _long(xs: list[int]) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.long)


@pytest.mark.skipif(not cpu_ops.load(), reason="nvllm's CPU ops are not built")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
# The fixed shapes, AVX-512 or AVX2 (8/2 and SmolLM2's 9/3 at 64, 4/1 at 128), and the
# generic loop (6/2 at 80).
@pytest.mark.parametrize("heads,kv_heads,d", [(8, 2, 64), (9, 3, 64), (4, 1, 128), (6, 2, 80)])
@pytest.mark.parametrize("window", [0, 3])
def test_native_kernel_query_runs(dtype, heads, kv_heads, d, window):
    """Several new tokens per sequence in one call: each run's K/V appended to its copy
    and stored at its slots, query j of a run attending over the keys up to its own
    position (the last `window` of them) as SDPA does under a mask built here, and each
    query's output bit for bit what decoding its token alone gives (so a verify row
    scores a draft exactly as decoding it would)."""
    qlens, lens, rows, bufs, qkv, slots = _query_run_case(dtype, heads, kv_heads, d,
                                                          heads * d + window)
    tokens, layer = qkv.shape[0], 1
    q = qkv[:, :heads * d].reshape(tokens, heads, d).contiguous()
    k = qkv[:, heads * d:(heads + kv_heads) * d].view(tokens, kv_heads, d)
    v = qkv[:, (heads + kv_heads) * d:].view(tokens, kv_heads, d)
    one = [b.clone() for b in bufs]  # for the token-by-token calls
    k_cache, v_cache = (torch.zeros(4, 16, kv_heads, d, dtype=dtype) for _ in range(2))
    out = torch.full_like(q, 7.0)
    cpu_ops.decode_attention(out, q, k, v, k_cache, v_cache, _long(slots), _long(rows),
                             _long([b.data_ptr() for b in bufs]),
                             _long([b.shape[3] for b in bufs]), _long(lens), layer, 0.3,
                             window, _long(qlens))
    flat_k, flat_v = k_cache.view(-1, kv_heads, d), v_cache.view(-1, kv_heads, d)
    assert torch.count_nonzero(flat_k.abs().sum((1, 2))) == sum(s >= 0 for s in slots)
    mine = set()
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    slot_of = iter(slots)
    for b, (row, n, ctx) in enumerate(zip(rows, qlens, lens)):
        kv = bufs[b][layer, :, :, :ctx]
        for j in range(n):
            r, slot, seen = row + j, next(slot_of), ctx - n + j + 1
            mine.add(r)
            assert torch.equal(kv[0, :, seen - 1], k[r]) and torch.equal(kv[1, :, seen - 1], v[r])
            if slot >= 0:
                assert torch.equal(flat_k[slot], k[r]) and torch.equal(flat_v[slot], v[r])
            first = max(0, seen - window) if window else 0
            want = F.scaled_dot_product_attention(
                q[r].float()[None, :, None], kv[0:1, :, first:seen].float(),
                kv[1:2, :, first:seen].float(), scale=0.3, enable_gqa=True)[0, :, 0]
            torch.testing.assert_close(out[r].float(), want, atol=tol, rtol=tol)
    others = [r for r in range(tokens) if r not in mine]
    assert others == [1, 8, 18, 36] and torch.all(out[others] == 7.0)
    # Token by token: the j-th new token of every run that has one, as one-token decodes.
    each = torch.full_like(q, 7.0)
    for j in range(max(qlens)):
        bs = [b for b, n in enumerate(qlens) if j < n]
        cpu_ops.decode_attention(each, q, k, v, torch.zeros_like(k_cache),
                                 torch.zeros_like(v_cache), _long([-1] * len(bs)),
                                 _long([rows[b] + j for b in bs]),
                                 _long([one[b].data_ptr() for b in bs]),
                                 _long([one[b].shape[3] for b in bs]),
                                 _long([lens[b] - qlens[b] + j + 1 for b in bs]), layer, 0.3,
                                 window)
    assert torch.equal(each, out)
    assert all(torch.equal(a, b) for a, b in zip(bufs, one))


def test_every_verify_row_fits_the_kernel():
    """The kernel's run bound covers a verify row at the largest k the config accepts (the
    kernels package may not import the config, so the two constants meet here)."""
    from nvllm.common.speculative import MAX_SPECULATIVE_TOKENS

    assert cpu_ops.MAX_QUERIES == 1 + MAX_SPECULATIVE_TOKENS


@pytest.mark.skipif(not cpu_ops.load(), reason="nvllm's CPU ops are not built")
@pytest.mark.parametrize("bad, match", [
    ({"qlens": 0}, r"query_lens\[1\] = 0 must be in 1..17"),
    ({"qlens": 18}, r"query_lens\[1\] = 18 must be in 1..17"),
    ({"lens": 3}, r"lens\[1\] = 3 must be in 4..caps\[1\] = 8"),
    ({"lens": 9}, r"lens\[1\] = 9 must be in 4..caps\[1\] = 8"),
    ({"rows": 3}, r"rows\[1\] = 3 \+ query_lens\[1\] = 4 runs past the tokens \(6 tokens\)"),
    ({"rows": -1}, r"rows\[1\] = -1 is not a token row"),
    ({"slots": 64}, r"slots\[4\] = 64 is outside the paged cache \(64 slots\)"),
    ({"slots": -2}, r"slots\[4\] = -2 is outside"),
    ({"nslots": 4}, r"slots must have one entry per new token \(sum\(query_lens\) = 5\)"),
])
def test_native_kernel_refuses_query_runs_out_of_bounds(bad, match):
    """Runs of several tokens: a query count outside 1..17, a length shorter than its run
    or past the copy, a run past the step's tokens, a slot outside the cache or too few
    slots are errors naming them, before anything is written."""
    d, kv_heads, heads = 64, 1, 2
    bufs = [torch.zeros(1, 2, kv_heads, 8, d) for _ in range(2)]
    q = torch.randn(6, heads, d)
    k, v = torch.randn(6, kv_heads, d), torch.randn(6, kv_heads, d)
    k_cache, v_cache = (torch.zeros(4, 16, kv_heads, d) for _ in range(2))
    vec = {"rows": [0, 2], "lens": [1, 6], "qlens": [1, 4], "slots": [3, 4, 5, 6, 7]}
    for name, value in bad.items():
        if name == "nslots":
            vec["slots"] = vec["slots"][:value]
        elif name == "slots":
            vec[name][4] = value
        else:
            vec[name][1] = value
    with pytest.raises(RuntimeError, match=match):
        cpu_ops.decode_attention(torch.empty_like(q), q, k, v, k_cache, v_cache,
                                 _long(vec["slots"]), _long(vec["rows"]),
                                 _long([b.data_ptr() for b in bufs]),
                                 _long([b.shape[3] for b in bufs]), _long(vec["lens"]),
                                 0, 0.3, 0, _long(vec["qlens"]))
    assert not k_cache.any() and not any(b.any() for b in bufs)


@pytest.mark.skipif(not cpu_ops.load(), reason="nvllm's CPU ops are not built")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("heads,kv_heads,d", [(8, 2, 64), (6, 2, 80)])
def test_decode_attention_qkv_with_query_runs(dtype, heads, kv_heads, d):
    """The fused call over runs of several tokens (each rotated at its own position)
    equals split + rotary_embedding + the kernel."""
    from nvllm.worker.layers.rotary import RotaryEmbedding, compute_inv_freq

    class Cfg:
        rope_theta = 10000.0

    qlens, lens, rows, bufs, qkv, slots = _query_run_case(dtype, heads, kv_heads, d, d)
    tokens, layer = qkv.shape[0], 2
    rot = RotaryEmbedding(d, 512, compute_inv_freq(Cfg(), d)[0])
    positions = torch.randint(0, 512, (tokens,), generator=torch.Generator().manual_seed(d))
    bufs2 = [b.clone() for b in bufs]
    caches = [[torch.zeros(4, 16, kv_heads, d, dtype=dtype) for _ in range(2)]
              for _ in range(2)]
    vecs = lambda bs: (_long(slots), _long(rows), _long([b.data_ptr() for b in bs]),  # noqa: E731
                       _long([b.shape[3] for b in bs]), _long(lens))
    q, k, v = qkv.view(tokens, -1, d).split([heads, kv_heads, kv_heads], dim=1)
    q, k = cpu_ops.rotary_embedding(positions, q, k, rot.cos, rot.sin)
    want = torch.zeros_like(q)
    cpu_ops.decode_attention(want, q, k, v, *caches[0], *vecs(bufs), layer, 0.3, 0,
                             _long(qlens))
    out = cpu_ops.decode_attention_qkv(qkv, positions, rot.cos, rot.sin, heads, kv_heads,
                                       *caches[1], *vecs(bufs2), layer, 0.3, 0, _long(qlens))
    mine = [r + j for r, n in zip(rows, qlens) for j in range(n)]
    assert torch.equal(out[mine], want.view(tokens, -1)[mine])
    assert all(torch.equal(a, b) for a, b in zip(bufs, bufs2))
    assert torch.equal(caches[0][0], caches[1][0]) and torch.equal(caches[0][1], caches[1][1])
