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
