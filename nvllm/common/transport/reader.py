"""The reader's side of a transport ring: map a writer's segment read-only and resolve
ArrayRefs into it, refusing any region whose generation is not the ref's. The segment
layout is described in nvllm/common/transport/ring.py, which writes it."""

from __future__ import annotations

import math
import mmap
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from nvllm.common.transport.refs import (
    DTYPES,
    INLINE,
    SHM,
    ArrayRef,
    BadRef,
    StaleRef,
)
from nvllm.common.transport.ring import (
    _HDR,
    HEADER_BYTES,
    MAGIC,
    VERSION,
    _posixshmem,
)


class _Segment:
    """A reader's read-only mapping of one ring."""

    __slots__ = ("name", "mm", "table", "num_slots", "slot_bytes", "data_offset",
                 "payload_bytes")

    def __init__(self, name: str) -> None:
        if _posixshmem is None:
            raise BadRef("shared-memory refs need POSIX shared memory on the reader")
        try:
            fd = _posixshmem.shm_open("/" + name, os.O_RDONLY, 0)
        except FileNotFoundError:
            raise BadRef(f"unknown buffer {name!r}: no shared-memory segment of that name "
                         "on this host (its writer closed it, or this reader runs on "
                         "another host: readers elsewhere need inline refs)") from None
        except OSError as e:
            raise BadRef(f"cannot open buffer {name!r}: {e}") from None
        # Mapped read-only and never through SharedMemory: no resource_tracker sees it
        # (a tracker unlinks what it saw at exit, and unregistering from a tracker shared
        # with the owner would drop the owner's entry), and a reader cannot scribble on
        # the writer's ring.
        try:
            size = os.fstat(fd).st_size
            if size < HEADER_BYTES:
                raise BadRef(f"buffer {name!r} is not an nvllm transport ring")
            self.mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        magic, version, kind, n, slot_bytes, table_off, data_off, payload = \
            _HDR.unpack_from(self.mm, 0)
        table_end = table_off + 8 * n
        ok = (magic == MAGIC and version == VERSION and kind == SHM and n >= 1
              and slot_bytes >= 1 and payload == n * slot_bytes and table_off >= HEADER_BYTES
              and table_off % 8 == 0 and table_end <= size
              and data_off >= table_end and data_off + payload <= size)
        if not ok:
            raise BadRef(f"buffer {name!r} is not an nvllm transport ring of version "
                         f"{VERSION} (bad header)")
        self.name, self.num_slots, self.slot_bytes = name, n, slot_bytes
        self.data_offset, self.payload_bytes = data_off, payload
        self.table = np.frombuffer(self.mm, np.uint64, n, table_off)

    def close(self) -> None:
        self.table = None
        try:
            self.mm.close()
        except BufferError:
            pass  # arrays handed out still map it; it goes when they do


class ArrayReader:
    """Resolves ArrayRefs to arrays: numpy views (read-only, zero-copy) of inline bytes
    or of a region of a writer's ring. Attaches to rings lazily by name and caches
    the mappings (at most max_buffers; the oldest is dropped beyond that).

    A view is valid until this reader releases its generation: copy what must outlive
    the step (np.array(view), torch.tensor(view)), or keep the generation unreleased.
    """

    def __init__(self, max_buffers: int = 16) -> None:
        self.max_buffers = max_buffers
        self._segments: dict[str, _Segment] = {}
        self._released = 0

    def get(self, ref: ArrayRef | list) -> Any:
        """The array a ref (or its list form) points at; BadRef/StaleRef if it cannot be
        resolved or the region holds another generation."""
        ref = ArrayRef.decode(ref)
        dt = DTYPES[ref.dtype]
        if ref.kind == INLINE:
            return np.frombuffer(ref.data, dt).reshape(ref.shape)
        seg = self._verify(ref)
        return np.frombuffer(seg.mm, dt, math.prod(ref.shape),
                             seg.data_offset + ref.offset).reshape(ref.shape)

    def get_many(self, refs: Sequence[ArrayRef | list]) -> list:
        return [self.get(r) for r in refs]

    def check(self, ref: ArrayRef | list) -> None:
        """Raise StaleRef if the ref's region no longer holds its generation (call after
        using a view to prove it was not rewritten meanwhile)."""
        ref = ArrayRef.decode(ref)
        if ref.kind != INLINE:
            self._verify(ref)

    def release(self, generation: int) -> int:
        """Record that this reader is done with every generation up to `generation`;
        returns the cumulative value to send back for the writer's `acked`."""
        if isinstance(generation, int) and generation > self._released:
            self._released = generation
        return self._released

    @property
    def released(self) -> int:
        return self._released

    def _segment(self, name: str) -> _Segment:
        seg = self._segments.get(name)
        if seg is None:
            seg = _Segment(name)
            if len(self._segments) >= self.max_buffers:
                self._segments.pop(next(iter(self._segments))).close()
            self._segments[name] = seg
        return seg

    def _verify(self, ref: ArrayRef) -> _Segment:
        seg = self._segment(ref.buffer)
        nbytes = ref.nbytes
        end = ref.offset + nbytes
        if end > seg.payload_bytes or (nbytes == 0 and ref.offset >= seg.payload_bytes):
            raise BadRef(f"array ref: bytes [{ref.offset}, {end}) are outside buffer "
                         f"{ref.buffer!r} ({seg.payload_bytes} bytes)")
        first = ref.offset // seg.slot_bytes
        last = (end - 1) // seg.slot_bytes if nbytes else first
        table = seg.table
        # One slot is the common case: a scalar read beats a numpy reduction.
        if (int(table[first]) != ref.generation if first == last
                else (table[first:last + 1] != ref.generation).any()):
            found = sorted({int(g) for g in table[first:last + 1]})
            raise StaleRef(f"buffer {ref.buffer!r} slots {first}..{last} hold generation(s) "
                           f"{found} (0 = being written), the ref says {ref.generation}: the "
                           "region was rewritten since the ref was made (an acknowledgement "
                           "for it reached the writer before this read, or the ref is old)")
        return seg

    def close(self) -> None:
        """Drop every mapping (views still alive keep theirs until they die)."""
        segs, self._segments = self._segments, {}
        for seg in segs.values():
            seg.close()

    def __enter__(self) -> ArrayReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
