"""Triton paged-attention kernels against their torch reference twins.

On CPU the kernels run under the Triton interpreter (numpy per program), so shapes stay small.
The interpreter is chosen when the kernel module is imported, hence the environment variable is
set before anything imports triton. On a GPU machine run with ``TRITON_INTERPRET=0`` to test the
compiled kernels on CUDA instead.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton", reason="the Triton kernels need the triton package")

from nvllm.kernels import reference  # noqa: E402
from nvllm.kernels import triton_attention as ta  # noqa: E402
from nvllm.kernels.metadata import AttentionMetadata  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
if not INTERPRET and not torch.cuda.is_available():
    pytest.skip("TRITON_INTERPRET is not 1 and there is no CUDA device", allow_module_level=True)
DEVICE = torch.device("cpu" if INTERPRET else "cuda")

# fp32 products are exact ("ieee" dots) so fp32 matches tightly; bf16/fp16 round q.k inputs,
# p before p@v and the output.
TOL = {
    torch.float32: dict(atol=2e-5, rtol=2e-5),
    torch.float16: dict(atol=5e-3, rtol=5e-3),
    torch.bfloat16: dict(atol=2e-2, rtol=1.6e-2),
}


# --------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------


def make_cache(num_blocks, block_size, kv_heads, head_dim, dtype, gen):
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k = torch.randn(shape, generator=gen).to(dtype).to(DEVICE)
    v = torch.randn(shape, generator=gen).to(dtype).to(DEVICE)
    return k, v


def make_meta(runs, ctx_lens, block_size, num_blocks, gen, extra_blocks=0):
    """Metadata like ModelRunner._prepare: query runs of `runs` tokens ending each context.

    Block tables are random, disjoint and non-contiguous; rows are padded with 0 to the
    longest table, and `extra_blocks` spare entries per table mimic tables longer than needed.
    """
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables, used = [], 0
    for ctx in ctx_lens:
        nblk = -(-ctx // block_size) + extra_blocks
        tables.append(perm[used:used + nblk])
        used += nblk
    assert used <= num_blocks, "test cache too small"
    width = max(len(t) for t in tables)
    padded = [t + [0] * (width - len(t)) for t in tables]
    cu, slots = [0], []
    for n, ctx, t in zip(runs, ctx_lens, tables):
        cu.append(cu[-1] + n)
        slots.extend(t[p // block_size] * block_size + p % block_size
                     for p in range(ctx - n, ctx))
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.long, device=DEVICE),
        cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=DEVICE),
        seq_lens=torch.tensor(ctx_lens, dtype=torch.int32, device=DEVICE),
        block_tables=torch.tensor(padded, dtype=torch.int32, device=DEVICE),
        max_seqlen_q=max(runs),
        max_seqlen_k=max(ctx_lens),
        cu_seqlens_q_host=cu,
        seq_lens_host=list(ctx_lens),
    )


def reference_attention(q, k_cache, v_cache, meta, scale):
    """The torch twin evaluated in fp32 on the same (rounded) inputs: the exact answer."""
    return reference.paged_attention(q.float(), k_cache.float(), v_cache.float(), meta, scale)


def assert_close(out, expected, dtype):
    assert out.dtype == dtype
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.float(), expected.float(), **TOL[dtype])


# --------------------------------------------------------------------------------------------
# store_kvcache
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kv_heads,head_dim,block_size,dtype", [
    (2, 64, 16, torch.float32),
    (1, 128, 32, torch.bfloat16),
    (3, 80, 8, torch.float16),
    (8, 96, 16, torch.bfloat16),
])
def test_store_kvcache(kv_heads, head_dim, block_size, dtype):
    gen = torch.Generator().manual_seed(0)
    num_blocks, num_tokens = 12, 23
    k_cache, v_cache = make_cache(num_blocks, block_size, kv_heads, head_dim, dtype, gen)
    # K/V as strided views into one fused projection output, as the model produces them.
    fused = torch.randn(num_tokens, 2 * kv_heads * head_dim + 7, generator=gen).to(dtype)
    fused = fused.to(DEVICE)
    k = fused[:, :kv_heads * head_dim].view(num_tokens, kv_heads, head_dim)
    v = fused[:, kv_heads * head_dim:2 * kv_heads * head_dim].view(num_tokens, kv_heads,
                                                                     head_dim)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[[0, 5, num_tokens - 1]] = -1  # padding slots are skipped
    slots = slots.to(DEVICE)

    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    reference.store_kvcache(k, v, k_ref, v_ref, slots)
    ta.store_kvcache(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache, k_ref)
    assert torch.equal(v_cache, v_ref)


def test_store_kvcache_all_padding_and_empty():
    gen = torch.Generator().manual_seed(1)
    k_cache, v_cache = make_cache(4, 16, 2, 64, torch.float32, gen)
    before = k_cache.clone(), v_cache.clone()
    k = torch.randn(3, 2, 64, generator=gen).to(DEVICE)
    ta.store_kvcache(k, k, k_cache, v_cache, torch.full((3,), -1, device=DEVICE))
    ta.store_kvcache(k[:0], k[:0], k_cache, v_cache, torch.empty(0, dtype=torch.long,
                                                                 device=DEVICE))
    assert torch.equal(k_cache, before[0]) and torch.equal(v_cache, before[1])


# --------------------------------------------------------------------------------------------
# decode (split-K)
# --------------------------------------------------------------------------------------------

# (num_heads, kv_heads, head_dim, block_size, dtype, num_splits)
DECODE_CASES = [
    (4, 4, 64, 16, torch.float32, 1),  # MHA, single split: direct write
    (8, 2, 64, 16, torch.float32, 3),  # GQA 4, split-K
    (8, 1, 128, 32, torch.float32, 2),  # MQA (GQA 8)
    (16, 2, 128, 16, torch.bfloat16, 4),  # GQA 8
    (4, 1, 80, 8, torch.float16, 5),  # odd head_dim, more splits than tiles: empty splits
    (6, 2, 96, 32, torch.bfloat16, None),  # odd head_dim, GQA 3, automatic splits
    (8, 2, 256, 16, torch.bfloat16, 2),  # head_dim 256 (smaller tiles)
    (7, 1, 64, 16, torch.float32, 2),  # GQA 7: a rank's heads of 14 / 2 at tp=3
]


@pytest.mark.parametrize("num_heads,kv_heads,head_dim,block_size,dtype,num_splits",
                         DECODE_CASES)
def test_decode_attention(num_heads, kv_heads, head_dim, block_size, dtype, num_splits):
    gen = torch.Generator().manual_seed(2)
    # Ragged: one token, exactly one block, one past a boundary, several blocks, long.
    ctx_lens = [1, block_size, block_size + 1, 3 * block_size - 1, 150]
    num_blocks = sum(-(-c // block_size) + 1 for c in ctx_lens) + 3
    k_cache, v_cache = make_cache(num_blocks, block_size, kv_heads, head_dim, dtype, gen)
    meta = make_meta([1] * len(ctx_lens), ctx_lens, block_size, num_blocks, gen, extra_blocks=1)
    q = torch.randn(len(ctx_lens), num_heads, head_dim, generator=gen).to(dtype).to(DEVICE)
    scale = head_dim ** -0.5

    out = ta.decode_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, scale,
                              num_splits=num_splits)
    assert_close(out, reference_attention(q, k_cache, v_cache, meta, scale), dtype)


def test_decode_splits_agree_and_zero_context_is_zero():
    """Any split count gives the same answer; a zero-length (padding) row gives 0, not NaN."""
    gen = torch.Generator().manual_seed(3)
    k_cache, v_cache = make_cache(16, 16, 2, 64, torch.float32, gen)
    meta = make_meta([1, 1], [200, 9], 16, 16, gen)
    seq_lens = torch.tensor([200, 9, 0], dtype=torch.int32, device=DEVICE)
    tables = torch.cat([meta.block_tables,
                        torch.zeros_like(meta.block_tables[:1])])  # padding row: table of 0s
    q = torch.randn(3, 8, 64, generator=gen).to(DEVICE)
    outs = [ta.decode_attention(q, k_cache, v_cache, tables, seq_lens, 0.125, num_splits=s)
            for s in (1, 2, 7)]
    expected = reference_attention(q[:2], k_cache, v_cache, meta, 0.125)
    for out in outs:
        torch.testing.assert_close(out[:2], expected, **TOL[torch.float32])
        assert torch.equal(out[2], torch.zeros_like(out[2]))


def test_choose_num_splits():
    cpu = torch.device("cpu")
    assert ta._choose_num_splits(1, 8, 100, cpu) == 1  # short context: no split
    assert ta._choose_num_splits(512, 8, 32768, cpu) == 1  # enough programs already
    few_long = ta._choose_num_splits(1, 8, 32768, cpu)
    assert 1 < few_long <= ta._MAX_SPLITS
    assert ta._choose_num_splits(1, 1, 1024, cpu) == 1024 // ta._MIN_TOKENS_PER_SPLIT


# --------------------------------------------------------------------------------------------
# extend / prefill over a paged prefix (mixed batches)
# --------------------------------------------------------------------------------------------

# (num_heads, kv_heads, head_dim, block_size, dtype)
EXTEND_CASES = [
    (4, 4, 64, 16, torch.float32),  # MHA
    (8, 2, 64, 32, torch.float32),  # GQA 4
    (8, 1, 128, 16, torch.float32),  # MQA (GQA 8)
    (16, 2, 128, 8, torch.bfloat16),  # GQA 8, small blocks
    (6, 2, 80, 16, torch.float16),  # odd head_dim, GQA 3 (tiles not a power of two)
    (4, 1, 96, 32, torch.bfloat16),  # odd head_dim, MQA
    (4, 2, 256, 16, torch.float32),  # head_dim 256 (smaller tiles)
    (7, 1, 64, 16, torch.float32),  # GQA 7: a rank's heads of 14 / 2 at tp=3
]


@pytest.mark.parametrize("num_heads,kv_heads,head_dim,block_size,dtype", EXTEND_CASES)
def test_extend_attention_mixed_batch(num_heads, kv_heads, head_dim, block_size, dtype):
    gen = torch.Generator().manual_seed(4)
    bs = block_size
    # (query run, context): decode rows, chunks after a cached prefix (one crossing block
    # boundaries), full prefills (one of exactly one block, one of a single token), and a
    # prefill longer than one query tile.
    batch = [(1, 2 * bs + 3), (7, 40), (1, 1), (bs, bs), (2 * bs + 5, 3 * bs), (13, 13),
             (1, bs), (70, 70)]
    runs, ctx_lens = zip(*batch)
    num_blocks = sum(-(-c // bs) for c in ctx_lens) + 4
    k_cache, v_cache = make_cache(num_blocks, bs, kv_heads, head_dim, dtype, gen)
    meta = make_meta(list(runs), list(ctx_lens), bs, num_blocks, gen)
    q = torch.randn(sum(runs), num_heads, head_dim, generator=gen).to(dtype).to(DEVICE)
    scale = head_dim ** -0.5

    out = ta.extend_attention(q, k_cache, v_cache, meta, scale)
    assert_close(out, reference_attention(q, k_cache, v_cache, meta, scale), dtype)


def test_extend_attention_decode_rows_only():
    """The extend kernel on one-token runs (what paged_attention sends to the decode kernel)
    agrees with the reference and with the decode kernel."""
    gen = torch.Generator().manual_seed(10)
    k_cache, v_cache = make_cache(16, 16, 2, 64, torch.float16, gen)
    meta = make_meta([1, 1, 1], [1, 16, 77], 16, 16, gen)
    q = torch.randn(3, 8, 64, generator=gen).to(torch.float16).to(DEVICE)
    out = ta.extend_attention(q, k_cache, v_cache, meta, 0.125)
    assert_close(out, reference_attention(q, k_cache, v_cache, meta, 0.125), torch.float16)
    dec = ta.decode_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, 0.125,
                              num_splits=2)
    torch.testing.assert_close(out, dec, **TOL[torch.float16])


def test_extend_attention_long_prefill_and_empty_run():
    """Several query tiles per sequence (MHA: 128 tokens per tile at head_dim 64) and a
    zero-length run in the batch (it owns one spare tile that must write nothing)."""
    gen = torch.Generator().manual_seed(5)
    k_cache, v_cache = make_cache(24, 16, 1, 64, torch.float32, gen)
    meta = make_meta([150, 0, 3], [150, 20, 60], 16, 24, gen)
    q = torch.randn(153, 1, 64, generator=gen).to(DEVICE)
    out = ta.extend_attention(q, k_cache, v_cache, meta, 0.125)
    assert_close(out, reference_attention(q, k_cache, v_cache, meta, 0.125), torch.float32)


# --------------------------------------------------------------------------------------------
# paged_attention: dispatch and the store -> attend flow of one layer
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("runs,ctx_lens", [
    ([1, 1, 1], [5, 33, 64]),  # pure decode -> decode kernel
    ([1, 9, 1], [17, 9, 40]),  # mixed -> extend kernel
], ids=["decode", "mixed"])
def test_paged_attention_store_then_attend(runs, ctx_lens):
    """One attention layer's step: earlier tokens already cached, this step's K/V stored by
    the Triton store kernel, then attention; compared to the same flow with the reference."""
    gen = torch.Generator().manual_seed(6)
    heads, kv_heads, head_dim, bs, dtype = 8, 2, 64, 16, torch.bfloat16
    num_blocks = 16
    k_cache, v_cache = make_cache(num_blocks, bs, kv_heads, head_dim, dtype, gen)
    meta = make_meta(runs, ctx_lens, bs, num_blocks, gen)
    tokens = sum(runs)
    q = torch.randn(tokens, heads, head_dim, generator=gen).to(dtype).to(DEVICE)
    k = torch.randn(tokens, kv_heads, head_dim, generator=gen).to(dtype).to(DEVICE)
    v = torch.randn(tokens, kv_heads, head_dim, generator=gen).to(dtype).to(DEVICE)

    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    reference.store_kvcache(k, v, k_ref, v_ref, meta.slot_mapping)
    expected = reference_attention(q, k_ref, v_ref, meta, 0.125)

    ta.store_kvcache(k, v, k_cache, v_cache, meta.slot_mapping)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)
    out = ta.paged_attention(q, k_cache, v_cache, meta, 0.125)
    assert_close(out, expected, dtype)


def test_paged_attention_strided_q():
    """q as a strided view into a fused qkv output (head_dim contiguous, rows strided)."""
    gen = torch.Generator().manual_seed(7)
    k_cache, v_cache = make_cache(8, 16, 2, 64, torch.float32, gen)
    meta = make_meta([4, 1], [20, 30], 16, 8, gen)
    fused = torch.randn(5, 8 * 64 + 2 * 2 * 64, generator=gen).to(DEVICE)
    q = fused[:, :8 * 64].view(5, 8, 64)
    out = ta.paged_attention(q, k_cache, v_cache, meta, 0.125)
    assert_close(out, reference_attention(q, k_cache, v_cache, meta, 0.125), torch.float32)


def test_paged_attention_long_decode_auto_splits():
    """A few long contexts: the automatic heuristic splits the context (checked), and the
    split-K result matches."""
    gen = torch.Generator().manual_seed(9)
    bs, kv_heads = 32, 1
    ctx_lens = [700, 530]
    assert ta._choose_num_splits(len(ctx_lens), kv_heads, max(ctx_lens), DEVICE) > 1
    k_cache, v_cache = make_cache(40, bs, kv_heads, 64, torch.float32, gen)
    meta = make_meta([1, 1], ctx_lens, bs, 40, gen)
    q = torch.randn(2, 4, 64, generator=gen).to(DEVICE)
    out = ta.paged_attention(q, k_cache, v_cache, meta, 0.125)
    assert_close(out, reference_attention(q, k_cache, v_cache, meta, 0.125), torch.float32)


@pytest.mark.parametrize("seed", range(6))
def test_paged_attention_random_batches(seed):
    """Random shapes and batches (decode-only or mixed), fp32, through the dispatch."""
    gen = torch.Generator().manual_seed(100 + seed)
    pick = lambda options: options[int(torch.randint(len(options), (1,), generator=gen))]
    kv_heads, group = pick([(1, 1), (2, 4), (1, 8), (4, 2), (2, 5)])
    head_dim, bs = pick([64, 80, 128]), pick([8, 16, 32])
    num_seqs = int(torch.randint(1, 5, (1,), generator=gen))
    decode_only = seed % 3 == 0
    runs, ctx_lens = [], []
    for _ in range(num_seqs):
        ctx = int(torch.randint(1, 90, (1,), generator=gen))
        n = 1 if decode_only else int(torch.randint(1, ctx + 1, (1,), generator=gen))
        runs.append(n)
        ctx_lens.append(ctx)
    num_blocks = sum(-(-c // bs) for c in ctx_lens) + 2
    k_cache, v_cache = make_cache(num_blocks, bs, kv_heads, head_dim, torch.float32, gen)
    meta = make_meta(runs, ctx_lens, bs, num_blocks, gen)
    q = torch.randn(sum(runs), kv_heads * group, head_dim, generator=gen).to(DEVICE)
    scale = head_dim ** -0.5
    out = ta.paged_attention(q, k_cache, v_cache, meta, scale)
    assert_close(out, reference_attention(q, k_cache, v_cache, meta, scale), torch.float32)


def test_shape_errors():
    k_cache = torch.zeros(2, 16, 2, 64, device=DEVICE)
    meta = make_meta([1], [4], 16, 2, torch.Generator().manual_seed(8))
    with pytest.raises(ValueError):
        ta.paged_attention(torch.zeros(1, 3, 64, device=DEVICE), k_cache, k_cache, meta, 1.0)
    with pytest.raises(ValueError):
        ta.paged_attention(torch.zeros(1, 4, 32, device=DEVICE), k_cache, k_cache, meta, 1.0)


# --------------------------------------------------------------------------------------------
# sliding window
# --------------------------------------------------------------------------------------------


def poison_outside_window(meta, runs, window, block_size, k_cache, v_cache):
    """Point every block-table entry wholly before a run's first visible key at a block of
    NaN (as if the leader had given it back): reading one would poison the output."""
    poison = k_cache.shape[0] - 1
    k_cache[poison] = v_cache[poison] = float("nan")
    for i, (n, ctx) in enumerate(zip(runs, meta.seq_lens_host)):
        meta.block_tables[i, :reference.window_start(ctx, n, window) // block_size] = poison


@pytest.mark.parametrize("window", [1, 5, 16, 37])
def test_sliding_window(window):
    """Decode (single and split-K) and extend (prefills, chunks after a prefix, decode
    rows) within a window equal the reference, never reading blocks before the window."""
    gen = torch.Generator().manual_seed(window)
    heads, kv_heads, head_dim, bs = 4, 2, 64, 8
    for runs, ctx_lens in (([1, 1, 1, 1], [1, 9, 40, 70]),
                           ([1, 7, 30, 1, 20], [50, 40, 30, 16, 61])):
        num_blocks = sum(-(-c // bs) for c in ctx_lens) + 1
        k_cache, v_cache = make_cache(num_blocks, bs, kv_heads, head_dim, torch.float32, gen)
        meta = make_meta(runs, ctx_lens, bs, num_blocks - 1, gen)
        poison_outside_window(meta, runs, window, bs, k_cache, v_cache)
        q = torch.randn(sum(runs), heads, head_dim, generator=gen).to(DEVICE)
        want = reference.paged_attention(q, k_cache, v_cache, meta, 0.125, window)
        assert torch.isfinite(want).all()
        assert_close(ta.paged_attention(q, k_cache, v_cache, meta, 0.125, window), want,
                     torch.float32)
        if len(runs) == 4:
            out = ta.decode_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens,
                                      0.125, num_splits=3, window=window)
            assert_close(out, want, torch.float32)
        else:
            assert_close(ta.extend_attention(q, k_cache, v_cache, meta, 0.125, window), want,
                         torch.float32)
