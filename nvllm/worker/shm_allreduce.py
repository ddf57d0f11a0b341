"""All-reduce (and broadcast, gather) through shared memory for the tensor-parallel ranks
of one host (CPU), instead of gloo's loopback TCP: a 576-float all-reduce between two
processes takes about a millisecond through gloo, a few microseconds here.

The leader names the segment (nvllm/common/shm_segments.py) and passes the name in the
worker spec; rank 0 creates it, every rank maps it, and rank 0 unlinks it as soon as all
have (``attach``, a collective on the gloo group): from then on nothing is left in
/dev/shm whatever happens to the processes (the leader unlinks the name again when its
group stops, for a rank 0 killed in between). A rank that cannot map it (another host, no
POSIX shared memory, not x86) makes every rank keep gloo.

Segment layout::

    [0, 128)        header: magic, version, world, depth, slot_bytes, ctrl offset, data
                    offset, a 16-byte nonce (a rank checks it is rank 0's segment)
    [128, +16w)     each rank's pid and process start time (peer liveness)
    [ctrl, +128w)   per rank, each on a cache line of its own: ``published`` (the last
                    round whose input it wrote) and, 64 bytes on, ``consumed`` (the last
                    round it finished reading)
    [data, ...)     depth x world slots of slot_bytes: round r uses buffer r % depth

Every rank issues the same collectives in the same order (the plan is the same on all
ranks, so are the shapes), so a call's round number is the same on every rank. A round:
wait until every rank consumed round r - depth (so this buffer is free: nobody reads it
any more), copy the input into the own slot, publish r; wait until every rank published
r, sum the slots in rank order (every rank computes bit-identical results), mark r
consumed. x86's total store order keeps the data stores before the counter store and the
counter load before the data loads; other architectures keep gloo. ``start`` and
``finish`` are the two halves, so a micro-batch's all-reduce can be started, the other
micro-batch computed, and the first finished (TPContext.run): up to ``depth`` rounds in
flight, finished in the order started.

Waiting: the ranks usually share the cores with the leader and each other, so a waiter
spins only briefly, then yields the core, then sleeps; it checks the peers' pids every
0.1 s (a dead peer is an error at once, as gloo's closed socket is) and gives up after
the collective timeout (``step_timeout_s``), as gloo does.
"""

from __future__ import annotations

import logging
import mmap
import os
import platform
import secrets
import struct
import time
from collections import deque
from collections.abc import Callable

import numpy as np
import torch

from nvllm.common.shm_segments import NAME_RE, _posixshmem, unlink_segment

logger = logging.getLogger(__name__)

MAGIC, VERSION = b"NVLLMAR1", 1
_HDR = struct.Struct("<8s6Q16s")
PID_OFFSET = 128
LINE = 64  # a cache line: each rank's counters sit on lines of their own
DEPTH = 2  # buffers: rounds that may be in flight (TPContext.run starts two)
# The largest tensor a call takes (per rank; larger ones use gloo): 4 MiB, less beyond 4
# ranks so that the segment stays within 32 MiB of /dev/shm.
MAX_SLOT_BYTES, MAX_SEGMENT_BYTES = 4 << 20, 32 << 20
# Waiting (measured on a 2-core VM with the leader and two ranks, docs/benchmarks.md).
SPIN_S = 20e-6  # busy-poll this long first
YIELD_S = 200e-6  # then os.sched_yield() until this long
SLEEP_S = 20e-6  # then sleep this long between polls
CHECK_S = 0.1  # how often a long wait checks the deadline and the peers' pids
DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int32)


def wait_phases() -> tuple[float, float, float]:
    """(spin, yield, sleep) seconds: the defaults, or $NVLLM_SHM_WAIT_US ("spin,yield,
    sleep" in microseconds; for measuring, scripts/bench_allreduce.py)."""
    env = os.environ.get("NVLLM_SHM_WAIT_US")
    if not env:
        return SPIN_S, YIELD_S, SLEEP_S
    spin, yld, sleep = (float(v) * 1e-6 for v in env.split(","))
    return spin, yld, sleep


class ShmAllReduceError(RuntimeError):
    """A peer died or did not arrive within the timeout."""


def supported_here() -> bool:
    """x86 (total store order: see the module doc) with POSIX shared memory."""
    return _posixshmem is not None and platform.machine().lower() in (
        "x86_64", "amd64", "i386", "i686")


def slot_bytes_for(world: int, depth: int = DEPTH) -> int:
    return min(MAX_SLOT_BYTES, MAX_SEGMENT_BYTES // (depth * world) // LINE * LINE)


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


def _layout(world: int, depth: int, slot_bytes: int) -> tuple[int, int, int]:
    """(ctrl offset, data offset, total size)."""
    ctrl = _round_up(PID_OFFSET + 16 * world, 2 * LINE)
    data = _round_up(ctrl + 2 * LINE * world, mmap.PAGESIZE)
    return ctrl, data, data + depth * world * slot_bytes


def _start_time(pid: int) -> int | None:
    """The process's start time (clock ticks since boot), None if there is no such live
    process (or no /proc)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError, IndexError, OSError):
        return None
    if fields[0] in (b"Z", b"X"):  # dead, not yet reaped
        return None
    return int(fields[19])


class ShmAllReduce:
    """One rank's view of the segment (made by ``attach``)."""

    def __init__(self, mm: mmap.mmap, rank: int, world: int, depth: int, slot_bytes: int,
                 timeout_s: float) -> None:
        self.rank, self.world, self.depth, self.slot_bytes = rank, world, depth, slot_bytes
        self.timeout_s = timeout_s
        self.spin_s, self.yield_s, self.sleep_s = wait_phases()
        ctrl, data, size = _layout(world, depth, slot_bytes)
        self._mm = mm
        self._pids = np.frombuffer(mm, np.uint64, 2 * world, PID_OFFSET).reshape(world, 2)
        # The counters through a memoryview: indexing it is a plain 8-byte load or store
        # and gives a Python int, several times cheaper than numpy's scalars.
        self._words = memoryview(mm).cast("B").cast("Q")
        per_rank = 2 * LINE // 8
        self._pub = [ctrl // 8 + q * per_rank for q in range(world)]  # word indices
        self._con = [i + LINE // 8 for i in self._pub]
        self._data = torch.frombuffer(mm, dtype=torch.uint8, count=size - data, offset=data)
        # (dtype, numel) -> per buffer, every rank's slot as a tensor of that shape
        self._views: dict[tuple[torch.dtype, int], list[list[torch.Tensor]]] = {}
        self._round = self._words[self._pub[rank]]
        self._pending: deque[int] = deque()
        self._peers: list[tuple[int, int, int]] = []  # (rank, pid, start time)
        self.rounds = 0  # calls served, for stats and tests

    # ---- setup ------------------------------------------------------------------------

    def _register(self) -> None:
        pid = os.getpid()
        self._pids[self.rank] = (pid, _start_time(pid) or 0)

    def _watch_peers(self) -> None:
        """After every rank registered: watch the peers' pids, if this rank sees them
        (ranks in different pid namespaces do not: then only the timeout applies)."""
        peers = [(q, int(p), int(s)) for q, (p, s) in enumerate(self._pids) if q != self.rank]
        if all(s and _start_time(p) == s for _, p, s in peers):
            self._peers = peers
        else:
            logger.info("rank %d: peers' pids not visible here; the shared-memory "
                        "all-reduce relies on its timeout alone", self.rank)

    def close(self) -> None:
        self._views.clear()
        self._data = self._pids = None
        self._words.release()
        try:
            self._mm.close()
        except BufferError:  # a caller still holds a view; it goes when they do
            pass

    # ---- what fits --------------------------------------------------------------------

    def fits(self, x: torch.Tensor) -> bool:
        return (x.device.type == "cpu" and x.dtype in DTYPES and x.is_contiguous()
                and x.numel() * x.element_size() <= self.slot_bytes)

    def _slots(self, buf: int, dtype: torch.dtype, numel: int) -> list[torch.Tensor]:
        """Every rank's slot in buffer `buf`, as flat tensors of numel `dtype`s."""
        views = self._views.get((dtype, numel))
        if views is None:
            if len(self._views) > 256:  # shapes come from a few dozen step sizes
                self._views.clear()
            n, nbytes = self.slot_bytes, numel * dtype.itemsize
            views = self._views[(dtype, numel)] = [
                [self._data[(b * self.world + q) * n:(b * self.world + q) * n + nbytes]
                 .view(dtype) for q in range(self.world)] for b in range(self.depth)]
        return views[buf]

    # ---- rounds ------------------------------------------------------------------------

    def start(self, x: torch.Tensor | None) -> int:
        """Begin the next round: wait for its buffer, write x (flat, contiguous; None: a
        broadcast's receiver writes nothing) into this rank's slot, publish. Returns the
        round, to pass to ``finish``."""
        if len(self._pending) >= self.depth:
            raise RuntimeError(f"more than {self.depth} shared-memory rounds in flight")
        r = self._round + 1
        if r > self.depth:
            self._wait(self._con, r - self.depth, "to free a buffer")
        if x is not None:
            self._slots(r % self.depth, x.dtype, x.numel())[self.rank].copy_(x)
        self._words[self._pub[self.rank]] = r  # after the data: x86 keeps store order
        self._round = r
        self._pending.append(r)
        return r

    def _done(self, r: int) -> None:
        if not self._pending or self._pending[0] != r:
            raise RuntimeError(f"shared-memory rounds must finish in the order they "
                               f"started: {r} finished, {list(self._pending)} open")
        self._pending.popleft()
        self._words[self._con[self.rank]] = r
        self.rounds += 1

    def finish(self, r: int, x: torch.Tensor) -> torch.Tensor:
        """End all-reduce round r: x (the flat tensor passed to ``start``) becomes the sum
        of every rank's input, added in rank order."""
        self._wait(self._pub, r, "to publish its input")
        slots = self._slots(r % self.depth, x.dtype, x.numel())
        torch.add(slots[0], slots[1], out=x)
        for s in slots[2:]:
            x.add_(s)
        self._done(r)
        return x

    # ---- collectives ---------------------------------------------------------------------

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum x over the ranks, in place (x: ``fits``)."""
        flat = x.view(-1)
        self.finish(self.start(flat), flat)
        return x

    def broadcast(self, x: torch.Tensor, root: int = 0) -> torch.Tensor:
        """Overwrite x on every rank with rank root's x, in place."""
        flat = x.view(-1)
        r = self.start(flat if self.rank == root else None)
        if self.rank != root:
            self._wait(self._pub[root:root + 1], r, "to publish its input")
            flat.copy_(self._slots(r % self.depth, x.dtype, flat.numel())[root])
        self._done(r)
        return x

    def gather(self, x: torch.Tensor, combine: Callable[[list[torch.Tensor]], torch.Tensor]
               ) -> torch.Tensor | None:
        """On rank 0, combine(every rank's x, in rank order: views into the segment, valid
        only during the call); None on the others."""
        r = self.start(x.view(-1))
        out = None
        if self.rank == 0:
            self._wait(self._pub, r, "to publish its input")
            out = combine([s.view(x.shape) for s in
                           self._slots(r % self.depth, x.dtype, x.numel())])
        self._done(r)
        return out

    # ---- waiting -------------------------------------------------------------------------

    def _arrived(self, counters: list[int], target: int) -> bool:
        words = self._words
        for i in counters:
            if words[i] < target:
                return False
        return True

    def _wait(self, counters: list[int], target: int, what: str) -> None:
        """Until every counter (word indices) >= target."""
        if self._arrived(counters, target):
            return
        t0 = now = time.perf_counter()
        spin_end, yield_end = t0 + self.spin_s, t0 + self.yield_s
        next_check = t0 + CHECK_S
        while not self._arrived(counters, target):
            now = time.perf_counter()
            if now < spin_end:
                continue
            if now < yield_end:
                os.sched_yield()
            else:
                time.sleep(self.sleep_s)
            if now >= next_check:
                next_check = now + CHECK_S
                self._check(counters, target, what, now - t0)

    def _check(self, counters: list[int], target: int, what: str, waited: float) -> None:
        late = [self._pub.index(i) if i in self._pub else self._con.index(i)
                for i in counters if self._words[i] < target]
        for q, pid, start in self._peers:
            if q in late and _start_time(pid) != start:
                raise ShmAllReduceError(
                    f"rank {self.rank}: tensor-parallel rank {q} (pid {pid}) died while "
                    f"this rank waited for it {what} (shared-memory round {target})")
        if waited > self.timeout_s:
            raise ShmAllReduceError(
                f"rank {self.rank}: waited {waited:.0f} s for rank(s) {late} {what} "
                f"(shared-memory round {target}); the collective timeout is "
                f"{self.timeout_s:.0f} s (step_timeout_s)")


def _create(name: str, size: int) -> mmap.mmap:
    fd = _posixshmem.shm_open("/" + name, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, size)
        if hasattr(os, "posix_fallocate"):
            # tmpfs pages are taken on first touch: reserve them now, so a full /dev/shm
            # is gloo from the start rather than a SIGBUS in the middle of a step.
            os.posix_fallocate(fd, 0, size)
        return mmap.mmap(fd, size)
    finally:
        os.close(fd)


def _open(name: str, size: int) -> mmap.mmap:
    fd = _posixshmem.shm_open("/" + name, os.O_RDWR, 0)
    try:
        if os.fstat(fd).st_size != size:
            raise OSError(f"segment {name} has the wrong size")
        return mmap.mmap(fd, size)
    finally:
        os.close(fd)


def attach(name: str, rank: int, world: int, group, timeout_s: float,
           slot_bytes: int | None = None, depth: int = DEPTH) -> ShmAllReduce | None:
    """Collective over `group` (gloo; every rank calls it with the same arguments but
    rank): map segment `name` on every rank, or on none (returns None: keep gloo). The
    segment is unlinked before this returns."""
    import torch.distributed as dist

    if not NAME_RE.fullmatch(name):
        raise ValueError(f"not an nvllm segment name: {name!r}")
    slot_bytes = slot_bytes or slot_bytes_for(world, depth)
    _, _, size = _layout(world, depth, slot_bytes)
    mm, why = None, ""
    nonce = secrets.token_bytes(16)
    if not supported_here():
        why = f"needs x86 and POSIX shared memory (this is {platform.machine()})"
    elif rank == 0:
        try:
            mm = _create(name, size)
            ctrl, data, _ = _layout(world, depth, slot_bytes)
            _HDR.pack_into(mm, 0, MAGIC, VERSION, world, depth, slot_bytes, ctrl, data, nonce)
        except OSError as e:
            why = f"cannot create {size} bytes of shared memory {name!r} ({e})"
    box = [nonce if mm is not None else None]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
    if rank != 0 and not why:
        ctrl, data, _ = _layout(world, depth, slot_bytes)
        want = (MAGIC, VERSION, world, depth, slot_bytes, ctrl, data, box[0])
        try:
            if box[0] is None:
                raise OSError("rank 0 could not create it")
            mm = _open(name, size)
            if _HDR.unpack_from(mm, 0) != want:
                raise OSError("not rank 0's segment (another host?)")
        except OSError as e:
            why = f"cannot map shared memory {name!r} ({e})"
            if mm is not None:
                mm.close()
                mm = None
    ar = None
    if mm is not None:
        ar = ShmAllReduce(mm, rank, world, depth, slot_bytes, timeout_s)
        ar._register()
    flag = torch.tensor([1 if ar is not None else 0], dtype=torch.int32)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)  # and a barrier: all mapped
    if rank == 0:
        unlink_segment(name)
    dist.barrier(group=group)  # so that it is gone before any rank returns
    if why:
        logger.warning("rank %d: tensor-parallel collectives stay on gloo: %s", rank, why)
    if not int(flag):
        if ar is not None:
            ar.close()
        return None
    ar._watch_peers()
    logger.info("rank %d: collectives of up to %d bytes through shared memory (%d ranks, "
                "%d buffers)", rank, slot_bytes, world, depth)
    return ar
