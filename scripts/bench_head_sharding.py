#!/usr/bin/env python
"""Three ways to shard SmolLM2-135M's attention (9 query / 3 KV heads, head_dim 64,
hidden 576, intermediate 1536) over tp=2, timed on this CPU: one decoder layer's decode
work on each rank (qkv_proj, attention over a KV history, o_proj, the MLP), the step
waiting for the slower rank (the critical path).

* kv-group (the engine's rule, nvllm/worker/sharding.py:head_partition): whole KV heads
  and the query heads that read them: 6 q / 2 KV heads + 3 q / 1 KV head.
* split-group: 5 + 4 query heads, the middle KV head on both ranks (2 + 2 KV heads); the
  local grouping is uneven (3 + 2 and 1 + 3 query heads per KV head), which no
  attention kernel of the engine runs: emulated with torch ops.
* zero-padding (SGLang's CPU approach, scripts/pad_heads.py): 12 q / 4 KV heads, the
  extra ones zero: 6 q / 2 KV heads on each rank.

The attention runs two ways: "torch" (for each local KV head, its query heads' scores,
softmax and weighted sum as batched matmuls: the same ops for every layout) and "native" (the
engine's CPU decode kernel, nvllm/kernels/csrc/cpu_decode_attention.cpp; uniform layouts
only). One thread per rank, as two workers share two cores.

    PYTHONPATH=$PWD python scripts/bench_head_sharding.py [--context 512] [--reps 200]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

HIDDEN, HEAD_DIM, INTER = 576, 64, 1536
HEADS, KV_HEADS = 9, 3

# layout -> per rank: the global KV head each local query head reads, and the global KV
# heads held (for padding: 12 / 4 heads, the last 3 query heads and last KV head zero).
LAYOUTS = {
    "kv-group": [([0, 0, 0, 1, 1, 1], [0, 1]), ([2, 2, 2], [2])],
    "split-group": [([0, 0, 0, 1, 1], [0, 1]), ([1, 2, 2, 2], [1, 2])],
    "zero-padding": [([0, 0, 0, 1, 1, 1], [0, 1]), ([2, 2, 2, 3, 3, 3], [2, 3])],
}


def make_rank(q_kv: list[int], kv_held: list[int], batch: int, context: int, g):
    nq, nkv, d = len(q_kv), len(kv_held), HEAD_DIM
    local = torch.tensor([kv_held.index(h) for h in q_kv])
    uniform = all(int(local[j]) == j // (nq // nkv) for j in range(nq)) and nq % nkv == 0
    return dict(
        nq=nq, nkv=nkv, uniform=uniform,
        # each local KV head's query heads: a contiguous run of local heads
        groups=[(int(torch.nonzero(local == h).min()), int(torch.nonzero(local == h).max()) + 1)
                for h in range(nkv)],
        w_qkv=torch.randn((nq + 2 * nkv) * d, HIDDEN, generator=g) / 24,
        w_o=torch.randn(HIDDEN, nq * d, generator=g) / 24,
        w_gu=torch.randn(INTER, HIDDEN, generator=g) / 24,  # this rank's 2 x 768 rows
        w_d=torch.randn(HIDDEN, INTER // 2, generator=g) / 28,
        x=torch.randn(batch, HIDDEN, generator=g),
        # torch path: K/V per sequence [batch, nkv, context, d]
        k=torch.randn(batch, nkv, context, d, generator=g),
        v=torch.randn(batch, nkv, context, d, generator=g),
        # native path: each sequence's contiguous [layers=1, 2, nkv, cap, d] buffer
        bufs=[torch.randn(1, 2, nkv, context + 8, d, generator=g) for _ in range(batch)],
    )


def layer_torch(r: dict) -> torch.Tensor:
    d, b = HEAD_DIM, r["x"].shape[0]
    qkv = F.linear(r["x"], r["w_qkv"])
    q = qkv[:, :r["nq"] * d].view(b, r["nq"], 1, d)
    o = torch.empty(b, r["nq"], 1, d)
    for h, (a, e) in enumerate(r["groups"]):  # each local KV head and its query heads
        att = torch.softmax(q[:, a:e] @ r["k"][:, h:h + 1].transpose(-1, -2) * d ** -0.5,
                            dim=-1)
        torch.matmul(att, r["v"][:, h:h + 1], out=o[:, a:e])
    y = F.linear(o.view(b, r["nq"] * d), r["w_o"])
    gu = F.linear(y, r["w_gu"])
    g, u = gu.chunk(2, dim=-1)
    return F.linear(F.silu(g) * u, r["w_d"])


def layer_native(r: dict, cpu_ops) -> torch.Tensor:
    d, b, nq, nkv = HEAD_DIM, r["x"].shape[0], r["nq"], r["nkv"]
    qkv = F.linear(r["x"], r["w_qkv"])
    q = qkv[:, :nq * d].view(b, nq, d)
    k = qkv[:, nq * d:(nq + nkv) * d].view(b, nkv, d)
    v = qkv[:, (nq + nkv) * d:].view(b, nkv, d)
    out = torch.empty_like(q)
    cpu_ops.decode_attention(out, q, k, v, r["k_cache"], r["v_cache"], r["slots"], r["rows"],
                             r["ptrs"], r["caps"], r["lens"], 0, d ** -0.5, 0)
    y = F.linear(out.view(b, nq * d), r["w_o"])
    gu = F.linear(y, r["w_gu"])
    g, u = gu.chunk(2, dim=-1)
    return F.linear(F.silu(g) * u, r["w_d"])


def timed(fns: dict, reps: int) -> dict:
    """Each function's fastest call (µs): the calls are interleaved, so load from other
    processes on a shared machine hits every layout alike, and the minimum is the run the
    least disturbed."""
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(3):
        for fn in fns.values():
            fn()
    for _ in range(reps):
        for key, fn in fns.items():
            t = time.perf_counter()
            fn()
            best[key] = min(best[key], time.perf_counter() - t)
    return {k: v * 1e6 for k, v in best.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--context", type=int, default=512, help="KV history per sequence")
    ap.add_argument("--batches", default="1,16", help="decoding sequences, comma-separated")
    ap.add_argument("--reps", type=int, default=200)
    args = ap.parse_args()
    torch.set_num_threads(1)
    from nvllm.kernels import cpu_ops

    native = cpu_ops.load()
    rows = []
    for batch in [int(x) for x in args.batches.split(",")]:
        fns = {}
        for name, ranks in LAYOUTS.items():
            g = torch.Generator().manual_seed(0)
            for rank, (q_kv, kv_held) in enumerate(ranks):
                r = make_rank(q_kv, kv_held, batch, args.context, g)
                fns[name, rank, "torch"] = lambda r=r: layer_torch(r)
                if native and r["uniform"]:
                    as_long = lambda xs: torch.tensor(xs, dtype=torch.long)  # noqa: E731
                    r.update(k_cache=torch.zeros(1, 8, r["nkv"], HEAD_DIM),
                             v_cache=torch.zeros(1, 8, r["nkv"], HEAD_DIM),
                             slots=as_long([-1] * batch), rows=as_long(range(batch)),
                             ptrs=as_long([t.data_ptr() for t in r["bufs"]]),
                             caps=as_long([t.shape[3] for t in r["bufs"]]),
                             lens=as_long([args.context] * batch))
                    fns[name, rank, "native"] = lambda r=r: layer_native(r, cpu_ops)
        best = timed(fns, args.reps)
        for name in LAYOUTS:
            times = {kind: [best[name, rank, kind] for rank in (0, 1)
                            if (name, rank, kind) in best] for kind in ("torch", "native")}
            rows.append((batch, name, times))
    print(f"SmolLM2-135M shapes, tp=2, one decoder layer per rank, context {args.context}, "
          f"fastest of {args.reps} interleaved, µs (rank 0 / rank 1, critical path = max)")
    print(f"{'seqs':>4} {'layout':<13} {'torch ops':>22} {'crit':>7} {'native kernel':>22} "
          f"{'crit':>7}")
    crit: dict[tuple[int, str, str], float] = {}
    for batch, name, times in rows:
        cells = []
        for kind in ("torch", "native"):
            t = times[kind]
            if len(t) == 2:
                crit[batch, name, kind] = max(t)
                cells += [f"{t[0]:9.1f} / {t[1]:9.1f}", f"{max(t):7.1f}"]
            else:
                cells += [f"{'n/a (uneven groups)':>22}", f"{'':>7}"]
        print(f"{batch:>4} {name:<13} {cells[0]:>22} {cells[1]} {cells[2]:>22} {cells[3]}")
    print("critical path relative to kv-group (lower is faster):")
    for batch in sorted({b for b, _, _ in rows}):
        for kind in ("torch", "native"):
            base = crit.get((batch, "kv-group", kind))
            if base is None:
                continue
            parts = [f"{name} {crit[batch, name, kind] / base:.2f}x"
                     for name in LAYOUTS if (batch, name, kind) in crit]
            print(f"  {batch:>2} seqs, {kind:<6}: " + ", ".join(parts))


if __name__ == "__main__":
    main()
