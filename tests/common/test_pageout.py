"""nvllm/common/pageout.py: which mappings it advises, and that a process that imported
torch gives back most of torch's start-up pages and computes the same afterwards."""

from __future__ import annotations

import json
import pathlib
import shutil
import subprocess
import sys
import textwrap
import unicodedata

import pytest

from nvllm.common.pageout import library_mappings

MAPS = """\
55d0c0000000-55d0c0021000 r--p 00000000 08:01 1 /usr/bin/python3.11
7f0000000000-7f0000100000 r--p 00000000 08:01 2 /x/torch/lib/libtorch_cpu.so
7f0000100000-7f0000900000 r-xp 00100000 08:01 2 /x/torch/lib/libtorch_cpu.so
7f0000900000-7f0000910000 rw-p 00900000 08:01 2 /x/torch/lib/libtorch_cpu.so
7f0000a00000-7f0000a10000 r-xp 00000000 08:01 3 /usr/lib/x86_64-linux-gnu/libc.so.6
7f0000b00000-7f0000b10000 r--p 00000000 08:01 4 /x/np/_umath.cpython-311-x86_64-linux-gnu.so
7f0000c00000-7f0000d00000 r--s 00000000 00:1a 5 /dev/shm/nvllm-tr-1-abc
7f0000d00000-7f0000e00000 r--p 00000000 08:01 6 /models/smol.gguf
7f0000e00000-7f0000e10000 r-xp 00000000 08:01 7 /tmp/old/libgone.so (deleted)
7f0000f00000-7f0000f21000 rw-p 00000000 00:00 0 [heap]
7f0001000000-7f0001001000 r--p 00000000 00:00 0
"""


def test_only_read_only_shared_objects_are_advised():
    got = [(hex(a), hex(b), p.rsplit("/", 1)[-1]) for a, b, p in library_mappings(MAPS)]
    assert got == [("0x7f0000000000", "0x7f0000100000", "libtorch_cpu.so"),
                   ("0x7f0000100000", "0x7f0000900000", "libtorch_cpu.so"),
                   ("0x7f0000a00000", "0x7f0000a10000", "libc.so.6"),
                   ("0x7f0000b00000", "0x7f0000b10000",
                    "_umath.cpython-311-x86_64-linux-gnu.so")]
    # Never: a library's writable data, the plan ring, the weights' file, the heap, a
    # deleted file, the executable.


PROBE = textwrap.dedent("""
    import ctypes, json, sys
    import torch
    from nvllm.common.pageout import library_mappings, page_out_libraries
    lib_path = sys.argv[1]
    ctypes.CDLL(lib_path)  # a copy only this process maps: nobody shares its pages

    def lib_ranges():
        with open("/proc/self/maps") as f:
            return [(a, b) for a, b, p in library_mappings(f.read()) if p == lib_path]

    def lib_rss():
        total, ours = 0, False
        with open("/proc/self/smaps") as f:
            for line in f:
                if "-" in line.split(" ", 1)[0] and not line.startswith(" "):
                    ours = line.rstrip().endswith(lib_path)
                elif ours and line.startswith("Rss:"):
                    total += int(line.split()[1]) * 1024
        return total

    for a, b in lib_ranges():
        ctypes.string_at(a, b - a)  # touch every page of it
    torch.manual_seed(0)
    x, w = torch.randn(64, 96), torch.randn(96, 32)
    first = torch.nn.functional.silu(x @ w).sum(0)
    before = lib_rss()
    dropped = page_out_libraries("test")
    after = lib_rss()
    again = torch.nn.functional.silu(x @ w).sum(0)
    json.dump({"before": before, "after": after, "dropped": dropped,
               "same": bool(torch.equal(first, again))}, sys.stdout)
""")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="MADV_PAGEOUT is Linux's")
def test_a_process_gives_back_its_library_pages_and_computes_the_same(tmp_path):
    """The library's pages leave the resident set (those other processes map too stay:
    the kernel skips shared pages, so torch's own are not counted on here, pytest maps
    them as well); torch computes the same afterwards."""
    src = pathlib.Path(unicodedata.__file__)  # ~1.1 MiB mapped, most of it tables
    lib = tmp_path / src.name
    shutil.copyfile(src, lib)
    r = subprocess.run([sys.executable, "-c", PROBE, str(lib)], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    assert got["same"]
    if got["dropped"] == 0:
        pytest.skip("this kernel has no MADV_PAGEOUT (Linux < 5.4)")
    assert got["before"] >= 512 << 10, got  # its read-only pages, all touched
    assert got["after"] <= got["before"] // 4, got
