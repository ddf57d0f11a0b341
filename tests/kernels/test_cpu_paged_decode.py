"""The native CPU decode kernel in paged mode (no contiguous copies: keys and values read
through the block tables): the same outputs, bit for bit, as the kernel over contiguous
copies holding the same keys, in both the plain and the fused-qkv calls; the new tokens
stored at their slots; causal and windowed attention against SDPA; the bounds it refuses.
(The engine with the mirror off, end to end: tests/e2e/test_exactness.py.)"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from nvllm.kernels import cpu_ops

pytestmark = pytest.mark.skipif(not cpu_ops.load(), reason="nvllm's CPU ops are not built")

NUM_BLOCKS = 48


def _case(dtype, heads, kv_heads, d, bs, seed=0):
    """Six sequences (1, 5, 1, 9, 17, 2 new tokens; contexts up to 70), each with its own
    shuffled blocks, the past keys in the pages and, for comparison, in contiguous copies."""
    g = torch.Generator().manual_seed(seed)
    qlens, lens = [1, 5, 1, 9, 17, 2], [1, 12, 40, 9, 70, 33]
    rows, tokens = [0, 1, 6, 7, 16, 33], 35
    k_cache, v_cache = (torch.randn(NUM_BLOCKS, bs, kv_heads, d, generator=g).to(dtype)
                        for _ in range(2))
    perm = torch.randperm(NUM_BLOCKS, generator=g).tolist()
    max_blocks = max(-(-n // bs) for n in lens) + 1
    tables, bufs, slots = [], [], []
    for n, nq in zip(lens, qlens):
        own = [perm.pop() for _ in range(-(-n // bs))]
        tables.append(own + [0] * (max_blocks - len(own)))
        buf = torch.zeros(1, 2, kv_heads, n + 2, d, dtype=dtype)
        for p in range(n):
            slot = own[p // bs] * bs + p % bs
            if p < n - nq:  # past tokens: in both homes
                buf[0, 0, :, p] = k_cache.view(-1, kv_heads, d)[slot]
                buf[0, 1, :, p] = v_cache.view(-1, kv_heads, d)[slot]
            else:
                slots.append(slot)
        bufs.append(buf)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * d, generator=g).to(dtype)
    long = lambda xs: torch.tensor(xs, dtype=torch.long)  # noqa: E731
    return dict(qlens=long(qlens), lens=long(lens), rows=long(rows), slots=long(slots),
                tables=torch.tensor(tables, dtype=torch.int32), k_cache=k_cache,
                v_cache=v_cache, bufs=bufs, qkv=qkv)


def _split(qkv, heads, kv_heads, d):
    t = qkv.shape[0]
    q = qkv[:, :heads * d].reshape(t, heads, d).contiguous()
    k = qkv[:, heads * d:(heads + kv_heads) * d].view(t, kv_heads, d)
    v = qkv[:, (heads + kv_heads) * d:].view(t, kv_heads, d)
    return q, k, v


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("heads,kv_heads,d", [(8, 2, 64), (9, 3, 64), (4, 1, 128), (6, 2, 80)])
@pytest.mark.parametrize("bs", [4, 16])
@pytest.mark.parametrize("window", [0, 3])
# The six sequences at 1 thread: one task per sequence, all its KV heads (its slots read
# whole); at 4 threads, too few sequences to share: one task per (sequence, KV head).
@pytest.mark.parametrize("threads", [1, 4], ids=["seq-tasks", "head-tasks"])
def test_paged_mode_equals_the_copies_and_sdpa(dtype, heads, kv_heads, d, bs, window, threads):
    c = _case(dtype, heads, kv_heads, d, bs)
    q, k, v = _split(c["qkv"], heads, kv_heads, d)
    kc, vc = c["k_cache"].clone(), c["v_cache"].clone()
    out = torch.full_like(q, 7.0)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        cpu_ops.paged_decode_attention(out, q, k, v, kc, vc, c["slots"], c["rows"], c["tables"],
                                       c["lens"], 0.3, window, c["qlens"])
    finally:
        torch.set_num_threads(before)
    flat_k, flat_v = kc.view(-1, kv_heads, d), vc.view(-1, kv_heads, d)
    tok = torch.cat([torch.arange(r, r + n) for r, n in zip(c["rows"], c["qlens"])])
    assert torch.equal(flat_k[c["slots"]], k[tok]) and torch.equal(flat_v[c["slots"]], v[tok])
    # The kernel over contiguous copies of the same keys: the same bits.
    bufs = [b.clone() for b in c["bufs"]]
    mirror = torch.full_like(q, 7.0)
    cpu_ops.decode_attention(mirror, q, k, v, c["k_cache"].clone(), c["v_cache"].clone(),
                             c["slots"], c["rows"], torch.tensor([b.data_ptr() for b in bufs]),
                             torch.tensor([b.shape[3] for b in bufs]), c["lens"], 0, 0.3,
                             window, c["qlens"])
    assert torch.equal(out[tok], mirror[tok])
    # SDPA over the pages, one query at a time.
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    bs_ = c["k_cache"].shape[1]
    for b, (row, nq, ctx) in enumerate(zip(c["rows"].tolist(), c["qlens"].tolist(),
                                           c["lens"].tolist())):
        table = c["tables"][b].long()
        slot_of = table[torch.arange(ctx) // bs_] * bs_ + torch.arange(ctx) % bs_
        keys, vals = flat_k[slot_of].transpose(0, 1), flat_v[slot_of].transpose(0, 1)
        for j in range(nq):
            seen = ctx - nq + j + 1
            first = max(0, seen - window) if window else 0
            want = F.scaled_dot_product_attention(
                q[row + j].float()[None, :, None], keys[None, :, first:seen].float(),
                vals[None, :, first:seen].float(), scale=0.3, enable_gqa=True)[0, :, 0]
            torch.testing.assert_close(out[row + j].float(), want, atol=tol, rtol=tol)
    untouched = torch.ones(q.shape[0], dtype=torch.bool)
    untouched[tok] = False
    assert bool((out[untouched] == 7.0).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_paged_fused_qkv_equals_the_copies(dtype):
    heads, kv_heads, d = 9, 3, 64
    c = _case(dtype, heads, kv_heads, d, 16, seed=3)
    tokens = c["qkv"].shape[0]
    positions = torch.randint(0, 100, (tokens,), generator=torch.Generator().manual_seed(1))
    ang = torch.randn(128, d // 2).repeat(1, 2)
    cos, sin = ang.cos().contiguous(), ang.sin().contiguous()
    kc = c["k_cache"].clone()
    out = cpu_ops.paged_decode_attention_qkv(c["qkv"], positions, cos, sin, heads, kv_heads,
                                             kc, c["v_cache"].clone(), c["slots"], c["rows"],
                                             c["tables"], c["lens"], 0.125, 0, c["qlens"])
    bufs = [b.clone() for b in c["bufs"]]
    kc2 = c["k_cache"].clone()
    want = cpu_ops.decode_attention_qkv(c["qkv"], positions, cos, sin, heads, kv_heads, kc2,
                                        c["v_cache"].clone(), c["slots"], c["rows"],
                                        torch.tensor([b.data_ptr() for b in bufs]),
                                        torch.tensor([b.shape[3] for b in bufs]), c["lens"], 0,
                                        0.125, 0, c["qlens"])
    tok = torch.cat([torch.arange(r, r + n) for r, n in zip(c["rows"], c["qlens"])])
    assert torch.equal(out[tok], want[tok])
    assert torch.equal(kc, kc2)  # the rotated keys stored alike


def _bf16(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.bfloat16)


@pytest.mark.parametrize("paged", [True, False], ids=["paged", "copies"])
@pytest.mark.parametrize("heads,kv_heads,d", [(9, 3, 64), (6, 2, 80)])
def test_a_bfloat16_cache_under_float32_reads_back_what_it_stored(paged, heads, kv_heads, d):
    """--kv-cache-dtype bfloat16 with float32 activations: the new keys and values are
    rounded once, when stored (to nearest even, as torch's cast), and attention then reads
    the stored values exactly: bit for bit the output of a float32 cache that holds the
    same rounded values."""
    c = _case(torch.float32, heads, kv_heads, d, 16, seed=5)
    q, k, v = _split(c["qkv"], heads, kv_heads, d)
    tok = torch.cat([torch.arange(r, r + n) for r, n in zip(c["rows"], c["qlens"])])

    def run(k_new, v_new, dtype):
        kc, vc = _bf16(c["k_cache"]).to(dtype), _bf16(c["v_cache"]).to(dtype)
        bufs = [_bf16(b).to(dtype) for b in c["bufs"]]
        out = torch.full_like(q, 7.0)
        if paged:
            cpu_ops.paged_decode_attention(out, q, k_new, v_new, kc, vc, c["slots"], c["rows"],
                                           c["tables"], c["lens"], 0.3, 0, c["qlens"])
        else:
            cpu_ops.decode_attention(out, q, k_new, v_new, kc, vc, c["slots"], c["rows"],
                                     torch.tensor([b.data_ptr() for b in bufs]),
                                     torch.tensor([b.shape[3] for b in bufs]), c["lens"], 0,
                                     0.3, 0, c["qlens"])
        return out, kc, bufs

    out, kc, bufs = run(k, v, torch.bfloat16)
    want, kc_want, bufs_want = run(_bf16(k).float(), _bf16(v).float(), torch.float32)
    assert torch.equal(out[tok], want[tok])
    assert torch.equal(kc.float(), kc_want)
    assert all(torch.equal(b.float(), w) for b, w in zip(bufs, bufs_want))
    assert torch.equal(kc.view(-1, kv_heads, d)[c["slots"]], _bf16(k[tok]))
    with pytest.raises(RuntimeError, match="bfloat16 under float32 q; got Float"):
        cpu_ops.paged_decode_attention(torch.empty_like(_bf16(q)), _bf16(q), _bf16(k), _bf16(v),
                                       c["k_cache"], c["v_cache"], c["slots"], c["rows"],
                                       c["tables"], c["lens"], 0.3, 0, c["qlens"])


def test_fused_qkv_with_a_bfloat16_cache_stores_the_rounded_rotated_keys():
    heads, kv_heads, d = 9, 3, 64
    c = _case(torch.float32, heads, kv_heads, d, 16, seed=7)
    positions = torch.randint(0, 100, (c["qkv"].shape[0],),
                              generator=torch.Generator().manual_seed(2))
    ang = torch.randn(128, d // 2).repeat(1, 2)
    cos, sin = ang.cos().contiguous(), ang.sin().contiguous()
    outs, caches = [], []
    for dtype in (torch.float32, torch.bfloat16):
        kc, vc = c["k_cache"].to(dtype), c["v_cache"].to(dtype)
        outs.append(cpu_ops.paged_decode_attention_qkv(
            c["qkv"], positions, cos, sin, heads, kv_heads, kc, vc, c["slots"], c["rows"],
            c["tables"], c["lens"], 0.125, 0, c["qlens"]))
        caches.append((kc, vc))
    (kf, vf), (kb, vb) = caches
    assert torch.equal(kb, _bf16(kf)) and torch.equal(vb, _bf16(vf))
    tok = torch.cat([torch.arange(r, r + n) for r, n in zip(c["rows"], c["qlens"])])
    # Both attend over their own caches: equal within bfloat16's rounding of the keys.
    torch.testing.assert_close(outs[1][tok], outs[0][tok], atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("change,match", [
    ("table", r"block_tables\[4, 2\] = 48 is outside the paged cache \(48 blocks\)"),
    ("slot", r"slots\[0\] = -1: paged decode attention reads every new token back"),
    ("short_table", r"lens\[4\] = 70 needs 5 blocks; block_tables has 3"),
    ("block_size", r"power-of-two block_size, not 12"),
    ("dtype", r"block_tables must be contiguous int32"),
])
def test_paged_mode_refuses_what_would_read_out_of_bounds(change, match):
    c = _case(torch.float32, 4, 2, 64, 16)
    q, k, v = _split(c["qkv"], 4, 2, 64)
    kc, vc, tables, slots = c["k_cache"], c["v_cache"], c["tables"], c["slots"]
    if change == "table":
        tables = tables.clone()
        tables[4, 2] = NUM_BLOCKS
    elif change == "slot":
        slots = slots.clone()
        slots[0] = -1
    elif change == "short_table":
        tables = tables[:, :3].contiguous()
    elif change == "block_size":
        kc, vc = torch.zeros(64, 12, 2, 64), torch.zeros(64, 12, 2, 64)
    else:
        tables = tables.long()
    with pytest.raises(RuntimeError, match=match):
        cpu_ops.paged_decode_attention(torch.empty_like(q), q, k, v, kc, vc, slots, c["rows"],
                                       tables, c["lens"], 0.3, 0, c["qlens"])


def test_a_runner_without_copies_decodes_through_the_paged_kernel(tiny, monkeypatch):
    """ModelRunner with cpu_kv_mirror off: decode steps go to the paged kernel (counted),
    the first step's 7-token prompt too while its 19-token one goes to SDPA, and the
    greedy tokens equal those of a runner keeping copies, over prompts spanning blocks."""
    from nvllm.common import worker_protocol as protocol
    from nvllm.common.config import EngineConfig
    from nvllm.worker.model_runner import ModelRunner
    from nvllm.worker.parallel import TPContext

    calls, mixed = [], []
    real, real_mixed = cpu_ops.paged_decode_attention_qkv, cpu_ops.paged_decode_attention

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    def counted_mixed(*args, **kwargs):
        mixed.append(1)
        return real_mixed(*args, **kwargs)

    monkeypatch.setattr(cpu_ops, "paged_decode_attention_qkv", counted)
    monkeypatch.setattr(cpu_ops, "paged_decode_attention", counted_mixed)
    greedy = protocol.WorkerSampling()
    prompts = {1: list(range(3, 22)), 2: list(range(40, 47))}
    results = []
    for mirror in (True, False):
        cfg = EngineConfig(tiny("llama"), device="cpu", dtype="float32", block_size=4,
                           max_num_seqs=2, max_model_len=64, cpu_kv_mirror=mirror).finalize()
        runner = ModelRunner(cfg, TPContext(), torch.device("cpu"))
        runner.init_kv_cache(40)
        blocks = {1: list(range(0, 12)), 2: list(range(20, 32))}
        new = [protocol.NewSeq(s, p, len(p), 0, len(p), blocks[s][:-(-len(p) // 4)], greedy)
               for s, p in prompts.items()]
        lens = {s: len(p) for s, p in prompts.items()}
        out = {s: [] for s in prompts}
        res = runner.execute(protocol.StepPlan.of(1, new, [], []))
        for step in range(2, 14):
            for s, t in zip(res.seq_ids, res.token_ids):
                out[s].append(t)
            running = []
            for s in prompts:
                n = lens[s]
                running.append(protocol.RunningSeq(s, 1, [blocks[s][n // 4]] if n % 4 == 0
                                                   else []))
                lens[s] = n + 1
            res = runner.execute(protocol.StepPlan.of(step, [], running, []))
        results.append(out)
        if mirror:
            assert not calls and not mixed
    assert results[0] == results[1]
    assert len(mixed) == 2  # the prefill step, in each of the two layers
    assert len(calls) >= 12 * 2  # every decode step, in every layer
