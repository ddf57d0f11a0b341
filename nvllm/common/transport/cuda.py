"""The GPU side of the transport: a ring's payload in device memory, shared by CUDA IPC.

CuPy is imported only here and only when a CUDA ring is made or read (any flavour:
cupy-cuda12x, cupy-cuda13x, ...). The ring's region table stays in host shared memory
(ring.py), so a reader checks generations without touching the GPU; the payload is one
raw cudaMalloc whose IPC handle and GPU (by PCI bus id, which unlike an ordinal does not
depend on CUDA_VISIBLE_DEVICES) are written in the ring's header.

Ordering: the writer copies on the legacy default stream (ordered after the work torch
queued on its default stream) and synchronizes the device before a reservation's refs
exist, so a reader that got a ref sees the finished bytes. CUDA IPC cannot open a
handle in the process that made it; a reader in the writer's own process uses the
writer's allocation directly.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from nvllm.common.transport.refs import BadRef

_OWNED: dict[str, CudaPayload] = {}  # buffer name -> this process's payload


def import_cupy() -> Any:
    try:
        import cupy
    except Exception as e:  # ImportError, or a CUDA flavour that does not fit the driver
        from nvllm.common.transport.ring import TransportError

        raise TransportError(f"CUDA transport needs CuPy matching the CUDA runtime (pip "
                             f"install cupy-cuda12x or cupy-cuda13x): {e}") from None
    return cupy


class CudaPayload:
    """A writer's device memory: one raw cudaMalloc, never CuPy's memory pool (an IPC
    handle names a whole allocation; a pool block sits at an unknown offset in one)."""

    def __init__(self, name: str, nbytes: int, device: int | None) -> None:
        cp = import_cupy()
        rt = cp.cuda.runtime
        self.cp, self.rt, self.name, self.nbytes = cp, rt, name, nbytes
        self.device = rt.getDevice() if device is None else int(device)
        self.ptr = 0
        with cp.cuda.Device(self.device):
            self.ptr = rt.malloc(nbytes)
            try:
                self.handle: bytes = rt.ipcGetMemHandle(self.ptr)
                self.pci_bus_id: str = rt.deviceGetPCIBusId(self.device)
            except BaseException:
                rt.free(self.ptr)
                self.ptr = 0
                raise
        _OWNED[name] = self

    def view(self, offset: int, shape: tuple[int, ...], dtype: np.dtype) -> Any:
        # A memory object per view, owned by self: no reference cycle, so the payload
        # outlives every view it handed out.
        mem = self.cp.cuda.UnownedMemory(self.ptr, self.nbytes, self, self.device)
        return self.cp.ndarray(shape, dtype, self.cp.cuda.MemoryPointer(mem, offset))

    def copy_in(self, offset: int, src: Any, dtype: np.dtype) -> None:
        """Copy a host (numpy) or device (__cuda_array_interface__) array to offset."""
        with self.cp.cuda.Device(self.device):
            if isinstance(src, np.ndarray):
                src = np.ascontiguousarray(src, dtype=dtype)
                ptr = src.ctypes.data
            else:
                src = self.cp.ascontiguousarray(self.cp.asarray(src), dtype=dtype)
                ptr = src.data.ptr
            if offset + src.nbytes > self.nbytes:
                raise ValueError("copy past the end of the CUDA payload")
            # memcpyDefault: the pointer says host or device (unified addressing). On the
            # legacy default stream, so it is ordered after torch's default-stream work.
            self.rt.memcpyAsync(self.ptr + offset, ptr, src.nbytes, self.rt.memcpyDefault, 0)
            if isinstance(src, np.ndarray):
                # From pinned memory the copy runs on after the call returns, and `src`
                # may be a temporary that dies with this frame: wait for it now.
                self.cp.cuda.Stream.null.synchronize()

    def sync(self) -> None:
        with self.cp.cuda.Device(self.device):
            self.rt.deviceSynchronize()

    def free(self) -> None:
        _OWNED.pop(self.name, None)
        if self.ptr:
            with self.cp.cuda.Device(self.device):
                self.rt.free(self.ptr)
            self.ptr = 0


class CudaImport:
    """A reader's mapping of another process's payload; closed when the reader's cache
    and every view it handed out have dropped it."""

    def __init__(self, name: str, handle: bytes, pci_bus_id: str, nbytes: int) -> None:
        try:
            cp = import_cupy()
        except Exception as e:
            raise BadRef(f"buffer {name!r} is a CUDA ring, and {e}") from None
        rt = cp.cuda.runtime
        self.cp, self.rt, self.nbytes, self.ptr, self._opened = cp, rt, nbytes, 0, False
        owned = _OWNED.get(name)
        if owned is not None:  # our own writer's: IPC refuses to open it in this process
            self.ptr, self.device, self._owner = owned.ptr, owned.device, owned
            return
        try:
            self.device = rt.deviceGetByPCIBusId(pci_bus_id)
        except Exception as e:
            raise BadRef(f"buffer {name!r} lives on GPU {pci_bus_id}, which this process "
                         f"cannot see (CUDA_VISIBLE_DEVICES?): {e}") from None
        try:
            with cp.cuda.Device(self.device):
                self.ptr = rt.ipcOpenMemHandle(handle)
        except Exception as e:
            raise BadRef(f"cannot open the CUDA IPC handle of buffer {name!r}: {e}") from None
        self._opened = True

    def view(self, offset: int, shape: tuple[int, ...], dtype: np.dtype) -> Any:
        mem = self.cp.cuda.UnownedMemory(self.ptr, self.nbytes, self, self.device)
        return self.cp.ndarray(shape, dtype, self.cp.cuda.MemoryPointer(mem, offset))

    def __del__(self) -> None:
        if self._opened and self.ptr:
            try:
                with self.cp.cuda.Device(self.device):
                    self.rt.ipcCloseMemHandle(self.ptr)
            except Exception:  # interpreter teardown: the driver cleans up with the process
                pass
            self.ptr = 0
