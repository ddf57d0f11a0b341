#!/usr/bin/env python
"""All-reduce latency between local ranks: gloo against the shared-memory all-reduce
(nvllm/worker/shm_allreduce.py), in one run.

Starts --world processes joined in a gloo group (a FileStore in a temporary folder, one
torch thread each, as the workers on a 2-core machine), and times back-to-back
all-reduces of each --sizes float32 count: median and p90 microseconds per call over
--iters calls, after a warm-up. --busy N adds N processes spinning on a core (the leader
and other load on a small machine): a waiter that spins then steals the core its peer
needs. --wait spin,yield,sleep (microseconds) overrides the shared-memory waiter's
phases, e.g. ``--wait 0,0,20`` (sleep only) or ``--wait 1000000,0,0`` (pure spinning).

    python scripts/bench_allreduce.py [--world 2] [--sizes 576 9216 73728] [--busy 1]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import tempfile
import time
from datetime import timedelta


def _rank(rank: int, world: int, store: str, name: str, sizes: list[int], iters: int,
          wait: list[float] | None, out) -> None:
    import torch
    import torch.distributed as dist

    from nvllm.worker import shm_allreduce

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=120))
    shm = shm_allreduce.attach(name, rank, world, dist.group.WORLD, 60.0,
                               slot_bytes=max(sizes) * 4)
    if wait:
        shm.spin_s, shm.yield_s, shm.sleep_s = (w * 1e-6 for w in wait)
    res = {}
    for n in sizes:
        x = torch.full((n,), float(rank + 1))
        for kind, fn in (("gloo", lambda t: dist.all_reduce(t)), ("shm", shm.all_reduce)):
            times = []
            for i in range(iters + iters // 10):
                x.fill_(rank + 1)
                t0 = time.perf_counter()
                fn(x)
                if i >= iters // 10:
                    times.append(time.perf_counter() - t0)
            assert float(x[0]) == world * (world + 1) / 2
            times.sort()
            res[f"{kind} {n}"] = (statistics.median(times) * 1e6,
                                  times[int(len(times) * 0.9)] * 1e6)
            dist.barrier()
    shm.close()
    dist.destroy_process_group()
    out.put((rank, res))


def _busy(stop) -> None:
    while not stop.is_set():
        sum(range(10000))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--sizes", type=int, nargs="*", default=[576, 9216, 73728])
    ap.add_argument("--iters", type=int, default=2000)
    ap.add_argument("--busy", type=int, default=0)
    ap.add_argument("--wait", help="spin,yield,sleep in microseconds")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()
    from nvllm.common.shm_segments import new_segment_name, unlink_segment

    wait = [float(w) for w in args.wait.split(",")] if args.wait else None
    ctx = mp.get_context("spawn")
    out, stop = ctx.Queue(), ctx.Event()
    name = new_segment_name("ar")
    busy = [ctx.Process(target=_busy, args=(stop,), daemon=True) for _ in range(args.busy)]
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        procs = [ctx.Process(target=_rank, args=(r, args.world, store, name, args.sizes,
                                                 args.iters, wait, out), daemon=True)
                 for r in range(args.world)]
        for p in busy + procs:
            p.start()
        try:
            results = dict(out.get(timeout=600) for _ in procs)
        finally:
            stop.set()
            for p in procs + busy:
                p.join(timeout=10)
                if p.is_alive():
                    p.kill()
            unlink_segment(name)
    print(f"world {args.world}, busy {args.busy}, wait {wait or 'default'}: "
          "microseconds per all-reduce, rank 0 median / p90")
    for key, (med, p90) in results[0].items():
        print(f"  {key:>12} floats: {med:9.1f} / {p90:9.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
