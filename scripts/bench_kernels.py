#!/usr/bin/env python
"""Kernel benchmark (CUDA): attention kernels next to the device's own ceilings.

Measured in one run, on one device:
- copy bandwidth (device-to-device copy, bytes read + written per second) and bf16
  matmul TFLOP/s (8192^3): the roofline probes;
- decode attention over the paged cache: bytes of KV read per second, vs copy bandwidth,
  and vs torch SDPA on the same data laid out dense;
- prefill attention: causal FLOP/s at 4,096 tokens, vs the matmul rate and vs SDPA.

    python scripts/bench_kernels.py [--json FILE] [--quick]
"""

from __future__ import annotations

import argparse
import json
import sys

import torch


def bench(fn, warmup: int = 5, iters: int = 20) -> float:
    """Median seconds per call, timed with CUDA events."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[len(times) // 2]


def roofline(dev) -> dict:
    src = torch.empty(1 << 30, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    copy_s = bench(lambda: dst.copy_(src))
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device=dev)
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device=dev)
    mm_s = bench(lambda: a @ b)
    return {"copy_GBps": 2 * src.numel() / copy_s / 1e9,
            "matmul_bf16_TFLOPs": 2 * 8192**3 / mm_s / 1e12}


def paged_inputs(num_seqs, ctx, q_len, heads, kv_heads, d, block_size, dev, dtype):
    from nvllm.kernels.metadata import build_metadata

    nblk = -(-ctx // block_size)
    perm = torch.randperm(num_seqs * nblk).tolist()  # scattered blocks, as in a live cache
    tables = [perm[i * nblk:(i + 1) * nblk] for i in range(num_seqs)]
    k_cache = torch.randn(num_seqs * nblk, block_size, kv_heads, d, dtype=dtype, device=dev)
    v_cache = torch.randn_like(k_cache)
    meta, _ = build_metadata([q_len] * num_seqs, [ctx] * num_seqs, tables, block_size, dev)
    q = torch.randn(num_seqs * q_len, heads, d, dtype=dtype, device=dev)
    # The same K/V laid out dense for SDPA: [B, kv_heads, ctx, d].
    idx = torch.tensor(tables, device=dev)
    k_dense = k_cache[idx].reshape(num_seqs, -1, kv_heads, d)[:, :ctx].transpose(1, 2)
    v_dense = v_cache[idx].reshape(num_seqs, -1, kv_heads, d)[:, :ctx].transpose(1, 2)
    return q, k_cache, v_cache, meta, k_dense.contiguous(), v_dense.contiguous()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", help="also write the results to this file")
    ap.add_argument("--quick", action="store_true", help="smaller shapes (smoke run)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_kernels.py needs a CUDA device (the CPU path is covered by the tests)")
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    from nvllm.kernels import ops

    dev, dtype = torch.device("cuda"), torch.bfloat16
    heads, kv_heads, d, bs = 16, 8, 128, 16  # Qwen3-0.6B-shaped attention
    res = {"device": torch.cuda.get_device_name(), **roofline(dev)}
    scale = d ** -0.5

    # Decode: 256 sequences x 1,024 tokens of context.
    n, ctx = (64, 512) if args.quick else (256, 1024)
    q, kc, vc, meta, kd, vd = paged_inputs(n, ctx, 1, heads, kv_heads, d, bs, dev, dtype)
    t = bench(lambda: ops.paged_attention(q, kc, vc, meta, scale, "triton"))
    kv_bytes = 2 * n * ctx * kv_heads * d * kd.element_size()
    qd = q.view(n, heads, 1, d)
    t_sdpa = bench(lambda: sdpa(qd, kd, vd, scale=scale, enable_gqa=True))
    res["decode"] = {"seqs": n, "context": ctx, "time_us": t * 1e6,
                     "GBps": kv_bytes / t / 1e9, "sdpa_GBps": kv_bytes / t_sdpa / 1e9}
    res["decode"]["fraction_of_copy_bw"] = res["decode"]["GBps"] / res["copy_GBps"]

    # Prefill: one 4,096-token prompt (causal), K/V read from the paged cache.
    s = 1024 if args.quick else 4096
    q, kc, vc, meta, kd, vd = paged_inputs(1, s, s, heads, kv_heads, d, bs, dev, dtype)
    t = bench(lambda: ops.paged_attention(q, kc, vc, meta, scale, "triton"))
    flops = 4 * s * s * heads * d / 2  # QK^T and PV, half of it masked by causality
    qd = q.view(1, s, heads, d).transpose(1, 2)
    t_sdpa = bench(lambda: sdpa(qd, kd, vd, is_causal=True, scale=scale, enable_gqa=True))
    res["prefill"] = {"tokens": s, "time_us": t * 1e6, "TFLOPs": flops / t / 1e12,
                      "sdpa_TFLOPs": flops / t_sdpa / 1e12}
    res["prefill"]["fraction_of_matmul"] = res["prefill"]["TFLOPs"] / res["matmul_bf16_TFLOPs"]

    print(json.dumps(res, indent=2))
    print(f"decode attention: {res['decode']['GBps']:.0f} GB/s = "
          f"{100 * res['decode']['fraction_of_copy_bw']:.0f}% of copy bandwidth "
          f"(SDPA dense: {res['decode']['sdpa_GBps']:.0f} GB/s)")
    print(f"prefill attention: {res['prefill']['TFLOPs']:.0f} TFLOP/s = "
          f"{100 * res['prefill']['fraction_of_matmul']:.0f}% of bf16 matmul "
          f"(SDPA dense: {res['prefill']['sdpa_TFLOPs']:.0f} TFLOP/s)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)


if __name__ == "__main__":
    main()
