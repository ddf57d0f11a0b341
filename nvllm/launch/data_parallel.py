"""``nvllm-launch --data-parallel-size N``: N engine replicas behind one router.

The launching process supervises its children (nvllm/launch/supervisor.py), each started
as ``python -m nvllm.launch.data_parallel`` with its spec in an environment variable (as
workers get theirs) and writing its endpoint to a file in a private folder once it
serves: N replicas, each a leader with its own tensor-parallel workers on a loopback
port of its own, then the router (nvllm/router/server.py) on the launch's client
endpoint. Children die with the launcher (PR_SET_PDEATHSIG and a parent watch), not with
each other. The launcher serves until SIGINT/SIGTERM. A replica that exits meanwhile has
the segments it and its workers left removed and is started again on its port (the
router, which replayed its requests elsewhere, routes to it again once it answers
``health`` ready); a router that exits is started again on its port after the clients'
LINK_GRACE_S has failed the requests it had (docs/data-parallel.md), and rebuilds its
routing state from traffic.
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
from dataclasses import asdict, dataclass
from typing import Any

import click

from nvllm.common.client import LINK_GRACE_S
from nvllm.common.proc import stop_on_signals
from nvllm.common.shm_segments import sweep_orphan_segments
from nvllm.common.zmq_utils import private_ipc_dir
from nvllm.launch.dp_nodes import Placement
from nvllm.launch.supervisor import STOP_TIMEOUT_S, Start, Supervisor, stop_processes

logger = logging.getLogger(__name__)

SPEC_ENV = "NVLLM_REPLICA_SPEC"
# A restarted router comes back only after its clients have given up the requests they
# had on it: a client that reconnected sooner would wait for answers no router owes.
# Twice the grace: a client sees the drop and checks the grace only between its reads
# (up to PING_INTERVAL_S apart), later still when its machine is loaded.
ROUTER_RESTART_DELAY_S = 2 * LINK_GRACE_S
READY_WAIT_S = 30.0  # a (re)started router waits this long for its replicas' answers


@dataclass(frozen=True, slots=True)
class DataParallelOptions:
    size: int
    router_policy: str
    cache_threshold: float
    balance_abs_threshold: int
    balance_rel_threshold: float
    placement: Placement | None = None  # None: every replica on this host


def start_replica(index: int, model: str, engine_kwargs: dict[str, Any], folder: str,
                  served_model_name: str | None, max_frame_bytes: int,
                  shutdown_timeout: float, log_level: str, port: int = 0, *,
                  host: str = "127.0.0.1", curve_key_dir: str | None = None,
                  env: dict[str, str] | None = None) -> tuple[subprocess.Popen, str]:
    """One replica's leader process (serving on host:`port`, 0: a port it picks; keyed
    with `curve_key_dir`, so only the router and keyed clients get in); returns it and
    the file its endpoint will be in; `env`: its own variables (its devices)."""
    endpoint_file = os.path.join(folder, f"replica-{index}.endpoint")
    if os.path.exists(endpoint_file):  # a dead predecessor's
        os.unlink(endpoint_file)
    spec = {"role": "replica", "index": index, "model": model, "engine_kwargs": engine_kwargs,
            "endpoint_file": endpoint_file, "served_model_name": served_model_name,
            "max_frame_bytes": max_frame_bytes, "shutdown_timeout": shutdown_timeout,
            "log_level": log_level, "parent_pid": os.getpid(), "port": port,
            "host": host, "curve_key_dir": curve_key_dir}
    return _spawn(spec, env), endpoint_file


def start_router(endpoints: list[str], config: Any, folder: str, host: str, port: int,
                 curve_key_dir: str | None, max_frame_bytes: int, shutdown_timeout: float,
                 log_level: str) -> tuple[subprocess.Popen, str]:
    """The router's process (a RouterConfig `config`, on host:`port`, 0: one it picks);
    returns it and the file its endpoint will be in."""
    endpoint_file = os.path.join(folder, "router.endpoint")
    if os.path.exists(endpoint_file):
        os.unlink(endpoint_file)
    spec = {"role": "router", "endpoints": endpoints, "config": asdict(config),
            "host": host, "port": port, "curve_key_dir": curve_key_dir,
            "max_frame_bytes": max_frame_bytes, "shutdown_timeout": shutdown_timeout,
            "log_level": log_level, "endpoint_file": endpoint_file,
            "parent_pid": os.getpid()}
    return _spawn(spec), endpoint_file


def replica_devices(slot: int, tp: int, visible: str | None, count: int) -> str | None:
    """CUDA_VISIBLE_DEVICES for the `slot`-th replica on this node: its own `tp` devices
    of the `count` this launch sees (`visible`: CUDA_VISIBLE_DEVICES, None: all), so that
    each replica's worker i (which uses cuda:i) lands on a device no other replica uses.
    None when there are too few: replicas then share devices (small models fit), with a
    warning."""
    ids = visible.split(",") if visible else [str(i) for i in range(count)]
    if len(ids) < (slot + 1) * tp:
        logger.warning("replica slot %d with --tp %d needs %d devices, %d visible: it "
                       "shares devices with other replicas", slot, tp, (slot + 1) * tp,
                       len(ids))
        return None
    return ",".join(ids[slot * tp:(slot + 1) * tp])


def _cuda_devices() -> int:
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count()


def _spawn(spec: dict[str, Any], extra: dict[str, str] | None = None) -> subprocess.Popen:
    env = dict(os.environ, **(extra or {}), **{SPEC_ENV: json.dumps(spec)})
    return subprocess.Popen([sys.executable, "-m", "nvllm.launch.data_parallel"], env=env,
                            stdin=subprocess.DEVNULL)


def wait_for_endpoints(replicas: list[tuple[subprocess.Popen, str]], timeout_s: float,
                       what: str = "replica") -> list[str]:
    """Each child's endpoint, once all are serving; a child that exits first, or a wait
    past `timeout_s`, is an error naming it."""
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
                raise RuntimeError(f"{what} {i} (pid {proc.pid}) exited with code "
                                   f"{proc.returncode} before it served (its log is above)")
        if time.monotonic() > deadline:
            missing = sorted(set(range(len(replicas))) - set(endpoints))
            raise TimeoutError(f"{what} {missing} did not start within {timeout_s:.0f} s "
                               f"(worker_start_timeout_s)")
        time.sleep(0.1)
    return [endpoints[i] for i in range(len(replicas))]


def run_data_parallel(dp: DataParallelOptions, model: str, engine_kwargs: dict[str, Any], *,
                      host: str, port: int, served_model_name: str | None,
                      curve_key_dir: str | None, max_frame_bytes: int,
                      shutdown_timeout: float, log_level: str,
                      gateway: dict[str, Any] | None) -> None:
    """Start this node's replicas; on the head node (start rank 0) also the router on
    host:port, once the other nodes' replicas registered (nvllm/launch/dp_nodes.py), and
    the HTTP gateway on the router when `gateway` holds start_gateway_process's
    arguments; keep them up until a signal."""
    from nvllm.common.config import EngineConfig
    from nvllm.launch.dp_nodes import collect_endpoints, local_address, register_endpoints

    defaults = EngineConfig(model=model, **engine_kwargs)  # checks the options once, here
    place = dp.placement or Placement(dp.size, dp.size, 0, "127.0.0.1", 0)
    # The head's replicas serve its router on loopback; another node's, the head's router.
    replica_host = "127.0.0.1" if place.head else local_address(place.address)
    folder = private_ipc_dir("nvllm-dp-")
    replicas: list[tuple[subprocess.Popen, str]] = []
    router: tuple[subprocess.Popen, str] | None = None
    gateway_proc = supervisor = None
    stop = threading.Event()

    gpus = _cuda_devices() if defaults.device != "cpu" else 0

    def replica(rank: int) -> Start:
        env = None  # on GPUs: each replica its own devices of this node's
        devices = gpus and replica_devices(rank - place.start_rank,
                                           defaults.tensor_parallel_size,
                                           os.environ.get("CUDA_VISIBLE_DEVICES"), gpus)
        if devices:
            env = {"CUDA_VISIBLE_DEVICES": devices}
        return lambda replica_port: start_replica(
            rank, model, engine_kwargs, folder, served_model_name, max_frame_bytes,
            shutdown_timeout, log_level, replica_port, host=replica_host,
            curve_key_dir=curve_key_dir, env=env)

    try:
        replicas = [replica(r)(0) for r in place.ranks]
        start_timeout_s = defaults.worker_start_timeout_s + 60
        local = wait_for_endpoints(replicas, start_timeout_s)
        # Records each replica's processes (its leader, its workers: started by now),
        # whose segments the launcher removes if they die without doing so.
        supervisor = Supervisor(start_timeout_s)
        for r, (proc, _), ep in zip(place.ranks, replicas, local):
            supervisor.add(f"replica {r}", proc, ep, replica(r), sweep_segments=True)
        endpoints = dict(zip(place.ranks, local))
        if not place.head:
            register_endpoints(place, endpoints, curve_key_dir, start_timeout_s)
            click.echo(f"data parallel: replicas {list(place.ranks)} (pids "
                       f"{[p.pid for p, _ in replicas]}) at {local}, registered with "
                       f"{place.address}:{place.rpc_port}; Ctrl-C to stop")
        else:
            if place.local < place.size:
                endpoints.update(collect_endpoints(place, curve_key_dir, start_timeout_s))
            router = _start_router_child(dp, defaults, [endpoints[r] for r in
                                                        range(place.size)],
                                         folder, host, port, curve_key_dir,
                                         max_frame_bytes, shutdown_timeout, log_level,
                                         supervisor)
            click.echo(f"data parallel: {dp.size} replicas (pids "
                       f"{[p.pid for p, _ in replicas]}) at "
                       f"{[endpoints[r] for r in range(place.size)]}, router policy "
                       f"{dp.router_policy} (router pid {router[0].pid})")
            if gateway is not None:
                from nvllm.launch.openai.process import start_gateway_process

                gateway_proc = start_gateway_process(router[1], **gateway)
                click.echo(f"OpenAI-compatible HTTP gateway on http://{gateway['host']}:"
                           f"{gateway['port']}/v1 (pid {gateway_proc.pid})")
        stop_on_signals(stop)  # (before this, a signal interrupts the start-up)
        supervisor.run(stop)
    finally:
        stop.set()
        procs = supervisor.procs() if supervisor else {}
        router_proc = procs.pop("router", router[0] if router else None)
        if gateway_proc is not None:
            stop_processes([gateway_proc])
        # The router first: it drains its requests while the replicas still serve them.
        if router_proc is not None:
            stop_processes([router_proc], STOP_TIMEOUT_S + shutdown_timeout)
        stop_processes(list(procs.values()) or [p for p, _ in replicas])
        if supervisor is not None:
            sweep_orphan_segments(supervisor.owners())
        shutil.rmtree(folder, ignore_errors=True)
        click.echo("shutting down")


def _start_router_child(dp: DataParallelOptions, defaults: Any, endpoints: list[str],
                        folder: str, host: str, port: int, curve_key_dir: str | None,
                        max_frame_bytes: int, shutdown_timeout: float, log_level: str,
                        supervisor: Supervisor) -> tuple[subprocess.Popen, str]:
    """The router on host:port, supervised; returns its process and endpoint once it
    serves (it printed "serving on")."""
    from nvllm.router.policy import CacheAwareConfig
    from nvllm.router.server import RouterConfig

    config = RouterConfig(
        policy=dp.router_policy,
        cache_aware=CacheAwareConfig(dp.cache_threshold, dp.balance_abs_threshold,
                                     dp.balance_rel_threshold),
        client_timeout_s=defaults.client_timeout_s,
        max_request_id_bytes=defaults.max_request_id_bytes,
        max_client_outbox=defaults.max_client_outbox,
        max_client_frames_per_step=defaults.max_client_frames_per_step)

    def start_the_router(router_port: int) -> tuple[subprocess.Popen, str]:
        return start_router(endpoints, config, folder, host, router_port, curve_key_dir,
                            max_frame_bytes, shutdown_timeout, log_level)

    proc, path = start_the_router(port)
    try:
        (endpoint,) = wait_for_endpoints([(proc, path)], 60, "router")
    except BaseException:
        stop_processes([proc])
        raise
    supervisor.add("router", proc, endpoint, start_the_router,
                   min_delay_s=ROUTER_RESTART_DELAY_S)
    click.echo(f"serving on {endpoint}; Ctrl-C to stop")
    return proc, endpoint


def _write_endpoint(path: str, endpoint: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(endpoint)
    os.replace(tmp, path)  # the launcher never reads half of it


def _router_main(spec: dict[str, Any]) -> None:
    """The router: connect to the replicas, serve on the launch's client endpoint, write
    it where the launcher looks, route until SIGTERM."""
    from nvllm.common.proc import die_with_parent, set_process_title
    from nvllm.router.policy import CacheAwareConfig
    from nvllm.router.server import Router, RouterConfig

    set_process_title("nvllm-router")
    die_with_parent(spec["parent_pid"])
    stop = threading.Event()
    stop_on_signals(stop)
    fields = dict(spec["config"])
    fields["cache_aware"] = CacheAwareConfig(**fields["cache_aware"])
    router = Router(spec["endpoints"], RouterConfig(**fields), host=spec["host"],
                    port=spec["port"], curve_key_dir=spec["curve_key_dir"],
                    max_frame_bytes=spec["max_frame_bytes"])
    thread = threading.Thread(target=router.serve, args=(stop, spec["shutdown_timeout"]),
                              name="nvllm-router")
    try:
        thread.start()
        # Announced once every replica answered (or after READY_WAIT_S with those that
        # did): a client told "serving on" then finds replicas to route to.
        deadline = time.monotonic() + READY_WAIT_S
        while not router.ready() and time.monotonic() < deadline and thread.is_alive():
            time.sleep(0.05)
        _write_endpoint(spec["endpoint_file"], router.endpoint)
        while thread.is_alive():
            thread.join(0.5)  # (the main thread takes the signals)
    finally:
        stop.set()
        thread.join()
        router.close()


def _replica_main(spec: dict[str, Any]) -> None:
    """A replica: build the engine, serve on a loopback port, write it where the launcher
    looks, serve until SIGTERM."""
    index = spec["index"]
    from nvllm.common.config import EngineConfig
    from nvllm.common.pageout import page_out_libraries
    from nvllm.common.proc import die_with_parent, set_process_title
    from nvllm.launch import engine_builder
    from nvllm.leader.server import EngineServer

    set_process_title(f"nvllm-leader-r{index}")
    die_with_parent(spec["parent_pid"])
    stop = threading.Event()
    stop_on_signals(stop)
    engine = engine_builder.build_engine(EngineConfig(model=spec["model"],
                                                      **spec["engine_kwargs"]), serving=True)
    try:
        server = EngineServer(engine, spec["host"], spec["port"],
                              model_name=spec["served_model_name"],
                              curve_key_dir=spec["curve_key_dir"],
                              max_frame_bytes=spec["max_frame_bytes"])
        try:
            _write_endpoint(spec["endpoint_file"], server.endpoint)
            if engine.config.page_out_libraries:
                page_out_libraries(f"replica {index}")
            server.serve(stop, spec["shutdown_timeout"])
        finally:
            server.close()
    finally:
        engine.shutdown()


def _child_main() -> None:
    spec = json.loads(os.environ[SPEC_ENV])
    name = "nvllm-router" if spec["role"] == "router" else f"nvllm-leader-r{spec['index']}"
    logging.basicConfig(level=spec["log_level"],
                        format=f"%(asctime)s {name} %(levelname)s %(message)s")
    (_router_main if spec["role"] == "router" else _replica_main)(spec)


if __name__ == "__main__":
    _child_main()
