"""glibc malloc settings for CPU workers: keep freed activation memory for reuse.

By default glibc serves every allocation above its mmap threshold (128 KiB, raised
dynamically up to 32 MiB) with a fresh mmap and returns it on free, so each step's
activations are new pages that fault in and get zeroed by the kernel: a 2,048-token
prefill of the benchmark model took ~100,000 page faults and ~13% longer. Serving them
from the heap and not trimming it keeps the pages mapped from one step to the next.
"""

from __future__ import annotations

import ctypes
import logging
import os

logger = logging.getLogger(__name__)

M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3  # <malloc.h>
ENV_KEYS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_")


def keep_freed_memory(mmap_threshold: int = 256 << 20, trim_threshold: int = 1 << 30,
                      top_pad: int = 64 << 20) -> bool:
    """Apply the settings to this process; False where they do not apply (not glibc,
    or the user set glibc's MALLOC_* variables, which then win)."""
    if any(k in os.environ for k in ENV_KEYS):
        logger.debug("malloc left as the MALLOC_* environment variables set it")
        return False
    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    ok = (mallopt(M_MMAP_THRESHOLD, mmap_threshold) == 1
          and mallopt(M_TRIM_THRESHOLD, trim_threshold) == 1
          and mallopt(M_TOP_PAD, top_pad) == 1)
    logger.debug("malloc keeps freed memory: %s", ok)
    return ok


def release_freed_memory() -> bool:
    """Give the heap's free pages back to the OS (glibc's malloc_trim): what sleep frees
    stays in the process's resident set otherwise, since keep_freed_memory serves large
    tensors from the heap and does not trim it. False where malloc_trim does not exist."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return False
    trim.argtypes = [ctypes.c_size_t]
    return bool(trim(0))


def trim_after_load(rank: int) -> int:
    """Return what loading freed (the checkpoint's buffers, the load-time repacks, the
    profiling forward's activations) once the KV cache is in place: keep_freed_memory's
    1 GiB trim threshold otherwise keeps it resident for the process's life (~250 MiB of
    SmolLM2-135M's worker). Steps after it fault their activations in once again.
    Returns the bytes the resident set shrank by."""
    before = rss_bytes()
    release_freed_memory()
    after = rss_bytes()
    logger.debug("rank %d: RSS %.1f -> %.1f MiB after trimming the load's free memory",
                 rank, before / 2**20, after / 2**20)
    return max(0, before - after)


# Steps of at least this many tokens (prefill) are followed by a trim (trim_after_step).
TRIM_STEP_TOKENS = 512


def trim_after_step(num_tokens: int) -> bool:
    """After a step of ``num_tokens``: give the heap's free pages back when the step was a
    big prefill. keep_freed_memory keeps a step's activations mapped for the next one,
    which decode steps (small, alike) profit from; a 2,048-token prefill of SmolLM2-135M
    left ~130 MiB of freed activations resident for good (the worker's RSS 538 -> 673
    MiB). A trim costs ~10-15 ms and the next prefill faults its pages in again: under
    1% of a 512-token prefill step (~0.7 s on 2 cores). True when it trimmed."""
    return num_tokens >= TRIM_STEP_TOKENS and release_freed_memory()


def rss_bytes() -> int:
    """This process's resident set now (0 where /proc is not there)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0
