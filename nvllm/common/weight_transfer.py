"""Weight updates on the wire: a trainer's HF-named tensors, cut into chunks of bounded
bytes, each chunk's tensors copied once into a shared-memory ring (nvllm/common/transport)
and named by ArrayRefs in one msgpack message (worker_protocol.WeightChunk). Nothing is
pickled; the receiver maps the ring read-only and copies out only its own shard.

Shared by the offline API (the leader writes the ring: ``LLM.update_weights``) and the
ZMQ clients (the trainer's process writes it and the leader forwards the refs). The sender
waits for every rank's acknowledgement of a chunk before its region is reused, so at most
one chunk (``chunk_bytes``, or one tensor larger than that) is in flight.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

# numpy and the transport are imported where a transfer runs: the HTTP gateway imports
# this module (through the client's RL calls) and never sends weights, and numpy is ~13
# MiB of its resident set.
if TYPE_CHECKING:
    import numpy as np

    from nvllm.common.transport import ArrayRef, ArrayWriter

DEFAULT_CHUNK_BYTES = 64 << 20
# Chunks that travel inline in client frames stay under the server's frame limit.
INLINE_CHUNK_BYTES = 16 << 20
# Boundaries a client message is held to (nvllm/common/client_decode.py checks them too).
MAX_WEIGHT_NAME_CHARS = 256
MAX_TENSORS_PER_CHUNK = 4096
MAX_CHUNK_BYTES = 1 << 32
# torch dtype name -> the ArrayRef dtype it travels as (no numpy bfloat16: its bits).
WIRE_DTYPES = {"float32": "float32", "float16": "float16", "bfloat16": "uint16"}
WEIGHT_VERSION_MAX_CHARS = 256

NamedTensors = Mapping[str, Any] | Iterable[tuple[str, Any]]
# (name, torch dtype name, the tensor's bytes as a numpy array of its wire dtype)
WireTensor = tuple[str, str, "np.ndarray"]


class WeightUpdateError(ValueError):
    """An update refused before anything changed: a bad name, shape or dtype, a quantized
    layer, a limit. The engine keeps serving its old weights."""


def same_host(endpoint: str) -> bool:
    """Whether a leader endpoint is on this host (its workers then map our segments)."""
    if endpoint.startswith("ipc://"):
        return True
    host = endpoint.split("://", 1)[-1].rsplit(":", 1)[0].strip("[]")
    return host in ("localhost", "::1") or host.startswith("127.")


def client_transfer(endpoint: str, shared_memory: bool | None, chunk_bytes: int
                    ) -> tuple[bool, int]:
    """A client's (shared memory?, chunk bytes): shared memory by default when the leader
    is on this host; inline chunks stay under the server's frame limit."""
    shm = same_host(endpoint) if shared_memory is None else shared_memory
    return shm, chunk_bytes if shm else min(chunk_bytes, INLINE_CHUNK_BYTES)


def check_weight_version(version: Any) -> int | str | None:
    """vLLM's ``weight_version``: an int or a short string (or None: count updates)."""
    if version is None or (isinstance(version, int) and not isinstance(version, bool)):
        return version
    if isinstance(version, str) and len(version) <= WEIGHT_VERSION_MAX_CHARS:
        return version
    raise WeightUpdateError(f"weight_version must be an int or a string of at most "
                            f"{WEIGHT_VERSION_MAX_CHARS} characters, got {version!r}")


def check_name(name: Any) -> str:
    if not isinstance(name, str) or not 0 < len(name) <= MAX_WEIGHT_NAME_CHARS:
        raise WeightUpdateError(f"a weight name must be a string of 1 to "
                                f"{MAX_WEIGHT_NAME_CHARS} characters, got {name!r:.80}")
    return name


def as_wire(name: str, tensor: Any) -> WireTensor:
    """A CPU torch tensor (or numpy array) as its wire form, without a copy when it is
    contiguous: the one copy is the ring write."""
    import numpy as np

    check_name(name)
    if hasattr(tensor, "detach"):  # torch, duck-typed: nvllm.common imports no torch
        t = tensor.detach()
        if t.device.type != "cpu":
            raise WeightUpdateError(f"{name}: a {t.device.type} tensor; update_weights takes "
                                    "CPU tensors here (move it with .cpu() first)")
        dtype = str(t.dtype).removeprefix("torch.")
        if dtype not in WIRE_DTYPES:
            raise WeightUpdateError(f"{name}: dtype {dtype} cannot be sent; use one of "
                                    f"{sorted(WIRE_DTYPES)}")
        t = t.contiguous()
        if dtype == "bfloat16":
            import torch

            t = t.view(torch.int16)
        return name, dtype, t.numpy().view(np.dtype(WIRE_DTYPES[dtype]).newbyteorder("<"))
    a = np.ascontiguousarray(tensor)
    dtype = a.dtype.name
    if dtype not in ("float32", "float16"):
        raise WeightUpdateError(f"{name}: numpy dtype {dtype} cannot be sent; use float32 or "
                                "float16 (or a torch bfloat16 tensor)")
    return name, dtype, a


def chunks(named_tensors: NamedTensors, chunk_bytes: int) -> Iterator[list[WireTensor]]:
    """Group tensors in order into chunks of at most `chunk_bytes` (a tensor larger than
    that travels alone); lazy, so a trainer may yield tensors as it gathers them."""
    if not 0 < chunk_bytes <= MAX_CHUNK_BYTES:
        raise WeightUpdateError(f"chunk_bytes must be in 1..{MAX_CHUNK_BYTES}, got "
                                f"{chunk_bytes}")
    items = named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors
    seen: set[str] = set()
    chunk: list[WireTensor] = []
    size = 0
    for name, tensor in items:
        w = as_wire(name, tensor)
        if name in seen:
            raise WeightUpdateError(f"{name} is given twice in one update")
        seen.add(name)
        if chunk and (size + w[2].nbytes > chunk_bytes or len(chunk) >= MAX_TENSORS_PER_CHUNK):
            yield chunk
            chunk, size = [], 0
        chunk.append(w)
        size += w[2].nbytes
    if chunk:
        yield chunk


def split_rows(chunk_list: Iterable[list[WireTensor]], chunk_bytes: int
               ) -> Iterator[tuple[list[WireTensor], list[int] | None]]:
    """Each chunk with its row range: a chunk of one tensor larger than `chunk_bytes` is
    cut into pieces of whole rows (along dim 0) of at most `chunk_bytes` each (one row
    at least), each with [first row, total rows], so no more than `chunk_bytes` is ever
    in flight; other chunks go as they are (None)."""
    for chunk in chunk_list:
        name, dtype, a = chunk[0]
        if len(chunk) > 1 or a.nbytes <= chunk_bytes or a.ndim == 0 or a.shape[0] < 2:
            yield chunk, None
            continue
        row_bytes = max(1, a.nbytes // a.shape[0])
        step = max(1, chunk_bytes // row_bytes)
        for first in range(0, a.shape[0], step):
            yield [(name, dtype, a[first:first + step])], [first, a.shape[0]]


SendChunk = Callable[[int, list[str], list[str], list[list], list[int] | None], None]


def push_weights(named_tensors: NamedTensors, send: SendChunk,
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES, shared_memory: bool = True
                 ) -> tuple[int, int]:
    """Write each chunk into a shared-memory ring and hand its (ordinal, names, dtypes,
    refs, row range) to `send`, which returns once every receiver is done with it (its
    region is then reused). A tensor larger than `chunk_bytes` goes in row ranges
    (split_rows). Without `shared_memory` (receivers on other hosts) the bytes travel
    inline in the message. Returns (tensors, bytes) sent; the ring is gone on return."""
    writer: ArrayWriter | None = None
    num = total = 0
    try:
        for k, (chunk, rows) in enumerate(split_rows(chunks(named_tensors, chunk_bytes),
                                                     chunk_bytes)):
            nbytes = sum(a.nbytes for _, _, a in chunk)
            if shared_memory and (writer is None or writer.capacity < nbytes + 64 * len(chunk)):
                if writer is not None:
                    writer.close()  # every region was acknowledged: nothing reads it
                writer = _ring(max(chunk_bytes, nbytes + 64 * len(chunk)))
            refs = _write(writer, chunk)
            send(k, [n for n, _, _ in chunk], [d for _, d, _ in chunk],
                 [r.encode() for r in refs], rows)
            if writer is not None:
                writer.reclaim_all()  # every rank answered: the region is free again
            num += len(chunk) if rows is None or rows[0] == 0 else 0
            total += nbytes
    finally:
        if writer is not None:
            writer.close()
    return num, total


def _ring(capacity: int) -> ArrayWriter:
    from nvllm.common.transport import ArrayWriter, TransportError

    slot = 64 << 10
    try:
        return ArrayWriter(capacity_bytes=-(-capacity // slot) * slot, slot_bytes=slot,
                           timeout_s=1.0)
    except TransportError as e:
        raise WeightUpdateError(f"no shared memory for a {capacity}-byte weight chunk ({e}): "
                                "lower chunk_bytes or free /dev/shm") from None


def _write(writer: ArrayWriter | None, chunk: list[WireTensor]) -> list[ArrayRef]:
    import numpy as np

    from nvllm.common.transport import inline_ref

    if writer is None:
        return [inline_ref(a) for _, _, a in chunk]
    res = writer.reserve([(a.shape, a.dtype) for _, _, a in chunk])
    try:
        for dst, (_, _, a) in zip(res.arrays, chunk):
            np.copyto(dst, a, casting="no")
        return res.commit()
    except BaseException:
        res.abort()
        raise
