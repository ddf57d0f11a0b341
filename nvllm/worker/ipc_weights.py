"""A worker's side of CUDA IPC weight updates (nvllm/common/cuda_ipc.py): open the
trainer's handle, view the tensor in place, stage this rank's shard through the
parameter's weight_loader, close the handle. The copy completes before the handle is
closed, so the trainer may reuse its memory once the chunk is answered.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from nvllm.common.cuda_ipc import ITEM_BYTES, IpcRef, cupy_module
from nvllm.common.weight_transfer import WeightUpdateError

# How each torch dtype is viewed through CuPy (which has no bfloat16: its bits).
_CUPY_DTYPES = {"float32": "float32", "float16": "float16", "bfloat16": "uint16"}
_TORCH = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def stage_ipc(weights: Any, name: str, dtype: str, raw: list) -> None:
    """Stage one tensor a trainer shares by CUDA IPC handle into `weights` (a
    WeightUpdater): checked (name, shape, dtype) before the handle is opened."""
    ref = IpcRef.decode(raw)
    weights.check_shape(name, ref.shape)
    if dtype not in _CUPY_DTYPES:
        raise WeightUpdateError(f"{name}: dtype {dtype} cannot be received; use one of "
                                f"{sorted(_CUPY_DTYPES)}")
    cupy = cupy_module()
    ptr = cupy.cuda.runtime.ipcOpenMemHandle(ref.handle)
    try:
        src = _view(cupy, ptr, ref, dtype)
        weights.stage_source(name, src)
        if src.device.type == "cuda":
            torch.cuda.current_stream(src.device).synchronize()  # copied before closing
    finally:
        cupy.cuda.runtime.ipcCloseMemHandle(ptr)


def _view(cupy: Any, ptr: int, ref: IpcRef, dtype: str) -> torch.Tensor:
    """The shared tensor as a torch tensor over the opened memory (no copy)."""
    item = ITEM_BYTES[dtype]
    extent = ref.offset + ref.extent(item)
    mem = cupy.cuda.UnownedMemory(ptr, extent, None)
    arr = cupy.ndarray(ref.shape, dtype=_CUPY_DTYPES[dtype],
                       memptr=cupy.cuda.MemoryPointer(mem, ref.offset),
                       strides=tuple(s * item for s in ref.strides))
    with warnings.catch_warnings():  # a read-only view: the loaders only read it
        warnings.simplefilter("ignore", UserWarning)
        t = torch.as_tensor(arr, device="cuda" if _is_device(arr) else "cpu")
    return t.view(_TORCH[dtype]) if dtype == "bfloat16" else t


def _is_device(arr: Any) -> bool:
    """A real CuPy array is device memory; a stand-in's host memory has no
    __cuda_array_interface__."""
    return hasattr(arr, "__cuda_array_interface__")
