"""Self-test across a real process boundary: ``python -m nvllm.common.transport
--selftest`` (host shared memory). Exit status 0: passed, 1: failed.
``--reader-child`` is the subprocess side.

The parent writes arrays into a small ring and sends the refs (hex msgpack lines) to a
child reader, which answers with a digest of each array and its release generation; then
it checks that a prematurely acknowledged, rewritten region is refused (StaleRef), that a
ring with no acks raises RingFull within its timeout and proceeds after acks, and that
the segment is gone from /dev/shm after close.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import msgpack
import numpy as np

from nvllm.common.transport import ArrayReader, ArrayWriter, BadRef, RingFull, StaleRef


def _digest(a: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()[:16]


def reader_child() -> int:
    reader = ArrayReader()
    for line in sys.stdin:
        if line.strip() == "quit":
            break
        refs = msgpack.unpackb(bytes.fromhex(line.strip()), raw=False)
        try:
            arrays = reader.get_many(refs)
            out = {"ok": True, "digests": [_digest(a) for a in arrays],
                   "shapes": [list(a.shape) for a in arrays]}
            for r in refs:
                reader.check(r)
            out["release"] = reader.release(max(r[-1] if r[0] else 0 for r in refs))
        except BadRef as e:
            out = {"ok": False, "error": type(e).__name__, "message": str(e)}
        print(json.dumps(out), flush=True)
    reader.close()
    return 0


class _Child:
    def __init__(self) -> None:
        root = str(Path(__file__).resolve().parents[3])
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            [root, *filter(None, [os.environ.get("PYTHONPATH")])]))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "nvllm.common.transport", "--reader-child"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)

    def ask(self, refs: list) -> dict:
        packed = msgpack.packb([r.encode() for r in refs], use_bin_type=True)
        self.proc.stdin.write(packed.hex() + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"reader child exited (rc={self.proc.wait()})")
        return json.loads(line)

    def close(self) -> int:
        self.proc.stdin.write("quit\n")
        self.proc.stdin.close()
        return self.proc.wait(timeout=30)


def selftest() -> int:
    rng = np.random.default_rng(0)
    arrays = [np.arange(100_003, dtype=np.int32), rng.integers(-2**40, 2**40, (64, 33)),
              rng.standard_normal((3, 5, 7)).astype(np.float32),
              rng.integers(0, 2**16, (257,), dtype=np.uint16), np.zeros((0, 4), np.int32)]
    want = [_digest(a) for a in arrays]
    checks: list[tuple[str, bool, str]] = []
    shm_dir = Path("/dev/shm")
    writer = ArrayWriter(capacity_bytes=4 << 20, slot_bytes=256 << 10, timeout_s=0.2)
    name = writer.name
    child = _Child()
    try:
        refs = writer.put_many(arrays)
        got = child.ask(refs)
        checks.append(("round trip through a child process", got.get("ok") and
                       got["digests"] == want, json.dumps(got)[:300]))
        writer.acked(0, got.get("release", 0))
        checks.append(("ack frees the region", writer.holders(refs[0].generation) == 0, ""))

        # A region acknowledged too early and rewritten: the child must refuse the old ref.
        old = writer.put(np.full(1000, 7, np.int64))
        writer.acked_all(old.generation)
        for _ in range(writer.num_slots):
            writer.acked_all(writer.put(np.ones(writer.slot_bytes // 8, np.int64)).generation)
        got = child.ask([old])
        checks.append(("a rewritten region is refused", got.get("error") ==
                       StaleRef.__name__, json.dumps(got)[:300]))

        # No acks: the ring fills, the writer gives up after its timeout, then proceeds.
        t0, err = time.monotonic(), ""
        try:
            for _ in range(writer.num_slots + 1):
                writer.put(np.ones(writer.slot_bytes // 8, np.int64))
        except RingFull as e:
            err = str(e)
        waited = time.monotonic() - t0
        checks.append(("full ring raises RingFull naming acked()",
                       "acked(" in err and waited < 5, f"{waited:.2f} s: {err[:200]}"))
        writer.acked_all(writer.last_generation)
        ref = writer.put(np.arange(10, dtype=np.int32))
        got = child.ask([ref])
        checks.append(("after acks it proceeds", got.get("ok") and
                       got["digests"] == [_digest(np.arange(10, dtype=np.int32))], ""))
    finally:
        writer.close()
        rc = child.close()
    checks.append(("child exits cleanly", rc == 0, f"rc={rc}"))
    checks.append(("segment unlinked", not (shm_dir / name).exists(), name))
    for what, ok, detail in checks:
        print(f"  {'ok  ' if ok else 'FAIL'} {what}" + ("" if ok else f": {detail}"))
    failed = [c for c in checks if not c[1]]
    print(f"selftest: {'FAILED' if failed else 'PASSED'} "
          f"({len(checks) - len(failed)}/{len(checks)})")
    return 1 if failed else 0


def main(argv: list[str]) -> int:
    if argv == ["--reader-child"]:
        return reader_child()
    if argv == ["--selftest"]:
        return selftest()
    print(__doc__.strip())
    return 0 if argv in ([], ["--help"], ["-h"]) else 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
