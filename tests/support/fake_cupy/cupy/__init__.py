"""A stand-in for the few CuPy calls CUDA IPC weight updates make
(nvllm/common/cuda_ipc.py, nvllm/worker/ipc_weights.py), for CI machines without a GPU.

A "device allocation" is a POSIX shared-memory segment; its IPC handle is the segment's
name, padded to CUDA's 64 bytes. ``ipcOpenMemHandle`` maps the segment with libc's mmap
and returns the raw address, ``ipcCloseMemHandle`` unmaps it (a view used after closing
faults, as it would on a GPU), and ``ndarray`` views raw memory as a numpy array. The
trainer's side allocates with ``alloc`` and looks bases up with ``allocation_base`` (the
test puts it in place of nvllm.common.cuda_ipc.allocation_base). A test puts this folder
first on PYTHONPATH, so the workers import it as ``cupy``; ``OPEN`` counts the handles
open in this process (0 once every one was closed).
"""

from __future__ import annotations

import ctypes
import mmap
import os
from multiprocessing import shared_memory

import numpy as np

HANDLE_BYTES = 64
OPEN: dict[int, int] = {}  # address -> size, of the handles this process opened
_ALLOCS: dict[int, shared_memory.SharedMemory] = {}  # base address -> segment (exporter)
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                       ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]


def alloc(nbytes: int) -> tuple[int, shared_memory.SharedMemory]:
    """A new 'device allocation' of `nbytes`: (its base address, its segment)."""
    seg = shared_memory.SharedMemory(create=True, size=nbytes)
    base = ctypes.addressof(ctypes.c_char.from_buffer(seg.buf))
    _ALLOCS[base] = seg
    return base, seg


def free_all() -> None:
    """Unlink every allocation of this process (the test's cleanup)."""
    for seg in _ALLOCS.values():
        seg.unlink()
    _ALLOCS.clear()


def allocation_base(ptr: int) -> int:
    for base, seg in _ALLOCS.items():
        if base <= ptr < base + seg.size:
            return base
    raise ValueError(f"{ptr:#x} is in no fake device allocation")


class _Runtime:
    @staticmethod
    def ipcGetMemHandle(ptr: int) -> bytes:
        seg = _ALLOCS[allocation_base(ptr)]
        return seg.name.encode().ljust(HANDLE_BYTES, b"\0")

    @staticmethod
    def ipcOpenMemHandle(handle: bytes, flags: int = 1) -> int:
        name = handle.rstrip(b"\0").decode().lstrip("/")
        fd = os.open(f"/dev/shm/{name}", os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            addr = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        finally:
            os.close(fd)
        if addr in (None, ctypes.c_void_p(-1).value):
            raise RuntimeError(f"mmap failed: errno {ctypes.get_errno()}")
        OPEN[addr] = size
        return addr

    @staticmethod
    def ipcCloseMemHandle(ptr: int) -> None:
        _libc.munmap(ptr, OPEN.pop(ptr))


class _Memory:
    def __init__(self, ptr: int, size: int, owner: object = None) -> None:
        self.ptr, self.size = ptr, size


class _MemoryPointer:
    def __init__(self, mem: _Memory, offset: int) -> None:
        self.ptr = mem.ptr + offset


class cuda:  # noqa: N801 (cupy.cuda)
    runtime = _Runtime
    UnownedMemory = _Memory
    MemoryPointer = _MemoryPointer


def ndarray(shape: tuple[int, ...], dtype: str, memptr: _MemoryPointer,
            strides: tuple[int, ...]) -> np.ndarray:
    """A read-only numpy view of raw memory (no copy)."""
    dt = np.dtype(dtype)
    extent = dt.itemsize * (1 + sum((d - 1) * s // dt.itemsize
                                    for d, s in zip(shape, strides))) if all(shape) else 0
    raw = (ctypes.c_char * max(extent, 1)).from_address(memptr.ptr)
    arr = np.ndarray(shape, dtype=dt, buffer=raw, strides=strides)
    arr.flags.writeable = False
    return arr
