"""Weight updates from sources other than tensors the caller hands over (a mixin of
LLMEngine, beside weight_sync.py): a trainer's weight-update process group
(``init_weight_update_group`` and ``update_weights_from_distributed``, SGLang's and vLLM's
RLHF examples' names) and a checkpoint on disk (``update_weights_from_path``).

The leader moves no tensor here: it sends each rank what to receive or read, and waits
for every rank to have staged it (nvllm/worker/weight_sources.py); only then does the
commit of weight_sync.py apply it everywhere. A refusal or a failure on any rank (a
trainer that dies mid-broadcast, a wrong path or architecture) aborts the staging on every
rank: the old weights stay. Every wait is bounded: joining (about twice the group's
``timeout_s``: torch's store client tries twice) and each receive (``timeout_s``) on the
workers, the leader by the sum of those plus a margin.
"""

from __future__ import annotations

import itertools
import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING

from nvllm.common import worker_protocol as wp
from nvllm.common.client_limits import (
    MAX_PATH_CHARS,
    MAX_TENSOR_DIMS,
    weight_group_error,
)
from nvllm.common.model_source import resolve_model_source
from nvllm.common.weight_transfer import (
    MAX_TENSORS_PER_CHUNK,
    WIRE_DTYPES,
    WeightUpdateError,
    check_name,
    check_weight_version,
)

if TYPE_CHECKING:
    from nvllm.leader.engine import LLMEngine

logger = logging.getLogger(__name__)

DEFAULT_GROUP_NAME = "weight_update_group"
DEFAULT_GROUP_TIMEOUT_S = 60.0
ACK_MARGIN_S = 30.0  # the leader waits this much longer than the workers may
_group_ids = itertools.count(1)


class WeightSources:
    """LLMEngine's updates from a process group and from a path (mixed into LLMEngine)."""

    def init_weight_update_group(self: LLMEngine, master_address: str, master_port: int,
                                 rank_offset: int, world_size: int,
                                 group_name: str = DEFAULT_GROUP_NAME,
                                 backend: str | None = None,
                                 timeout_s: float = DEFAULT_GROUP_TIMEOUT_S) -> None:
        """Have every worker join the trainer's process group as rank rank_offset + its
        tp rank (the trainer, rank 0, hosts its TCPStore at master_address:master_port
        and joins meanwhile). `backend`: "nccl" on CUDA, "gloo" on CPU by default. Blocks
        the engine until every rank joined or failed, at most about `timeout_s`;
        WeightUpdateError when any could not (the engine keeps serving, no group)."""
        tp = self.config.tensor_parallel_size
        backend = backend or ("nccl" if self.config.device == "cuda" else "gloo")
        error = weight_group_error(master_address, master_port, rank_offset, world_size,
                                   group_name, backend, timeout_s, tp)
        if error is not None:
            raise WeightUpdateError(f"init_weight_update_group: {error}")
        self._quiesce("join a weight-update group")
        group_id = next(_group_ids)
        error = self.executor.weight_request(
            wp.InitWeightGroup(group_id, master_address, master_port, rank_offset,
                               world_size, group_name, backend, float(timeout_s)),
            # torch's store client tries twice before it gives up: up to about 2 x timeout_s
            group_id, wp.INIT_GROUP_CHUNK, 2 * timeout_s + ACK_MARGIN_S)
        self._group_timeout_s = None if error else float(timeout_s)
        if error is not None:
            raise WeightUpdateError(f"init_weight_update_group failed: {error}")
        logger.info("every rank joined weight-update group %r (%s, world size %d)",
                    group_name, backend, world_size)

    def update_weights_from_distributed(self: LLMEngine, names: list[str],
                                        dtypes: list[str], shapes: list[list[int]],
                                        weight_version: int | str | None = None
                                        ) -> int | str:
        """Receive `names` (HF names, torch dtype names, full shapes) from the trainer's
        broadcasts over the weight-update group, in this order, then apply them on every
        rank at once; returns the new weight_version. A failed broadcast (a dead trainer)
        or a refused tensor leaves the old weights in force and closes the group."""
        version = check_weight_version(weight_version)
        update_id = self.begin_weight_update()
        try:
            for k, at in enumerate(range(0, max(len(names), 1), MAX_TENSORS_PER_CHUNK)):
                end = at + MAX_TENSORS_PER_CHUNK
                self.stage_from_group(update_id, k, names[at:end], dtypes[at:end],
                                      shapes[at:end])
        except BaseException:
            self.abort_weight_update(update_id)
            raise
        return self.commit_weight_update(update_id, version)

    def stage_from_group(self: LLMEngine, update_id: int, chunk: int, names: list[str],
                         dtypes: list[str], shapes: list[list[int]]) -> None:
        """Have every rank receive and stage one chunk of broadcasts; WeightUpdateError
        (the update aborted on every rank) when any failed."""
        timeout_s = getattr(self, "_group_timeout_s", None)
        try:
            if timeout_s is None:
                raise WeightUpdateError("no weight-update group: call "
                                        "init_weight_update_group first (a failed or "
                                        "refused update closes the group)")
            check_tensor_specs(names, dtypes, shapes)
            self._stage_request(update_id, wp.WeightsFromGroup(
                update_id, chunk, list(names), list(dtypes), [list(s) for s in shapes]),
                chunk, timeout_s * max(1, len(names)) + ACK_MARGIN_S)  # each receive's bound
        except WeightUpdateError:
            # The trainer's broadcasts are no longer matched by receives: the group is
            # spent (the ranks closed their side, or will replace it at the next init).
            self._group_timeout_s = None
            self.abort_weight_update(update_id)
            raise

    def update_weights_from_path(self: LLMEngine, path: str,
                                 weight_version: int | str | None = None) -> int | str:
        """Load a checkpoint (a safetensors folder, or a .gguf file) of this model's
        architecture: every rank reads its own shards through the loader, then all apply
        at once. A wrong path or architecture is refused; the old weights stay."""
        version = check_weight_version(weight_version)
        self.check_checkpoint_path(path)
        update_id = self.begin_weight_update()
        try:
            self._stage_request(update_id, wp.WeightsFromPath(update_id, 0, str(path)), 0,
                                self.config.step_timeout_s)
        except BaseException:
            self.abort_weight_update(update_id)
            raise
        return self.commit_weight_update(update_id, version)

    def check_checkpoint_path(self: LLMEngine, path: str) -> None:
        """WeightUpdateError unless `path` is a checkpoint of the served architecture."""
        if not isinstance(path, str) or not 0 < len(path) <= MAX_PATH_CHARS:
            raise WeightUpdateError(f"path must be 1 to {MAX_PATH_CHARS} characters")
        try:
            source = resolve_model_source(path)
        except (FileNotFoundError, OSError, ValueError) as e:
            raise WeightUpdateError(f"update_weights_from_path: {e}") from None
        want, got = (_architectures(s.config_dir) for s in (self.config.source, source))
        if want and got and want != got:
            raise WeightUpdateError(f"update_weights_from_path: {path} holds a "
                                    f"{'/'.join(got)}, but the engine serves a "
                                    f"{'/'.join(want)}: restart the engine to change models")

    def _stage_request(self: LLMEngine, update_id: int, msg: object, chunk: int,
                       timeout_s: float) -> None:
        if update_id != self._staging:
            raise WeightUpdateError(f"weight update {update_id} is not being staged "
                                    f"(now: {self._staging})")
        error = self.executor.weight_request(msg, update_id, chunk, timeout_s)
        if error is not None:
            self.abort_weight_update(update_id)
            raise WeightUpdateError(f"weight update refused, the old weights stay: {error}")

    def _quiesce(self: LLMEngine, what: str) -> None:
        """Refuse while requests run unpaused (the workers will block); take an idle
        engine's last plan result first."""
        if self._staging is not None:
            raise WeightUpdateError(f"cannot {what} while weight update {self._staging} is "
                                    "being staged")
        self.begin_weight_update()  # the same rule as an update; nothing is staged yet
        self._staging = None


def check_tensor_specs(names: list[str], dtypes: list[str], shapes: list[list[int]]
                       ) -> None:
    """WeightUpdateError unless names, dtypes and shapes describe tensors one to one."""
    if not len(names) == len(dtypes) == len(shapes):
        raise WeightUpdateError(f"names, dtypes and shapes need one entry per tensor (got "
                                f"{len(names)}, {len(dtypes)}, {len(shapes)})")
    for name, dtype, shape in zip(names, dtypes, shapes):
        check_name(name)
        if dtype not in WIRE_DTYPES:
            raise WeightUpdateError(f"{name}: dtype {dtype!r} is not one of "
                                    f"{sorted(WIRE_DTYPES)}")
        if not (isinstance(shape, list | tuple) and len(shape) <= MAX_TENSOR_DIMS and all(
                type(d) is int and d >= 0 for d in shape)):
            raise WeightUpdateError(f"{name}: a shape is at most {MAX_TENSOR_DIMS} "
                                    "non-negative integers")


def _architectures(config_dir: str) -> list[str]:
    try:
        return list(json.loads((Path(config_dir) / "config.json").read_text())
                    .get("architectures") or [])
    except (OSError, ValueError):
        return []
