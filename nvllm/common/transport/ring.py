"""The writer's ring of reusable regions (the reader is nvllm/common/transport/reader.py).

Segment layout (one POSIX shared-memory segment per writer, named ``nvllm-tr-PID-TOKEN``):

    [0, 64)       header: magic, layout version, payload kind (SHM), num_slots,
                  slot_bytes, table offset, data offset, payload bytes
    [64, 256)     unused (CUDA rings, since removed, kept their IPC handle here)
    [table, +8n)  the region table: one uint64 generation per slot (0 = being written)
    [data, ...)   the payload, num_slots * slot_bytes

A region is a run of consecutive slots holding the arrays of one reservation. The
writer hands regions out in ring order and reuses one only when every reader has
acknowledged its generation; a reader checks the table against a ref's generation, so
a region that was rewritten (or is being written) is refused, never read.
"""

from __future__ import annotations

import math
import mmap
import os
import struct
import threading
import time
import weakref
from collections.abc import Sequence
from typing import Any

import numpy as np

from nvllm.common.errors import NvllmError
from nvllm.common.shm_janitor import ensure_janitor
from nvllm.common.shm_segments import new_segment_name, unlink_segment
from nvllm.common.transport.refs import (
    DTYPES,
    INLINE,
    SHM,
    ArrayRef,
    RingFull,
    dtype_name,
    inline_ref,
)
from nvllm.common.utils import cdiv

try:  # the module SharedMemory itself uses; readers map segments read-only through it
    import _posixshmem
except ImportError:  # Windows: no POSIX shared memory; only inline refs work there
    _posixshmem = None

MAGIC, VERSION = b"NVLLMTR1", 1
_HDR = struct.Struct("<8s7Q")
HEADER_BYTES = 256
ALIGN = 64  # arrays in a region start on cache-line (and any dtype's) alignment


class TransportError(NvllmError, RuntimeError):
    """A writer cannot be set up here (no POSIX shared memory, no room in /dev/shm)."""


def new_buffer_name() -> str:
    """Unique per writer: nvllm/common/shm_segments.py's naming rule, kind "tr" (what the
    janitor and the sweep of dead owners' segments match)."""
    return new_segment_name("tr")


def _round_up(n: int, to: int) -> int:
    return cdiv(n, to) * to


class _Owned:
    """What the finalizer releases: the segment's name and mapping, and the views into it
    (dropped first, or closing the mapping raises BufferError). Kept apart from the
    writer so that weakref.finalize does not keep the writer alive."""

    __slots__ = ("name", "mm", "table", "data", "pid")

    def __init__(self, name: str, mm: mmap.mmap) -> None:
        self.name, self.mm, self.table, self.data = name, mm, None, None
        self.pid = os.getpid()


def _create_segment(name: str, size: int) -> mmap.mmap:
    """A new segment of `size` bytes, mapped: shm_open (never through SharedMemory, which
    would start multiprocessing's resource tracker: nvllm/common/shm_janitor.py says why),
    its tmpfs pages reserved now so that a full /dev/shm is an error here rather than a
    SIGBUS in the middle of a step."""
    fd = _posixshmem.shm_open("/" + name, os.O_CREAT | os.O_EXCL | os.O_RDWR, mode=0o600)
    try:
        os.ftruncate(fd, size)
        if hasattr(os, "posix_fallocate"):
            os.posix_fallocate(fd, 0, size)
        return mmap.mmap(fd, size)  # holds its own copy of the descriptor
    except BaseException:
        unlink_segment(name)
        raise
    finally:
        os.close(fd)


def _release(owned: _Owned) -> None:
    if os.getpid() != owned.pid:  # a forked child exiting: the ring is its parent's
        return
    owned.table = owned.data = None
    unlink_segment(owned.name)  # first: the name goes at once, the memory with the mapping
    try:
        owned.mm.close()
    except BufferError:
        pass  # a caller still holds arrays of a reservation: mapped until they die


class Reservation:
    """Arrays to fill in place, then `commit()` for their refs (or `abort()`).

    Writable numpy views into the ring (plain numpy arrays when the payload goes
    inline). Refs exist only after commit, and the arrays must not
    be touched after it: readers may be looking at them. Used as a context manager, a
    reservation left uncommitted is aborted.
    """

    __slots__ = ("writer", "arrays", "generation", "_layout", "_slots", "_base", "_done",
                 "__weakref__")

    def __init__(self, writer: ArrayWriter, arrays: list, layout: list,
                 slots: tuple[int, int] | None, generation: int, base: int) -> None:
        self.writer, self.arrays, self.generation = writer, arrays, generation
        self._layout, self._slots, self._base, self._done = layout, slots, base, False

    @property
    def inline(self) -> bool:
        return self._slots is None

    def commit(self) -> list[ArrayRef]:
        if self._done:
            raise RuntimeError("this reservation was already committed or aborted")
        self._done = True
        arrays, self.arrays = self.arrays, []
        if self._slots is None:
            return [inline_ref(a) for a in arrays]
        w = self.writer
        w._publish(self._slots, self.generation)
        name, base = w.name, self._base
        return [ArrayRef(SHM, dt, shape, name, base + off, self.generation) if n else
                ArrayRef(INLINE, dt, shape, data=b"")  # an empty array needs no region
                for shape, dt, off, n in self._layout]

    def abort(self) -> None:
        if not self._done:
            self._done = True
            self.arrays = []
            if self._slots is not None:
                self.writer._abort(self._slots)

    def __enter__(self) -> Reservation:
        return self

    def __exit__(self, *exc: object) -> None:
        self.abort()


class ArrayWriter:
    """Owns one ring in host shared memory; turns arrays into ArrayRefs. One producer
    thread; acks may come from any thread (a writer waiting for room wakes on them).
    Readers on other hosts get no refs from it: plans to them travel as lists, and a
    single array can go as ``inline_ref``.

    capacity_bytes / slot_bytes: the ring's size and its allocation unit; a payload
    takes whole slots. num_readers: how many readers must
    acknowledge a generation before its region is reused. timeout_s: how long a
    reservation waits for room before RingFull. min_shm_bytes: payloads smaller than
    this go inline (for tiny arrays a region and its ack cost more than the bytes).
    """

    def __init__(self, *, capacity_bytes: int = 16 << 20, slot_bytes: int = 64 << 10,
                 num_readers: int = 1, timeout_s: float = 1.0,
                 min_shm_bytes: int = 0) -> None:
        if num_readers < 1 or slot_bytes < ALIGN or slot_bytes % ALIGN:
            raise ValueError(f"need num_readers >= 1 and slot_bytes a multiple of {ALIGN}")
        self.num_readers, self.timeout_s, self.min_shm_bytes = num_readers, timeout_s, \
            min_shm_bytes
        self.slot_bytes = slot_bytes
        self.num_slots = max(1, capacity_bytes // slot_bytes)
        self.capacity = self.num_slots * slot_bytes
        self.name = ""
        self._cond = threading.Condition()
        self._acked = [0] * num_readers  # per reader: every generation <= this is done
        self._slot_gen = np.zeros(self.num_slots, np.int64)  # writer's copy of the table
        self._next_gen, self._committed, self._cursor = 1, 0, 0
        self._open: weakref.ref | None = None
        self._owned: _Owned | None = None
        self._closed = False
        self.num_shm = self.num_inline = 0  # reservations of each sort, for stats
        self._create()

    def _create(self) -> None:
        if _posixshmem is None:
            raise TransportError("shared-memory transport needs POSIX shared memory")
        table_end = HEADER_BYTES + 8 * self.num_slots
        data_off = _round_up(table_end, mmap.PAGESIZE)
        size = data_off + self.capacity
        self.name = new_buffer_name()
        ensure_janitor()  # removes the ring should this process be killed
        try:
            mm = _create_segment(self.name, size)
        except OSError as e:
            raise TransportError(f"cannot set up a {self.capacity}-byte transport ring in "
                                 f"/dev/shm ({e}): free space there or lower "
                                 "capacity_bytes") from None
        owned = self._owned = _Owned(self.name, mm)
        # From here the finalizer unlinks on close(), on garbage collection and at exit;
        # a killed process leaves it to its janitor.
        self._finalizer = weakref.finalize(self, _release, owned)
        try:
            _HDR.pack_into(mm, 0, MAGIC, VERSION, SHM, self.num_slots,
                           self.slot_bytes, HEADER_BYTES, data_off, self.capacity)
            # np.frombuffer, never np.ndarray(buffer=...): only frombuffer holds a buffer
            # export, so the mapping cannot be closed under a live view (close() raises
            # BufferError instead, and the views keep it mapped).
            owned.table = np.frombuffer(mm, np.uint64, self.num_slots, HEADER_BYTES)
            owned.data = np.frombuffer(mm, np.uint8, self.capacity, data_off)
        except BaseException:
            self.close()
            raise

    # ---- writing ----------------------------------------------------------------------

    def reserve(self, specs: Sequence[tuple[Sequence[int], Any]],
                timeout_s: float | None = None) -> Reservation:
        """Room for arrays of the given (shape, dtype)s in one region, under one
        generation. Waits up to timeout_s (default: the writer's) for readers to
        acknowledge older regions, then raises RingFull."""
        layout, total = [], 0
        for shape, dtype in specs:
            dt = dtype_name(dtype)
            shape = tuple(int(d) for d in shape)
            n = math.prod(shape) * DTYPES[dt].itemsize
            layout.append((shape, dt, total, n))
            total += _round_up(n, ALIGN)
        if self._closed:
            raise RuntimeError("this ArrayWriter is closed")
        if total == 0 or total < self.min_shm_bytes:
            self.num_inline += 1
            return Reservation(self, [np.empty(s, DTYPES[dt]) for s, dt, _, _ in layout],
                               layout, None, 0, 0)
        start, k, gen = self._alloc(total, timeout_s)
        base = start * self.slot_bytes
        arrays = [self._view(base + off, shape, dt) for shape, dt, off, _ in layout]
        res = Reservation(self, arrays, layout, (start, k), gen, base)
        self._open = weakref.ref(res)
        self.num_shm += 1
        return res

    def put_many(self, arrays: Sequence[Any], timeout_s: float | None = None
                 ) -> list[ArrayRef]:
        """Copy arrays into one region (or inline) and return their refs, in order.
        Accepts numpy arrays and anything np.asarray takes."""
        srcs = [np.asarray(a) for a in arrays]
        res = self.reserve([(a.shape, a.dtype) for a in srcs], timeout_s)
        if res.inline:  # straight to bytes, no staging copy
            res.abort()
            return [inline_ref(a) for a in srcs]
        try:
            for (_, _, _, n), dst, src in zip(res._layout, res.arrays, srcs):
                if n:
                    np.copyto(dst, src, casting="equiv")  # equiv: byte order may differ
        except BaseException:
            res.abort()
            raise
        return res.commit()

    def put(self, array: Any, timeout_s: float | None = None) -> ArrayRef:
        """One array in a region of its own. The engine's plans use reserve/commit
        (nvllm/common/plan_arrays.py); this general API, per-reader ``holders`` and
        ``ArrayReader.release`` are kept for bulky per-request payloads (e.g. compiled
        grammars for structured output), and are tested as such."""
        return self.put_many([array], timeout_s)[0]

    # ---- acknowledgements -------------------------------------------------------------

    def acked(self, reader: int, generation: int) -> None:
        """Reader `reader` (0..num_readers-1) is done with every generation up to
        `generation` (cumulative: repeats and reordering are harmless)."""
        if not 0 <= reader < self.num_readers:
            raise ValueError(f"reader {reader} out of range (num_readers={self.num_readers})")
        with self._cond:
            # Never past what was committed: a bogus ack must not free a region that is
            # still being written.
            g = min(int(generation), self._committed)
            if g > self._acked[reader]:
                self._acked[reader] = g
                self._cond.notify_all()

    def acked_all(self, generation: int) -> None:
        """Every reader is done up to `generation` (e.g. the result of a lockstep step)."""
        for r in range(self.num_readers):
            self.acked(r, generation)

    def reclaim_all(self) -> None:
        """The readers are gone (a replaced worker group): every region is free again."""
        self.acked_all(self._committed)

    def holders(self, generation: int) -> int:
        """How many readers have not yet acknowledged `generation`."""
        with self._cond:
            return sum(a < generation for a in self._acked)

    @property
    def last_generation(self) -> int:
        """The newest committed generation (0: none yet)."""
        return self._committed

    # ---- internals --------------------------------------------------------------------

    def _view(self, offset: int, shape: tuple[int, ...], dt: str) -> Any:
        n = math.prod(shape) * DTYPES[dt].itemsize
        return self._owned.data[offset:offset + n].view(DTYPES[dt]).reshape(shape)

    def _alloc(self, nbytes: int, timeout_s: float | None) -> tuple[int, int, int]:
        k = cdiv(nbytes, self.slot_bytes)
        if k > self.num_slots:
            raise ValueError(f"a payload of {nbytes} bytes is larger than the whole ring "
                             f"({self.capacity} bytes): raise capacity_bytes or send it "
                             "inline (inline_ref)")
        timeout = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout
        with self._cond:
            if self._open is not None and self._open() is not None and \
                    not self._open()._done:
                raise RuntimeError("one reservation at a time: commit or abort the open "
                                   "one first (acks are cumulative, so generations must be "
                                   "sent in the order they were reserved)")
            # A region never wraps: if it does not fit before the end, it starts at 0.
            start = self._cursor if self._cursor + k <= self.num_slots else 0
            while True:
                floor = min(self._acked)
                held = int(self._slot_gen[start:start + k].max())
                if held <= floor:
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    lagging = [r for r, a in enumerate(self._acked) if a < held]
                    raise RingFull(
                        f"transport ring {self.name}: no free region of {nbytes} bytes "
                        f"after {timeout:.2f} s: slots {start}..{start + k - 1} still hold "
                        f"generation {held}, and reader(s) {lagging} acknowledged only up "
                        f"to {[self._acked[r] for r in lagging]}. A region is reused only "
                        "once every reader acknowledged it: call ArrayWriter.acked(reader, "
                        "generation) (or acked_all) when the readers answer, e.g. on each "
                        f"step result; or raise capacity_bytes (now {self.capacity}); or "
                        "send this payload inline (inline_ref)")
                self._cond.wait(left)
            gen = self._next_gen
            self._next_gen += 1
            self._slot_gen[start:start + k] = gen
            # 0 = being written: a stale ref into these slots is refused from now on.
            self._owned.table[start:start + k] = 0
            self._cursor = (start + k) % self.num_slots
            return start, k, gen

    def _publish(self, slots: tuple[int, int], generation: int) -> None:
        start, k = slots
        with self._cond:
            self._owned.table[start:start + k] = generation
            self._committed = generation

    def _abort(self, slots: tuple[int, int]) -> None:
        start, k = slots
        with self._cond:
            self._slot_gen[start:start + k] = 0  # free again; the table keeps 0
            self._cond.notify_all()

    # ---- lifetime -----------------------------------------------------------------------

    def close(self) -> None:
        """Unlink the segment. Readers' existing mappings stay
        valid until they drop them; new refs to this ring no longer resolve."""
        self._closed = True
        fin = getattr(self, "_finalizer", None)
        if fin is not None:
            fin()

    def __enter__(self) -> ArrayWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"ArrayWriter(name={self.name!r}, slots={self.num_slots}x"
                f"{self.slot_bytes}, readers={self.num_readers}, acked={self._acked})")


# ---- reading ------------------------------------------------------------------------------
