"""Weight updates on one rank: stage every chunk, apply all at once on commit.

A chunk (worker_protocol.WeightChunk) names HF tensors by ArrayRef. Each tensor is checked
against the shape the checkpoint had (recorded at load), then handed to the parameter's
own ``weight_loader`` (the loader's sharding: column/row ranges, heads by KV group, fused
q/k/v and gate/up, experts) with a staging tensor in place of the parameter, so the rank
copies out only its shard. Nothing the model holds changes before ``commit``: a refused
chunk (an unknown name, a wrong shape, a quantized layer) drops the staging and the old
weights stay. Staging holds, per parameter touched, one dense copy of this rank's shard
(a fused parameter updated in part starts from its current values).

``commit`` writes into what the layers actually hold: in place into dense parameters (a
CUDA graph keeps its addresses), and a float32 CPU layer whose weight was repacked for
oneDNN (layers/linear.py:pack_for_cpu, dense copy dropped) gets a freshly packed one.
Layers held quantized refuse updates (the rule: a quantized layer is loaded from a
checkpoint, never updated in place; restart the engine on the new checkpoint, or run
with quantization off).
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import torch
from torch import nn

from nvllm.common.cuda_ipc import is_ipc_ref
from nvllm.common.transport import ArrayReader, ArrayRef, BadRef
from nvllm.common.weight_transfer import WIRE_DTYPES, WeightUpdateError
from nvllm.common.worker_protocol import WeightChunk
from nvllm.worker.ipc_weights import stage_ipc
from nvllm.worker.loader import _default_loader
from nvllm.worker.models import decode_stack

logger = logging.getLogger(__name__)

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16,
                "bfloat16": torch.bfloat16}


class WeightUpdater:
    """One rank's staging area for weight updates (one update at a time)."""

    def __init__(self, model: nn.Module, hf_shapes: dict[str, tuple[int, ...]],
                 quantized: dict[str, str]) -> None:
        """`hf_shapes`: every checkpoint tensor's full shape, by HF name (what an update
        must match); `quantized`: the modules held quantized (refused)."""
        self.model = model
        self.hf_shapes = hf_shapes
        self.quantized = quantized
        # every name, a tied head's shared parameter too (quantize.share_tied_head)
        self.params = dict(model.named_parameters(remove_duplicate=False))
        self.update_id: int | None = None
        self.next_chunk = 0
        self.staged: dict[str, torch.Tensor] = {}
        self.reader: ArrayReader | None = None
        # A tensor arriving in row ranges: (name, its full buffer, rows filled so far).
        self.partial: tuple[str, torch.Tensor, int] | None = None

    @property
    def staged_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.staged.values())

    def stage(self, msg: WeightChunk) -> None:
        """Slice this rank's shard of every tensor of `msg` into staging. Raises
        WeightUpdateError (and drops everything staged) when any tensor is refused."""
        with self.aborting(msg.update_id):
            self._stage(msg)

    @contextmanager
    def aborting(self, update_id: int) -> Iterator[None]:
        """Any failure inside drops everything staged for `update_id` (every source's one
        rule: a refused tensor leaves the old weights) and surfaces as WeightUpdateError."""
        try:
            yield
        except WeightUpdateError:
            self.abort(update_id)
            raise
        except (BadRef, ValueError, RuntimeError, KeyError, OSError) as e:
            self.abort(update_id)
            raise WeightUpdateError(f"{type(e).__name__}: {e}") from None

    def begin_chunk(self, update_id: int, chunk: int) -> None:
        """Start staging chunk `chunk` of `update_id` (chunk 0 drops an update never
        committed); WeightUpdateError when it comes out of order. Every source (the ring,
        CUDA IPC, a process group, a checkpoint path) stages through this."""
        if chunk == 0:
            self.abort(self.update_id)  # an older update never committed: abandoned
            self.update_id, self.next_chunk = update_id, 0
        if update_id != self.update_id or chunk != self.next_chunk:
            raise WeightUpdateError(f"chunk {chunk} of update {update_id} out of "
                                    f"order (expected chunk {self.next_chunk} of update "
                                    f"{self.update_id})")

    def _stage(self, msg: WeightChunk) -> None:
        self.begin_chunk(msg.update_id, msg.chunk)
        if self.reader is None:
            self.reader = ArrayReader()
        if not len(msg.names) == len(msg.dtypes) == len(msg.refs):
            raise WeightUpdateError("a weight chunk needs one dtype and one ref per name")
        if msg.rows is not None:
            self._stage_rows(msg)
            self.next_chunk += 1
            return
        if self.partial is not None:
            raise WeightUpdateError(f"{self.partial[0]} arrived only in part (rows up to "
                                    f"{self.partial[2]})")
        for name, dtype, ref in zip(msg.names, msg.dtypes, msg.refs):
            if is_ipc_ref(ref):  # a trainer's CUDA memory, by handle
                stage_ipc(self, name, dtype, ref)
            else:
                self._stage_one(name, dtype, ArrayRef.decode(ref))
        self.next_chunk += 1

    def check_shape(self, name: str, shape: tuple[int, ...] | list[int]) -> None:
        """WeightUpdateError unless `name` is a checkpoint tensor of exactly `shape`."""
        want = self.hf_shapes.get(name)
        if want is None:
            raise WeightUpdateError(f"{name} is not a tensor of this model's checkpoint "
                                    "(names are the HF checkpoint's, e.g. "
                                    "model.layers.0.self_attn.q_proj.weight)")
        if tuple(shape) != tuple(want):
            raise WeightUpdateError(f"{name}: shape {list(shape)} does not match the "
                                    f"checkpoint's {list(want)}")

    def _stage_rows(self, msg: WeightChunk) -> None:
        """One piece of a tensor sent in row ranges: copied into a full-size buffer (one
        tensor, in the sender's dtype), staged once its last row arrived."""
        if len(msg.names) != 1 or len(msg.rows) != 2:
            raise WeightUpdateError("a chunk with rows holds one tensor and [first, total]")
        name, dtype, ref = msg.names[0], msg.dtypes[0], ArrayRef.decode(msg.refs[0])
        first, total = msg.rows
        if not ref.shape or first + ref.shape[0] > total:
            raise WeightUpdateError(f"{name}: rows {first}.. of {total} do not fit")
        self.check_shape(name, (total, *ref.shape[1:]))
        src = self._tensor(name, dtype, ref)
        if first == 0:
            if self.partial is not None:
                raise WeightUpdateError(f"{self.partial[0]} arrived only in part")
            self.partial = (name, torch.empty((total, *src.shape[1:]), dtype=src.dtype), 0)
        part = self.partial
        if part is None or part[0] != name or part[2] != first:
            raise WeightUpdateError(f"{name}: rows from {first} out of order")
        part[1][first:first + src.shape[0]].copy_(src)
        self.partial = (name, part[1], first + src.shape[0])
        if self.partial[2] == total:
            self.partial = None
            self.stage_source(name, part[1])

    def _source(self, name: str, dtype: str, ref: ArrayRef) -> torch.Tensor:
        self.check_shape(name, ref.shape)
        return self._tensor(name, dtype, ref)

    def _tensor(self, name: str, dtype: str, ref: ArrayRef) -> torch.Tensor:
        """The ring region `ref` as a read-only tensor of torch dtype `dtype`."""
        if WIRE_DTYPES.get(dtype) != ref.dtype:
            raise WeightUpdateError(f"{name}: dtype {dtype} sent as {ref.dtype}")
        arr = self.reader.get(ref)
        with warnings.catch_warnings():  # read-only view: the loaders only read it
            warnings.simplefilter("ignore", UserWarning)
            t = torch.from_numpy(np.asarray(arr))
        return t.view(torch.bfloat16) if dtype == "bfloat16" else t

    def _stage_one(self, name: str, dtype: str, ref: ArrayRef) -> None:
        self.stage_source(name, self._source(name, dtype, ref))

    def stage_source(self, name: str, src) -> None:
        """Stage this rank's shard of HF tensor `name` from `src` (a tensor, or a lazy
        slice the loaders index), cut by the parameter's own weight_loader; the caller
        checked its shape."""
        for pname, shard_id in self.model.param_for(name):
            param = self.params.get(pname)
            if param is None:
                raise WeightUpdateError(f"{name} has no place in this model ({pname})")
            owner = pname.rsplit(".", 1)[0]
            if owner in self.quantized:
                raise WeightUpdateError(
                    f"{name}: layer {owner} is held quantized ({self.quantized[owner]}); "
                    "quantized layers are loaded from a checkpoint, never updated in place: "
                    "restart on the new checkpoint, or serve with quantization off")
            staged = self.staged.get(pname)
            if staged is None:
                # A loader without a shard id writes the whole (local) parameter: no need
                # to start from its current values, as a fused one's part must.
                staged = self.staged[pname] = self._current(pname, param) \
                    if shard_id is not None else torch.empty(self._shape(pname, param),
                                                             dtype=param.dtype)
            loader = getattr(param, "weight_loader", _default_loader)
            with torch.no_grad():
                loader(staged, src, shard_id)

    def _shape(self, pname: str, param: nn.Parameter) -> torch.Size:
        """The parameter's shape as the model uses it (a packed weight's, if packed)."""
        packed = getattr(self.model.get_submodule(pname.rsplit(".", 1)[0]), "packed", None)
        if param.numel() == 0 and isinstance(packed, torch.Tensor):
            return packed.shape
        return param.shape

    def _current(self, pname: str, param: nn.Parameter) -> torch.Tensor:
        """A dense copy of what the parameter holds now (the packed weight unpacked)."""
        module = self.model.get_submodule(pname.rsplit(".", 1)[0])
        packed = getattr(module, "packed", None)
        if pname.endswith(".weight") and isinstance(packed, torch.Tensor) \
                and param.numel() == 0:
            return packed.to_dense()
        return param.detach().clone()

    def commit(self, update_id: int) -> int:
        """Apply everything staged for `update_id`; returns the parameters changed."""
        if update_id != self.update_id:
            raise WeightUpdateError(f"commit of update {update_id}, but update "
                                    f"{self.update_id} is staged")
        if self.partial is not None:
            name, rows = self.partial[0], self.partial[2]
            self.abort(update_id)
            raise WeightUpdateError(f"{name} arrived only in part (rows up to {rows})")
        staged, self.staged = self.staged, {}
        with torch.no_grad():
            for pname, value in staged.items():
                param = self.params[pname]
                module = self.model.get_submodule(pname.rsplit(".", 1)[0])
                packed = getattr(module, "packed", None)
                if pname.endswith(".weight") and isinstance(packed, torch.Tensor) \
                        and param.numel() == 0:
                    module.packed = value.to_mkldnn()
                else:
                    param.data.copy_(value)
        self._close()
        decode_stack.forget(self.model)  # rebuilt from the modules' tensors as they are now
        logger.info("weight update %d applied: %d parameters", update_id, len(staged))
        return len(staged)

    def abort(self, update_id: int | None) -> None:
        """Drop what was staged for `update_id` (a no-op for any other)."""
        if update_id is not None and update_id == self.update_id:
            self.staged = {}
            self.partial = None
            self._close()

    def _close(self) -> None:
        self.update_id, self.next_chunk = None, 0
        if self.reader is not None:
            self.reader.close()  # unmap the sender's segments
            self.reader = None
