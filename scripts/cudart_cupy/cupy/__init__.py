"""The few CuPy calls nvllm's CUDA IPC weight updates make, over the CUDA runtime's own
IPC functions through ctypes, for scripts/cuda_ipc_check.py on a GPU image without CuPy
(its wheel is too large to carry there). The handles are real: cudaIpcGetMemHandle in
the exporting process, cudaIpcOpenMemHandle / cudaIpcCloseMemHandle in each worker, and
arrays reach torch through ``__cuda_array_interface__`` as CuPy's do."""

from __future__ import annotations

import ctypes
import glob
import os

import torch


def _load() -> ctypes.CDLL:
    torch.cuda.init()  # the runtime torch loaded is the one to share
    names = ["libcudart.so", "libcudart.so.13", "libcudart.so.12"]
    site = os.path.dirname(os.path.dirname(torch.__file__))
    names += sorted(glob.glob(os.path.join(site, "nvidia", "cuda_runtime", "lib",
                                           "libcudart.so*")))
    for name in names:
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    raise ImportError("no libcudart found")


class _Handle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * 64)]


_rt = _load()
_rt.cudaIpcGetMemHandle.argtypes = [ctypes.POINTER(_Handle), ctypes.c_void_p]
_rt.cudaIpcOpenMemHandle.argtypes = [ctypes.POINTER(ctypes.c_void_p), _Handle,
                                     ctypes.c_uint]
_rt.cudaIpcCloseMemHandle.argtypes = [ctypes.c_void_p]


def _check(err: int, what: str) -> None:
    if err != 0:
        raise RuntimeError(f"{what} failed: cudaError {err}")


class _Runtime:
    @staticmethod
    def ipcGetMemHandle(ptr: int) -> bytes:
        h = _Handle()
        _check(_rt.cudaIpcGetMemHandle(ctypes.byref(h), ctypes.c_void_p(ptr)),
               "cudaIpcGetMemHandle")
        return ctypes.string_at(ctypes.addressof(h), 64)  # the field reads stop at a NUL

    @staticmethod
    def ipcOpenMemHandle(handle: bytes, flags: int = 1) -> int:
        h = _Handle.from_buffer_copy(handle)
        ptr = ctypes.c_void_p()
        _check(_rt.cudaIpcOpenMemHandle(ctypes.byref(ptr), h, flags),
               "cudaIpcOpenMemHandle")
        return ptr.value

    @staticmethod
    def ipcCloseMemHandle(ptr: int) -> None:
        _check(_rt.cudaIpcCloseMemHandle(ctypes.c_void_p(ptr)), "cudaIpcCloseMemHandle")


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


_TYPESTR = {"float32": "<f4", "float16": "<f2", "uint16": "<u2"}


class ndarray:  # noqa: N801 (cupy.ndarray)
    def __init__(self, shape, dtype, memptr: _MemoryPointer, strides) -> None:
        self.__cuda_array_interface__ = {
            "shape": tuple(shape), "typestr": _TYPESTR[str(dtype)],
            "data": (memptr.ptr, True), "strides": tuple(strides), "version": 3}
