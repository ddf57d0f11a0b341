"""``nvllm-launch``: start the leader and N tensor-parallel workers.

With ``--prompt`` (repeatable) or ``--demo`` it generates, prints the text and the
throughput, and exits; otherwise it serves clients on a ZMQ endpoint (``--host``,
``--port``; see ``nvllm/leader/server.py``) until interrupted.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import threading
import time

import click

DEMO_PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village by the sea,",
    "A tensor-parallel inference engine splits every layer",
    "List three prime numbers:",
]


def resolve_model(model: str) -> str:
    """A path, or ``tiny:NAME`` for a built-in tiny checkpoint (built on first use)."""
    if model.startswith("tiny:"):
        from nvllm.launch.tiny import ensure_tiny_checkpoint

        return str(ensure_tiny_checkpoint(model[len("tiny:"):]))
    return model


def _check_access(host: str, http_host: str | None, api_key: str | None,
                  curve_key_dir: str | None, dist) -> None:
    """Refuse an unauthenticated non-loopback bind before anything is loaded."""
    from nvllm.common.zmq_utils import check_curve_bind
    from nvllm.launch.openai.cli import check_http_host
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
              help="HF-format checkpoint folder, or tiny:NAME (e.g. tiny:qwen3) for a "
                   "built-in random checkpoint. Required on node rank 0; on other nodes it "
                   "overrides the leader's path (where the checkpoint lives elsewhere).")
@click.option("--tp", "--tensor-parallel-size", "tp", default=1, type=int,
              help="Number of tensor-parallel worker processes.")
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto")
@click.option("--dtype", type=click.Choice(["auto", "float32", "bfloat16", "float16"]),
              default="auto")
@click.option("--block-size", default=16, type=int, help="Tokens per KV block.")
@click.option("--max-num-seqs", default=256, type=int)
@click.option("--max-num-batched-tokens", default=2048, type=int)
@click.option("--max-model-len", default=None, type=int)
@click.option("--num-kv-blocks", default=None, type=int,
              help="Override the KV capacity computed from memory.")
@click.option("--gpu-memory-utilization", default=0.9, type=float)
@click.option("--cpu-kv-cache-gib", default=1.0, type=float,
              help="KV-cache budget per worker on CPU.")
@click.option("--enable-prefix-caching/--no-enable-prefix-caching", default=True)
@click.option("--attention-backend", type=click.Choice(["auto", "torch", "triton"]),
              default="auto")
@click.option("--async-scheduling/--no-async-scheduling", default=True,
              help="Send step N+1's plan before applying step N's result, so the leader's "
                   "work overlaps the workers' (outputs are identical either way).")
@click.option("--micro-batch-overlap/--no-micro-batch-overlap", default=True,
              help="With --tp > 1, cut big steps into two micro-batches so one's all-reduce "
                   "runs while the other computes.")
@click.option("--micro-batch-min-tokens", default=256, type=int,
              help="Smallest step (in tokens) that is cut into micro-batches.")
@click.option("--enforce-eager", is_flag=True,
              help="CUDA: run decode steps eagerly instead of replaying CUDA graphs.")
@click.option("--plan-shm/--no-plan-shm", default=True,
              help="Big plans' token ids and block tables through a shared-memory ring "
                   "(when every worker is on this host) instead of msgpack lists.")
@click.option("--max-queued-requests", default=None, type=int,
              help="Refuse new requests with 'overloaded' beyond this many waiting.")
@click.option("--batch-timeout-ms", default=0.0, type=float,
              help="When idle, wait this long for more arrivals before the first prefill.")
@click.option("--client-timeout-s", default=10.0, type=float,
              help="Abort the requests of a client silent for this long.")
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
              help="Require 'Authorization: Bearer KEY' on the gateway's /v1 routes.")
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
              help="CURVE keys (made by nvllm-keys) for the client endpoint and the "
                   "leader<->worker sockets; required when binding beyond loopback.")
@click.option("--max-frame-bytes", default=64 << 20, type=int,
              help="Largest client frame; ZMQ drops a bigger one and that connection.")
@click.option("--heartbeat-timeout", default=4.0, type=float,
              help="Seconds of heartbeat silence after which a worker (or, seen from a "
                   "worker, the leader) counts as dead.")
@click.option("--step-timeout", default=600.0, type=float,
              help="Watchdog: a step without a result after this many seconds is an error.")
@click.option("--restart-workers", is_flag=True,
              help="On a worker failure, start a new worker group and recompute the "
                   "in-flight requests instead of failing them (workers on this node only).")
@click.option("--max-worker-restarts", default=3, type=int,
              help="With --restart-workers: give up (and fail requests) after this many.")
@click.option("--prompt", "prompts", multiple=True, help="Generate for this prompt and exit.")
@click.option("--demo", is_flag=True, help="Generate for a few built-in prompts and exit.")
@click.option("--max-tokens", default=32, type=int)
@click.option("--temperature", default=0.0, type=float)
@click.option("--log-level", default="INFO",
              type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"]))
def launch(model, tp, device, dtype, block_size, max_num_seqs, max_num_batched_tokens,
           max_model_len, num_kv_blocks, gpu_memory_utilization, cpu_kv_cache_gib,
           enable_prefix_caching, attention_backend, async_scheduling, micro_batch_overlap,
           micro_batch_min_tokens, enforce_eager, plan_shm, max_queued_requests,
           batch_timeout_ms,
           client_timeout_s, shutdown_timeout, host, port, http_port, http_host,
           served_model_name, api_key, nnodes, node_rank, nproc_per_node, master_addr,
           master_port, leader_only, curve_key_dir, max_frame_bytes, heartbeat_timeout,
           step_timeout,
           restart_workers, max_worker_restarts, prompts,
           demo, max_tokens, temperature, log_level) -> None:
    """Start an nvllm engine: one leader (this process) and TP worker processes.

    With --nnodes M, run it once per node: node rank 0 runs the leader and its workers,
    the others (--node-rank 1..M-1) only their workers.
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
    _check_access(host, http_host if http_port is not None else None, api_key, curve_key_dir,
                  dist)
    logging.basicConfig(level=log_level,
                        format="%(asctime)s nvllm-leader %(levelname)s %(message)s")
    from nvllm import LLM, SamplingParams

    set_process_title("nvllm-leader")
    if os.environ.get("NVLLM_PARENT_PID"):  # started by torchrun/srun's rank 0: die with it
        from nvllm.common.proc import die_with_parent

        die_with_parent(int(os.environ["NVLLM_PARENT_PID"]))

    t0 = time.perf_counter()
    llm = LLM(resolve_model(model), tensor_parallel_size=tp, device=device, dtype=dtype,
              block_size=block_size, enable_prefix_caching=enable_prefix_caching,
              max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
              max_model_len=max_model_len, num_kv_blocks=num_kv_blocks,
              gpu_memory_utilization=gpu_memory_utilization, cpu_kv_cache_gib=cpu_kv_cache_gib,
              attention_backend=attention_backend, async_scheduling=async_scheduling,
              micro_batch_overlap=micro_batch_overlap,
              micro_batch_min_tokens=micro_batch_min_tokens, enforce_eager=enforce_eager,
              plan_shm=plan_shm,
              max_queued_requests=max_queued_requests,
              batch_timeout_ms=batch_timeout_ms, client_timeout_s=client_timeout_s,
              heartbeat_timeout_s=heartbeat_timeout, step_timeout_s=step_timeout,
              restart_workers=restart_workers, max_worker_restarts=max_worker_restarts,
              dist=dist)
    with llm:
        cfg = llm.config
        click.echo(f"engine ready in {time.perf_counter() - t0:.1f}s: {cfg.model} tp={tp} "
                   f"device={cfg.device} dtype={cfg.dtype} workers={llm.worker_pids}")
        prompts = list(prompts) or (DEMO_PROMPTS if demo else [])
        if prompts:
            params = SamplingParams(temperature=temperature, max_tokens=max_tokens)
            t1 = time.perf_counter()
            outs = llm.generate(prompts, params)
            dt = time.perf_counter() - t1
            for out in outs:
                click.echo(f"\n--- {out.prompt!r}")
                if out.error:
                    click.echo(f"[error] {out.error}")
                else:
                    click.echo(f"{out.text!r}  ({len(out.token_ids)} tokens, "
                               f"{out.finish_reason})")
            n_out = sum(len(o.token_ids) for o in outs)
            n_in = sum(len(o.prompt_token_ids) for o in outs)
            click.echo(f"\n{len(outs)} requests, {n_in} prompt + {n_out} generated tokens in "
                       f"{dt:.2f}s: {n_out / dt:.1f} output tok/s, "
                       f"{(n_in + n_out) / dt:.1f} total tok/s")
            return
        from nvllm.leader.server import EngineServer

        server = EngineServer(llm.engine, host, port, model_name=served_model_name,
                              curve_key_dir=curve_key_dir, max_frame_bytes=max_frame_bytes)
        stop = threading.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
        click.echo(f"serving on {server.endpoint}; Ctrl-C to stop")
        gateway = None
        if http_port is not None:
            from nvllm.launch.openai.cli import start_gateway_process

            gateway = start_gateway_process(server.endpoint, http_host, http_port,
                                            served_model_name, api_key=api_key,
                                            curve_key_dir=curve_key_dir)
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
