#!/usr/bin/env python
"""Per-step cost of a decode plan's path, without a model: the leader builds the plan
(PlanBuilder.build over scheduled Sequences), encodes it, a worker decodes it and turns it
into the step's inputs (state update, input ids, positions, attention metadata on CPU),
then appends the sampled tokens. Inline plans only (no shared-memory ring), one process.

Runs against whichever nvllm is on PYTHONPATH, so the same script times main and a
branch (it takes the worker path each one has):

    PYTHONPATH=/work/main python scripts/bench_plan_path.py --seqs 1 16 64 256
    PYTHONPATH=$PWD python scripts/bench_plan_path.py --seqs 1 16 64 256

Each figure is the median over --steps steps, in microseconds.
"""

from __future__ import annotations

import argparse
import statistics
import time
from types import SimpleNamespace

import numpy as np
import torch

from nvllm.common import worker_protocol as protocol
from nvllm.leader.plan_builder import PlanBuilder
from nvllm.leader.scheduler import SchedulerOutput
from nvllm.leader.sequence import Sequence
from nvllm.worker import model_runner

BS, CTX, VOCAB, NUM_BLOCKS = 16, 512, 32_000, 65_536


def stub_runner(max_seqs: int):
    """What ModelRunner's plan path reads of self, without a model."""
    cfg = SimpleNamespace(micro_batch_overlap=False, max_num_seqs=max_seqs,
                          max_model_len=4096, model_info=SimpleNamespace(vocab_size=VOCAB))
    r = SimpleNamespace(kv_cache=torch.empty(2, 1, NUM_BLOCKS, 1, 1, 1), config=cfg,
                        block_size=BS, seqs={}, scoring=set(), structured=None, cpu_kv=None,
                        graphs=None, tp=SimpleNamespace(world_size=1, rank=0),
                        device=torch.device("cpu"))
    if hasattr(model_runner, "InputBatch"):
        r.batch = model_runner.InputBatch(max_seqs, 4096, 4096 // BS, BS, VOCAB, NUM_BLOCKS)
        r._forget = lambda sid: model_runner.ModelRunner._forget(r, sid)
        r._tensor = lambda a: model_runner.ModelRunner._tensor(r, a)
    return r


def worker_step(r, plan) -> None:
    """Apply + prepare + append the sampled tokens, as ModelRunner.execute does."""
    M = model_runner.ModelRunner
    if hasattr(model_runner, "InputBatch"):
        step = M._apply(r, plan, None)
        M._prepare(r, step)
        rows = step.rows[step.sample_idx]
        r.batch.append_sampled(rows, np.full(len(rows), 7, np.int64))
    else:
        M.validate(r, plan)
        batch = M._apply_plan(r, plan)
        M._prepare(r, batch)
        for _, seq, n in batch:
            seq.num_computed_tokens += n
            seq.token_ids.append(7)


def make_of(plan_cls):
    return getattr(plan_cls, "of", plan_cls)


def run(n: int, steps: int) -> dict[str, float]:
    r = stub_runner(max(n, 1))
    # The workers first get every sequence whole.
    ws = protocol.WorkerSampling()
    first = make_of(protocol.StepPlan)(0, [protocol.NewSeq(
        i, [5] * CTX, CTX, 0, CTX, list(range(i * 64, i * 64 + CTX // BS + 1)), ws)
        for i in range(n)], [], [])
    worker_step(r, first)
    leader = [_leader_seq(i) for i in range(n)]
    builder = PlanBuilder()
    t = {"build": [], "encode": [], "decode": [], "apply+prepare": []}
    for k in range(steps):
        sched = SchedulerOutput()
        sched.scheduled = [(s, 1) for s in leader]
        for s in leader:
            s.num_computed_tokens += 1
            s.token_ids.append(7)
            if (CTX + k) % BS == 0:  # a new block now and then
                s.block_table.append(s.block_table[-1] + 1)
        t0 = time.perf_counter()
        plan = builder.build(sched, [])
        t1 = time.perf_counter()
        _mark(leader)
        data = protocol.encode(plan)
        t2 = time.perf_counter()
        got = protocol.decode(data)
        t3 = time.perf_counter()
        worker_step(r, got)
        t4 = time.perf_counter()
        for name, a, b in (("build", t0, t1), ("encode", t1, t2), ("decode", t2, t3),
                           ("apply+prepare", t3, t4)):
            t[name].append((b - a) * 1e6)
    return {k: statistics.median(v) for k, v in t.items()}


def _leader_seq(i: int) -> Sequence:
    from nvllm.common.sampling_params import SamplingParams

    s = Sequence(seq_id=i, request_id=f"r{i}", token_ids=[5] * CTX, num_prompt_tokens=CTX,
                 params=SamplingParams())
    s.num_computed_tokens = CTX
    s.block_table = list(range(i * 64, i * 64 + CTX // BS + 1))
    s.on_worker, s.num_sent_blocks = True, len(s.block_table)
    return s


def _mark(leader: list[Sequence]) -> None:
    for s in leader:  # as Scheduler.mark_sent (main's builder did it itself)
        s.on_worker, s.num_sent_blocks = True, len(s.block_table)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seqs", nargs="*", type=int, default=[1, 16, 64, 256])
    ap.add_argument("--steps", type=int, default=200)
    args = ap.parse_args()
    torch.set_num_threads(1)
    print("| running seqs | build µs | encode µs | decode µs | apply+prepare µs | total µs |")
    print("|---:|---:|---:|---:|---:|---:|")
    for n in args.seqs:
        m = run(n, args.steps)
        print(f"| {n} | {m['build']:.0f} | {m['encode']:.0f} | {m['decode']:.0f} | "
              f"{m['apply+prepare']:.0f} | {sum(m.values()):.0f} |")


if __name__ == "__main__":
    main()
