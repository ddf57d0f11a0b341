"""CUDA IPC handles for weight updates: a trainer's GPU tensors shared by handle, not copied.

The client exports each tensor's own device memory with CuPy
(``cupy.cuda.runtime.ipcGetMemHandle`` of the allocation that holds it) and sends, in a
weight chunk's refs, an ``IpcRef``: the handle, the device, the tensor's byte offset from
the allocation's base, its shape and its element strides, all plain msgpack (never
torch's pickle-based sharing, which would run code on the receiving side). Each worker
opens the handle (``ipcOpenMemHandle``), copies out its own shard through the parameter's
weight_loader and closes it (nvllm/worker/ipc_weights.py). The trainer keeps the tensors
alive and unchanged until the chunk is answered; nothing of them passes the leader.

nvllm.common imports no torch: a tensor is duck-typed (``data_ptr``, ``shape``,
``stride``, ``dtype``, ``device``, ``element_size``). CuPy is imported when first used, so
a test may put a stand-in module in its place (tests/support/fake_cupy).
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from nvllm.common.weight_transfer import (
    DEFAULT_CHUNK_BYTES,
    MAX_CHUNK_BYTES,
    MAX_TENSORS_PER_CHUNK,
    WIRE_DTYPES,
    NamedTensors,
    SendChunk,
    WeightUpdateError,
    check_name,
)

TAG = "cuda_ipc"  # a ref's first item: an ArrayRef's is a segment name, never this
HANDLE_BYTES = 64  # CUDA_IPC_HANDLE_SIZE
MAX_DIMS = 8
MAX_DEVICE = 1023
ITEM_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


@dataclass(slots=True, frozen=True)
class IpcRef:
    """One tensor in another process's device memory: `handle` names the allocation,
    `offset` the tensor's first byte in it; `strides` count elements, as torch's."""

    handle: bytes
    device: int
    offset: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]

    def encode(self) -> list:
        return [TAG, self.handle, self.device, self.offset, list(self.shape),
                list(self.strides)]

    @classmethod
    def decode(cls, ref: Any) -> IpcRef:
        """The IpcRef a ref's list form holds; WeightUpdateError naming what is wrong."""
        if not (isinstance(ref, list | tuple) and len(ref) == 6 and ref[0] == TAG):
            raise WeightUpdateError(f"a CUDA IPC ref is [{TAG!r}, handle, device, offset, "
                                    "shape, strides]")
        _, handle, device, offset, shape, strides = ref
        if not isinstance(handle, bytes) or len(handle) != HANDLE_BYTES:
            raise WeightUpdateError(f"a CUDA IPC handle is {HANDLE_BYTES} bytes")
        if not _int_in(device, 0, MAX_DEVICE):
            raise WeightUpdateError(f"a CUDA IPC ref's device must be in 0..{MAX_DEVICE}")
        if not _int_in(offset, 0, 1 << 48):
            raise WeightUpdateError("a CUDA IPC ref's offset must be in 0..2**48")
        for what, dims in (("shape", shape), ("strides", strides)):
            if not (isinstance(dims, list | tuple) and len(dims) <= MAX_DIMS
                    and all(_int_in(d, 0, 1 << 40) for d in dims)):
                raise WeightUpdateError(f"a CUDA IPC ref's {what} must be at most "
                                        f"{MAX_DIMS} integers in 0..2**40")
        if len(shape) != len(strides):
            raise WeightUpdateError("a CUDA IPC ref needs one stride per dimension")
        return cls(handle, device, offset, tuple(shape), tuple(strides))

    def extent(self, item_bytes: int) -> int:
        """Bytes from the tensor's first element to just past its last."""
        if any(d == 0 for d in self.shape):
            return 0
        return item_bytes * (1 + sum((d - 1) * s for d, s in zip(self.shape, self.strides)))


def _int_in(x: Any, lo: int, hi: int) -> bool:
    return type(x) is int and lo <= x <= hi


def is_ipc_ref(ref: Any) -> bool:
    return isinstance(ref, list | tuple) and len(ref) > 0 and ref[0] == TAG


@functools.cache
def _libcuda() -> ctypes.CDLL:
    lib = ctypes.CDLL("libcuda.so.1")
    lib.cuMemGetAddressRange_v2.argtypes = [ctypes.POINTER(ctypes.c_uint64),
                                            ctypes.POINTER(ctypes.c_size_t), ctypes.c_uint64]
    return lib


def allocation_base(ptr: int) -> int:
    """The base address of the CUDA allocation holding `ptr` (an IPC handle names a whole
    allocation: a tensor of torch's caching allocator lies somewhere inside one)."""
    base, size = ctypes.c_uint64(), ctypes.c_size_t()
    err = _libcuda().cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), ptr)
    if err != 0:
        raise WeightUpdateError(f"cuMemGetAddressRange failed (CUresult {err}): is the "
                                "tensor's memory from cudaMalloc (torch's allocator)?")
    return base.value


def cupy_module() -> Any:
    try:
        import cupy
    except ImportError:
        raise WeightUpdateError("sharing CUDA tensors by IPC handle needs CuPy (pip install "
                                "cupy-cuda12x); or move the tensors to the CPU") from None
    return cupy


def export_tensor(name: str, tensor: Any) -> tuple[str, IpcRef]:
    """(torch dtype name, IpcRef) of a CUDA tensor's own memory, no copy."""
    check_name(name)
    dtype = str(tensor.dtype).removeprefix("torch.")
    if dtype not in WIRE_DTYPES:
        raise WeightUpdateError(f"{name}: dtype {dtype} cannot be sent; use one of "
                                f"{sorted(WIRE_DTYPES)}")
    ptr = int(tensor.data_ptr())
    base = allocation_base(ptr)
    handle = bytes(cupy_module().cuda.runtime.ipcGetMemHandle(base))
    index = tensor.device.index
    return dtype, IpcRef(handle, 0 if index is None else int(index), ptr - base,
                         tuple(int(d) for d in tensor.shape),
                         tuple(int(s) for s in tensor.stride()))


def ipc_chunks(named_tensors: NamedTensors, chunk_bytes: int
               ) -> Iterator[tuple[list[str], list[str], list[list], list[Any]]]:
    """(names, dtypes, encoded refs, the tensors) per chunk of at most `chunk_bytes` of
    tensor data (a larger tensor alone): what one chunk asks the workers to copy."""
    if not 0 < chunk_bytes <= MAX_CHUNK_BYTES:
        raise WeightUpdateError(f"chunk_bytes must be in 1..{MAX_CHUNK_BYTES}, got "
                                f"{chunk_bytes}")
    items = named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors
    seen: set[str] = set()
    names: list[str] = []
    dtypes: list[str] = []
    refs: list[list] = []
    keep: list[Any] = []
    size = 0
    for name, tensor in items:
        if name in seen:
            raise WeightUpdateError(f"{name} is given twice in one update")
        seen.add(name)
        dtype, ref = export_tensor(name, tensor)
        nbytes = ref.extent(ITEM_BYTES[dtype])
        if names and (size + nbytes > chunk_bytes or len(names) >= MAX_TENSORS_PER_CHUNK):
            yield names, dtypes, refs, keep
            names, dtypes, refs, keep, size = [], [], [], [], 0
        names.append(name)
        dtypes.append(dtype)
        refs.append(ref.encode())
        keep.append(tensor)
        size += nbytes
    if names:
        yield names, dtypes, refs, keep


def push_ipc(named_tensors: NamedTensors, send: SendChunk,
             chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> tuple[int, int]:
    """Hand each chunk's (ordinal, names, dtypes, IPC refs) to `send`, which returns once
    every rank copied its shard and closed the handles; the tensors are referenced until
    then. Returns (tensors, bytes) shared."""
    num = total = 0
    for k, (names, dtypes, refs, keep) in enumerate(ipc_chunks(named_tensors, chunk_bytes)):
        send(k, names, dtypes, refs, None)
        num += len(names)
        total += sum(IpcRef.decode(r).extent(ITEM_BYTES[d]) for r, d in zip(refs, dtypes))
        keep.clear()  # answered: every rank closed its handles
    return num, total


def wants_ipc(named_tensors: NamedTensors) -> tuple[bool, NamedTensors]:
    """Whether the first tensor lives on CUDA (then every one must), and the tensors to
    send (the first one put back in front of a lazy iterable)."""
    if isinstance(named_tensors, Mapping):
        first = next(iter(named_tensors.values()), None)
        return _on_cuda(first), named_tensors
    it = iter(named_tensors)
    head = next(it, None)
    if head is None:
        return False, []

    def chained() -> Iterator:
        yield head
        yield from it

    return _on_cuda(head[1]), chained()


def _on_cuda(tensor: Any) -> bool:
    device = getattr(tensor, "device", None)
    return getattr(device, "type", None) == "cuda"


def choose_ipc(named_tensors: NamedTensors, cuda_ipc: bool | None
               ) -> tuple[bool, NamedTensors]:
    """Whether to share the tensors by CUDA IPC handle (None: when they are on CUDA)."""
    auto, named_tensors = wants_ipc(named_tensors)
    return (auto if cuda_ipc is None else cuda_ipc), named_tensors
