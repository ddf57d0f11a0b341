"""A weight-update process group: the trainer (rank 0) and every worker (rank_offset + its
tp rank), for trainers on other devices or hosts that broadcast their tensors (SGLang's
``init_weights_update_group`` / ``update_weights_from_distributed``; vLLM's RLHF
examples' ``init_weight_update_group``).

The group is stateless with respect to torch.distributed: it has its own TCPStore (the
trainer hosts it at master_address:master_port) and a process group built straight on it
(``ProcessGroupGloo`` on CPU, ``ProcessGroupNCCL`` on CUDA), never the default group the
workers' tensor parallelism uses, so joining, using or losing it changes nothing there.
Every wait is bounded by the group's ``timeout_s``: a trainer that never comes or dies
mid-broadcast is an error on each worker after at most that long, never a hang.

``TrainerWeightGroup`` is the trainer's side: create it (the store starts listening), ask
the engine to ``init_weight_update_group`` from another thread, ``connect()``; then, per
update, ask for ``update_weights_from_distributed(names, dtypes, shapes)`` from another
thread and ``broadcast`` each tensor in the same order.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

DEFAULT_GROUP_NAME = "weight_update_group"
DEFAULT_TIMEOUT_S = 60.0
BACKENDS = ("gloo", "nccl")


def stateless_group(master_address: str, master_port: int, rank: int, world_size: int,
                    group_name: str = DEFAULT_GROUP_NAME, backend: str = "gloo",
                    timeout_s: float = DEFAULT_TIMEOUT_S,
                    store: dist.Store | None = None) -> dist.ProcessGroup:
    """A process group of its own (its own store; not the default group). Rank 0 hosts
    the store unless `store` is given. Blocks until every rank joined, at most
    `timeout_s` (then RuntimeError / DistStoreError)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    timeout = timedelta(seconds=timeout_s)
    if store is None:
        store = dist.TCPStore(master_address, master_port, world_size, is_master=rank == 0,
                              timeout=timeout, wait_for_workers=False)
    prefixed = dist.PrefixStore(group_name, store)
    if backend == "gloo":
        return dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = timeout
    return dist.ProcessGroupNCCL(prefixed, rank, world_size, opts)


def broadcast(pg: dist.ProcessGroup, tensor: torch.Tensor) -> None:
    """Broadcast from rank 0 into `tensor` on every rank (blocks until done)."""
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    pg.broadcast([tensor], opts).wait()


class WeightGroup:
    """A worker's membership: receives the trainer's tensors, one broadcast each."""

    def __init__(self, pg: dist.ProcessGroup, backend: str, device: torch.device,
                 name: str, timeout_s: float) -> None:
        self.pg, self.backend, self.device = pg, backend, device
        self.name, self.timeout_s = name, timeout_s

    @classmethod
    def join(cls, master_address: str, master_port: int, rank: int, world_size: int,
             group_name: str, backend: str, timeout_s: float,
             device: torch.device) -> WeightGroup:
        if backend == "nccl" and device.type != "cuda":
            raise ValueError("backend nccl needs a CUDA engine; use gloo on CPU")
        pg = stateless_group(master_address, master_port, rank, world_size, group_name,
                             backend, timeout_s)
        return cls(pg, backend, device, group_name, timeout_s)

    def receive(self, shape: Iterable[int], dtype: torch.dtype) -> torch.Tensor:
        """The trainer's next broadcast tensor (on the group's device: NCCL receives into
        the GPU, gloo into host memory)."""
        device = self.device if self.backend == "nccl" else torch.device("cpu")
        buf = torch.empty(tuple(shape), dtype=dtype, device=device)
        broadcast(self.pg, buf)
        return buf

    def close(self) -> None:
        """Drop the group (its store connection closes with it)."""
        shutdown = getattr(self.pg, "shutdown", None) or getattr(self.pg, "abort", None)
        if self.backend == "nccl" and shutdown is not None:
            try:
                shutdown()
            except Exception as e:  # noqa: BLE001 (a broken group: nothing left to free)
                logger.debug("weight group %s shutdown: %s", self.name, e)
        self.pg = None


class TrainerWeightGroup:
    """The trainer's side (rank 0): hosts the store, then broadcasts tensors."""

    def __init__(self, master_address: str, master_port: int, world_size: int,
                 group_name: str = DEFAULT_GROUP_NAME, backend: str = "gloo",
                 timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        """Starts listening at once (the workers connect to it); `connect` joins."""
        self.args = (master_address, master_port, 0, world_size, group_name, backend,
                     timeout_s)
        self.store = dist.TCPStore(master_address, master_port, world_size, is_master=True,
                                   timeout=timedelta(seconds=timeout_s),
                                   wait_for_workers=False)
        self.pg: dist.ProcessGroup | None = None

    def connect(self) -> None:
        """Join the group once every worker does (the engine's init_weight_update_group,
        called meanwhile from another thread or process)."""
        self.pg = stateless_group(*self.args, store=self.store)

    def broadcast(self, tensors: Iterable[Any]) -> None:
        """Send each tensor, in the order the engine was given their names."""
        if self.pg is None:
            raise RuntimeError("connect() first")
        for t in tensors:
            broadcast(self.pg, t.detach().contiguous())


def describe(named_tensors: Iterable[tuple[str, Any]]) -> tuple[list[str], list[str],
                                                                list[list[int]]]:
    """(names, dtypes, shapes) of tensors, as update_weights_from_distributed takes them."""
    names, dtypes, shapes = [], [], []
    for name, t in named_tensors:
        names.append(name)
        dtypes.append(str(t.dtype).removeprefix("torch."))
        shapes.append(list(t.shape))
    return names, dtypes, shapes
