"""The CPU attention backend (contiguous per-sequence K/V copies) against the reference
(paged gather + SDPA) over multi-step runs of ragged batches: bit for bit on the SDPA
path, within float rounding where the native decode kernel (cpu_ops) serves decoding
sequences. In float32 every step is also checked against dense float64 attention over the
sequence's whole K/V history under a causal (and sliding-window) mask built here by hand,
independently of the reference's mask, window start and slicing."""

from __future__ import annotations

import functools
import random
import shutil
from dataclasses import dataclass, field

import pytest
import torch
import torch.nn.functional as F
from float_bounds import attention_bound

from nvllm.common.utils import cdiv
from nvllm.kernels import cpu_attention, cpu_ops, ops, reference
from nvllm.kernels.cpu_attention import MIN_CAPACITY, CpuKVStore
from nvllm.kernels.metadata import build_metadata

LAYERS, HEAD_DIM, SCALE = 2, 8, 0.35

# The native kernel where it builds (every CI machine has a compiler: see
# test_native_ops_build), else only the SDPA path.
NATIVE = [pytest.param(False, id="sdpa"),
          pytest.param(True, id="native", marks=pytest.mark.skipif(
              not cpu_ops.load(), reason="nvllm's CPU ops are not built"))]


def _assert_close(out: torch.Tensor, want: torch.Tensor, native: bool, where: str) -> None:
    if not native:
        assert torch.equal(out, want), where
    elif out.dtype == torch.bfloat16:  # float32 sums, one rounding: within a bf16 step
        torch.testing.assert_close(out.float(), want.float(), atol=2e-2, rtol=2e-2, msg=where)
    else:
        torch.testing.assert_close(out, want, atol=2e-6, rtol=1e-5, msg=where)


@functools.cache
def _visible(ctx: int, n: int, window: int | None) -> torch.Tensor:
    """[n, ctx] bool, by hand: the query at absolute position i (a run's last n of ctx
    positions) sees key j iff j <= i and i - j < window (HF's sliding window)."""
    return torch.tensor([[j <= i and (window is None or i - j < window) for j in range(ctx)]
                         for i in range(ctx - n, ctx)])


def _by_head(q: torch.Tensor, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q [n, heads, d] and keys [ctx, kv_heads, d] as float64 [heads, n, d] and
    [heads, d, ctx], KV head h // (heads // kv_heads) under query head h (GQA)."""
    kk = keys.double().repeat_interleave(q.shape[1] // keys.shape[1], dim=1)
    return q.double().transpose(0, 1), kk.permute(1, 2, 0)


def _dense_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                     window: int | None) -> torch.Tensor:
    """Float64 attention of q [n, heads, d] (the last n of ctx positions) over every key
    and value of the sequence, [ctx, kv_heads, d] each, under _visible's mask."""
    n, ctx = q.shape[0], keys.shape[0]
    qh, kh = _by_head(q, keys)
    _, vh = _by_head(q, values)
    scores = (qh @ kh * SCALE).masked_fill(~_visible(ctx, n, window), float("-inf"))
    return (scores.softmax(-1) @ vh.transpose(1, 2)).transpose(0, 1)


def _assert_close_to_dense(out: torch.Tensor, q: torch.Tensor, keys: torch.Tensor,
                           values: torch.Tensor, window: int | None, where: str) -> None:
    """A float32 run's output against _dense_attention, within float_bounds.attention_bound
    (derived there from the magnitudes), doubled for the native kernel's fast-math exp (a
    few ulp). Measured: at most 1.4% of it. A mask one key off moves the output by about
    max|v| / m (m keys visible), orders of magnitude more."""
    bound = 2 * attention_bound(q, keys, values, SCALE, window)
    err = float((out.double() - _dense_attention(q, keys, values, window)).abs().max())
    assert err <= bound, f"{where}: {err:.3g} from dense attention (bound {bound:.3g})"


@dataclass
class Seq:
    """Starts with `prefix` tokens already in its pages (a prefix hit), computes its prompt
    up to `prompt` in chunks of at most `chunk` tokens, then decodes `decode` tokens,
    `verify` at a time (as speculative verify rows score the last token and k drafts);
    joins the batch at step `arrive`."""

    prefix: int
    prompt: int
    decode: int
    chunk: int = 1 << 30
    arrive: int = 0
    verify: int = 1  # tokens per decode step (> 1: speculative verify rows)
    done: int = 0
    table: list[int] = field(default_factory=list)

    @property
    def total(self) -> int:
        return self.prompt + self.decode

    def next_len(self) -> int:
        if self.done < self.prompt:
            return min(self.chunk, self.prompt - self.done)
        return min(self.verify, self.total - self.done)


def _copy_bytes(cap: int, kv_heads: int, dtype: torch.dtype) -> int:
    return 2 * LAYERS * cap * kv_heads * HEAD_DIM * dtype.itemsize


def _run(seqs: list[Seq], heads: int, kv_heads: int, budget: int, block_size: int = 4,
         seed: int = 0, dtype: torch.dtype = torch.float32,
         native: bool = False, window: int | None = None) -> dict[str, int]:
    """Runs every step through the CPU backend and the reference (each on its own paged
    cache) and asserts equal outputs and caches; returns what the store went through.
    With a window, every block wholly before a sequence's next visible key turns to NaN
    after each step, as if the leader had given it back: neither side may read it."""
    g = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    num_blocks = sum(cdiv(s.total, block_size) for s in seqs) + 3
    perm = rng.sample(range(num_blocks), num_blocks)
    for s in seqs:
        nb = cdiv(s.total, block_size)
        s.table, perm = perm[:nb], perm[nb:]
    # NaN in every slot nobody writes: reading one would poison the output.
    paged = torch.full((2, LAYERS, num_blocks, block_size, kv_heads, HEAD_DIM), float("nan"),
                       dtype=dtype)
    # Every K/V each sequence ever had, per layer: what dense attention reads (float32).
    history: list[list[list[torch.Tensor]]] = []
    for s in seqs:  # the cached prefixes
        s.done = s.prefix
        slots = torch.tensor([s.table[p // block_size] * block_size + p % block_size
                              for p in range(s.prefix)], dtype=torch.long)
        history.append([])
        for layer in range(LAYERS):
            k, v = (torch.randn(s.prefix, kv_heads, HEAD_DIM, generator=g, dtype=dtype)
                    for _ in range(2))
            reference.store_kvcache(k, v, paged[0, layer], paged[1, layer], slots)
            history[-1].append([k, v])
    ref_cache = paged.clone()
    max_len = max(s.total for s in seqs)
    store = CpuKVStore(paged, budget, max_len, native_decode=native, window=window)
    assert store.native_decode == native
    seen = dict(mixed_steps=0, grown=0, built=0, lost=0, native=0, native_runs=0)
    ids = {id(s): i for i, s in enumerate(seqs)}
    step = 0
    while any(s.done < s.total for s in seqs):
        batch = [s for s in seqs if s.arrive <= step and s.done < s.total]
        step += 1
        if not batch:
            continue
        before = {i: c.shape[3] for i, c in store.copies.items()}
        lens = [s.next_len() for s in batch]
        ctxs = [s.done + n for s, n in zip(batch, lens)]
        meta, _ = build_metadata(lens, ctxs, [s.table for s in batch], block_size)
        plain, _ = build_metadata(lens, ctxs, [s.table for s in batch], block_size)
        meta.cpu_kv = store.views_for_step([ids[id(s)] for s in batch],
                                           [s.table for s in batch], lens, ctxs)
        assert store.nbytes <= budget
        dec = meta.cpu_kv.decode
        with_copy = set(meta.cpu_kv.with_copy) | set(dec.seqs if dec else ())
        seen["native"] += len(dec.seqs) if dec else 0
        seen["native_runs"] += sum(lens[i] > 1 for i in dec.seqs) if dec else 0
        seen["mixed_steps"] += 0 < len(with_copy) < len(batch)
        for j, s in enumerate(batch):
            i = ids[id(s)]
            if i in before and i not in store.copies:
                seen["lost"] += 1
            elif i in before and store.copies[i].shape[3] > before[i]:
                seen["grown"] += 1
            elif i not in before and i in store.copies and s.done > 0:
                seen["built"] += 1
            assert (j in with_copy) == (i in store.copies)
        for layer in range(LAYERS):
            t = sum(lens)
            q = torch.randn(t, heads, HEAD_DIM, generator=g, dtype=dtype)
            k, v = (torch.randn(t, kv_heads, HEAD_DIM, generator=g, dtype=dtype)
                    for _ in range(2))
            out = ops.attention(q, k, v, paged[0, layer], paged[1, layer], meta, SCALE,
                                "torch", layer, window)
            reference.store_kvcache(k, v, ref_cache[0, layer], ref_cache[1, layer],
                                    plain.slot_mapping)
            want = reference.paged_attention(q, ref_cache[0, layer], ref_cache[1, layer],
                                             plain, SCALE, window)
            where = f"step {step} layer {layer}: lens {lens} ctx {ctxs}"
            # First the independent check (float32 only: bfloat16's rounding bound would
            # be too loose to say much), then the reference's bits.
            row = 0
            for s, n in zip(batch, lens) if dtype == torch.float32 else ():
                h = history[ids[id(s)]][layer]
                h[0], h[1] = torch.cat((h[0], k[row:row + n])), torch.cat((h[1], v[row:row + n]))
                _assert_close_to_dense(out[row:row + n], q[row:row + n], h[0], h[1], window,
                                       f"{where}, seq {ids[id(s)]}")
                row += n
            _assert_close(out, want, native, where)
        for s, n in zip(batch, lens):
            s.done += n
            if s.done == s.total:
                store.drop(ids[id(s)])
            elif window:
                for b in s.table[:reference.window_start(s.done + 1, 1, window) // block_size]:
                    paged[:, :, b] = ref_cache[:, :, b] = float("nan")
        # Every copy holds exactly what the pages hold (with a window: the visible tail).
        for i, buf in store.copies.items():
            s, off = seqs[i], store.offsets[i]
            a = max(off, reference.window_start(s.done + 1, 1, window))
            pages = paged[:, :, torch.tensor(s.table[:cdiv(s.done, block_size)])]
            pages = pages.reshape(2, LAYERS, -1, kv_heads, HEAD_DIM)[:, :, a:s.done]
            assert torch.equal(buf[:, :, :, a - off:s.done - off], pages.permute(1, 0, 3, 2, 4))
            if window:  # the bound: the window, the step's tokens, a window of slack
                assert buf.shape[3] <= max(MIN_CAPACITY, s.chunk + 2 * window)
    assert torch.equal(paged.nan_to_num(), ref_cache.nan_to_num())
    assert store.nbytes == 0 and not store.copies
    assert (seen["native"] > 0) == native
    return seen


GQA = [(4, 4), (4, 2), (4, 1)]
ROOMY = 1 << 30


@pytest.mark.parametrize("native", NATIVE)
@pytest.mark.parametrize("heads,kv_heads", GQA)
def test_decode(heads, kv_heads, native):
    # Whole prompts cached in the pages but the last token: each copy is built from them.
    seqs = [Seq(prefix=p - 1, prompt=p, decode=d) for p, d in
            ((1, 3), (5, 4), (9, 2), (16, 5), (30, 3), (4, 1))]
    seen = _run(seqs, heads, kv_heads, ROOMY, seed=heads + kv_heads, native=native)
    assert seen["built"] == 5  # all but the one-token prompt


@pytest.mark.parametrize("native", NATIVE)
@pytest.mark.parametrize("heads,kv_heads", GQA)
@pytest.mark.parametrize("block_size", [4, 16])
def test_prefill_then_decode(heads, kv_heads, block_size, native):
    seqs = [Seq(0, p, 3, arrive=a) for p, a in ((7, 0), (1, 0), (16, 1), (33, 0), (5, 2))]
    _run(seqs, heads, kv_heads, ROOMY, block_size, seed=10 * heads + kv_heads, native=native)


@pytest.mark.parametrize("native", NATIVE)
@pytest.mark.parametrize("heads,kv_heads,dtype,window", [
    (4, 2, torch.float32, None), (4, 1, torch.float32, 5), (4, 4, torch.bfloat16, None),
    (4, 2, torch.bfloat16, 3)], ids=str)
def test_verify_rows_beside_decodes_and_prefills(heads, kv_heads, dtype, window, native):
    """Speculative steps: verify rows of 2, 5 and 17 tokens (k = 1, 4, 16; shorter at the
    end) beside one-token decodes, a 17-token prompt (the kernel's longest run) and an
    18-token one (SDPA's), with and without copies built from a prefix, in one batch:
    the native kernel serves every run of at most cpu_ops.MAX_QUERIES tokens, each query
    under its causal (and window) mask."""
    seqs = [Seq(0, 6, 10, verify=5), Seq(4, 9, 5), Seq(0, 3, 20, verify=17, arrive=1),
            Seq(10, 12, 4, verify=2), Seq(0, 17, 4, verify=5), Seq(0, 18, 2, arrive=2),
            Seq(0, 30, 5, chunk=13, verify=5)]
    seen = _run(seqs, heads, kv_heads, ROOMY, 4, seed=heads * 7 + kv_heads, dtype=dtype,
                native=native, window=window)
    assert (seen["native_runs"] > 0) == native and seen["mixed_steps"] == 0


@pytest.mark.parametrize("heads,kv_heads", GQA)
def test_chunks_after_a_prefix(heads, kv_heads):
    # Chunks of n > 1 behind a cached prefix: the causal mask is offset by it.
    seqs = [Seq(10, 23, 2, chunk=5), Seq(0, 17, 1, chunk=8), Seq(12, 13, 3),
            Seq(3, 40, 2, chunk=13, arrive=1)]
    seen = _run(seqs, heads, kv_heads, ROOMY, seed=20 + heads + kv_heads)
    assert seen["built"] == 3


@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (2, 2)])
def test_growth_by_doubling(heads, kv_heads):
    seqs = [Seq(0, 60, 10), Seq(50, 62, 70, chunk=4), Seq(0, 3, 140)]
    seen = _run(seqs, heads, kv_heads, ROOMY, seed=3)
    assert seen["grown"] >= 3 and seen["lost"] == 0


@pytest.mark.parametrize("native", NATIVE)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_budget_running_out_mid_run(dtype, native):
    """Room for about two minimal copies: sequences take copies, lose them when growing
    would overrun, read their pages meanwhile, and rebuild copies from the pages once
    others finish."""
    kv_heads = 2
    budget = int(2.5 * _copy_bytes(MIN_CAPACITY, kv_heads, dtype))
    seqs = [Seq(0, 40, 30, chunk=16), Seq(20, 50, 25, chunk=7), Seq(0, 9, 12, arrive=1),
            Seq(30, 31, 60, arrive=2), Seq(0, 5, 4, arrive=20), Seq(2, 70, 3, arrive=25)]
    seen = _run(seqs, 4, kv_heads, budget, seed=7, dtype=dtype, native=native)
    assert seen["mixed_steps"] > 0 and seen["lost"] > 0 and seen["built"] > 0
    assert seen["grown"] > 0


def test_no_budget_reads_pages():
    seqs = [Seq(0, 6, 3), Seq(4, 9, 2)]
    seen = _run(seqs, 4, 2, 0, seed=5)
    assert seen["built"] == seen["grown"] == 0


@pytest.mark.parametrize("native", NATIVE)
@pytest.mark.parametrize("seed", range(4))
def test_random_ragged_runs(seed, native):
    rng = random.Random(seed)
    heads, kv_heads = rng.choice(GQA)
    seqs = []
    for _ in range(rng.randint(2, 7)):
        prompt = rng.randint(1, 70)
        seqs.append(Seq(rng.randint(0, prompt - 1), prompt, rng.randint(1, 20),
                        chunk=rng.randint(1, 32), arrive=rng.randint(0, 6)))
    budget = rng.choice([ROOMY, int(rng.uniform(1, 4) * _copy_bytes(MIN_CAPACITY, kv_heads,
                                                                     torch.float32))])
    _run(seqs, heads, kv_heads, budget, rng.choice([4, 16]), seed=seed, native=native)


@pytest.mark.parametrize("native", NATIVE)
@pytest.mark.parametrize("window", [1, 6])
def test_sliding_window(window, native):
    """Prefill, chunks after a prefix and decode within a window, with the blocks before
    it poisoned: copies keep only the window's tail (shifting instead of growing)."""
    seqs = [Seq(0, 30, 40, chunk=7), Seq(20, 41, 6, chunk=16), Seq(9, 10, 40, arrive=2),
            Seq(0, 5, 70, arrive=1)]
    _run(seqs, 4, 2, ROOMY, 4, seed=window, native=native, window=window)


@pytest.mark.parametrize("native", NATIVE)
@pytest.mark.parametrize("window", [1, 2, 3, 4, 5, 8, 13])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 1)])
def test_sliding_window_equals_dense_attention_under_a_hand_built_mask(window, heads, kv_heads,
                                                                      native):
    """The CPU paths against dense attention under the mask built by hand (_visible): a
    whole prompt at once, prefill chunks shorter, equal to and longer than the window
    after a prefix, chunks that straddle block boundaries, and decoding (the SDPA path or
    the native kernel) far past the window, with copies shifting their tail. _run checks
    every step of every layer of every sequence (and the blocks behind each window are
    NaN, so reading one key too many poisons the output)."""
    seqs = [Seq(0, 11, 3 * window + 5), Seq(0, 23, 9, chunk=window),
            Seq(6, 20, 2 * window, chunk=window + 1), Seq(3, 3 + 2 * window, 7, chunk=3),
            Seq(1, 2, window + 9, arrive=1), Seq(0, 17, 4, chunk=max(1, window - 1), arrive=2)]
    _run(seqs, heads, kv_heads, ROOMY, 4, seed=window * 10 + kv_heads, native=native,
         window=window)


def test_sliding_window_budget_runs_out():
    """A window and a budget for about one copy: sequences fall back to their (windowed)
    pages and rebuild copies from the window's tail."""
    seqs = [Seq(0, 30, 20, chunk=7), Seq(20, 41, 6, chunk=16), Seq(9, 10, 30, arrive=2)]
    seen = _run(seqs, 4, 2, int(1.5 * _copy_bytes(MIN_CAPACITY, 2, torch.float32)), 4,
                seed=3, window=9)
    assert seen["mixed_steps"] > 0 and seen["built"] > 0


def test_store_capacity_and_bytes():
    paged = torch.zeros(2, LAYERS, 40, 4, 2, HEAD_DIM)
    store = CpuKVStore(paged, ROOMY, max_model_len=150, native_decode=False)
    views = store.views_for_step([7], [list(range(40))], [10], [10])
    assert views.with_copy == [0] and store.copies[7].shape == (LAYERS, 2, 2, 64, HEAD_DIM)
    store.views_for_step([7], [list(range(40))], [1], [65])
    assert store.copies[7].shape[3] == 128  # doubled
    store.views_for_step([7], [list(range(40))], [1], [129])
    assert store.copies[7].shape[3] == 150  # capped at the model's length
    assert store.nbytes == store.copies[7].nbytes == _copy_bytes(150, 2, torch.float32)
    store.drop(7)
    store.drop(7)
    assert store.nbytes == 0 and not store.copies


def test_uses_cpu_attention():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert ops.uses_cpu_attention("torch", cpu, True)
    assert not ops.uses_cpu_attention("torch", cpu, False)
    assert not ops.uses_cpu_attention("triton", cpu, True)
    assert not ops.uses_cpu_attention("torch", cuda, True)
    assert cpu_attention.attention.__module__ == "nvllm.kernels.cpu_attention"


def test_native_ops_build():
    """Where a C++ compiler exists (CI's machines), the native ops must build and load:
    otherwise every CPU run silently takes the slow path."""
    if shutil.which("c++") is None and shutil.which("g++") is None:
        pytest.skip("no C++ compiler on this machine")
    assert cpu_ops.load(), f"could not build or load {cpu_ops.library_path()}"


@pytest.mark.skipif(not cpu_ops.load(), reason="nvllm's CPU ops are not built")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
# The fixed-shape AVX-512 kernels (query heads per KV head 1, 2, 4 or 8; head_dim 64 or
# 128) and the generic loop (the other shapes).
@pytest.mark.parametrize("heads,kv_heads,d", [(8, 2, 64), (2, 2, 64), (8, 1, 64), (4, 2, 128),
                                              (8, 1, 128), (4, 4, 32), (16, 1, 128),
                                              (6, 2, 80),
                                              # uneven head shards (sharding.py): 9 / 3
                                              # heads at tp=2 are 6 / 2 + 3 / 1; 14 / 2
                                              # at tp=3 give groups 4, 3, 7
                                              (6, 2, 64), (3, 1, 64), (7, 1, 64)])
@pytest.mark.parametrize("window", [0, 20])
def test_native_decode_kernel(dtype, heads, kv_heads, d, window):
    """The kernel alone: a subset of a step's rows, K/V taken from a strided view (as the
    fused qkv projection hands them over), appended at each sequence's last position."""
    g = torch.Generator().manual_seed(heads * d)
    lens = [1, 7, 64, 300, 33]
    layers, layer = 3, 1
    bufs = [torch.randn(layers, 2, kv_heads, n + 5, d, generator=g).to(dtype) for n in lens]
    tokens = len(lens) + 2
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * d, generator=g).to(dtype)
    q = qkv[:, :heads * d].reshape(tokens, heads, d).contiguous()
    k = qkv[:, heads * d:(heads + kv_heads) * d].view(tokens, kv_heads, d)
    v = qkv[:, (heads + kv_heads) * d:].view(tokens, kv_heads, d)
    rows = [0, 2, 3, 5, 6]  # rows 1 and 4 belong to other sequences: left alone
    slots = [3, -1, 17, 40, 63]  # -1: not stored in the paged cache
    k_cache, v_cache = (torch.zeros(4, 16, kv_heads, d, dtype=dtype) for _ in range(2))
    out = torch.full_like(q, 7.0)
    as_long = lambda xs: torch.tensor(xs, dtype=torch.long)  # noqa: E731
    cpu_ops.decode_attention(out, q, k, v, k_cache, v_cache, as_long(slots), as_long(rows),
                             as_long([b.data_ptr() for b in bufs]),
                             as_long([b.shape[3] for b in bufs]), as_long(lens), layer, 0.3,
                             window)
    flat_k, flat_v = k_cache.view(-1, kv_heads, d), v_cache.view(-1, kv_heads, d)
    stored = [s for s in slots if s >= 0]
    assert torch.count_nonzero(flat_k.abs().sum((1, 2))) == len(stored)
    for b, (row, n) in enumerate(zip(rows, lens)):
        kv = bufs[b][layer, :, :, :n]
        assert torch.equal(kv[0, :, n - 1], k[row]) and torch.equal(kv[1, :, n - 1], v[row])
        if slots[b] >= 0:
            assert torch.equal(flat_k[slots[b]], k[row])
            assert torch.equal(flat_v[slots[b]], v[row])
        kv = kv[:, :, max(0, n - window) if window else 0:]  # a window: the last keys only
        want = F.scaled_dot_product_attention(
            q[row].float()[None, :, None], kv[0:1].float(), kv[1:2].float(), scale=0.3,
            enable_gqa=True)[0, :, 0]
        tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
        torch.testing.assert_close(out[row].float(), want, atol=tol, rtol=tol)
    assert torch.all(out[[1, 4]] == 7.0)


@pytest.mark.skipif(not cpu_ops.load(), reason="nvllm's CPU ops are not built")
@pytest.mark.parametrize("bad, match", [
    ({"lens": 0}, r"lens\[1\] = 0 must be in 1..caps"),
    ({"lens": 9}, r"lens\[1\] = 9 must be in 1..caps\[1\] = 8"),
    ({"rows": 3}, r"rows\[1\] = 3 is not a token row \(3 tokens\)"),
    ({"slots": 64}, r"slots\[1\] = 64 is outside the paged cache \(64 slots\)"),
    ({"slots": -2}, r"slots\[1\] = -2 is outside"),
])
def test_native_decode_kernel_refuses_indices_out_of_bounds(bad, match):
    """An index that would write out of bounds (a length of 0 among them: the new token
    is always a key) is an error naming it, before anything is written."""
    d, kv_heads, heads = 64, 1, 2
    bufs = [torch.zeros(1, 2, kv_heads, 8, d) for _ in range(2)]
    q = torch.randn(3, heads, d)
    k, v = torch.randn(3, kv_heads, d), torch.randn(3, kv_heads, d)
    k_cache, v_cache = (torch.zeros(4, 16, kv_heads, d) for _ in range(2))
    vec = {"rows": [0, 2], "lens": [1, 5], "slots": [3, 4]}
    for name, value in bad.items():
        vec[name][1] = value
    as_long = lambda xs: torch.tensor(xs, dtype=torch.long)  # noqa: E731
    with pytest.raises(RuntimeError, match=match):
        cpu_ops.decode_attention(torch.empty_like(q), q, k, v, k_cache, v_cache,
                                 as_long(vec["slots"]), as_long(vec["rows"]),
                                 as_long([b.data_ptr() for b in bufs]),
                                 as_long([b.shape[3] for b in bufs]), as_long(vec["lens"]),
                                 0, 0.3, 0)
    assert not k_cache.any() and not any(b.any() for b in bufs)


@pytest.mark.skipif(not cpu_ops.load(), reason="nvllm's CPU ops are not built")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("heads,kv_heads,d", [(9, 3, 64), (8, 2, 64), (6, 2, 80), (4, 4, 32)])
@pytest.mark.parametrize("window", [0, 20])
def test_decode_attention_qkv_equals_split_rotary_then_kernel(dtype, heads, kv_heads, d,
                                                              window):
    """The fused call (rotary inside the kernel, q/k/v read from the projection's output)
    stores and returns exactly what split + rotary_embedding + decode_attention do."""
    from nvllm.worker.layers.rotary import RotaryEmbedding, compute_inv_freq

    class Cfg:
        rope_theta = 10000.0

    g = torch.Generator().manual_seed(heads * d + window)
    rot = RotaryEmbedding(d, 512, compute_inv_freq(Cfg(), d)[0])
    lens = [1, 7, 64, 300, 33]
    layers, layer = 3, 1
    bufs = [torch.randn(layers, 2, kv_heads, n + 5, d, generator=g).to(dtype) for n in lens]
    bufs2 = [b.clone() for b in bufs]
    tokens = len(lens) + 2
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * d, generator=g).to(dtype)
    positions = torch.randint(0, 512, (tokens,), generator=g)
    rows = [0, 2, 3, 5, 6]
    slots = [3, -1, 17, 40, 63]
    caches = [[torch.zeros(4, 16, kv_heads, d, dtype=dtype) for _ in range(2)]
              for _ in range(2)]
    as_long = lambda xs: torch.tensor(xs, dtype=torch.long)  # noqa: E731
    vecs = lambda bs: (as_long(slots), as_long(rows),  # noqa: E731
                       as_long([b.data_ptr() for b in bs]), as_long([b.shape[3] for b in bs]),
                       as_long(lens))
    q, k, v = qkv.view(tokens, -1, d).split([heads, kv_heads, kv_heads], dim=1)
    q, k = cpu_ops.rotary_embedding(positions, q, k, rot.cos, rot.sin)
    want = torch.zeros_like(q)
    cpu_ops.decode_attention(want, q, k, v, *caches[0], *vecs(bufs), layer, 0.3, window)
    out = cpu_ops.decode_attention_qkv(qkv, positions, rot.cos, rot.sin, heads, kv_heads,
                                       *caches[1], *vecs(bufs2), layer, 0.3, window)
    assert torch.equal(out[rows], want.view(tokens, -1)[rows])
    assert all(torch.equal(a, b) for a, b in zip(bufs, bufs2))
    assert torch.equal(caches[0][0], caches[1][0]) and torch.equal(caches[0][1], caches[1][1])

