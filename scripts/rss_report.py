"""Per-process memory of a process tree, from /proc/PID/smaps_rollup: where an nvllm
server's resident set goes (issue 24 compares its sum with llama-server's).

    python scripts/rss_report.py ROOT_PID            # the root and all its descendants
    python scripts/rss_report.py --pids 123 456      # just these processes

Columns, MiB: Rss, then Rss split into anonymous (heap, tensors, KV cache, thread
stacks), file-backed (mapped libraries and files: torch's .so files count once per
process that maps them) and shmem (/dev/shm segments, counted in each mapping process);
Pss (shared pages split between their processes: the sum is the tree's real footprint);
Swap. The last row sums each column.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import pathlib
import sys

FIELDS = ("Rss", "Pss", "Anonymous", "Rss_file", "Rss_shmem", "Swap")


@dataclasses.dataclass(slots=True)
class ProcMemory:
    """One process's smaps_rollup figures in bytes (file = Rss_file, shmem = Rss_shmem;
    kernels before 5.x lack these two, and file is then Rss - anonymous)."""

    pid: int
    name: str
    rss: int = 0
    pss: int = 0
    anon: int = 0
    file: int = 0
    shmem: int = 0
    swap: int = 0


def parse_smaps_rollup(text: str) -> dict[str, int]:
    """The ``Key: N kB`` lines of smaps_rollup as bytes, by key."""
    out: dict[str, int] = {}
    for line in text.splitlines():
        key, sep, rest = line.partition(":")
        parts = rest.split()
        if sep and len(parts) == 2 and parts[1] == "kB" and parts[0].isdigit():
            out[key.strip()] = int(parts[0]) * 1024
    return out


def proc_memory(pid: int, proc: pathlib.Path = pathlib.Path("/proc")) -> ProcMemory:
    """Read one process; raises OSError when it is gone or not ours to read."""
    d = proc / str(pid)
    f = parse_smaps_rollup((d / "smaps_rollup").read_text())
    name = describe(d)
    anon = f.get("Anonymous", 0)
    shmem = f.get("Rss_shmem", 0)
    file = f.get("Rss_file", f.get("Rss", 0) - anon - shmem)
    return ProcMemory(pid, name, f.get("Rss", 0), f.get("Pss", 0), anon, file, shmem,
                      f.get("Swap", 0))


def describe(d: pathlib.Path) -> str:
    """A short name: the console script or module the process runs, else its comm."""
    try:
        argv = (d / "cmdline").read_bytes().split(b"\0")
    except OSError:
        argv = []
    args = [a.decode(errors="replace") for a in argv if a]
    for i, a in enumerate(args):
        if a == "-c" and i + 1 < len(args) and args[i + 1].startswith("from "):
            return args[i + 1].split()[1]  # multiprocessing's resource tracker
        if a == "-c" and i + 1 < len(args) and "/dev/shm/nvllm-" in args[i + 1]:
            return "shm janitor (sh)"  # nvllm/common/shm_janitor.py
        if a == "-m" and i + 1 < len(args):
            return args[i + 1]
        base = os.path.basename(a)
        if base.startswith(("nvllm", "llama")):
            return base
    try:
        return (d / "comm").read_text().strip()
    except OSError:
        return "?"


def children(pid: int, proc: pathlib.Path = pathlib.Path("/proc")) -> list[int]:
    """Direct children, from each thread's children file (Linux 3.5+)."""
    out: list[int] = []
    try:
        for task in (proc / str(pid) / "task").iterdir():
            try:
                out += [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                continue
    except OSError:
        pass
    return out


def tree(root: int, proc: pathlib.Path = pathlib.Path("/proc")) -> list[int]:
    """The root and all its descendants, parents first."""
    seen, order = set(), []
    stack = [root]
    while stack:
        pid = stack.pop(0)
        if pid not in seen:
            seen.add(pid)
            order.append(pid)
            stack += children(pid, proc)
    return order


def format_table(rows: list[ProcMemory]) -> str:
    """A Markdown table in MiB, one row per process and a total row."""
    mib = lambda b: f"{b / 2**20:,.1f}"  # noqa: E731
    lines = ["| pid | process | Rss | anon | file | shmem | Pss | Swap |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r.pid} | {r.name} | {mib(r.rss)} | {mib(r.anon)} | {mib(r.file)} | "
                     f"{mib(r.shmem)} | {mib(r.pss)} | {mib(r.swap)} |")
    tot = ProcMemory(0, "total", *(sum(getattr(r, k) for r in rows)
                                   for k in ("rss", "pss", "anon", "file", "shmem", "swap")))
    lines.append(f"| | **total** | {mib(tot.rss)} | {mib(tot.anon)} | {mib(tot.file)} | "
                 f"{mib(tot.shmem)} | {mib(tot.pss)} | {mib(tot.swap)} |")
    return "\n".join(lines)


def report(pids: list[int]) -> list[ProcMemory]:
    """The readable processes among pids (gone or foreign ones are skipped)."""
    rows = []
    for pid in pids:
        try:
            rows.append(proc_memory(pid))
        except OSError:
            continue
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("root", nargs="?", type=int, help="a process-tree root")
    ap.add_argument("--pids", nargs="+", type=int, help="these processes only")
    a = ap.parse_args(argv)
    if (a.root is None) == (a.pids is None):
        ap.error("give a root pid or --pids, not both")
    rows = report(a.pids if a.pids else tree(a.root))
    if not rows:
        print(f"no readable process among {a.pids or a.root}", file=sys.stderr)
        return 1
    print(format_table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
