"""Tensor-parallel context: passed explicitly to every layer (no module globals)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(slots=True)
class TPContext:
    rank: int = 0
    world_size: int = 1
    group: dist.ProcessGroup | None = None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.world_size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def gather_to_first(self, x: torch.Tensor) -> torch.Tensor | None:
        """Concatenate every rank's x along the last dim on rank 0 (None elsewhere)."""
        if self.world_size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.world_size)] if self.rank == 0 else None
        dist.gather(x, parts, dst=0, group=self.group)
        return torch.cat(parts, dim=-1) if self.rank == 0 else None


def shard_range(total: int, tp: TPContext) -> tuple[int, int]:
    """[start, end) of this rank's equal share of `total` (must divide)."""
    assert total % tp.world_size == 0, (total, tp.world_size)
    size = total // tp.world_size
    return tp.rank * size, (tp.rank + 1) * size
