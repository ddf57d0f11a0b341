"""Run a function on N local ranks joined in a gloo process group (spawned processes,
a FileStore in a test folder); every process is reaped, whatever happens."""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import traceback
from collections.abc import Callable
from datetime import timedelta


def _entry(fn: Callable, rank: int, world: int, store: str, out) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank,
                                world_size=world, timeout=timedelta(seconds=60))
        out.put((rank, fn(rank, world), None))
        dist.destroy_process_group()
    except BaseException:
        out.put((rank, None, traceback.format_exc()))


def run_ranks(fn: Callable, world: int, tmp_dir: str, timeout_s: float = 120.0) -> list:
    """fn(rank, world) on every rank (fn must be importable: define it in tests/support);
    returns the ranks' results in rank order, or raises with a failing rank's traceback."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    store = os.path.join(tmp_dir, "dist-store")
    procs = [ctx.Process(target=_entry, args=(fn, r, world, store, out), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    try:
        results: dict[int, object] = {}
        while len(results) < world:
            try:
                rank, value, error = out.get(timeout=timeout_s)
            except queue.Empty:
                raise TimeoutError(f"ranks {sorted(set(range(world)) - set(results))} gave "
                                   f"no answer within {timeout_s} s") from None
            if error is not None:
                raise RuntimeError(f"rank {rank} failed:\n{error}")
            results[rank] = value
        return [results[r] for r in range(world)]
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()


# ---- rank functions used by tests/worker/test_parallel.py --------------------------------


def _pass(rank: int, seed: int, stages: int, rows: int):
    """A toy forward pass: each stage mixes the reduced tensor nonlinearly and yields a
    rank-dependent partial sum."""
    import torch

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, 8, generator=g)
    for s in range(stages):
        partial = torch.tanh(x * (rank + 1) + s).contiguous()
        x = (yield partial) * 0.5 + x
    return x


def overlap_vs_sync(rank: int, world: int) -> bool:
    import torch
    import torch.distributed as dist

    from nvllm.worker.parallel import TPContext

    tp = TPContext(rank, world, dist.group.WORLD)
    together = tp.run([_pass(rank, 1, 5, 3), _pass(rank, 2, 5, 4), _pass(rank, 3, 2, 1)])
    alone = [tp.run([_pass(rank, seed, st, rows)])[0]
             for seed, st, rows in ((1, 5, 3), (2, 5, 4), (3, 2, 1))]
    same = all(torch.equal(a, b) for a, b in zip(together, alone))
    # And the reductions really happened: every rank ends with the same tensors.
    gathered = [torch.empty_like(together[0]) for _ in range(world)]
    dist.all_gather(gathered, together[0])
    return same and all(torch.equal(gathered[0], g) for g in gathered)


def broadcast_tokens(rank: int, world: int) -> list[int]:
    import torch
    import torch.distributed as dist

    from nvllm.worker.parallel import TPContext

    tp = TPContext(rank, world, dist.group.WORLD)
    t = torch.tensor([11, 22, 33]) if rank == 0 else torch.full((3,), -rank)
    return tp.broadcast_from_first(t).tolist()


def uneven_vocab(rank: int, world: int) -> bool:
    """An LM head and embedding over a vocabulary no world divides (1031 rows): rank 0's
    gathered logits and every rank's reduced embedding equal the unsharded ones."""
    import torch
    import torch.distributed as dist

    from nvllm.worker.layers.embed_head import ParallelLMHead, VocabParallelEmbedding
    from nvllm.worker.parallel import TPContext

    tp = TPContext(rank, world, dist.group.WORLD)
    g = torch.Generator().manual_seed(7)
    vocab, hidden = 1031, 8
    w = torch.randn(vocab, hidden, generator=g)
    h = torch.randn(3, hidden, generator=g)
    ids = torch.tensor([0, 515, 516, 1030, 343, 344, 687, 688])
    head = ParallelLMHead(vocab, hidden, tp, torch.float32)
    head.weight.weight_loader(head.weight, w)
    emb = VocabParallelEmbedding(vocab, hidden, tp, torch.float32)
    emb.weight.weight_loader(emb.weight, w)
    logits = head(h)
    ok = torch.equal(emb(ids), w[ids])
    if rank == 0:
        ok = ok and logits.shape == (3, vocab) and torch.allclose(logits, h @ w.T)
    else:
        ok = ok and logits is None
    return ok


# ---- rank functions used by tests/worker/test_shm_allreduce.py ---------------------------


def _attach(rank: int, world: int, name: str, **kw):
    import torch.distributed as dist

    from nvllm.worker.shm_allreduce import attach

    return attach(name, rank, world, dist.group.WORLD, kw.pop("timeout_s", 60.0), **kw)


def shm_rounds(rank: int, world: int, name: str, rounds: int, slot_floats: int) -> dict:
    """Many all-reduces back to back through TPContext (shared memory up to the slot,
    gloo beyond), each rank sleeping at random now and then so that the ranks drift apart:
    every result must equal the sum of the ranks' inputs taken in rank order, bit for bit
    (every rank draws every rank's input from the same seeds). Also broadcasts and
    gathers. Returns what it saw, and a digest of its results to compare across ranks."""
    import hashlib
    import os
    import random
    import time

    import torch
    import torch.distributed as dist

    from nvllm.worker.parallel import TPContext

    shm = _attach(rank, world, name, slot_bytes=slot_floats * 4)
    assert shm is not None, "the ranks of one host must get the shared-memory path"
    gone = not os.path.exists(f"/dev/shm/{name}")
    tp = TPContext(rank, world, dist.group.WORLD, shm)
    jitter = random.Random(rank)
    digest = hashlib.sha256()
    exact = True
    sizes = [1, 7, 576, 4096, slot_floats, slot_floats + 1, 3 * slot_floats]
    via_shm = via_gloo = 0
    for i in range(rounds):
        n = sizes[i % len(sizes)]
        dtype = torch.bfloat16 if i % 5 == 4 else torch.float32
        inputs = [torch.randn(n, generator=torch.Generator().manual_seed(i * 100 + q))
                  .to(dtype) for q in range(world)]
        want = inputs[0] + inputs[1]
        for t in inputs[2:]:
            want = want + t
        if jitter.random() < 0.2:
            time.sleep(jitter.random() * 2e-3)
        before = shm.rounds
        got = tp.all_reduce(inputs[rank].clone())
        if shm.rounds > before:
            via_shm += 1
            exact &= torch.equal(got, want)  # bit for bit: the rank-order sum
        else:
            via_gloo += 1
            # gloo adds in its own order: within rounding (bf16: 2 ulps at |x| < 8)
            tol = 0.07 if dtype == torch.bfloat16 else 1e-5
            exact &= torch.allclose(got.float(), want.float(), rtol=0, atol=tol)
        digest.update(got.view(torch.uint8 if dtype == torch.float32 else torch.int16)
                      .numpy().tobytes())
        if i % 7 == 0:  # the sampled tokens' broadcast
            toks = torch.arange(n % 9 + 1) * 3 + i if rank == 0 else torch.full(
                (n % 9 + 1,), -1, dtype=torch.long)
            exact &= tp.broadcast_from_first(toks).tolist() == list(
                range(i, i + 3 * (n % 9 + 1), 3))
        if i % 11 == 0:  # the logits' gather, uneven widths
            widths = [5 + q for q in range(world)]
            part = torch.full((2, widths[rank]), float(rank + i))
            cat = tp.gather_to_first(part, widths)
            if rank == 0:
                exact &= torch.equal(cat, torch.cat([torch.full((2, w), float(q + i))
                                                     for q, w in enumerate(widths)], -1))
            else:
                exact &= cat is None
    shm.close()
    return {"exact": exact, "gone": gone, "via_shm": via_shm, "via_gloo": via_gloo,
            "digest": digest.hexdigest()}


def shm_overlap_vs_sync(rank: int, world: int, name: str) -> bool:
    """TPContext.run's two interleaved passes through shared memory give what one pass at
    a time gives, on every rank alike."""
    import torch
    import torch.distributed as dist

    from nvllm.worker.parallel import TPContext

    shm = _attach(rank, world, name)
    tp = TPContext(rank, world, dist.group.WORLD, shm)
    before = shm.rounds
    together = tp.run([_pass(rank, 1, 5, 3), _pass(rank, 2, 5, 4)])
    used = shm.rounds - before == 10
    alone = [tp.run([_pass(rank, seed, st, rows)])[0] for seed, st, rows in ((1, 5, 3),
                                                                             (2, 5, 4))]
    three = tp.run([_pass(rank, 1, 5, 3), _pass(rank, 2, 5, 4), _pass(rank, 3, 2, 1)])
    same = all(torch.equal(a, b) for a, b in zip(together, alone))
    same &= all(torch.equal(a, b) for a, b in zip(three, alone))
    gathered = [torch.empty_like(together[0]) for _ in range(world)]
    dist.all_gather(gathered, together[0])
    shm.close()
    return used and same and all(torch.equal(gathered[0], g) for g in gathered)


def shm_peer_dies(rank: int, world: int, name: str, how: str) -> str:
    """Rank 1 stops taking part after a few rounds ("exit": its process ends; "stall": it
    sleeps past rank 0's timeout); rank 0's next all-reduce must raise, not hang."""
    import time

    import torch

    from nvllm.worker.shm_allreduce import ShmAllReduceError

    # "exit" must be seen by the pid check, not the timeout: a long timeout keeps a slow
    # process exit (a loaded machine) from looking like a stall.
    shm = _attach(rank, world, name, timeout_s=1.5 if how == "stall" else 20.0)
    for _ in range(5):
        shm.all_reduce(torch.ones(576))
    if rank != 0:
        if how == "stall":
            time.sleep(4)
        return "left"  # the process then exits
    t0 = time.monotonic()
    try:
        shm.all_reduce(torch.ones(576))
    except ShmAllReduceError as e:
        return f"{time.monotonic() - t0:.2f} {e}"
    return "no error"


def shm_not_everywhere(rank: int, world: int, name: str, other: str) -> list:
    """Rank 1 cannot map rank 0's segment (here: it looks for another name, as a rank on
    another host would): every rank keeps gloo, and the segment is gone."""
    import os

    import torch
    import torch.distributed as dist

    from nvllm.worker.parallel import TPContext

    shm = _attach(rank, world, name if rank == 0 else other)
    tp = TPContext(rank, world, dist.group.WORLD, shm)
    x = tp.all_reduce(torch.full((4,), float(rank + 1)))
    return [shm is None, os.path.exists(f"/dev/shm/{name}"), x.tolist()]
