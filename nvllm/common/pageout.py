"""Give back the shared libraries' start-up pages once a process is warm (MADV_PAGEOUT).

Why: a CPU worker's ``import torch`` maps libtorch_cpu.so (325 MiB of file) and start-up
(op registration, loading, the profiling forward) touches ~64 MiB of it and ~13 MiB of
libtorch_python.so; the steps of a served model then use ~15 MiB of those. Clean file
pages stay in the process's resident set until memory pressure reclaims them, so a
machine that runs nvllm beside other work (or counts its memory) carries ~70 MiB of
start-up code per worker for nothing. ``madvise(MADV_PAGEOUT)`` (Linux 5.4+) reclaims them
at once: the kernel drops the pages no other process maps, and a later touch reads them
back (a page fault; from the file when the page cache let them go). Android's app
compaction makes the same call for its cached apps.

Only read-only, file-backed mappings of shared objects (``*.so``, ``*.so.N``) are advised:
their contents never change, so the call is safe at any moment and costs nothing but the
faults of the pages that are used again. Writable mappings (a library's data, the heap,
the KV cache, the weights) are never touched. Only for processes nvllm owns (the leader,
the workers, the gateway), after their start-up, as ``freeze_startup_objects``.
"""

from __future__ import annotations

import ctypes
import logging
import re
import sys

logger = logging.getLogger(__name__)

MADV_PAGEOUT = 21  # <linux/mman.h>, Linux 5.4
_SHARED_OBJECT = re.compile(r"\.so(\.\d+)*$")


def library_mappings(maps_text: str) -> list[tuple[int, int, str]]:
    """(start, end, path) of each read-only mapping of a shared object in a
    /proc/PID/maps text: the ranges page_out_libraries advises."""
    out = []
    for line in maps_text.splitlines():
        parts = line.split(maxsplit=5)
        if len(parts) < 6 or "w" in parts[1]:
            continue
        path = parts[5].strip()
        if not path.startswith("/") or not _SHARED_OBJECT.search(path):
            continue
        start, end = (int(x, 16) for x in parts[0].split("-"))
        out.append((start, end, path))
    return out


def resident_file_bytes() -> int:
    """This process's resident file-backed bytes (RssFile of /proc/self/status); 0 where
    there is no such line."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("RssFile:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def page_out_libraries(who: str = "") -> int:
    """Advise MADV_PAGEOUT on every read-only shared-object mapping of this process.
    Returns the bytes the resident file pages shrank by (0 where the call does not exist:
    not Linux, a kernel before 5.4, or no libc)."""
    if not sys.platform.startswith("linux"):
        return 0
    try:
        with open("/proc/self/maps") as f:
            ranges = library_mappings(f.read())
        libc = ctypes.CDLL(None, use_errno=True)
        madvise = libc.madvise
    except (OSError, AttributeError):
        return 0
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    before = resident_file_bytes()
    advised = sum(madvise(start, end - start, MADV_PAGEOUT) == 0 for start, end, _ in ranges)
    if not advised:  # EINVAL for all: a kernel without MADV_PAGEOUT
        return 0
    dropped = max(0, before - resident_file_bytes())
    logger.debug("%s: paged out %.1f MiB of shared-library pages", who or "process",
                 dropped / 2**20)
    return dropped
