"""Zero-copy array transport: round trips (in process, and to a real subprocess reader),
generation checks, the ring never handing out a held region, inline fallback, malformed
refs, /dev/shm hygiene, and the self-test entry point."""

from __future__ import annotations

import gc
import hashlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from multiprocessing.shared_memory import SharedMemory
from pathlib import Path

import msgpack
import numpy as np
import pytest
import torch

from nvllm.common.errors import ProtocolError
from nvllm.common.transport import (
    INLINE,
    SHM,
    ArrayReader,
    ArrayRef,
    ArrayWriter,
    BadRef,
    RingFull,
    StaleRef,
    inline_ref,
    new_buffer_name,
)
from nvllm.common.transport.ring import _release

REPO = Path(__file__).resolve().parents[2]
SHM_DIR = Path("/dev/shm")
pytestmark = pytest.mark.skipif(not SHM_DIR.is_dir(), reason="needs /dev/shm")


def _env() -> dict:
    return dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]))


def _digest(a: np.ndarray) -> list:
    return [a.dtype.str, list(a.shape), hashlib.sha256(np.ascontiguousarray(a).tobytes())
            .hexdigest()]


@pytest.fixture
def writer():
    w = ArrayWriter(capacity_bytes=1 << 20, slot_bytes=64 << 10, timeout_s=0.2)
    yield w
    w.close()
    assert not (SHM_DIR / w.name).exists()


@pytest.fixture
def reader():
    r = ArrayReader()
    yield r
    r.close()


def _bf16_bits(shape) -> tuple[torch.Tensor, np.ndarray]:
    t = torch.randn(shape, dtype=torch.float32).to(torch.bfloat16)
    return t, t.view(torch.uint16).numpy()


SHAPES = [(), (1,), (1000,), (17, 33), (2, 3, 4, 5), (0,), (3, 0)]
DTYPES = ["int32", "int64", "float32", "bfloat16"]


def _array(dtype: str, shape, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if dtype == "bfloat16":
        return _bf16_bits(shape)[1]
    if dtype == "float32":
        return rng.standard_normal(shape).astype(np.float32)
    info = np.iinfo(dtype)
    return rng.integers(info.min, info.max, shape, dtype=dtype, endpoint=True)


# ---- round trips ----------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_round_trip_in_process(writer, reader, dtype, shape):
    a = _array(dtype, shape)
    ref = writer.put(a)
    assert ref.kind == (SHM if a.nbytes else INLINE)  # nothing to share for an empty array
    wire = msgpack.unpackb(msgpack.packb(ref.encode(), use_bin_type=True), raw=False)
    b = reader.get(wire)
    assert b.dtype == a.dtype and b.shape == a.shape and np.array_equal(b, a)
    assert not b.flags.writeable  # readers map the ring read-only
    reader.check(wire)


def test_bfloat16_survives_as_uint16(writer, reader):
    t, bits = _bf16_bits((64, 48))
    back = torch.from_numpy(np.array(reader.get(writer.put(bits)))).view(torch.bfloat16)
    assert torch.equal(back, t)


def test_put_many_shares_one_region_and_generation(writer, reader):
    arrays = [_array(d, (129, 7), seed=i) for i, d in enumerate(DTYPES)]
    refs = writer.put_many(arrays)
    assert len({r.generation for r in refs}) == 1 and len({r.buffer for r in refs}) == 1
    assert all(r.offset % 64 == 0 for r in refs)
    for a, b in zip(arrays, reader.get_many(refs)):
        assert np.array_equal(a, b)


def test_reserve_fills_in_place(writer, reader):
    with writer.reserve([((4, 5), np.int32), ((3,), "float32"), ((0,), "int64")]) as res:
        res.arrays[0][:] = np.arange(20).reshape(4, 5)
        res.arrays[1][:] = [1.5, 2.5, 3.5]
        refs = res.commit()
    assert np.array_equal(reader.get(refs[0]), np.arange(20).reshape(4, 5))
    assert reader.get(refs[1]).tolist() == [1.5, 2.5, 3.5]
    assert refs[2].kind == INLINE and reader.get(refs[2]).shape == (0,)
    with pytest.raises(RuntimeError, match="already committed"):
        res.commit()


def test_one_open_reservation_at_a_time_and_abort_frees(writer):
    res = writer.reserve([((10,), "int32")])
    with pytest.raises(RuntimeError, match="one reservation at a time"):
        writer.reserve([((10,), "int32")])
    res.abort()
    # The aborted region is free: a ring's worth of unacknowledged puts still fits only
    # because it was handed back (its slot is the last one the cursor reaches again).
    for _ in range(writer.num_slots - 1):
        writer.put(np.zeros(10, np.int32))
    writer.put(np.zeros(10, np.int32))  # wraps to the aborted slot 0
    with pytest.raises(RingFull):
        writer.put(np.zeros(10, np.int32), timeout_s=0)


READER_SNIPPET = r"""
import hashlib, json, sys, msgpack, numpy as np
from nvllm.common.transport import ArrayReader, BadRef
r = ArrayReader()
for line in sys.stdin:
    try:
        arrays = r.get_many(msgpack.unpackb(bytes.fromhex(line), raw=False))
        out = [[a.dtype.str, list(a.shape), hashlib.sha256(np.ascontiguousarray(a).tobytes())
                .hexdigest()] for a in arrays]
    except BadRef as e:
        out = {"error": type(e).__name__, "message": str(e)}
    print(json.dumps(out), flush=True)
r.close()
"""


class SubprocessReader:
    """A reader in a fresh interpreter (subprocess, not a multiprocessing fork)."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", READER_SNIPPET],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, env=_env())

    def ask(self, refs: list[ArrayRef]):
        self.proc.stdin.write(msgpack.packb([r.encode() for r in refs]).hex() + "\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def close(self) -> str:
        out, err = self.proc.communicate(timeout=30)
        assert self.proc.returncode == 0, err
        return err


def test_round_trip_across_a_subprocess_reader(writer):
    child = SubprocessReader()
    try:
        arrays = [_array(d, s, seed=i) for i, (d, s) in
                  enumerate([(d, s) for d in DTYPES for s in SHAPES])]
        assert child.ask(writer.put_many(arrays)) == [_digest(a) for a in arrays]
        writer.acked(0, writer.last_generation)
        # Separate puts, several regions, the ring wrapping around more than once.
        for i in range(3 * writer.num_slots):
            a = _array(DTYPES[i % 4], (5000 + i,), seed=i)
            ref = writer.put(a)
            assert child.ask([ref]) == [_digest(a)]
            writer.acked(0, ref.generation)
    finally:
        err = child.close()
    # The reader never registered the segment with a resource tracker: no warnings, and
    # the segment outlives the reader process.
    assert "resource_tracker" not in err and "leaked" not in err, err
    assert (SHM_DIR / writer.name).exists()


# ---- generations and reuse ------------------------------------------------------------


def _cycle_ring(w: ArrayWriter) -> None:
    """Rewrite every slot, acknowledging as it goes."""
    for _ in range(w.num_slots):
        w.acked_all(w.put(np.ones(w.slot_bytes // 8, np.int64)).generation)


def test_generation_check_catches_a_rewritten_region(writer, reader):
    a = np.arange(3000, dtype=np.int64)
    ref = writer.put(a)
    view = reader.get(ref)
    assert np.array_equal(view, a)
    writer.acked(0, ref.generation)  # acknowledged too early: the view is still in use
    _cycle_ring(writer)
    with pytest.raises(StaleRef, match="rewritten"):
        reader.check(ref)  # after use: proves the bytes changed under the view
    with pytest.raises(StaleRef):
        reader.get(ref)  # and a late reader is refused outright
    child = SubprocessReader()
    try:
        assert child.ask([ref])["error"] == "StaleRef"
    finally:
        child.close()


def test_a_region_being_written_is_refused(writer, reader):
    res = writer.reserve([((100,), "int32")])
    forged = ArrayRef(SHM, "int32", (100,), writer.name, 0, res.generation)
    with pytest.raises(StaleRef, match="being written"):
        reader.get(forged)
    ref = res.commit()[0]
    assert ref == forged and reader.get(ref).shape == (100,)


def test_writer_never_hands_out_a_held_region(writer, reader):
    filler = [np.full(writer.slot_bytes // 4, i, np.int32) for i in range(writer.num_slots)]
    refs = [writer.put(a) for a in filler]  # every slot held, nothing acknowledged
    assert writer.holders(refs[0].generation) == 1
    t0 = time.monotonic()
    with pytest.raises(RingFull) as e:
        writer.put(np.zeros(10, np.int32))
    assert 0.15 < time.monotonic() - t0 < 2  # waited its timeout (0.2 s), not forever
    msg = str(e.value)
    assert "acked(reader, generation)" in msg and "capacity_bytes" in msg and "inline" in msg
    assert isinstance(e.value, TimeoutError)
    for a, r in zip(filler, refs):  # nothing was clobbered
        assert np.array_equal(reader.get(r), a)
    writer.acked(0, refs[0].generation)  # frees exactly slot 0
    new = writer.put(np.zeros(10, np.int32))
    assert new.offset == 0 and new.generation == refs[-1].generation + 1
    with pytest.raises(StaleRef):
        reader.get(refs[0])
    for a, r in zip(filler[1:], refs[1:]):
        assert np.array_equal(reader.get(r), a)


def test_waits_for_an_ack_from_another_thread():
    with ArrayWriter(capacity_bytes=128 << 10, slot_bytes=64 << 10,
                     timeout_s=5) as w:
        g1 = w.put(np.zeros(1000)).generation
        w.put(np.zeros(1000))
        threading.Timer(0.2, w.acked, (0, g1)).start()
        t0 = time.monotonic()
        assert w.put(np.zeros(1000)).offset == 0
        assert 0.1 < time.monotonic() - t0 < 4


def test_every_reader_must_ack():
    with ArrayWriter(capacity_bytes=64 << 10, slot_bytes=64 << 10, num_readers=3,
                     timeout_s=0) as w:
        g = w.put(np.zeros(10)).generation
        w.acked(0, g)
        w.acked(2, g + 100)  # a future ack counts only up to what was committed
        assert w.holders(g) == 1
        with pytest.raises(RingFull, match=r"reader\(s\) \[1\]"):
            w.put(np.zeros(10))
        w.acked(1, g)
        w.put(np.zeros(10))
        with pytest.raises(ValueError, match="out of range"):
            w.acked(3, g)


def test_an_early_ack_cannot_free_a_region_being_written(writer):
    res = writer.reserve([((10,), "int32")])
    writer.acked_all(10**9)
    assert writer.holders(res.generation) == 1
    res.commit()


def test_reclaim_all_and_oversized_payloads(writer):
    for _ in range(writer.num_slots):
        writer.put(np.zeros(writer.slot_bytes // 8))
    writer.reclaim_all()  # e.g. the worker group was replaced
    writer.put(np.zeros(writer.slot_bytes // 8), timeout_s=0)
    with pytest.raises(ValueError, match="larger than the whole ring"):
        writer.put(np.zeros(writer.capacity // 8 + 1))
    big = writer.put(np.arange(3 * writer.slot_bytes // 8))  # spans several slots
    assert big.nbytes == 3 * writer.slot_bytes


# ---- inline fallback ------------------------------------------------------------------


def test_inline_ref_and_min_shm_bytes(reader):
    be = np.arange(10, dtype=">i4")  # big-endian input travels little-endian
    assert np.array_equal(reader.get(inline_ref(be)), np.arange(10))
    with ArrayWriter(min_shm_bytes=4096) as w:
        assert w.put(np.zeros(100, np.int32)).kind == INLINE  # 400 bytes: inline
        assert w.put(np.zeros(2000, np.int32)).kind == SHM
        assert (w.num_inline, w.num_shm) == (1, 1)
    with pytest.raises(ValueError, match="cannot travel"):
        inline_ref(np.array(["x"]))


# ---- malformed refs -------------------------------------------------------------------


def _bad_refs(name: str) -> list:
    ok = [SHM, "int32", [4], name, 0, 1]
    return [
        None, 7, "ref", b"\x01", {}, [], [SHM, "int32"],
        [9, "int32", [4], name, 0, 1],  # unknown kind
        [2, "int32", [4], name, 0, 1],  # kind 2 (CUDA rings) was removed
        [True, "int32", [4], name, 0, 1],  # bool is not a kind
        [SHM, "object", [4], name, 0, 1], [SHM, 5, [4], name, 0, 1],  # dtype
        [SHM, "int32", 4, name, 0, 1], [SHM, "int32", [-1], name, 0, 1],  # shape
        [SHM, "int32", [True], name, 0, 1], [SHM, "int32", [1.5], name, 0, 1],
        [SHM, "int32", [1] * 9, name, 0, 1], [SHM, "int32", [2**20, 2**20, 2**20], name, 0, 1],
        ok[:5], ok + [0],  # field counts
        [SHM, "int32", [4], "../etc/passwd", 0, 1], [SHM, "int32", [4], "psm_1234", 0, 1],
        [SHM, "int32", [4], 17, 0, 1], [SHM, "int32", [4], name + "x", 0, 1],  # names
        [SHM, "int32", [4], name, -4, 1], [SHM, "int32", [4], name, 2, 1],  # offsets
        [SHM, "int32", [4], name, 2**60, 1], [SHM, "int32", [4], name, "0", 1],
        [SHM, "int32", [4], name, 0, 0], [SHM, "int32", [4], name, 0, -1],  # generations
        [SHM, "int32", [4], name, 0, "1"], [SHM, "int32", [4], name, 0, 2**64],
        [INLINE, "int32", [4], b"\0" * 15], [INLINE, "int32", [4], "x" * 16],  # inline
        [INLINE, "int32", [4]], [INLINE, "int32", [4], b"\0" * 16, 1],
    ]


def test_malformed_refs_raise_bad_ref(writer, reader):
    writer.put(np.zeros(10, np.int32))
    for bad in _bad_refs(writer.name):
        with pytest.raises(BadRef) as e:
            reader.get(bad)
        assert isinstance(e.value, (ValueError, ProtocolError)), bad


def test_refs_that_decode_but_do_not_resolve(writer, reader):
    g = writer.put(np.zeros(10, np.int32)).generation
    cap = writer.capacity
    cases = {
        "outside buffer": [SHM, "int32", [4], writer.name, cap, g],
        "outside buffer ": [SHM, "int32", [cap // 4 + 1], writer.name, 0, g],  # length
        "outside buffer  ": [SHM, "int8", [2], writer.name, cap - 1, g],
        "unknown buffer": [SHM, "int32", [4], new_buffer_name(), 0, g],
        "generation": [SHM, "int32", [4], writer.name, 0, g + 1],
    }
    for match, bad in cases.items():
        with pytest.raises(BadRef, match=match.strip()):
            reader.get(bad)
    # A segment with a transport name that is not a ring (garbage header) is refused.
    fake = SharedMemory(new_buffer_name(), create=True, size=4096)
    try:
        with pytest.raises(BadRef, match="not an nvllm transport ring"):
            reader.get([SHM, "int32", [4], fake.name.lstrip("/"), 0, 1])
    finally:
        fake.close()
        fake.unlink()


def test_reader_cache_is_bounded():
    writers = [ArrayWriter(capacity_bytes=64 << 10) for _ in range(3)]
    try:
        r = ArrayReader(max_buffers=2)
        refs = [w.put(np.full(5, i)) for i, w in enumerate(writers)]
        for _ in range(2):
            for i, ref in enumerate(refs):
                assert r.get(ref).tolist() == [i] * 5
        assert len(r._segments) == 2
        r.close()
    finally:
        for w in writers:
            w.close()


# ---- /dev/shm hygiene -----------------------------------------------------------------


def test_two_writers_side_by_side_use_different_names(reader):
    with ArrayWriter() as a, ArrayWriter() as b:
        assert a.name != b.name and "nvllm" in a.name and "nvllm" in b.name
        assert (SHM_DIR / a.name).exists() and (SHM_DIR / b.name).exists()
        ra, rb = a.put(np.arange(5)), b.put(np.arange(5) * 10)
        assert ra.offset == rb.offset and ra.generation == rb.generation  # same position...
        assert reader.get(ra).tolist() == [0, 1, 2, 3, 4]  # ...different rings
        assert reader.get(rb).tolist() == [0, 10, 20, 30, 40]
    out = subprocess.run([sys.executable, "-c", "from nvllm.common.transport import "
                          "ArrayWriter as W; a, b = W(), W(); print(a.name, b.name)"],
                         capture_output=True, text=True, env=_env(), check=True).stdout.split()
    assert len(set(out)) == 2 and a.name not in out and b.name not in out


def test_no_leftovers_after_close_and_gc():
    w = ArrayWriter()
    path = SHM_DIR / w.name
    assert path.exists()
    w.close()
    w.close()  # idempotent
    assert not path.exists()
    with pytest.raises(RuntimeError, match="closed"):
        w.put(np.zeros(3))
    w = ArrayWriter()
    path = SHM_DIR / w.name
    res = w.reserve([((10,), "int64")])
    kept = res.arrays[0]  # a caller holding a view does not stop the unlink
    del w, res
    gc.collect()
    assert not path.exists()
    kept[:] = 1  # the mapping itself stays valid while the view lives
    del kept


def test_a_forked_child_never_unlinks_its_parents_ring():
    w = ArrayWriter()
    path, pid = SHM_DIR / w.name, w._owned.pid
    w._owned.pid = pid + 1  # what the finalizer sees in a forked child at its exit
    w._finalizer()
    assert path.exists()
    w._owned.pid = pid
    _release(w._owned)  # the finalizer already ran once: release by hand
    assert not path.exists()


OWNER_SNIPPET = r"""
import os, signal, sys, time, numpy as np
from nvllm.common.transport import ArrayWriter
from multiprocessing import resource_tracker
w = ArrayWriter()
w.put(np.arange(100))
print(w.name, resource_tracker._resource_tracker._pid, flush=True)
mode = sys.argv[1]
if mode == "raise":
    raise SystemExit("owner fails")
if mode == "kill":
    time.sleep(60)
"""


@pytest.mark.parametrize("mode", ["exit", "raise", "kill"])
def test_no_leftovers_after_the_owner_process_exits(mode):
    proc = subprocess.Popen([sys.executable, "-c", OWNER_SNIPPET, mode], env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    name, tracker = proc.stdout.readline().split()
    assert name.startswith("nvllm-tr-")
    assert tracker == "None"  # no multiprocessing resource tracker (a 15 MiB process)
    if mode == "kill":
        assert (SHM_DIR / name).exists()
        os.kill(proc.pid, signal.SIGKILL)  # no atexit: the owner's janitor cleans up
    proc.communicate(timeout=30)
    deadline = time.monotonic() + 10
    while (SHM_DIR / name).exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not (SHM_DIR / name).exists()


# ---- self-test entry points -----------------------------------------------------------


def test_selftest_entry_point():
    out = subprocess.run([sys.executable, "-m", "nvllm.common.transport", "--selftest"],
                         capture_output=True, text=True, env=_env(), timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "selftest: PASSED" in out.stdout
