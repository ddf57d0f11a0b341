#!/usr/bin/env python
"""A decode step's time outside the model: ``ModelRunner.execute`` minus the forward
(``TPContext.run``) and the LM head (``compute_logits``), i.e. applying the plan, building
the step's tensors, sampling and appending the tokens. B sequences of the qwen3-36m tiny
preset at context L, one torch thread, this thread's CPU clock (so a loaded machine reads
like a quiet one), median of the timed steps.

Runs against whichever nvllm is on PYTHONPATH and builds its plans either way the tree
knows (``StepPlan.of`` or the older list form), so one command times two commits:

    PYTHONPATH=/path/to/old python scripts/bench_step_overhead.py --seqs 64 --dtype bfloat16
    PYTHONPATH=$PWD python scripts/bench_step_overhead.py --seqs 64 --dtype bfloat16
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from nvllm.common import worker_protocol as P
from nvllm.common.config import EngineConfig
from nvllm.launch.tiny import ensure_tiny_checkpoint
from nvllm.worker.model_runner import ModelRunner
from nvllm.worker.parallel import TPContext

BS = 16


def plan(step: int, new: list, running: list):
    if hasattr(P.StepPlan, "of"):
        return P.StepPlan.of(step, new, running, [])
    return P.StepPlan(step, new, running, [])


class TimedTP:
    """The runner's TPContext, with the time spent in forward passes counted."""

    def __init__(self, tp, spent: list[float]) -> None:
        self._tp, self._spent = tp, spent

    def __getattr__(self, name):
        return getattr(self._tp, name)

    def run(self, stages):
        t0 = time.thread_time()
        try:
            return self._tp.run(stages)
        finally:
            self._spent[0] += time.thread_time() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seqs", type=int, default=64)
    ap.add_argument("--context", type=int, default=300)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args()
    torch.set_num_threads(1)
    B, L = args.seqs, args.context
    cfg = EngineConfig(str(ensure_tiny_checkpoint("qwen3-36m")), device="cpu",
                       dtype=args.dtype, block_size=BS, max_num_seqs=B,
                       max_model_len=L + args.steps + 64).finalize()
    r = ModelRunner(cfg, TPContext(), torch.device("cpu"))
    per = (L + args.steps + 4 + BS - 1) // BS
    r.init_kv_cache(B * per + 8)
    greedy = P.WorkerSampling()
    known = {}
    step = 0
    for a in range(0, B, 8):  # prefill, 8 prompts a step
        new = []
        for i in range(a, min(a + 8, B)):
            toks = [(i * 7 + j) % 15000 + 3 for j in range(L)]
            new.append(P.NewSeq(i + 1, toks, L, 0, L,
                                list(range(i * per, i * per + (L + BS - 1) // BS)), greedy))
            known[i + 1] = L
        step += 1
        r.execute(plan(step, new, []))
    spent = [0.0]
    r.tp = TimedTP(r.tp, spent)
    head = r.model.compute_logits

    def timed_head(h):
        t0 = time.thread_time()
        try:
            return head(h)
        finally:
            spent[0] += time.thread_time() - t0

    r.model.compute_logits = timed_head
    total, outside = [], []
    for k in range(args.steps + 4):  # the first 4 warm up
        running = []
        for sid in range(1, B + 1):
            n = known[sid]
            blocks = [(sid - 1) * per + n // BS] if n % BS == 0 else []
            running.append(P.RunningSeq(sid, 1, blocks))
            known[sid] = n + 1
        spent[0] = 0.0
        step += 1
        t0 = time.thread_time()
        r.execute(plan(step, [], running))
        dt = time.thread_time() - t0
        if k >= 4:
            total.append(dt)
            outside.append(dt - spent[0])
    print(f"{B} sequences at context {L}, {args.dtype}: step "
          f"{statistics.median(total) * 1e3:.2f} ms, outside the forward and the LM head "
          f"{statistics.median(outside) * 1e3:.3f} ms (median of {args.steps}, thread CPU "
          "time, 1 thread)")


if __name__ == "__main__":
    main()
