"""``nvllm-launch --data-parallel-size N``: N engine replicas behind one router.

The launching process runs the router (nvllm/router/server.py) on the launch's client
endpoint and starts each replica as a child process (``python -m
nvllm.launch.data_parallel``, its spec in an environment variable, as workers get
theirs): a leader with its own tensor-parallel workers, serving on a loopback port of its
own, which it writes to a file in a private folder once its engine is ready. Replicas die
with the launcher (PR_SET_PDEATHSIG and a parent watch). The launcher waits for every
replica, then serves until SIGINT/SIGTERM. A replica that exits meanwhile
(``ReplicaSupervisor``) has the shared-memory segments it and its workers left removed
and is started again on the same port, after a backoff and at most ``MAX_RESTARTS``
times in a row; the router, which replayed its requests elsewhere, routes to it again
once it answers ``health`` ready.
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
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import click

from nvllm.common.proc import stop_on_signals
from nvllm.common.shm_segments import sweep_orphan_segments
from nvllm.common.zmq_utils import private_ipc_dir

logger = logging.getLogger(__name__)

SPEC_ENV = "NVLLM_REPLICA_SPEC"
STOP_TIMEOUT_S = 15.0  # a replica's own shutdown (its workers too) after SIGTERM
# Restarts of a replica that keeps dying: at most MAX_RESTARTS in a row, the k-th after
# RESTART_BACKOFF_S * 2**k; a replica that served STABLE_AFTER_S since its last start
# has its count reset (a crash a day is restarted every time, a crash loop is not).
MAX_RESTARTS = 3
RESTART_BACKOFF_S = 1.0
STABLE_AFTER_S = 60.0
POLL_S = 0.5  # how often the supervisor looks at its replicas
WORKERS_EXIT_S = 1.0  # a dead leader's workers notice within this (their parent watch)


@dataclass(frozen=True, slots=True)
class DataParallelOptions:
    size: int
    router_policy: str
    cache_threshold: float
    balance_abs_threshold: int
    balance_rel_threshold: float


def start_replica(index: int, model: str, engine_kwargs: dict[str, Any], folder: str,
                  served_model_name: str | None, max_frame_bytes: int,
                  shutdown_timeout: float, log_level: str, port: int = 0
                  ) -> tuple[subprocess.Popen, str]:
    """One replica's leader process (serving on loopback `port`, 0: one it picks);
    returns it and the file its endpoint will be in."""
    endpoint_file = os.path.join(folder, f"replica-{index}.endpoint")
    if os.path.exists(endpoint_file):  # a dead predecessor's
        os.unlink(endpoint_file)
    spec = {"index": index, "model": model, "engine_kwargs": engine_kwargs,
            "endpoint_file": endpoint_file, "served_model_name": served_model_name,
            "max_frame_bytes": max_frame_bytes, "shutdown_timeout": shutdown_timeout,
            "log_level": log_level, "parent_pid": os.getpid(), "port": port}
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


@dataclass(slots=True)
class _Replica:
    index: int
    proc: subprocess.Popen
    port: int
    owners: set[int]  # its leader's and workers' pids, whose segments die with them
    started: float = field(default_factory=time.monotonic)
    restarts: int = 0  # in a row (reset once it served STABLE_AFTER_S)
    given_up: bool = False


class ReplicaSupervisor:
    """Watches the replicas (a thread of the launcher): one that exits has its segments
    removed (a SIGKILLed leader unlinks nothing, and its workers die with it) and is
    started again on its port, so the router's connection to it comes back by itself."""

    def __init__(self, procs: list[subprocess.Popen], endpoints: list[str],
                 start: Callable[[int, int], tuple[subprocess.Popen, str]],
                 start_timeout_s: float) -> None:
        self.replicas = [_Replica(i, p, int(ep.rsplit(":", 1)[1]), {p.pid} | child_pids(p.pid))
                         for i, (p, ep) in enumerate(zip(procs, endpoints))]
        self.start, self.start_timeout_s = start, start_timeout_s
        self.restarted = 0
        self._lock = threading.Lock()  # procs are replaced here and stopped by the launcher

    def procs(self) -> list[subprocess.Popen]:
        with self._lock:
            return [r.proc for r in self.replicas]

    def owners(self) -> set[int]:
        return set().union(*(r.owners for r in self.replicas))

    def run(self, stop: threading.Event) -> None:
        while not stop.wait(POLL_S):
            for r in self.replicas:
                if not r.given_up and r.proc.poll() is not None:
                    self._replace(r, stop)

    def _replace(self, r: _Replica, stop: threading.Event) -> None:
        logger.error("replica %d (pid %d) exited with code %s; the router replays its "
                     "requests elsewhere", r.index, r.proc.pid, r.proc.returncode)
        stop.wait(WORKERS_EXIT_S)  # before its segments go: its workers may hold them
        swept = sweep_orphan_segments(r.owners)
        if swept:
            logger.info("removed %d shared-memory segment(s) of exited processes: %s",
                        len(swept), swept)
        if time.monotonic() - r.started > STABLE_AFTER_S:
            r.restarts = 0
        if r.restarts >= MAX_RESTARTS:
            r.given_up = True
            logger.error("replica %d exited %d times in a row: not restarted again (the "
                         "others serve; restart the launch to bring it back)", r.index,
                         r.restarts + 1)
            return
        delay = RESTART_BACKOFF_S * 2 ** r.restarts
        r.restarts += 1
        logger.warning("restarting replica %d on port %d in %g s (attempt %d of %d)",
                       r.index, r.port, delay, r.restarts, MAX_RESTARTS)
        if stop.wait(delay):
            return
        with self._lock:
            if stop.is_set():
                return
            r.proc, path = self.start(r.index, r.port)
            r.started = time.monotonic()
        r.owners |= {r.proc.pid}
        deadline = time.monotonic() + self.start_timeout_s
        while not os.path.exists(path):
            if r.proc.poll() is not None or stop.is_set():
                return  # the next turn sees it exited (and counts the attempt)
            if time.monotonic() > deadline:
                logger.error("replica %d did not serve within %.0f s: stopping it",
                             r.index, self.start_timeout_s)
                stop_replicas([r.proc])
                return
            stop.wait(0.1)
        r.owners = {r.proc.pid} | child_pids(r.proc.pid)
        self.restarted += 1
        logger.warning("replica %d is back (pid %d, port %d)", r.index, r.proc.pid, r.port)


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
    router = gateway_proc = supervisor = watcher = None
    stop = threading.Event()

    def start(index: int, replica_port: int = 0) -> tuple[subprocess.Popen, str]:
        return start_replica(index, model, engine_kwargs, folder, served_model_name,
                             max_frame_bytes, shutdown_timeout, log_level, replica_port)

    try:
        replicas = [start(i) for i in range(dp.size)]
        start_timeout_s = defaults.worker_start_timeout_s + 60
        endpoints = wait_for_endpoints(replicas, start_timeout_s)
        # Records each replica's processes (its leader, its workers: started by now),
        # whose segments the launcher removes if they die without doing so.
        supervisor = ReplicaSupervisor([p for p, _ in replicas], endpoints, start,
                                       start_timeout_s)
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
        watcher = threading.Thread(target=supervisor.run, args=(stop,), daemon=True,
                                   name="nvllm-replica-supervisor")
        watcher.start()
        router.serve(stop, shutdown_timeout)
    finally:
        stop.set()
        if watcher is not None:
            watcher.join(STOP_TIMEOUT_S)
        if gateway_proc is not None:
            stop_replicas([gateway_proc])
        stop_replicas(supervisor.procs() if supervisor else [p for p, _ in replicas])
        if supervisor is not None:
            sweep_orphan_segments(supervisor.owners())
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
        server = EngineServer(engine, "127.0.0.1", spec["port"],
                              model_name=spec["served_model_name"],
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
