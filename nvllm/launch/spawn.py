"""Start the worker processes of one engine on this host and stop them again.

Workers are plain subprocesses (``python -m nvllm.worker.main``), so nothing depends on
the caller's ``__main__``; each gets its spec in an environment variable. Rendezvous uses
a FileStore in a private temporary folder: no fixed port, so engines run side by side.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

from nvllm.common.config import EngineConfig
from nvllm.leader.executor import WorkerGroupClient

logger = logging.getLogger(__name__)


@dataclass
class LocalWorkers:
    procs: list[subprocess.Popen]
    tmpdir: str
    client: WorkerGroupClient
    stopped: bool = field(default=False)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def liveness(self) -> str | None:
        for rank, p in enumerate(self.procs):
            rc = p.poll()
            if rc is not None:
                how = f"signal {signal.Signals(-rc).name}" if rc < 0 else f"exit code {rc}"
                return f"worker rank {rank} (pid {p.pid}) died with {how}"
        return None

    def stop(self, timeout_s: float = 5.0) -> None:
        """Wait for a graceful exit, then SIGTERM, then SIGKILL; remove the temp folder."""
        if self.stopped:
            return
        self.stopped = True
        deadline = time.monotonic() + timeout_s
        for sig in (None, signal.SIGTERM, signal.SIGKILL):
            for p in self.procs:
                if sig is not None and p.poll() is None:
                    p.send_signal(sig)
            for p in self.procs:
                try:
                    p.wait(max(0.0, deadline - time.monotonic()) if sig is None else 2.0)
                except subprocess.TimeoutExpired:
                    pass
            if all(p.poll() is not None for p in self.procs):
                break
        self.client.close()
        shutil.rmtree(self.tmpdir, ignore_errors=True)


def start_local_workers(config: EngineConfig) -> LocalWorkers:
    tp = config.tensor_parallel_size
    client = WorkerGroupClient(tp)
    tmpdir = tempfile.mkdtemp(prefix="nvllm-")
    procs: list[subprocess.Popen] = []
    base = {
        "world_size": tp,
        "local_world_size": tp,
        "dist_init_method": f"file://{os.path.join(tmpdir, 'dist_store')}",
        "result_endpoint": client.result_endpoint,
        "config": config.to_dict(),
        "parent_pid": os.getpid(),
    }
    try:
        for rank in range(tp):
            spec = dict(base, rank=rank, local_rank=rank,
                        plan_endpoint=client.plan_endpoints[rank])
            env = dict(os.environ, NVLLM_WORKER_SPEC=json.dumps(spec))
            if config.device == "cpu" and config.attention_backend == "triton":
                env["TRITON_INTERPRET"] = "1"  # Triton kernels run on CPU only interpreted
            procs.append(subprocess.Popen([sys.executable, "-m", "nvllm.worker.main"], env=env,
                                          stdin=subprocess.DEVNULL))
    except BaseException:
        for p in procs:
            p.kill()
        client.close()
        shutil.rmtree(tmpdir, ignore_errors=True)
        raise
    workers = LocalWorkers(procs, tmpdir, client)
    client.liveness_check = workers.liveness
    logger.info("started %d worker(s): pids %s", tp, workers.pids)
    return workers
