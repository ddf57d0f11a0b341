"""``nvllm-launch --data-parallel-size N``: N engine replicas behind one router.

The launching process runs the router (nvllm/router/server.py) on the launch's client
endpoint and starts each replica as a child process (``python -m
nvllm.launch.data_parallel``, its spec in an environment variable, as workers get
theirs): a leader with its own tensor-parallel workers, serving on a loopback port of its
own, which it writes to a file in a private folder once its engine is ready. Replicas die
with the launcher (PR_SET_PDEATHSIG and a parent watch). The launcher waits for every
replica, then serves until SIGINT/SIGTERM; a replica that exits meanwhile is logged and
the router stops routing to it (restarting it is not done yet: docs/data-parallel.md).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

import click

from nvllm.common.proc import stop_on_signals
from nvllm.common.shm_segments import sweep_orphan_segments
from nvllm.common.zmq_utils import private_ipc_dir

logger = logging.getLogger(__name__)

SPEC_ENV = "NVLLM_REPLICA_SPEC"
STOP_TIMEOUT_S = 15.0  # a replica's own shutdown (its workers too) after SIGTERM


@dataclass(frozen=True, slots=True)
class DataParallelOptions:
    size: int
    router_policy: str
    cache_threshold: float
    balance_abs_threshold: int
    balance_rel_threshold: float


def start_replica(index: int, model: str, engine_kwargs: dict[str, Any], folder: str,
                  served_model_name: str | None, max_frame_bytes: int,
                  shutdown_timeout: float, log_level: str) -> tuple[subprocess.Popen, str]:
    """One replica's leader process; returns it and the file its endpoint will be in."""
    endpoint_file = os.path.join(folder, f"replica-{index}.endpoint")
    spec = {"index": index, "model": model, "engine_kwargs": engine_kwargs,
            "endpoint_file": endpoint_file, "served_model_name": served_model_name,
            "max_frame_bytes": max_frame_bytes, "shutdown_timeout": shutdown_timeout,
            "log_level": log_level, "parent_pid": os.getpid()}
    env = dict(os.environ, **{SPEC_ENV: json.dumps(spec)})
    proc = subprocess.Popen([sys.executable, "-m", "nvllm.launch.data_parallel"], env=env,
                            stdin=subprocess.DEVNULL)
    return proc, endpoint_file


def wait_for_endpoints(replicas: list[tuple[subprocess.Popen, str]],
                       timeout_s: float) -> list[str]:
    """Each replica's endpoint, once all are serving; a replica that exits first, or a
    wait past `timeout_s`, is an error naming it."""
    deadline = time.monotonic() + timeout_s
    endpoints: dict[int, str] = {}
    while len(endpoints) < len(replicas):
        for i, (proc, path) in enumerate(replicas):
            if i in endpoints:
                continue
            if os.path.exists(path):
                with open(path) as f:
                    endpoints[i] = f.read().strip()
            elif proc.poll() is not None:
                raise RuntimeError(f"replica {i} (pid {proc.pid}) exited with code "
                                   f"{proc.returncode} before it served (its log is above)")
        if time.monotonic() > deadline:
            missing = sorted(set(range(len(replicas))) - set(endpoints))
            raise TimeoutError(f"replicas {missing} did not start within {timeout_s:.0f} s "
                               f"(worker_start_timeout_s)")
        time.sleep(0.1)
    return [endpoints[i] for i in range(len(replicas))]


def stop_replicas(procs: list[subprocess.Popen]) -> None:
    """SIGTERM (each drains and stops its workers), then SIGKILL what is left."""
    for p in procs:
        if p.poll() is None:
            p.terminate()
    deadline = time.monotonic() + STOP_TIMEOUT_S
    for p in procs:
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def child_pids(pid: int) -> set[int]:
    """The live processes whose parent is `pid` (from /proc; empty where there is none)."""
    out = set()
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else ():
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            if ppid == pid:
                out.add(int(entry))
    return out


def _watch_replicas(procs: list[subprocess.Popen], owners: list[set[int]],
                    stop: threading.Event) -> None:
    """Log each replica that exits while serving (the router sees its connection drop),
    and remove the shared-memory segments it or its workers (`owners[i]`: their pids)
    left: a SIGKILLed leader unlinks nothing, and its workers die with it."""
    reported: set[int] = set()
    while not stop.wait(0.5):
        for i, p in enumerate(procs):
            if i not in reported and p.poll() is not None:
                reported.add(i)
                logger.error("replica %d (pid %d) exited with code %s; the router no longer "
                             "routes to it (it is not restarted)", i, p.pid, p.returncode)
                stop.wait(1.0)  # its workers notice their parent is gone
                swept = sweep_orphan_segments(owners[i])
                if swept:
                    logger.info("removed %d shared-memory segment(s) of exited processes: "
                                "%s", len(swept), swept)


def run_data_parallel(dp: DataParallelOptions, model: str, engine_kwargs: dict[str, Any], *,
                      host: str, port: int, served_model_name: str | None,
                      curve_key_dir: str | None, max_frame_bytes: int,
                      shutdown_timeout: float, log_level: str,
                      gateway: dict[str, Any] | None) -> None:
    """Start the replicas, then route on host:port (and start the HTTP gateway on the
    router when `gateway` holds start_gateway_process's arguments) until a signal."""
    from nvllm.common.config import EngineConfig
    from nvllm.router.policy import CacheAwareConfig
    from nvllm.router.server import Router, RouterConfig

    defaults = EngineConfig(model=model, **engine_kwargs)  # checks the options once, here
    folder = private_ipc_dir("nvllm-dp-")
    replicas: list[tuple[subprocess.Popen, str]] = []
    router = gateway_proc = None
    owners: list[set[int]] = []
    try:
        for i in range(dp.size):
            replicas.append(start_replica(i, model, engine_kwargs, folder, served_model_name,
                                          max_frame_bytes, shutdown_timeout, log_level))
        endpoints = wait_for_endpoints(replicas, defaults.worker_start_timeout_s + 60)
        # Each replica's processes (its leader, its workers: started by now), whose
        # segments the launcher removes if they die without doing so.
        owners = [{p.pid} | child_pids(p.pid) for p, _ in replicas]
        config = RouterConfig(
            policy=dp.router_policy,
            cache_aware=CacheAwareConfig(dp.cache_threshold, dp.balance_abs_threshold,
                                         dp.balance_rel_threshold),
            client_timeout_s=defaults.client_timeout_s,
            max_request_id_bytes=defaults.max_request_id_bytes,
            max_client_outbox=defaults.max_client_outbox,
            max_client_frames_per_step=defaults.max_client_frames_per_step)
        router = Router(endpoints, config, host=host, port=port, curve_key_dir=curve_key_dir,
                        max_frame_bytes=max_frame_bytes)
        stop = threading.Event()
        stop_on_signals(stop)
        click.echo(f"serving on {router.endpoint}; Ctrl-C to stop")
        click.echo(f"data parallel: {dp.size} replicas (pids "
                   f"{[p.pid for p, _ in replicas]}) at {endpoints}, router policy "
                   f"{dp.router_policy}")
        if gateway is not None:
            from nvllm.launch.openai.cli import start_gateway_process

            gateway_proc = start_gateway_process(router.endpoint, **gateway)
            click.echo(f"OpenAI-compatible HTTP gateway on http://{gateway['host']}:"
                       f"{gateway['port']}/v1 (pid {gateway_proc.pid})")
        watcher = threading.Thread(target=_watch_replicas,
                                   args=([p for p, _ in replicas], owners, stop), daemon=True)
        watcher.start()
        router.serve(stop, shutdown_timeout)
    finally:
        if gateway_proc is not None:
            stop_replicas([gateway_proc])
        stop_replicas([p for p, _ in replicas])
        sweep_orphan_segments(set().union(*owners))
        if router is not None:
            router.close()
        shutil.rmtree(folder, ignore_errors=True)
        click.echo("shutting down")


def _replica_main() -> None:
    """A replica: build the engine, serve on a loopback port, write it where the launcher
    looks, serve until SIGTERM."""
    spec = json.loads(os.environ[SPEC_ENV])
    index = spec["index"]
    logging.basicConfig(level=spec["log_level"],
                        format=f"%(asctime)s nvllm-leader-r{index} %(levelname)s %(message)s")
    from nvllm.common.config import EngineConfig
    from nvllm.common.proc import die_with_parent, set_process_title
    from nvllm.launch import engine_builder
    from nvllm.leader.server import EngineServer

    set_process_title(f"nvllm-leader-r{index}")
    die_with_parent(spec["parent_pid"])
    stop = threading.Event()
    stop_on_signals(stop)
    engine = engine_builder.build_engine(EngineConfig(model=spec["model"],
                                                      **spec["engine_kwargs"]))
    try:
        server = EngineServer(engine, "127.0.0.1", 0, model_name=spec["served_model_name"],
                              max_frame_bytes=spec["max_frame_bytes"])
        try:
            tmp = spec["endpoint_file"] + ".tmp"
            with open(tmp, "w") as f:
                f.write(server.endpoint)
            os.replace(tmp, spec["endpoint_file"])  # the launcher never reads half of it
            server.serve(stop, spec["shutdown_timeout"])
        finally:
            server.close()
    finally:
        engine.shutdown()


if __name__ == "__main__":
    _replica_main()
