"""Tensor-parallel context: passed explicitly to every layer (no module globals)."""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from nvllm.worker.sharding import shard_span
from nvllm.worker.shm_allreduce import ShmAllReduce


class _ShmWork:
    """A started shared-memory all-reduce round, finished by ``wait`` (as a gloo Work)."""

    __slots__ = ("shm", "round", "flat")

    def __init__(self, shm: ShmAllReduce, t: torch.Tensor) -> None:
        self.shm, self.flat = shm, t.view(-1)
        self.round = shm.start(self.flat)

    def wait(self) -> None:
        self.shm.finish(self.round, self.flat)


@dataclass(slots=True)
class TPContext:
    rank: int = 0
    world_size: int = 1
    group: dist.ProcessGroup | None = None
    # CPU ranks on one host: small collectives through shared memory instead of the group
    # (nvllm/worker/shm_allreduce.py); larger tensors still take the group.
    shm: ShmAllReduce | None = None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.world_size > 1:
            if self.shm is not None and self.shm.fits(x):
                self.shm.all_reduce(x)
            else:
                dist.all_reduce(x, group=self.group)
        return x

    def _start(self, t: torch.Tensor, shm: ShmAllReduce | None):
        if shm is not None and shm.fits(t):
            return _ShmWork(shm, t)
        return dist.all_reduce(t, group=self.group, async_op=True)

    def run(self, passes: list[Generator]) -> list:
        """Drive forward passes written as generators that yield each partial sum to
        all-reduce (in place) and take the reduced tensor back; returns their results.

        One pass runs its all-reduces synchronously. Two or more (micro-batches of one
        step) take turns: a pass's all-reduce is started asynchronously (on gloo, its
        own thread; on NCCL, its own stream; through shared memory, this rank's input is
        published and the sum taken when the pass resumes) and the next pass computes
        meanwhile, so communication hides behind compute. Each pass does exactly the same
        arithmetic either way. Every rank must drive the same number of passes (the
        shared-memory path is used only for up to its depth of them).
        """
        results: list = [None] * len(passes)
        if len(passes) == 1 or self.world_size == 1:
            for i, g in enumerate(passes):
                try:
                    t = next(g)
                    while True:
                        t = g.send(self.all_reduce(t))
                except StopIteration as e:
                    results[i] = e.value
            return results
        # Rounds finish in the order they started (the loop below is FIFO), as the
        # shared-memory path requires; it allows `depth` of them in flight.
        shm = self.shm if self.shm is not None and len(passes) <= self.shm.depth else None
        live: dict[int, tuple[torch.Tensor, object]] = {}
        for i, g in enumerate(passes):
            t = next(g)
            live[i] = (t, self._start(t, shm))
        while live:
            for i in list(live):
                t, work = live.pop(i)
                work.wait()
                try:
                    t = passes[i].send(t)
                except StopIteration as e:
                    results[i] = e.value
                    continue
                live[i] = (t, self._start(t, shm))
        return results

    def broadcast_from_first(self, x: torch.Tensor) -> torch.Tensor:
        """Overwrite x on every rank with rank 0's x (in place)."""
        if self.world_size > 1:
            if self.shm is not None and self.shm.fits(x):
                self.shm.broadcast(x)
            else:
                dist.broadcast(x, src=dist.get_global_rank(self.group, 0), group=self.group)
        return x

    def gather_to_first(self, x: torch.Tensor, sizes: list[int] | None = None
                        ) -> torch.Tensor | None:
        """Concatenate every rank's x along the last dim on rank 0 (None elsewhere).

        sizes: each rank's last dim when they differ (uneven shards, see
        nvllm/worker/sharding.py): the collective needs equal tensors, so each rank pads
        its x to the largest and rank 0 cuts the padding off again."""
        if self.world_size == 1:
            return x
        width = max(sizes) if sizes else x.shape[-1]
        if x.shape[-1] < width:
            x = torch.nn.functional.pad(x, (0, width - x.shape[-1]))
        x = x.contiguous()

        def combine(parts: list[torch.Tensor]) -> torch.Tensor:
            if sizes and min(sizes) < width:
                parts = [p[..., :n] for p, n in zip(parts, sizes)]
            return torch.cat(parts, dim=-1)

        if self.shm is not None and self.shm.fits(x):
            return self.shm.gather(x, combine)
        parts = [torch.empty_like(x) for _ in range(self.world_size)] if self.rank == 0 else None
        dist.gather(x, parts, dst=0, group=self.group)
        return combine(parts) if self.rank == 0 else None


def shard_range(total: int, tp: TPContext, granule: int = 1) -> tuple[int, int]:
    """[start, end) of this rank's share of `total` (nvllm/worker/sharding.py:shard_sizes:
    as even as granule allows, the first ranks taking the extra)."""
    return shard_span(total, tp.world_size, tp.rank, granule)
