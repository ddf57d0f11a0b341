#!/usr/bin/env python
"""GPU check of the Triton fused MoE (nvllm/kernels/triton_moe.py), run by device_check.sh.

At a realistic per-rank shape (T=256, H=1024, I=512, E=8, K=2, and a decode batch), compiled
natively: the max error against a float32 torch reference (exit 1 past the tolerance), for
bf16 and fp32 and for an expert-parallel slice, then the median time of the kernel next to
a bf16 torch grouped reference (per expert: gather its tokens, two matmuls, index_add).
Timings are printed, never asserted. A few seconds.

    python scripts/moe_check.py [--tokens 256] [--hidden 1024] [--inter 512] ...
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("TRITON_INTERPRET", "0")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from bench_kernels import bench  # noqa: E402  (scripts/ is on sys.path when run)

# Error bounds relative to the output's max magnitude (the unit tests' bounds).
TOL = {torch.float32: 1e-4, torch.bfloat16: 1e-2}


def grouped_torch(x, w13, w2, ids, wts, expert_start=0, acc=torch.float32):
    """Per-expert torch MoE: each local expert's tokens in one batch, summed in `acc`."""
    t, k = ids.shape
    i = w2.shape[2]
    out = torch.zeros(x.shape, dtype=acc, device=x.device)
    local = ids - expert_start
    for e in range(w13.shape[0]):
        tok, slot = (local == e).nonzero(as_tuple=True)
        if tok.numel() == 0:
            continue
        gu = x[tok].to(w13.dtype) @ w13[e].T
        h = F.silu(gu[:, :i]) * gu[:, i:]
        y = (h @ w2[e].T).to(acc) * wts[tok, slot, None].to(acc)
        out.index_add_(0, tok, y)
    return out


def make(t, h, i, e, k, n_global, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=g)
    w13 = torch.randn(e, 2 * i, h, generator=g) * h ** -0.5
    w2 = torch.randn(e, h, i, generator=g) * i ** -0.5
    ids = torch.stack([torch.randperm(n_global, generator=g)[:k] for _ in range(t)])
    wts = torch.softmax(torch.randn(t, k, generator=g), dim=-1)
    return [a.cuda() for a in (x.to(dtype), w13.to(dtype), w2.to(dtype), ids, wts)]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--inter", type=int, default=512)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--topk", type=int, default=2)
    a = p.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device", file=sys.stderr)
        return 2
    from nvllm.kernels.triton_moe import fused_moe

    torch.backends.cuda.matmul.allow_tf32 = False  # an exact fp32 reference

    h, i, e, k = a.hidden, a.inter, a.experts, a.topk
    ok = True
    # (label, T, dtype, global experts, expert_start): the last one is an EP rank owning
    # experts 8..15 of 32 (most pairs are other ranks').
    cases = [("bf16", a.tokens, torch.bfloat16, e, 0), ("fp32", a.tokens, torch.float32, e, 0),
             ("bf16 decode", 4, torch.bfloat16, e, 0),
             ("bf16 EP slice", a.tokens, torch.bfloat16, 4 * e, e)]
    for label, t, dtype, n_global, start in cases:
        x, w13, w2, ids, wts = make(t, h, i, e, k, n_global, dtype, seed=t)
        out = fused_moe(x, w13, w2, ids, wts, expert_start=start)
        ref = grouped_torch(x.float(), w13.float(), w2.float(), ids, wts, start)
        scale = ref.abs().max().clamp(min=1.0).item()
        err = (out.float() - ref).abs().max().item()
        good = err <= TOL[dtype] * scale
        ok &= good
        print(f"{label:14} T={t:4} H={h} I={i} E={e} K={k}: max err {err:.3g} "
              f"(scale {scale:.3g}, tol {TOL[dtype] * scale:.3g}) {'ok' if good else 'FAIL'}")

    for t in (a.tokens, 4):
        args = make(t, h, i, e, k, e, torch.bfloat16, seed=t)
        tri = bench(lambda args=args: fused_moe(*args))
        ref = bench(lambda args=args: grouped_torch(*args, acc=torch.bfloat16))
        flops = 2 * t * k * 3 * h * i
        print(f"time bf16 T={t}: triton {tri * 1e6:.0f} us ({flops / tri / 1e12:.2f} TFLOP/s), "
              f"torch grouped {ref * 1e6:.0f} us, speedup {ref / tri:.2f}x")
    print("moe check:", "PASSED" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
