"""The ZMQ clients' RL calls (mixed into Client and AsyncClient): vLLM's
pause_generation / resume_generation / update_weights (shared memory or CUDA IPC
handles), joining a trainer's weight-update process group, an update the trainer
broadcasts over it, and an update read from a checkpoint path. The leader's side is
nvllm/leader/rollout_control.py and nvllm/leader/weight_sources.py."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

from nvllm.common import client_protocol as cp
from nvllm.common.cuda_ipc import choose_ipc, push_ipc
from nvllm.common.weight_transfer import (
    DEFAULT_CHUNK_BYTES,
    MAX_TENSORS_PER_CHUNK,
    NamedTensors,
    WeightUpdateError,
    client_transfer,
    push_weights,
)


class WeightSourceClient:
    """Client's pause_generation, resume_generation, update_weights,
    init_weight_update_group, update_weights_from_distributed and
    update_weights_from_path."""

    _request: Any
    _send: Any
    endpoint: str

    def pause_generation(self, mode: str = "abort", clear_cache: bool = True) -> None:
        """Returns once paused (for "wait": once the running requests finished)."""
        self._request(cp.PauseGeneration(mode=mode, clear_cache=clear_cache), cp.Paused)

    def resume_generation(self) -> None:
        self._request(cp.ResumeGeneration(), cp.Resumed)

    def update_weights(self, named_tensors: NamedTensors,
                       weight_version: int | str | None = None,
                       chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                       shared_memory: bool | None = None,
                       cuda_ipc: bool | None = None) -> int | str:
        """LLM.update_weights over the socket: the tensors go through shared memory this
        process creates (`shared_memory`, default: when the endpoint is on this host),
        else inline in the frames; CUDA tensors (`cuda_ipc`, default: when the first one
        is on CUDA) by IPC handle, each worker copying straight from them. Returns the
        weight_version now in force."""
        ipc, named_tensors = choose_ipc(named_tensors, cuda_ipc)
        shm, chunk_bytes = client_transfer(self.endpoint, shared_memory, chunk_bytes)

        def send(k: int, names: list[str], dtypes: list[str], refs: list[list],
                 rows: list[int] | None) -> None:
            self._request(cp.WeightsChunk(chunk=k, names=names, dtypes=dtypes, refs=refs,
                                          rows=rows), cp.WeightsStaged)

        try:
            if ipc:
                push_ipc(named_tensors, send, chunk_bytes)
            else:
                push_weights(named_tensors, send, chunk_bytes, shm)
        except BaseException:
            self._send(cp.encode(cp.WeightsAbort()), best_effort=True)
            raise
        return self._request(cp.WeightsCommit(weight_version=weight_version),
                             cp.WeightsCommitted)["weight_version"]

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
    endpoint: str

    async def pause_generation(self, mode: str = "abort", clear_cache: bool = True) -> None:
        await self._request(cp.PauseGeneration(mode=mode, clear_cache=clear_cache))

    async def resume_generation(self) -> None:
        await self._request(cp.ResumeGeneration())

    async def update_weights(self, named_tensors: NamedTensors,
                             weight_version: int | str | None = None,
                             chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                             shared_memory: bool | None = None,
                             cuda_ipc: bool | None = None) -> int | str:
        """As Client.update_weights; the ring writes run on a thread, off the loop."""
        ipc, named_tensors = choose_ipc(named_tensors, cuda_ipc)
        shm, chunk_bytes = client_transfer(self.endpoint, shared_memory, chunk_bytes)
        loop = asyncio.get_running_loop()

        def send(k: int, names: list[str], dtypes: list[str], refs: list[list],
                 rows: list[int] | None) -> None:
            asyncio.run_coroutine_threadsafe(self._request(cp.WeightsChunk(
                chunk=k, names=names, dtypes=dtypes, refs=refs, rows=rows)), loop).result()

        try:
            if ipc:
                await asyncio.to_thread(push_ipc, named_tensors, send, chunk_bytes)
            else:
                await asyncio.to_thread(push_weights, named_tensors, send, chunk_bytes, shm)
        except BaseException:
            await self._send(cp.encode(cp.WeightsAbort()), best_effort=True)
            raise
        return (await self._request(cp.WeightsCommit(weight_version=weight_version))
                )["weight_version"]

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
