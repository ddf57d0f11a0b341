"""ArrayRef: what a msgpack message carries in place of a bulky array, and its strict codec.

Wire form (a msgpack array, positional like the rest of the protocol):

    inline  [0, dtype, shape, bytes]                          the data itself (any host)
    shm     [1, dtype, shape, buffer, offset, generation]     a region of a host ring

`dtype` is a name from DTYPES (always little-endian), `shape` a list of ints, `buffer`
the ring's shared-memory name, `offset` the byte offset of the array in the ring's
payload, `generation` the region's generation (readers check it against the ring's
header). Decoding checks every field; anything else raises BadRef, a ProtocolError
(hence a ValueError). Nothing is ever unpickled.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

import numpy as np

from nvllm.common.errors import NvllmError, ProtocolError
from nvllm.common.utils import is_int

# Step plans use SHM refs (nvllm/common/plan_arrays.py); an empty array, a payload under
# the writer's min_shm_bytes, or inline_ref's result travels INLINE. (Kind 2, a CUDA IPC
# ring, is gone: no production caller; a ref of that kind is refused as unknown.)
INLINE, SHM = 0, 1
KIND_NAMES = {INLINE: "inline", SHM: "shm"}

# bfloat16 has no numpy dtype: send it as uint16 (torch: t.view(torch.uint16).numpy(),
# back with torch.from_numpy(a).view(torch.bfloat16)); the receiver knows the model dtype.
DTYPES: dict[str, np.dtype] = {
    n: np.dtype(n).newbyteorder("<")
    for n in ("bool", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64",
              "uint64", "float16", "float32", "float64")
}
_DTYPE_NAMES = {dt: n for n, dt in DTYPES.items()}

MAX_NDIM = 8
MAX_REF_BYTES = 1 << 40  # far above any real array; keeps shape products from overflowing
MAX_OFFSET = 1 << 48
MAX_GENERATION = (1 << 63) - 1
# Buffer names are made by ring writers only (see shm.new_buffer_name); a reader opens
# nothing else, so a forged ref cannot make it map an arbitrary /dev/shm segment.
BUFFER_NAME_RE = re.compile(r"nvllm-tr-[0-9]{1,10}-[0-9a-f]{12}")


class BadRef(ProtocolError):
    """An array reference that cannot be resolved: malformed, out of range, an unknown
    buffer, or a stale region (StaleRef). Raised by decoding and by ArrayReader."""


class StaleRef(BadRef):
    """The region a ref points at holds another generation: it was rewritten (or is being
    written) since the ref was made, so its bytes are not the ones the writer sent."""


class RingFull(NvllmError, TimeoutError):
    """The writer found no free region within its timeout: readers have not acknowledged
    enough generations. The message names the fix."""


def dtype_name(dtype: Any) -> str:
    """The wire name of a numpy dtype (any byte order); ValueError if not transportable."""
    if isinstance(dtype, str) and dtype in DTYPES:  # the hot path: names from a spec
        return dtype
    dt = np.dtype(dtype)
    name = _DTYPE_NAMES.get(dt.newbyteorder("<"))
    if name is None:
        raise ValueError(f"dtype {dt} cannot travel as an ArrayRef; supported: "
                         f"{', '.join(DTYPES)} (send bfloat16 as uint16)")
    return name


@dataclass(slots=True)
class ArrayRef:
    """A reference to one array: inline bytes, or a region of a shared ring. Treat as
    immutable (not frozen only because frozen dataclasses build several times slower)."""

    kind: int  # INLINE or SHM
    dtype: str
    shape: tuple[int, ...]
    buffer: str = ""
    offset: int = 0
    generation: int = 0  # 0 for inline refs: nothing to acknowledge
    data: bytes | None = None

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPES[self.dtype].itemsize

    def encode(self) -> list:
        """The msgpack-friendly list form (see the module docstring)."""
        if self.kind == INLINE:
            return [INLINE, self.dtype, list(self.shape), self.data]
        return [self.kind, self.dtype, list(self.shape), self.buffer, self.offset,
                self.generation]

    @staticmethod
    def decode(obj: Any) -> ArrayRef:
        """Check and build a ref from its list form; BadRef says what is wrong."""
        if isinstance(obj, ArrayRef):
            return obj
        if not isinstance(obj, (list, tuple)) or len(obj) < 3:
            raise BadRef(f"array ref: expected a list [kind, dtype, shape, ...], got "
                         f"{type(obj).__name__}")
        kind, dtype, shape = obj[0], obj[1], obj[2]
        if not is_int(kind) or kind not in KIND_NAMES:
            raise BadRef(f"array ref: unknown kind {kind!r}")
        if not isinstance(dtype, str) or dtype not in DTYPES:
            raise BadRef(f"array ref: unknown dtype {dtype!r}")
        if not isinstance(shape, (list, tuple)) or len(shape) > MAX_NDIM:
            raise BadRef(f"array ref: shape must be a list of at most {MAX_NDIM} "
                         f"non-negative ints, got {shape!r}")
        itemsize = DTYPES[dtype].itemsize
        # Multiply step by step against the cap: a forged shape cannot make a huge int.
        nbytes = itemsize
        for d in shape:
            if type(d) is not int or not 0 <= d <= MAX_REF_BYTES:  # exact type: no bools
                raise BadRef(f"array ref: shape must be a list of at most {MAX_NDIM} "
                             f"non-negative ints, got {shape!r}")
            nbytes *= d
            if nbytes > MAX_REF_BYTES:
                raise BadRef(f"array ref: shape {shape} is over {MAX_REF_BYTES} bytes")
        shape = tuple(shape)
        if kind == INLINE:
            if len(obj) != 4:
                raise BadRef(f"inline array ref: expected 4 fields, got {len(obj)}")
            data = obj[3]
            if not isinstance(data, bytes) or len(data) != nbytes:
                got = len(data) if isinstance(data, bytes) else type(data).__name__
                raise BadRef(f"inline array ref: expected {nbytes} bytes of data for "
                             f"{dtype}{list(shape)}, got {got}")
            return ArrayRef(INLINE, dtype, shape, data=data)
        if len(obj) != 6:
            raise BadRef(f"{KIND_NAMES[kind]} array ref: expected 6 fields, got {len(obj)}")
        buffer, offset, generation = obj[3], obj[4], obj[5]
        if not isinstance(buffer, str) or not BUFFER_NAME_RE.fullmatch(buffer):
            raise BadRef(f"array ref: {buffer!r} is not an nvllm transport buffer name")
        if not is_int(offset) or not 0 <= offset <= MAX_OFFSET or offset % itemsize:
            raise BadRef(f"array ref: offset {offset!r} is not a non-negative multiple of "
                         f"{itemsize} (the {dtype} item size)")
        if not is_int(generation) or not 1 <= generation <= MAX_GENERATION:
            raise BadRef(f"array ref: generation {generation!r} is not a positive int")
        return ArrayRef(kind, dtype, shape, buffer, offset, generation)


def inline_ref(array: Any) -> ArrayRef:
    """A self-contained ref holding a copy of the array's bytes (any host can read it).
    Accepts numpy arrays and anything np.asarray takes."""
    a = np.asarray(array)
    name = dtype_name(a.dtype)
    if a.dtype != DTYPES[name]:  # big-endian input: the wire is little-endian
        a = a.astype(DTYPES[name])
    return ArrayRef(INLINE, name, tuple(a.shape), data=np.ascontiguousarray(a).tobytes())

