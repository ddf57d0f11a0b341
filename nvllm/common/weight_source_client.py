"""The ZMQ clients' weight updates from other sources (mixed into Client and
AsyncClient): joining a trainer's weight-update process group, an update the trainer
broadcasts over it, and an update read from a checkpoint path. The leader's side is
nvllm/leader/rollout_control.py and nvllm/leader/weight_sources.py."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from nvllm.common import client_protocol as cp
from nvllm.common.weight_transfer import MAX_TENSORS_PER_CHUNK, WeightUpdateError


class WeightSourceClient:
    """Client's init_weight_update_group, update_weights_from_distributed and
    update_weights_from_path."""

    _request: Any
    _send: Any

    def init_weight_update_group(self, master_address: str, master_port: int,
                                 rank_offset: int, world_size: int,
                                 group_name: str = "weight_update_group",
                                 backend: str | None = None,
                                 timeout_s: float = 60.0) -> None:
        """LLM.init_weight_update_group over the socket (returns once every worker
        joined; this client's timeout_s must exceed the group's)."""
        self._request(cp.InitWeightUpdateGroup(
            master_address=master_address, master_port=master_port, rank_offset=rank_offset,
            world_size=world_size, group_name=group_name, backend=backend,
            timeout_s=timeout_s), cp.WeightUpdateGroupReady)

    def update_weights_from_distributed(self, names: list[str], dtypes: list[str],
                                        shapes: list[list[int]],
                                        weight_version: int | str | None = None
                                        ) -> int | str:
        """LLM.update_weights_from_distributed over the socket: the trainer broadcasts
        the tensors meanwhile (from another thread or process), in this order."""
        try:
            for k, names_k, dtypes_k, shapes_k in _spec_chunks(names, dtypes, shapes):
                self._request(cp.WeightsFromDistributed(chunk=k, names=names_k,
                                                        dtypes=dtypes_k, shapes=shapes_k),
                              cp.DistributedStaged)
        except BaseException:
            self._send(cp.encode(cp.WeightsAbort()), best_effort=True)
            raise
        return self._request(cp.WeightsCommit(weight_version=weight_version),
                             cp.WeightsCommitted)["weight_version"]

    def update_weights_from_path(self, path: str,
                                 weight_version: int | str | None = None) -> int | str:
        """LLM.update_weights_from_path over the socket (a path on the workers' hosts)."""
        return self._request(cp.UpdateWeightsFromPath(path=str(path),
                                                      weight_version=weight_version),
                             cp.WeightsFromPathLoaded)["weight_version"]


class AsyncWeightSourceClient:
    """As WeightSourceClient, for AsyncClient."""

    _request: Any
    _send: Any

    async def init_weight_update_group(self, master_address: str, master_port: int,
                                       rank_offset: int, world_size: int,
                                       group_name: str = "weight_update_group",
                                       backend: str | None = None,
                                       timeout_s: float = 60.0) -> None:
        await self._request(cp.InitWeightUpdateGroup(
            master_address=master_address, master_port=master_port, rank_offset=rank_offset,
            world_size=world_size, group_name=group_name, backend=backend,
            timeout_s=timeout_s))

    async def update_weights_from_distributed(self, names: list[str], dtypes: list[str],
                                              shapes: list[list[int]],
                                              weight_version: int | str | None = None
                                              ) -> int | str:
        try:
            for k, names_k, dtypes_k, shapes_k in _spec_chunks(names, dtypes, shapes):
                await self._request(cp.WeightsFromDistributed(
                    chunk=k, names=names_k, dtypes=dtypes_k, shapes=shapes_k))
        except BaseException:
            await self._send(cp.encode(cp.WeightsAbort()), best_effort=True)
            raise
        return (await self._request(cp.WeightsCommit(weight_version=weight_version))
                )["weight_version"]

    async def update_weights_from_path(self, path: str,
                                       weight_version: int | str | None = None
                                       ) -> int | str:
        return (await self._request(cp.UpdateWeightsFromPath(
            path=str(path), weight_version=weight_version)))["weight_version"]


def _spec_chunks(names: list[str], dtypes: list[str], shapes: list[list[int]]
                 ) -> Iterator[tuple[int, list[str], list[str], list[list[int]]]]:
    """update_weights_from_distributed's lists, at most MAX_TENSORS_PER_CHUNK a message."""
    if not len(names) == len(dtypes) == len(shapes):
        raise WeightUpdateError("names, dtypes and shapes need one entry per tensor")
    for k, at in enumerate(range(0, max(len(names), 1), MAX_TENSORS_PER_CHUNK)):
        end = at + MAX_TENSORS_PER_CHUNK
        yield (k, list(names[at:end]), list(dtypes[at:end]),
               [list(s) for s in shapes[at:end]])
