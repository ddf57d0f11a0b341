#!/usr/bin/env python
"""Single engine steps of the bench_vs_hf checkpoint, timed in-process (no leader).

Runs one ModelRunner (tp=1, float32 unless --dtype, the default backend on CPU: the
native CPU ops where they build) and times decode steps of
B sequences at context L, and prefill steps, each the minimum over repeats: on a shared
machine the minimum is what a change can be judged by (whole runs vary by +-15%). Prints
each step's time and its linear layers' FLOP rate as a share of a matmul probe of the
model's shape measured in the same run.

    python scripts/bench_steps.py [--decode 1x300 27x400 48x400] [--prefill 512x4 256x8]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--decode", nargs="*", default=["1x300", "8x300", "27x400", "48x400"],
                    help="BxL: B sequences decoding one token at context L")
    ap.add_argument("--prefill", nargs="*", default=["512x4", "256x8"],
                    help="NxB: B new prompts of N tokens in one step")
    ap.add_argument("--repeats", type=int, default=8)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()
    from bench_vs_hf import SHAPE, probe_gflops

    from nvllm.common import worker_protocol as protocol
    from nvllm.common.config import EngineConfig
    from nvllm.launch.tiny import make_tiny_checkpoint
    from nvllm.worker.cpu_malloc import keep_freed_memory
    from nvllm.worker.model_runner import ModelRunner
    from nvllm.worker.parallel import TPContext

    keep_freed_memory()  # as a worker does
    model = make_tiny_checkpoint(tempfile.mkdtemp(prefix="nvllm-steps-"), **SHAPE)
    config = EngineConfig(str(model), device="cpu", dtype=args.dtype, block_size=16,
                          max_model_len=2048).finalize()
    runner = ModelRunner(config, TPContext(), torch.device("cpu"))
    runner.init_kv_cache(4096)
    greedy = protocol.WorkerSampling()
    h, i, n_layers, vocab = (SHAPE["hidden_size"], SHAPE["intermediate_size"],
                             SHAPE["num_hidden_layers"], SHAPE["vocab_size"])
    heads, kv_heads, d = (SHAPE["num_attention_heads"], SHAPE["num_key_value_heads"],
                          SHAPE["head_dim"])
    layer_params = h * (heads + 2 * kv_heads) * d + heads * d * h + 3 * h * i
    next_id = [0]

    def prefill_plan(lens: list[int]) -> protocol.StepPlan:
        new, block = [], 0
        for n in lens:
            next_id[0] += 1
            nb = -(-(n + 512) // 16)  # room to decode
            new.append(protocol.NewSeq(next_id[0], [7 + k % 100 for k in range(n)], n, 0, n,
                                       list(range(block, block + nb)), greedy))
            block += nb
        return protocol.StepPlan.of(next_id[0], new, [], [])

    def timed(plan: protocol.StepPlan) -> float:
        t = time.perf_counter()
        runner.execute(plan)
        return time.perf_counter() - t

    res: dict = {"probe_gflops": probe_gflops(h, i, 256, getattr(torch, args.dtype)),
                 "backend": runner.backend, "dtype": args.dtype, "decode": [],
                 "prefill": []}
    for spec in args.decode:
        b, ctx = map(int, spec.split("x"))
        first = prefill_plan([ctx] * b)
        runner.execute(first)
        ids = [ns.seq_id for ns in first.new_seqs]
        best = min(timed(protocol.StepPlan.of(0, [], [protocol.RunningSeq(s, 1, []) for s in ids],
                                           [])) for _ in range(args.repeats))
        runner.execute(protocol.StepPlan.of(0, [], [], ids))
        flops = 2 * b * (n_layers * layer_params + vocab * h)
        res["decode"].append({"seqs": b, "context": ctx, "ms": best * 1e3,
                              "linear_share_of_probe": flops / best / 1e9 / res["probe_gflops"]})
    for spec in args.prefill:
        n, b = map(int, spec.split("x"))
        times = []
        for _ in range(max(2, args.repeats // 3)):
            plan = prefill_plan([n] * b)
            times.append(timed(plan))
            runner.execute(protocol.StepPlan.of(0, [], [], [ns.seq_id for ns in plan.new_seqs]))
        flops = 2 * n * b * n_layers * layer_params + 2 * b * vocab * h
        res["prefill"].append({"tokens": n * b, "prompt": n, "ms": min(times) * 1e3,
                               "linear_share_of_probe":
                                   flops / min(times) / 1e9 / res["probe_gflops"]})
    print(json.dumps(res, indent=2))
    print(f"{args.dtype}, {runner.backend} backend; matmul probe "
          f"{res['probe_gflops']:.0f} GFLOP/s")
    for r in res["decode"]:
        print(f"decode  {r['seqs']:3d} seqs at context {r['context']:4d}: {r['ms']:7.1f} ms "
              f"(linears {r['linear_share_of_probe']:.2f} of the probe)")
    for r in res["prefill"]:
        print(f"prefill {r['tokens']:5d} tokens ({r['prompt']}-token prompts): {r['ms']:7.1f} ms "
              f"(linears {r['linear_share_of_probe']:.2f} of the probe)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)


if __name__ == "__main__":
    main()
