"""Model layers on one process (TPContext() = world size 1, float32): RMSNorm, rotary,
paged attention (torch path) and the KV cache store, against HF and by-hand references."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from float_bounds import attention_bound
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import (
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
)

from nvllm.kernels import ops
from nvllm.kernels.metadata import AttentionMetadata
from nvllm.kernels.ops import paged_attention, store_kvcache
from nvllm.worker.layers.activation import SiluAndMul
from nvllm.worker.layers.attention import Attention
from nvllm.worker.layers.embed_head import ParallelLMHead, VocabParallelEmbedding
from nvllm.worker.layers.layernorm import RMSNorm
from nvllm.worker.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from nvllm.worker.layers.rotary import RotaryEmbedding, compute_inv_freq
from nvllm.worker.parallel import TPContext

F32 = torch.float32


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# --- RMSNorm ---------------------------------------------------------------------------

def _rmsnorm(hidden=64, eps=1e-5, seed=0):
    norm = RMSNorm(hidden, eps, F32)
    norm.weight.data.copy_(torch.randn(hidden, generator=gen(seed)) * 0.5 + 1)
    return norm


def test_rmsnorm_matches_formula_and_hf():
    norm = _rmsnorm()
    x = torch.randn(7, 64, generator=gen(1)) * 3
    x64 = x.double()
    ref = x64 / torch.sqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-5) * norm.weight.double()
    out = norm(x)
    assert out.dtype == F32 and out.shape == x.shape
    # A 64-term mean of squares in any order is within 64*eps of the exact one, relatively;
    # the rsqrt and the products add a few eps: rtol 1e-5 (84 eps) holds on any x86-64 CPU.
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=0)
    hf = LlamaRMSNorm(64, eps=1e-5)
    hf.weight.data.copy_(norm.weight)
    torch.testing.assert_close(out, hf(x), rtol=0, atol=0)


def test_rmsnorm_3d_and_bf16_match_hf():
    norm = _rmsnorm(32, 1e-6, seed=2)
    hf = LlamaRMSNorm(32, eps=1e-6)
    hf.weight.data.copy_(norm.weight)
    x = torch.randn(2, 5, 32, generator=gen(3))
    torch.testing.assert_close(norm(x), hf(x), rtol=0, atol=0)
    norm16, hf16 = norm.to(torch.bfloat16), hf.to(torch.bfloat16)
    xb = x.to(torch.bfloat16)
    torch.testing.assert_close(norm16(xb), hf16(xb), rtol=0, atol=0)


def test_rmsnorm_fused_residual():
    norm = _rmsnorm()
    x = torch.randn(5, 64, generator=gen(4))
    r = torch.randn(5, 64, generator=gen(5))
    x0, r0 = x.clone(), r.clone()
    out, new_residual = norm(x, r)
    torch.testing.assert_close(new_residual, x0 + r0, rtol=0, atol=0)
    torch.testing.assert_close(out, norm(x0 + r0), rtol=0, atol=0)
    # Inputs are not modified.
    assert torch.equal(x, x0) and torch.equal(r, r0)


@pytest.mark.parametrize("backend", ["torch", pytest.param("cpu", marks=pytest.mark.skipif(
    not __import__("nvllm.kernels.cpu_ops", fromlist=["load"]).load(),
    reason="nvllm's CPU ops are not built"))])
@pytest.mark.parametrize("dtype", [F32, torch.bfloat16], ids=str)
def test_add_norm_in_place_gives_the_fused_values(backend, dtype):
    """add_norm_ (the decoder layers' residual add): forward(x, residual)'s values; on the
    cpu backend written into x (the norm) and residual (the sum), with no new tensor."""
    norm = _rmsnorm()
    norm.weight.data = norm.weight.data.to(dtype)
    norm.backend = backend
    x = torch.randn(5, 64, generator=gen(4)).to(dtype)
    r = torch.randn(5, 64, generator=gen(5)).to(dtype)
    want_out, want_res = norm(x.clone(), r.clone())
    out, res = norm.add_norm_(x, r)
    assert torch.equal(out, want_out) and torch.equal(res, want_res)
    if backend == "cpu":
        assert out is x and res is r


def test_pin_to_cores(monkeypatch):
    """cpu_pin_workers: local rank i takes the i-th run of `threads` cores it may use, and
    nothing is pinned when there are too few."""
    from nvllm.worker import main

    pinned = []
    monkeypatch.setattr(main.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    monkeypatch.setattr(main.os, "sched_setaffinity", lambda pid, cores: pinned.append(cores))
    main.pin_to_cores(1, 2)
    main.pin_to_cores(0, 1)
    main.pin_to_cores(2, 2)  # cores 4-5: there are none
    assert pinned == [[2, 3], [0]]


# --- Rotary ----------------------------------------------------------------------------

HEAD_DIM, HEADS, KV_HEADS, MAX_POS = 16, 4, 2, 512

ROPE_CONFIGS = {
    "default": dict(rope_theta=10000.0),
    "theta500k": dict(rope_theta=500000.0),
    "llama3": dict(rope_theta=500000.0, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    "linear": dict(rope_theta=10000.0, rope_scaling={"rope_type": "linear", "factor": 2.0}),
    "yarn": dict(rope_theta=10000.0, rope_scaling={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}),
}


def _llama_config(**kw) -> LlamaConfig:
    return LlamaConfig(hidden_size=HEAD_DIM * HEADS, head_dim=HEAD_DIM,
                       num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                       max_position_embeddings=MAX_POS, **kw)


@pytest.mark.parametrize("name", list(ROPE_CONFIGS))
def test_rotary_matches_hf(name):
    cfg = _llama_config(**ROPE_CONFIGS[name])
    inv_freq, scaling = compute_inv_freq(cfg, HEAD_DIM)
    hf = LlamaRotaryEmbedding(cfg)
    torch.testing.assert_close(inv_freq, hf.inv_freq.float(), rtol=0, atol=0)
    assert scaling == pytest.approx(hf.attention_scaling)
    rope = RotaryEmbedding(HEAD_DIM, MAX_POS, inv_freq, scaling)

    # Unsorted positions from several sequences, including the last one.
    positions = torch.tensor([0, 1, 2, 3, 0, 5, 100, 101, 257, MAX_POS - 1, 63, 64, 65])
    t = positions.numel()
    q = torch.randn(t, HEADS, HEAD_DIM, generator=gen(6))
    k = torch.randn(t, KV_HEADS, HEAD_DIM, generator=gen(7))
    q_out, k_out = rope(positions, q, k)

    cos, sin = hf(q, positions[None])  # [1, T, d]
    q_hf, k_hf = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                      cos, sin)
    torch.testing.assert_close(q_out, q_hf[0].transpose(0, 1), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(k_out, k_hf[0].transpose(0, 1), rtol=1e-5, atol=1e-5)


def test_llama3_scaling_changes_low_frequencies_only():
    base, _ = compute_inv_freq(_llama_config(**ROPE_CONFIGS["theta500k"]), HEAD_DIM)
    l3, _ = compute_inv_freq(_llama_config(**ROPE_CONFIGS["llama3"]), HEAD_DIM)
    assert l3[0] == base[0]  # the highest frequency is kept
    assert l3[-1] == pytest.approx(base[-1].item() / 8.0)  # the lowest is divided by factor


def test_rotary_position_zero_is_identity_and_norm_preserving():
    cfg = _llama_config(rope_theta=10000.0)
    rope = RotaryEmbedding(HEAD_DIM, MAX_POS, compute_inv_freq(cfg, HEAD_DIM)[0])
    q = torch.randn(3, HEADS, HEAD_DIM, generator=gen(8))
    k = torch.randn(3, KV_HEADS, HEAD_DIM, generator=gen(9))
    q0, k0 = rope(torch.zeros(3, dtype=torch.long), q, k)
    torch.testing.assert_close(q0, q, rtol=0, atol=0)
    torch.testing.assert_close(k0, k, rtol=0, atol=0)
    q1, _ = rope(torch.tensor([5, 77, 300]), q, k)
    torch.testing.assert_close(q1.norm(dim=-1), q.norm(dim=-1), rtol=1e-5, atol=1e-5)


def test_dynamic_rope_is_refused():
    cfg = _llama_config(rope_theta=10000.0,
                        rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    with pytest.raises(ValueError, match="dynamic"):
        compute_inv_freq(cfg, HEAD_DIM)


# --- paged attention -------------------------------------------------------------------

def _reference(q, k, v, scale, window=None):
    """Dense causal attention by hand, float64. q [n, H, d]; k, v [ctx, KVH, d]; the n
    queries are the last n positions of the context; with a window, query i sees key j
    only if i - j < window (HF's sliding-window mask)."""
    n, heads, _ = q.shape
    ctx, kv_heads, _ = k.shape
    kv_of_head = torch.arange(heads) // (heads // kv_heads)  # query head h reads KV h // g
    qh = q.double().transpose(0, 1)  # [H, n, d]
    kh = k.double()[:, kv_of_head].transpose(0, 1)  # [H, ctx, d]
    vh = v.double()[:, kv_of_head].transpose(0, 1)
    pos_q = torch.arange(ctx - n, ctx)[:, None]
    allowed = torch.arange(ctx)[None, :] <= pos_q  # [n, ctx]
    if window:
        allowed &= pos_q - torch.arange(ctx)[None, :] < window
    s = (qh @ kh.transpose(1, 2) * scale).masked_fill(~allowed, float("-inf"))
    return (torch.softmax(s, dim=-1) @ vh).transpose(0, 1)  # [n, H, d]


def _slots(table: list[int], positions, block_size: int) -> list[int]:
    return [table[p // block_size] * block_size + p % block_size for p in positions]


def _run_paged(seqs, heads, kv_heads, block_size, head_dim=8, seed=0, extra_blocks=3,
               window=None):
    """seqs: [(ctx, n)]. Stores every sequence's context through store_kvcache into a
    cache with random, non-contiguous block tables, runs paged_attention on the query runs
    and compares with the dense reference."""
    g = gen(seed)
    nblks = [-(-ctx // block_size) for ctx, _ in seqs]
    num_blocks = sum(nblks) + extra_blocks
    perm = torch.randperm(num_blocks, generator=g).tolist()
    # NaN in every slot nobody writes: reading one would poison the output.
    k_cache = torch.full((num_blocks, block_size, kv_heads, head_dim), float("nan"))
    v_cache = torch.full_like(k_cache, float("nan"))
    tables, ks, vs, qs = [], [], [], []
    for (ctx, n), nb in zip(seqs, nblks):
        table, perm = perm[:nb], perm[nb:]
        tables.append(table)
        k = torch.randn(ctx, kv_heads, head_dim, generator=g)
        v = torch.randn(ctx, kv_heads, head_dim, generator=g)
        store_kvcache(k, v, k_cache, v_cache,
                      torch.tensor(_slots(table, range(ctx), block_size), dtype=torch.long))
        ks.append(k)
        vs.append(v)
        qs.append(torch.randn(n, heads, head_dim, generator=g))
    max_blocks = max(nblks)
    block_tables = torch.tensor([t + [0] * (max_blocks - len(t)) for t in tables],
                                dtype=torch.int32)
    cu = [0]
    for _, n in seqs:
        cu.append(cu[-1] + n)
    slot_mapping = sum((_slots(t, range(ctx - n, ctx), block_size)
                        for t, (ctx, n) in zip(tables, seqs)), [])
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slot_mapping, dtype=torch.long),
        cu_seqlens_q=torch.tensor(cu, dtype=torch.int32),
        seq_lens=torch.tensor([c for c, _ in seqs], dtype=torch.int32),
        block_tables=block_tables,
        max_seqlen_q=max(n for _, n in seqs),
        max_seqlen_k=max(c for c, _ in seqs),
        cu_seqlens_q_host=cu,
        seq_lens_host=[c for c, _ in seqs],
    )
    scale = 1 / math.sqrt(head_dim)
    q = torch.cat(qs)
    out = paged_attention(q, k_cache, v_cache, meta, scale, "torch", window)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert torch.isfinite(out).all()
    for i, (k, v) in enumerate(zip(ks, vs)):
        ref = _reference(qs[i], k, v, scale, window)
        # Float32 SDPA vs float64, within a bound derived from the magnitudes that holds on
        # any x86-64 CPU (float_bounds.attention_bound says why).
        torch.testing.assert_close(out[cu[i]:cu[i + 1]].double(), ref, rtol=0,
                                   atol=attention_bound(qs[i], k, v, scale, window),
                                   msg=lambda m, i=i: f"sequence {i} {seqs[i]}: {m}")


GQA = [(4, 4), (4, 2), (4, 1)]


@pytest.mark.parametrize("heads,kv_heads", GQA)
@pytest.mark.parametrize("block_size", [4, 16])
def test_paged_attention_ragged_mixed_batch(heads, kv_heads, block_size):
    # Full prefills, chunks after a cached prefix, decodes; contexts crossing blocks.
    seqs = [(7, 7), (13, 1), (9, 4), (1, 1), (16, 16), (21, 3), (4, 1), (5, 5), (33, 32)]
    _run_paged(seqs, heads, kv_heads, block_size, seed=heads * 10 + kv_heads + block_size)


@pytest.mark.parametrize("heads,kv_heads", GQA)
def test_paged_attention_decode_only(heads, kv_heads):
    _run_paged([(1, 1), (4, 1), (5, 1), (8, 1), (9, 1), (30, 1)], heads, kv_heads, 4, seed=1)


@pytest.mark.parametrize("heads,kv_heads", GQA)
def test_paged_attention_chunk_after_cached_prefix(heads, kv_heads):
    # n < ctx with n > 1: the mask must be offset by the cached prefix length.
    _run_paged([(10, 3), (12, 4), (17, 8), (6, 2), (40, 13)], heads, kv_heads, 4, seed=2)


@pytest.mark.parametrize("heads,kv_heads", GQA)
def test_paged_attention_prefill_only(heads, kv_heads):
    _run_paged([(3, 3), (8, 8), (11, 11)], heads, kv_heads, 4, seed=3)


@pytest.mark.parametrize("window", [1, 3, 8, 40])
def test_paged_attention_sliding_window(window):
    # Prefills, chunks after a prefix and decodes, within windows smaller and larger
    # than the blocks and the contexts.
    _run_paged([(7, 7), (13, 1), (21, 3), (17, 8), (33, 32), (40, 1)], 4, 2, 4, seed=window,
               window=window)


def test_paged_attention_single_sequence_exact_blocks():
    _run_paged([(16, 16)], 4, 2, 4, seed=4, extra_blocks=0)
    _run_paged([(16, 1)], 4, 2, 4, seed=5, extra_blocks=0)


def test_attention_layer_chunked_prefill_then_decode_equals_dense():
    """The Attention module (store, then attend) over a prompt sent in two chunks and
    then two decode steps equals dense causal attention over the whole sequence."""
    heads, kv_heads, d, bs = 4, 2, 8, 4
    g = gen(11)
    total = 14
    q = torch.randn(total, heads, d, generator=g)
    k = torch.randn(total, kv_heads, d, generator=g)
    v = torch.randn(total, kv_heads, d, generator=g)
    scale = 0.3
    layer = Attention(heads, kv_heads, d, scale, "torch")
    layer.k_cache = torch.full((8, bs, kv_heads, d), float("nan"))
    layer.v_cache = torch.full_like(layer.k_cache, float("nan"))
    table = [6, 2, 7, 0]
    outs = []
    for start, end in ((0, 5), (5, 12), (12, 13), (13, 14)):
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(_slots(table, range(start, end), bs), dtype=torch.long),
            cu_seqlens_q=torch.tensor([0, end - start], dtype=torch.int32),
            seq_lens=torch.tensor([end], dtype=torch.int32),
            block_tables=torch.tensor([table], dtype=torch.int32),
            max_seqlen_q=end - start, max_seqlen_k=end,
            cu_seqlens_q_host=[0, end - start], seq_lens_host=[end])
        outs.append(layer(q[start:end], k[start:end], v[start:end], meta))
    torch.testing.assert_close(torch.cat(outs).double(), _reference(q, k, v, scale),
                               rtol=0, atol=attention_bound(q, k, v, scale))


def test_resolve_backend():
    assert ops.resolve_backend("torch", torch.device("cpu")) == "torch"
    with pytest.raises(ValueError, match="backend"):
        ops.resolve_backend("cuda-magic", torch.device("cpu"))


# --- store_kvcache ---------------------------------------------------------------------

def test_store_kvcache_writes_slots_and_skips_minus_one():
    num_blocks, bs, kvh, d = 5, 4, 2, 3
    k_cache = torch.zeros(num_blocks, bs, kvh, d)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.tensor([17, -1, 0, 6, -1, 9], dtype=torch.long)
    k = torch.arange(1, 6 * kvh * d + 1, dtype=F32).view(6, kvh, d)
    v = -k
    store_kvcache(k, v, k_cache, v_cache, slots)
    for i, s in enumerate(slots.tolist()):
        if s >= 0:
            assert torch.equal(k_cache[s // bs, s % bs], k[i])
            assert torch.equal(v_cache[s // bs, s % bs], v[i])
    written = {17, 0, 6, 9}
    flat_k = k_cache.view(-1, kvh, d)
    flat_v = v_cache.view(-1, kvh, d)
    for s in range(num_blocks * bs):
        if s not in written:  # includes the last slot, which -1 would alias to
            assert not flat_k[s].any() and not flat_v[s].any(), s


def test_store_kvcache_all_valid_and_overwrite():
    k_cache = torch.zeros(3, 4, 1, 2)
    v_cache = torch.zeros_like(k_cache)
    k = torch.randn(4, 1, 2, generator=gen(12))
    v = torch.randn(4, 1, 2, generator=gen(13))
    slots = torch.tensor([11, 4, 5, 0], dtype=torch.long)
    store_kvcache(k, v, k_cache, v_cache, slots)
    torch.testing.assert_close(k_cache.view(-1, 1, 2)[slots], k, rtol=0, atol=0)
    torch.testing.assert_close(v_cache.view(-1, 1, 2)[slots], v, rtol=0, atol=0)
    store_kvcache(k * 2, v * 2, k_cache, v_cache, slots)
    torch.testing.assert_close(k_cache.view(-1, 1, 2)[slots], k * 2, rtol=0, atol=0)


def test_store_kvcache_only_padding_writes_nothing():
    k_cache = torch.zeros(2, 4, 1, 2)
    v_cache = torch.zeros_like(k_cache)
    store_kvcache(torch.ones(3, 1, 2), torch.ones(3, 1, 2), k_cache, v_cache,
                  torch.full((3,), -1, dtype=torch.long))
    assert not k_cache.any() and not v_cache.any()


# --- small layers at world size 1, and shard loading ------------------------------------

def test_silu_and_mul():
    x = torch.randn(3, 10, generator=gen(14))
    torch.testing.assert_close(SiluAndMul()(x), F.silu(x[:, :5]) * x[:, 5:])


def test_linear_layers_world_size_1():
    tp = TPContext()
    w = torch.randn(6, 4, generator=gen(15))
    b = torch.randn(6, generator=gen(16))
    x = torch.randn(2, 4, generator=gen(17))
    col = ColumnParallelLinear(4, 6, True, tp, F32)
    col.weight.weight_loader(col.weight, w)
    col.bias.weight_loader(col.bias, b)
    torch.testing.assert_close(col(x), F.linear(x, w, b))
    row = RowParallelLinear(4, 6, True, tp, F32)
    row.weight.weight_loader(row.weight, w)
    row.bias.weight_loader(row.bias, b)
    torch.testing.assert_close(row(x), F.linear(x, w, b))
    gate, up = torch.randn(5, 4, generator=gen(18)), torch.randn(5, 4, generator=gen(19))
    merged = MergedColumnParallelLinear(4, [5, 5], False, tp, F32)
    merged.weight.weight_loader(merged.weight, gate, 0)
    merged.weight.weight_loader(merged.weight, up, 1)
    torch.testing.assert_close(merged(x), torch.cat([x @ gate.T, x @ up.T], -1))


def test_onednn_packed_linears_match_dense():
    """pack_for_cpu moves float32 linear weights (Column, Row, LM head) into oneDNN's
    layout and frees the dense copy; outputs stay equal to F.linear's up to rounding.
    The embedding (a lookup, not a matmul) and non-float32 layers are left alone."""
    tp = TPContext()
    model = torch.nn.Module()
    model.col = ColumnParallelLinear(64, 96, True, tp, F32)
    model.row = RowParallelLinear(96, 64, False, tp, F32)
    model.head = ParallelLMHead(300, 64, tp, F32)
    model.emb = VocabParallelEmbedding(300, 64, tp, F32)
    model.bf16 = ColumnParallelLinear(64, 32, False, tp, torch.bfloat16)
    for i, m in enumerate(model.children()):
        for p in m.parameters():
            p.data.copy_(torch.randn(p.shape, generator=gen(40 + i)))
    dense = {n: m.weight.detach().clone() for n, m in model.named_children()}
    from nvllm.worker.layers.linear import pack_for_cpu

    assert pack_for_cpu(model) == 3
    assert not hasattr(model.emb, "packed")
    assert model.col.weight.numel() == 0 and model.bf16.packed is None
    x = torch.randn(27, 64, generator=gen(50))
    torch.testing.assert_close(model.col(x), F.linear(x, dense["col"], model.col.bias))
    h = torch.randn(5, 96, generator=gen(51))
    torch.testing.assert_close(model.row(h), h @ dense["row"].T)
    torch.testing.assert_close(model.head(x), x @ dense["head"].T)
    torch.testing.assert_close(model.emb(torch.tensor([0, 299])), dense["emb"][[0, 299]])
    assert pack_for_cpu(model) == 0  # already packed


@pytest.mark.parametrize("world,heads,kv_heads", [(1, 4, 2), (2, 4, 2), (2, 4, 1), (4, 4, 2),
                                                  (4, 8, 4)])
def test_qkv_shards_reassemble(world, heads, kv_heads):
    d, hidden = 3, 8
    wq = torch.randn(heads * d, hidden, generator=gen(20))
    wk = torch.randn(kv_heads * d, hidden, generator=gen(21))
    wv = torch.randn(kv_heads * d, hidden, generator=gen(22))
    x = torch.randn(2, hidden, generator=gen(23))
    for rank in range(world):
        tp = TPContext(rank=rank, world_size=world)
        qkv = QKVParallelLinear(hidden, d, heads, kv_heads, False, tp, F32)
        for sid, w in (("q", wq), ("k", wk), ("v", wv)):
            qkv.weight.weight_loader(qkv.weight, w, sid)
        y = qkv(x)
        hq, hkv = heads // world, max(1, kv_heads // world)
        q, k, v = y.split([hq * d, hkv * d, hkv * d], dim=-1)
        torch.testing.assert_close(q, (x @ wq.T)[:, rank * hq * d:(rank + 1) * hq * d])
        # Each of this rank's query heads must find its own KV head locally.
        for j in range(hq):
            global_kv = (rank * hq + j) // (heads // kv_heads)
            local_kv = j // (hq // hkv)
            torch.testing.assert_close(k[:, local_kv * d:(local_kv + 1) * d],
                                       (x @ wk.T)[:, global_kv * d:(global_kv + 1) * d])
            torch.testing.assert_close(v[:, local_kv * d:(local_kv + 1) * d],
                                       (x @ wv.T)[:, global_kv * d:(global_kv + 1) * d])


def test_row_and_column_shards_reassemble():
    world = 2
    w = torch.randn(6, 4, generator=gen(24))
    x = torch.randn(3, 4, generator=gen(25))
    cols, partial = [], torch.zeros(3, 6)
    for rank in range(world):
        tp = TPContext(rank=rank, world_size=world)
        col = ColumnParallelLinear(4, 6, False, tp, F32)
        col.weight.weight_loader(col.weight, w)
        cols.append(col(x))
        row = RowParallelLinear(4, 6, False, tp, F32)
        row.weight.weight_loader(row.weight, w)
        partial += F.linear(x[:, rank * 2:(rank + 1) * 2], row.weight)
    torch.testing.assert_close(torch.cat(cols, -1), x @ w.T)
    torch.testing.assert_close(partial, x @ w.T)


def test_embedding_and_lm_head_world_size_1():
    tp = TPContext()
    w = torch.randn(10, 4, generator=gen(26))
    emb = VocabParallelEmbedding(10, 4, tp, F32)
    emb.weight.weight_loader(emb.weight, w)
    ids = torch.tensor([0, 9, 3, 3])
    torch.testing.assert_close(emb(ids), w[ids])
    head = ParallelLMHead(10, 4, tp, F32)
    head.weight.weight_loader(head.weight, w)
    h = torch.randn(2, 4, generator=gen(27))
    logits = head(h)
    assert logits.shape == (2, 10) and logits.dtype == F32
    torch.testing.assert_close(logits, h @ w.T)


@pytest.mark.parametrize("vocab,world", [(10, 3), (5, 4), (8, 2)])
def test_vocab_shards_are_uneven_and_complete(vocab, world):
    """shard_sizes' rule: 10 rows on 3 ranks are 4 + 3 + 3, no padding rows."""
    w = torch.randn(vocab, 4, generator=gen(28))
    shards = []
    for rank in range(world):
        emb = VocabParallelEmbedding(vocab, 4, TPContext(rank=rank, world_size=world), F32)
        emb.weight.weight_loader(emb.weight, w)
        shards.append(emb.weight.data)
    sizes = [s.shape[0] for s in shards]
    assert sizes == sorted(sizes, reverse=True) and max(sizes) - min(sizes) <= 1
    torch.testing.assert_close(torch.cat(shards), w, rtol=0, atol=0)
