"""Names of the engine's POSIX shared-memory segments (the transport rings' too, kind
"tr": nvllm/common/transport/ring.py), and their removal.

A name is ``nvllm-KIND-PID-TOKEN``: "nvllm" in it so the leak checks over /dev/shm see
it, the pid of the process that named it (whose segment it is), and 12 random hex digits
so two engines side by side never collide. The leader names the tensor-parallel
all-reduce segment (nvllm/worker/shm_allreduce.py) and unlinks it again when its worker
group stops, whatever happened to the workers.
"""

from __future__ import annotations

import os
import re
import secrets
from collections.abc import Collection

try:  # the module multiprocessing.shared_memory itself uses
    import _posixshmem
except ImportError:  # Windows: no POSIX shared memory
    _posixshmem = None

NAME_RE = re.compile(r"nvllm-[a-z]{2}-[0-9]{1,10}-[0-9a-f]{12}")


def new_segment_name(kind: str) -> str:
    """A fresh name for a segment of `kind` (two lower-case letters, e.g. "ar")."""
    name = f"nvllm-{kind}-{os.getpid()}-{secrets.token_hex(6)}"
    if not NAME_RE.fullmatch(name):
        raise ValueError(f"bad segment kind {kind!r}")
    return name


def unlink_segment(name: str) -> bool:
    """Remove segment `name` from /dev/shm if it is there (mappings stay valid until
    dropped); True if it was."""
    if _posixshmem is None:
        return False
    try:
        _posixshmem.shm_unlink("/" + name)
        return True
    except FileNotFoundError:
        return False


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def sweep_orphan_segments(owners: Collection[int] | None = None,
                          folder: str = "/dev/shm") -> list[str]:
    """Unlink every nvllm segment (``nvllm-KIND-PID-TOKEN``, the plan rings' included)
    whose owner pid is gone (only those of `owners` when given): a SIGKILLed process
    never unlinks its own. Returns the names removed. A segment whose owner lives (or
    whose pid was reused) is left alone."""
    try:
        names = os.listdir(folder)
    except FileNotFoundError:
        return []
    removed = []
    for name in names:
        if not NAME_RE.fullmatch(name):
            continue
        pid = int(name.split("-")[2])
        if (owners is None or pid in owners) and not _pid_alive(pid):
            if unlink_segment(name):
                removed.append(name)
    return removed
