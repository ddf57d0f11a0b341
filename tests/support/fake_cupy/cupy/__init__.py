"""A CPU stand-in for the few CuPy calls nvllm.common.transport.cuda makes, so the CUDA
ring's logic (IPC handles in the header, the same-process shortcut, copies, views) runs
in CI without a GPU. NOT on sys.path by default: tests put tests/support/fake_cupy first
only where they ask for it, and never on a machine that has the real CuPy.

"Device memory" is a POSIX shared-memory segment per malloc (named nvllm-fakecuda-*, so
the suite's /dev/shm leak check covers it); its IPC handle is the name, NUL-padded to 64
bytes; a pointer is the mapping's real address, so memcpy is ctypes.memmove. Like real
CUDA, opening a handle in the process that allocated it fails.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import secrets
import types

import numpy as np

__version__ = "0.0-fake"
int32, int64, float32, uint16 = np.int32, np.int64, np.float32, np.uint16

_allocs: dict[int, tuple[object, int, str | None, object]] = {}  # base -> (mm, size, name, pin)
_own_names: set[str] = set()


def _map(mm: mmap.mmap, size: int, name: str | None) -> int:
    pin = ctypes.c_char.from_buffer(mm)  # keeps the mapping open while registered
    base = ctypes.addressof(pin)
    _allocs[base] = (mm, size, name, pin)
    return base


def _find(ptr: int) -> tuple[int, mmap.mmap, int]:
    for base, (mm, size, _, _) in _allocs.items():
        if base <= ptr < base + max(size, 1):
            return base, mm, size
    raise RuntimeError(f"cudaErrorInvalidValue: 0x{ptr:x} is not device memory")


def _shm_open(name: str, flags: int) -> int:
    import _posixshmem

    return _posixshmem.shm_open("/" + name, flags, 0o600)


class CUDARuntimeError(RuntimeError):
    pass


def _malloc(size: int) -> int:
    name = f"nvllm-fakecuda-{os.getpid()}-{secrets.token_hex(6)}"
    fd = _shm_open(name, os.O_CREAT | os.O_EXCL | os.O_RDWR)
    try:
        os.ftruncate(fd, size)
        mm = mmap.mmap(fd, size)
    finally:
        os.close(fd)
    _own_names.add(name)
    return _map(mm, size, name)


def _free(ptr: int) -> None:
    mm, size, name, pin = _allocs.pop(ptr)
    import _posixshmem

    _posixshmem.shm_unlink("/" + name)
    _own_names.discard(name)


def _ipc_get(ptr: int) -> bytes:
    base, _, _ = _find(ptr)
    name = _allocs[base][2]
    if name is None or base != ptr:
        raise CUDARuntimeError("cudaErrorInvalidValue: not the base of a cudaMalloc")
    return name.encode().ljust(64, b"\0")


def _ipc_open(handle: bytes, flags: int = 1) -> int:
    name = handle.rstrip(b"\0").decode()
    if name in _own_names:
        raise CUDARuntimeError("cudaErrorDeviceUninitialized: cannot open an IPC handle in "
                               "the process that made it")
    fd = _shm_open(name, os.O_RDWR)
    try:
        size = os.fstat(fd).st_size
        mm = mmap.mmap(fd, size)
    finally:
        os.close(fd)
    return _map(mm, size, None)


def _ipc_close(ptr: int) -> None:
    _allocs.pop(ptr)


def _memcpy(dst: int, src: int, n: int, kind: int, stream: int = 0) -> None:
    ctypes.memmove(dst, src, n)


runtime = types.SimpleNamespace(
    getDevice=lambda: 0, getDeviceCount=lambda: 1, malloc=_malloc, free=_free,
    ipcGetMemHandle=_ipc_get, ipcOpenMemHandle=_ipc_open, ipcCloseMemHandle=_ipc_close,
    deviceGetPCIBusId=lambda d: "0000:00:00.0",
    deviceGetByPCIBusId=lambda s: 0 if s == "0000:00:00.0" else (_ for _ in ()).throw(
        CUDARuntimeError("cudaErrorInvalidDevice")),
    memcpyAsync=_memcpy, memcpy=lambda d, s, n, k: _memcpy(d, s, n, k), memcpyDefault=4,
    deviceSynchronize=lambda: None, runtimeGetVersion=lambda: 0, driverGetVersion=lambda: 0,
    CUDARuntimeError=CUDARuntimeError)


class Device:
    def __init__(self, device: int = 0) -> None:
        self.id = device

    def __enter__(self) -> Device:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


class UnownedMemory:
    def __init__(self, ptr: int, size: int, owner: object, device_id: int = -1) -> None:
        self.ptr, self.size, self._owner, self.device_id = ptr, size, owner, device_id


class MemoryPointer:
    def __init__(self, mem: UnownedMemory, offset: int) -> None:
        self.mem, self.ptr = mem, mem.ptr + offset


class _Stream:
    def synchronize(self) -> None:
        pass


cuda = types.SimpleNamespace(runtime=runtime, Device=Device, UnownedMemory=UnownedMemory,
                             MemoryPointer=MemoryPointer,
                             Stream=types.SimpleNamespace(null=_Stream()))


class ndarray:
    """A numpy view over fake device memory, with the attributes the transport uses."""

    def __init__(self, shape, dtype, memptr: MemoryPointer) -> None:
        dtype = np.dtype(dtype)
        base, mm, size = _find(memptr.ptr) if memptr.ptr else (0, None, 0)
        n = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if memptr.ptr and memptr.ptr + n > base + size:
            raise RuntimeError("view past the end of the allocation")
        self.data, self.shape, self.dtype = memptr, tuple(shape), dtype
        self._a = (np.frombuffer(mm, dtype, n // dtype.itemsize, memptr.ptr - base)
                   .reshape(shape) if mm is not None else np.empty(shape, dtype))

    nbytes = property(lambda self: self._a.nbytes)

    @property
    def __cuda_array_interface__(self) -> dict:
        return {"shape": self.shape, "typestr": self.dtype.str, "version": 3,
                "data": (self.data.ptr, False), "strides": None}

    def get(self) -> np.ndarray:
        return np.array(self._a)

    def __mul__(self, k: object) -> ndarray:
        return _upload(self._a * k)


def _upload(a: np.ndarray) -> ndarray:
    a = np.ascontiguousarray(a)
    mm = mmap.mmap(-1, max(a.nbytes, 1))
    base = _map(mm, max(a.nbytes, 1), None)
    out = ndarray(a.shape, a.dtype, MemoryPointer(UnownedMemory(base, a.nbytes, None), 0))
    out._a[...] = a
    return out


def asarray(x: object) -> ndarray:
    if isinstance(x, ndarray):
        return x
    cai = getattr(x, "__cuda_array_interface__", None)
    if cai is not None:
        return ndarray(cai["shape"], cai["typestr"],
                       MemoryPointer(UnownedMemory(cai["data"][0], 0, x), 0))
    return _upload(np.asarray(x))


def ascontiguousarray(x: object, dtype: object = None) -> ndarray:
    x = asarray(x)
    if (dtype is None or np.dtype(dtype) == x.dtype) and x._a.flags.c_contiguous:
        return x
    return _upload(np.ascontiguousarray(x._a, dtype=dtype))


def asnumpy(x: object) -> np.ndarray:
    return asarray(x).get()


def arange(n: int, dtype: object = None) -> ndarray:
    return _upload(np.arange(n, dtype=dtype))
