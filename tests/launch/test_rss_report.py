"""scripts/rss_report.py: smaps_rollup parsed into the Rss split, a process tree walked
through /proc's children files (a fake /proc here), and the table's total row."""

from __future__ import annotations

import importlib.util
import os
import pathlib
import sys

from nvllm.common.shm_janitor import janitor_script

ROOT = pathlib.Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("rss_report", ROOT / "scripts" / "rss_report.py")
rss_report = importlib.util.module_from_spec(spec)
sys.modules["rss_report"] = rss_report  # dataclasses look their module up
spec.loader.exec_module(rss_report)

ROLLUP = """55d0c0000000-7ffc4a3f1000 ---p 00000000 00:00 0                  [rollup]
Rss:              800000 kB
Pss:              700000 kB
Pss_Anon:         600000 kB
Shared_Clean:      90000 kB
Anonymous:        600000 kB
Rss_file:         190000 kB
Rss_shmem:         10000 kB
Swap:                  0 kB
THPeligible:           0
"""


def fake_proc(tmp_path: pathlib.Path, pid: int, argv: list[str], kids: list[int]) -> None:
    d = tmp_path / str(pid)
    (d / "task" / str(pid)).mkdir(parents=True)
    (d / "smaps_rollup").write_text(ROLLUP)
    (d / "cmdline").write_bytes(b"\0".join(a.encode() for a in argv) + b"\0")
    (d / "comm").write_text("python\n")
    (d / "task" / str(pid) / "children").write_text(" ".join(map(str, kids)))


def test_parse_and_split(tmp_path):
    fake_proc(tmp_path, 10, ["/usr/bin/python", "/x/bin/nvllm-launch", "--model", "m"], [])
    got = rss_report.proc_memory(10, tmp_path)
    assert (got.rss, got.pss, got.anon, got.file, got.shmem) == (
        800000 << 10, 700000 << 10, 600000 << 10, 190000 << 10, 10000 << 10)
    assert got.name == "nvllm-launch"
    assert "THPeligible" not in rss_report.parse_smaps_rollup(ROLLUP)


def test_tree_walk_names_and_total(tmp_path):
    fake_proc(tmp_path, 1, ["nvllm-leader"], [2, 3])
    fake_proc(tmp_path, 2, ["python", "-m", "nvllm.launch.openai"], [4])
    fake_proc(tmp_path, 3, ["python", "-c", "from multiprocessing.resource_tracker "
                            "import main;main(5)"], [])
    fake_proc(tmp_path, 4, ["python"], [5])
    fake_proc(tmp_path, 5, ["/bin/sh", "-c", janitor_script("nvllm-tr-1-*")], [])
    pids = rss_report.tree(1, tmp_path)
    assert pids == [1, 2, 3, 4, 5]
    rows = [rss_report.proc_memory(p, tmp_path) for p in pids]
    assert [r.name for r in rows] == ["nvllm-leader", "nvllm.launch.openai",
                                      "multiprocessing.resource_tracker", "python",
                                      "shm janitor (sh)"]
    total = rss_report.format_table(rows).splitlines()[-1]
    assert total.startswith("| | **total** | 3,906.2 | 2,929.7 | 927.7 | 48.8 | 3,418.0 |")


def test_reads_this_process():
    rows = rss_report.report([os.getpid()])
    assert rows and rows[0].rss > 0 and rows[0].anon + rows[0].file <= rows[0].rss
