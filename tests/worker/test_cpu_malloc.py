"""CPU workers keep freed memory mapped: a step's activations reuse the last step's pages
instead of faulting in fresh ones (measured in a fresh interpreter, since the settings
are per process)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from nvllm.worker import cpu_malloc

PROBE = """
import ctypes, json, resource
import torch
from nvllm.worker.cpu_malloc import M_MMAP_THRESHOLD, keep_freed_memory

def step():
    # A layer's temporaries (MiB): alive together, then freed, as in a prefill step.
    held = [torch.ones(m << 18) for m in (8, 24, 24, 4, 8)]
    return sum(float(t[-1]) for t in held)

def faults():
    for _ in range(2):
        step()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(10):
        step()
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

# glibc's starting point: every block over 128 KiB is its own mmap. (Its threshold then
# adapts to what the process frees, or not, depending on the heap's history: this
# makes the "before" deterministic.)
ctypes.CDLL(None).mallopt(M_MMAP_THRESHOLD, 128 << 10)
before = faults()
applied = keep_freed_memory()
print(json.dumps({"before": before, "applied": applied, "after": faults()}))
"""


def probe(env: dict[str, str]) -> dict:
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True,
                         timeout=120, env=env, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc")
def test_freed_activations_reuse_pages():
    got = probe(clean_env())
    assert got["applied"] is True
    # Before: each step faults in its 68 MiB of temporaries afresh (17,408 pages).
    assert got["before"] > 10 * 15000
    # After: the heap keeps them (at most a one-off growth while it settles).
    assert got["after"] < got["before"] / 10


def test_user_malloc_variables_win():
    env = clean_env()
    env["MALLOC_TRIM_THRESHOLD_"] = str(1 << 20)
    assert probe(env)["applied"] is False


TRIM_PROBE = """
import ctypes, json
from nvllm.worker.cpu_malloc import keep_freed_memory, rss_bytes, trim_after_load

libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
keep_freed_memory()
# A load-time transient: 64 MiB in 1 MiB blocks (under the raised mmap threshold, so
# the heap serves them), touched, then freed: the heap keeps the pages.
blocks = [libc.malloc(1 << 20) for _ in range(64)]
for b in blocks:
    ctypes.memset(b, 1, 1 << 20)
for b in reversed(blocks):
    libc.free(b)
kept = rss_bytes()
released = trim_after_load(0)
print(json.dumps({"kept": kept, "released": released, "after": rss_bytes()}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc")
def test_trim_after_load_returns_the_loads_free_heap():
    out = subprocess.run([sys.executable, "-c", TRIM_PROBE], capture_output=True,
                         text=True, timeout=60, env=clean_env(), check=True)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["released"] > 48 << 20, got  # most of the 64 MiB goes back to the OS
    assert got["after"] < got["kept"] - (48 << 20)


def test_big_steps_are_trimmed_after(monkeypatch):
    calls = []
    monkeypatch.setattr(cpu_malloc, "release_freed_memory", lambda: calls.append(1) or True)
    assert not cpu_malloc.trim_after_step(cpu_malloc.TRIM_STEP_TOKENS - 1)  # decode, small
    assert calls == []
    assert cpu_malloc.trim_after_step(cpu_malloc.TRIM_STEP_TOKENS)  # a prefill
    assert calls == [1]
