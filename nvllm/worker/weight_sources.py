"""A rank's weight updates from sources other than the leader's ring: a trainer's
weight-update process group (nvllm/worker/weight_group.py) and a checkpoint on disk.

Both stage through the same WeightUpdater as the shared-memory path (chunk order, shape
checks against the checkpoint the engine loaded, the parameter's own weight_loader, the
quantized-layer refusal) and are applied only by the leader's CommitWeights, so a failure
on any rank leaves every rank's old weights in force.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from nvllm.common import worker_protocol as wp
from nvllm.common.model_source import resolve_model_source
from nvllm.common.weight_transfer import WeightUpdateError
from nvllm.worker.loader import _tensor_sources
from nvllm.worker.weight_group import WeightGroup
from nvllm.worker.weight_update import TORCH_DTYPES, WeightUpdater

logger = logging.getLogger(__name__)

MESSAGES = (wp.InitWeightGroup, wp.WeightsFromGroup, wp.WeightsFromPath)


class WeightSources:
    """One rank's weight-update group (at most one) and its updates from a path."""

    def __init__(self, weights: WeightUpdater, device: torch.device, rank: int) -> None:
        self.weights, self.device, self.rank = weights, device, rank
        self.group: WeightGroup | None = None

    def handle(self, msg: Any) -> wp.WeightsAck:
        """One message; the answer the leader waits for (with the reason on refusal)."""
        if isinstance(msg, wp.InitWeightGroup):
            return self._ack(msg.group_id, wp.INIT_GROUP_CHUNK, self._join, msg)
        if isinstance(msg, wp.WeightsFromGroup):
            return self._ack(msg.update_id, msg.chunk, self._staged, self._from_group, msg)
        return self._ack(msg.update_id, msg.chunk, self._staged, self._from_path, msg)

    def _ack(self, ident: int, chunk: int, fn: Callable, *args: Any) -> wp.WeightsAck:
        try:
            fn(*args)
        except WeightUpdateError as e:
            logger.error("rank %d: weight update %d refused: %s", self.rank, ident, e)
            return wp.WeightsAck(self.rank, ident, chunk, str(e) or "refused")
        return wp.WeightsAck(self.rank, ident, chunk, "", self.weights.staged_bytes)

    # ---- the group --------------------------------------------------------------------

    def _join(self, msg: wp.InitWeightGroup) -> None:
        self.close()  # a new group replaces the old one
        try:
            self.group = WeightGroup.join(
                msg.master_address, msg.master_port, msg.rank_offset + self.rank,
                msg.world_size, msg.group_name, msg.backend, msg.timeout_s, self.device)
        except Exception as e:  # noqa: BLE001 (torch raises several kinds; all mean "no")
            raise WeightUpdateError(
                f"could not join weight-update group {msg.group_name!r} at "
                f"{msg.master_address}:{msg.master_port} as rank "
                f"{msg.rank_offset + self.rank} of {msg.world_size} within "
                f"{msg.timeout_s:g}s: {type(e).__name__}: {_first_line(e)} (the trainer "
                "must host the store there and join as rank 0 meanwhile)") from None
        logger.info("rank %d joined weight-update group %r (%s) as rank %d of %d",
                    self.rank, msg.group_name, msg.backend, msg.rank_offset + self.rank,
                    msg.world_size)

    def close(self) -> None:
        if self.group is not None:
            self.group.close()
            self.group = None

    def _from_group(self, msg: wp.WeightsFromGroup) -> None:
        w = self.weights
        if self.group is None:
            raise WeightUpdateError("no weight-update group: call init_weight_update_group "
                                    "first (a failed broadcast closes the group)")
        if not len(msg.names) == len(msg.dtypes) == len(msg.shapes):
            raise WeightUpdateError("names, dtypes and shapes need one entry per tensor")
        try:
            for name, dtype, shape in zip(msg.names, msg.dtypes, msg.shapes):
                w.check_shape(name, shape)  # before any buffer of the sender's size
                if dtype not in TORCH_DTYPES:
                    raise WeightUpdateError(f"{name}: dtype {dtype} cannot be received; use "
                                            f"one of {sorted(TORCH_DTYPES)}")
        except WeightUpdateError:
            self.close()  # the trainer's broadcasts now go unanswered: the group is spent
            raise
        for name, dtype, shape in zip(msg.names, msg.dtypes, msg.shapes):
            try:
                buf = self.group.receive(shape, TORCH_DTYPES[dtype])
            except Exception as e:  # noqa: BLE001 (gloo/NCCL errors: a dead or slow trainer)
                self.close()
                raise WeightUpdateError(
                    f"the trainer's broadcast of {name} failed ({type(e).__name__}: "
                    f"{_first_line(e)}); the group is closed: call init_weight_update_group "
                    "again") from None
            w.stage_source(name, buf)

    # ---- a checkpoint on disk ---------------------------------------------------------

    def _from_path(self, msg: wp.WeightsFromPath) -> None:
        try:
            source = resolve_model_source(msg.path)
        except (FileNotFoundError, OSError, ValueError) as e:
            raise WeightUpdateError(f"cannot read a checkpoint at {msg.path}: {e}") from None
        w = self.weights
        for _path, open_file in _tensor_sources(source):
            with open_file() as tensors:
                for name, src in tensors:
                    w.check_shape(name, src.get_shape() if hasattr(src, "get_shape")
                                  else src.shape)
                    w.stage_source(name, src)

    def _staged(self, fn: Callable, msg: Any) -> None:
        """Run one staging chunk under the updater's rules: in order, and any failure
        drops everything staged for the update."""
        w = self.weights
        with w.aborting(msg.update_id):
            w.begin_chunk(msg.update_id, msg.chunk)
            fn(msg)
            w.next_chunk += 1


def _first_line(e: BaseException) -> str:
    return (str(e).strip().split("\n") or [""])[0][:300]
