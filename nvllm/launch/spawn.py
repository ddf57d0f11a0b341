"""Start the workers of one engine and stop them again.

The leader's node starts its local workers as plain subprocesses (``python -m
nvllm.worker.main``, spec in an environment variable), so nothing depends on the caller's
``__main__``. On one host, rendezvous uses a FileStore in a private (0700) temporary
folder, and the leader's plan, result and heartbeat sockets are ``ipc://`` paths in the
same folder: no fixed port, so engines run side by side, and no other user can reach the
sockets. The folder goes when the group stops. Across nodes the leader hosts (or, under
torchrun, joins) a TCPStore at master_addr:master_port and publishes the group spec there
(its plan, result and heartbeat endpoints: tcp on the master address, with
``--curve-key-dir`` CURVE servers admitting only the workers' key; the engine config);
the other nodes' launchers (``run_worker_node``) or torchrun/srun tasks read it and start
their ranks.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from nvllm.common.config import DistConfig, EngineConfig
from nvllm.common.proc import stop_on_signals
from nvllm.common.shm_segments import new_segment_name, unlink_segment
from nvllm.common.zmq_utils import check_curve_bind, private_ipc_dir
from nvllm.leader.worker_client import WorkerGroupClient

logger = logging.getLogger(__name__)

SPEC_KEY = "nvllm/spec"


def wait_for_port(host: str, port: int, timeout_s: float) -> None:
    """Wait until host:port accepts connections (quietly; TCPStore's own retries are loud)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((host, port), timeout=1.0):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise TimeoutError(f"nothing answered on {host}:{port} within {timeout_s:.0f} s: "
                                   "is the leader (node rank 0) running with the same "
                                   "--master-addr/--master-port?") from None
            time.sleep(0.2)


def connect_store(host: str, port: int, timeout_s: float):
    from torch.distributed import TCPStore

    wait_for_port(host, port, timeout_s)
    return TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s))


def read_group_spec(store, timeout_s: float) -> dict:
    store.set_timeout(timedelta(seconds=timeout_s))
    try:
        return json.loads(store.get(SPEC_KEY))
    except Exception as e:
        raise TimeoutError(f"the leader published no engine spec within {timeout_s:.0f} s "
                           f"({e})") from None


def spawn_workers(spec: dict, ranks: range, parent_pid: int | None) -> list[subprocess.Popen]:
    """Start one worker process per rank of this node (local rank = index in `ranks`)."""
    procs: list[subprocess.Popen] = []
    cfg = spec["config"]
    try:
        for local_rank, rank in enumerate(ranks):
            full = dict(spec, rank=rank, local_rank=local_rank, local_world_size=len(ranks),
                        parent_pid=parent_pid)
            env = dict(os.environ, NVLLM_WORKER_SPEC=json.dumps(full))
            if cfg["device"] == "cpu" and cfg["attention_backend"] == "triton":
                env["TRITON_INTERPRET"] = "1"  # Triton kernels run on CPU only interpreted
            procs.append(subprocess.Popen([sys.executable, "-m", "nvllm.worker.main"], env=env,
                                          stdin=subprocess.DEVNULL))
    except BaseException:
        for p in procs:
            p.kill()
            p.wait()
        raise
    return procs


def describe_exit(rank: int, p: subprocess.Popen) -> str | None:
    rc = p.poll()
    if rc is None:
        return None
    how = f"signal {signal.Signals(-rc).name}" if rc < 0 else f"exit code {rc}"
    return f"worker rank {rank} (pid {p.pid}) died with {how}"


def stop_processes(procs: list[subprocess.Popen], timeout_s: float, *,
                   graceful: bool = True) -> None:
    """Wait for a graceful exit, then SIGTERM, then SIGKILL (only SIGKILL if not graceful)."""
    deadline = time.monotonic() + timeout_s
    for sig in (None, signal.SIGTERM, signal.SIGKILL) if graceful else (signal.SIGKILL,):
        for p in procs:
            if sig is not None and p.poll() is None:
                p.send_signal(sig)
        for p in procs:
            try:
                p.wait(max(0.0, deadline - time.monotonic()) if sig is None else 2.0)
            except subprocess.TimeoutExpired:
                pass
        if all(p.poll() is not None for p in procs):
            break


@dataclass
class WorkerGroup:
    """The leader's side of one worker group: its client, and the processes it started."""

    client: WorkerGroupClient
    procs: dict[int, subprocess.Popen]  # rank -> process, for ranks started on this node
    tmpdir: str | None = None  # one host: the FileStore and the ipc sockets (mode 0700)
    store: Any = None  # keeps a hosted TCPStore alive for the group's lifetime
    shm_name: str | None = None  # the ranks' all-reduce segment (rank 0 unlinks it early)
    stopped: bool = field(default=False)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs.values()]

    def liveness(self) -> dict[int, str]:
        """rank -> how it died, for each local worker that did."""
        return {rank: d for rank, p in self.procs.items()
                if (d := describe_exit(rank, p)) is not None}

    def stop(self, timeout_s: float = 5.0) -> None:
        if self.stopped:
            return
        self.stopped = True
        # A dead group got no shutdown message (and may hold a hung or stopped process).
        stop_processes(list(self.procs.values()), timeout_s,
                       graceful=self.client.dead is None)
        self.client.close()
        if self.tmpdir:
            shutil.rmtree(self.tmpdir, ignore_errors=True)
        if self.shm_name:  # rank 0 died before unlinking it
            unlink_segment(self.shm_name)


def check_worker_bind(dist: DistConfig) -> str:
    """Where the worker sockets bind (returned); beyond loopback that needs CURVE keys
    (on every node)."""
    host = _bind_host(dist)
    check_curve_bind(host, dist.curve_key_dir,
                     f"the worker sockets (--master-addr {dist.master_addr})")
    return host


def _bind_host(dist: DistConfig) -> str:
    """Loopback on one host (where the sockets are ipc anyway); across nodes, the master
    address (workers connect to it)."""
    if not dist.uses_store:
        return "127.0.0.1"
    try:
        return socket.gethostbyname(dist.master_addr)
    except OSError as e:
        raise ValueError(f"cannot resolve --master-addr {dist.master_addr}: {e}") from None


def start_worker_group(config: EngineConfig, dist: DistConfig | None = None) -> WorkerGroup:
    """Bind the leader's sockets, publish the group spec, start this node's workers."""
    dist = (dist or DistConfig()).validate(config.tensor_parallel_size)
    tp = config.tensor_parallel_size
    bind_host = check_worker_bind(dist)
    # One host: every socket is a unix socket in a folder only this user can enter.
    tmpdir = None if dist.uses_store else private_ipc_dir()
    try:
        client = WorkerGroupClient(tp, bind_host, config.heartbeat_timeout_s,
                                   dist.curve_key_dir, ipc_dir=tmpdir)
    except BaseException:
        if tmpdir:
            shutil.rmtree(tmpdir, ignore_errors=True)
        raise
    store = None
    shm_name = (new_segment_name("ar") if config.cpu_shm_allreduce and config.device == "cpu"
                and tp > 1 and dist.nnodes == 1 else None)
    try:
        spec: dict[str, Any] = {
            "world_size": tp, "config": config.to_dict(),
            "nproc_per_node": None if dist.leader_only else dist.per_node(tp),
            "plan_endpoints": client.plan_endpoints, "result_endpoint": client.result_endpoint,
            "heartbeat_endpoint": client.heartbeat_endpoint,
            "curve_key_dir": dist.curve_key_dir,
            # CPU ranks that turn out to share this host all-reduce through this segment
            # (nvllm/worker/shm_allreduce.py: rank 0 creates it, all map it, or none).
            "shm_allreduce": shm_name,
        }
        if dist.uses_store:
            from torch.distributed import TCPStore

            # Under torchrun the agent already hosts the store at MASTER_PORT; else we do
            # (and if the port turns out taken by a store, we join that one).
            timeout = config.worker_start_timeout_s
            if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
                store = connect_store(dist.master_addr, dist.master_port, timeout)
            else:
                try:
                    store = TCPStore(dist.master_addr, dist.master_port, is_master=True,
                                     wait_for_workers=False, timeout=timedelta(seconds=timeout))
                except Exception as e:  # DistNetworkError and friends: the port is in use
                    logger.info("cannot host the store on port %d (%s); joining the one "
                                "there", dist.master_port, str(e).split("\n")[0])
                    store = connect_store(dist.master_addr, dist.master_port, timeout)
            # A fresh prefix per group keeps a restarted group off the old one's keys.
            spec["rendezvous"] = {"tcp": [dist.master_addr, dist.master_port],
                                  "prefix": f"nvllm/pg/{os.getpid()}/{time.time_ns()}/"}
            store.set(SPEC_KEY, json.dumps(spec))
            logger.info("published the engine spec on %s:%d for %d worker(s)",
                        dist.master_addr, dist.master_port, tp)
        else:
            spec["rendezvous"] = {"file": os.path.join(tmpdir, "dist_store")}
        ranks = dist.local_ranks(tp)
        procs = dict(zip(ranks, spawn_workers(spec, ranks, os.getpid())))
    except BaseException:
        client.close()
        if tmpdir:
            shutil.rmtree(tmpdir, ignore_errors=True)
        raise
    group = WorkerGroup(client, procs, tmpdir, store, shm_name)
    client.liveness_check = group.liveness
    if procs:
        logger.info("started %d local worker(s): pids %s", len(procs), group.pids)
    return group


def run_worker_node(dist: DistConfig, node_rank: int, model: str | None = None,
                    timeout_s: float = 300.0) -> int:
    """A node other than the leader's: start its ranks from the leader's published spec,
    then wait. Returns 0 when every worker exited cleanly (the leader shut them down)."""
    store = connect_store(dist.master_addr, dist.master_port, timeout_s)
    spec = read_group_spec(store, timeout_s)
    del store
    n = spec["nproc_per_node"]
    if n is None or node_rank < 1 or (node_rank + 1) * n > spec["world_size"]:
        raise ValueError(f"node rank {node_rank} does not exist in a group of "
                         f"{spec['world_size']} workers with {n} per node")
    if model:  # the checkpoint may live at another path on this node
        spec["model_override"] = model
    if dist.curve_key_dir:
        spec["curve_key_dir"] = dist.curve_key_dir
    ranks = range(node_rank * n, (node_rank + 1) * n)
    procs = spawn_workers(spec, ranks, os.getpid())
    logger.info("node %d: started ranks %s (pids %s)", node_rank, list(ranks),
                [p.pid for p in procs])
    stop = threading.Event()
    stop_on_signals(stop)
    try:
        while not stop.is_set():
            if all(p.poll() is not None for p in procs):
                break
            for rank, p in zip(ranks, procs):
                if p.poll() not in (None, 0):
                    logger.error("%s", describe_exit(rank, p))
                    stop.set()
            stop.wait(0.2)
    finally:
        stop_processes(procs, 5.0)
    codes = [p.returncode for p in procs]
    return 0 if all(c == 0 for c in codes) else 1
