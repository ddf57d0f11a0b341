#!/usr/bin/env python
"""CPU attention for speculative verify rows: the native kernel vs per-sequence SDPA.

One layer's ``cpu_attention.attention`` over a batch of sequences that each bring n new
tokens (n = 1: plain decode; n = k + 1: a verify row of k drafts; up to 16, the kernel's
bound) at a given context, with the contiguous copies in place: the native kernel
(``native_decode=True``) against the SDPA path (``native_decode=False``) on the same
inputs, in one run. Prints microseconds per layer call for both (the fastest of --iters) and
their ratio.

    python scripts/bench_cpu_verify.py [--batch 16] [--ctx 256] [--queries 1,2,5,9,16]
        [--heads 9 --kv-heads 3 --head-dim 64] [--dtype float32]

The defaults are SmolLM2-135M's attention shape (scripts/bench_spec.py's model).
"""

from __future__ import annotations

import argparse
import time

import torch

from nvllm.kernels import cpu_ops, ops
from nvllm.kernels.cpu_attention import CpuKVStore
from nvllm.kernels.metadata import build_metadata


def layer_time(native: bool, batch: int, ctx: int, n: int, heads: int, kv_heads: int,
               d: int, dtype: torch.dtype, iters: int) -> float:
    """Fastest seconds (of iters: the least disturbed on a shared machine) of one layer's
    attention step over `batch` sequences of n new tokens at context ctx (the copies
    sized to fit, the step's K/V rewritten each time)."""
    block = 16
    nblk = -(-ctx // block)
    paged = torch.randn(2, 1, batch * nblk, block, kv_heads, d).to(dtype)
    tables = [list(range(i * nblk, (i + 1) * nblk)) for i in range(batch)]
    store = CpuKVStore(paged, 1 << 34, ctx, native_decode=native)
    ids = list(range(batch))
    store.views_for_step(ids, tables, [ctx - n] * batch, [ctx - n] * batch)  # make copies
    for c in store.copies.values():  # finite keys everywhere (torch.empty may hold NaN)
        c.normal_()
    meta, _ = build_metadata([n] * batch, [ctx] * batch, tables, block)
    meta.cpu_kv = store.views_for_step(ids, tables, [n] * batch, [ctx] * batch)
    t = batch * n
    q = torch.randn(t, heads, d).to(dtype)
    k, v = torch.randn(t, kv_heads, d).to(dtype), torch.randn(t, kv_heads, d).to(dtype)
    scale = d ** -0.5
    times = []
    for i in range(iters + 3):
        s = time.perf_counter()
        ops.attention(q, k, v, paged[0, 0], paged[1, 0], meta, scale, "cpu", 0)
        if i >= 3:
            times.append(time.perf_counter() - s)
    return min(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--ctx", type=int, default=256)
    p.add_argument("--queries", default="1,2,5,9,16")
    p.add_argument("--heads", type=int, default=9)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--iters", type=int, default=50)
    a = p.parse_args()
    if not cpu_ops.load():
        raise SystemExit("nvllm's CPU ops are not built: python -m nvllm.kernels.cpu_ops")
    dtype = getattr(torch, a.dtype)
    print(f"batch {a.batch}, context {a.ctx}, heads {a.heads}/{a.kv_heads}, d {a.head_dim}, "
          f"{a.dtype}: us per layer call")
    print(f"{'n':>3} {'kernel':>9} {'sdpa':>9} {'sdpa/kernel':>12}")
    for native in (True, False):  # warm up (threads, allocator) before the first figure
        layer_time(native, a.batch, a.ctx, 1, a.heads, a.kv_heads, a.head_dim, dtype, 3)
    for n in (int(x) for x in a.queries.split(",")):
        ker, ref = (layer_time(native, a.batch, a.ctx, n, a.heads, a.kv_heads, a.head_dim,
                               dtype, a.iters) for native in (True, False))
        print(f"{n:>3} {ker * 1e6:>9.0f} {ref * 1e6:>9.0f} {ref / ker:>11.2f}x")


if __name__ == "__main__":
    main()
