"""Worker process: one tensor-parallel rank. Started by the launcher as
``python -m nvllm.worker.main`` with its spec (JSON) in $NVLLM_WORKER_SPEC.

It loads its weight shard, reports how many KV blocks fit, allocates what the leader
decides, then executes step plans until told to shut down. It never decides anything.
A failure is reported to the leader (with its traceback) before the process exits, and
the worker exits by itself when its parent dies.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
import zmq

from nvllm.common import protocol
from nvllm.common.config import EngineConfig, ModelInfo
from nvllm.common.errors import ProtocolError
from nvllm.common.proc import die_with_parent, set_process_title
from nvllm.common.zmq_utils import make_socket
from nvllm.worker.model_runner import ModelRunner
from nvllm.worker.parallel import TPContext

logger = logging.getLogger("nvllm.worker")


def run_worker(spec: dict) -> None:
    rank, world = spec["rank"], spec["world_size"]
    cfg_dict = dict(spec["config"])
    config = EngineConfig(**cfg_dict)
    config.model_info = ModelInfo.from_pretrained(config.model)
    if config.device == "cuda":
        local_rank = spec.get("local_rank", rank)
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        backend = "nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // spec.get("local_world_size", world)))
    torch.manual_seed(config.seed)

    ctx = zmq.Context()
    plan_sock = make_socket(ctx, zmq.PULL)
    plan_sock.connect(spec["plan_endpoint"])
    result_sock = make_socket(ctx, zmq.PUSH)
    result_sock.connect(spec["result_endpoint"])
    step_id = 0
    try:
        if world > 1:
            dist.init_process_group(backend, init_method=spec["dist_init_method"], rank=rank,
                                    world_size=world,
                                    timeout=timedelta(seconds=config.step_timeout_s))
            tp = TPContext(rank, world, dist.group.WORLD)
        else:
            tp = TPContext()
        runner = ModelRunner(config, tp, device)
        result_sock.send(protocol.encode(protocol.WorkerReady(
            rank, "loaded", runner.available_kv_blocks(), {"block_bytes": runner.block_bytes()})))
        while True:
            data = plan_sock.recv()
            try:
                msg = protocol.decode(data)
            except ProtocolError as e:
                logger.error("rank %d: dropping malformed plan frame: %s", rank, e)
                continue
            if isinstance(msg, protocol.Shutdown):
                break
            if isinstance(msg, protocol.InitKVCache):
                runner.init_kv_cache(msg.num_blocks)
                result_sock.send(protocol.encode(
                    protocol.WorkerReady(rank, "kv", msg.num_blocks, {})))
            elif isinstance(msg, protocol.StepPlan):
                step_id = msg.step_id
                result = runner.execute(msg)
                if result is not None:
                    result_sock.send(protocol.encode(result))
    except Exception as e:
        result_sock.send(protocol.encode(protocol.WorkerError(
            rank, step_id, f"{type(e).__name__}: {e}", traceback.format_exc())))
        time.sleep(0.2)  # let ZMQ flush the error before the process exits
        raise
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass
        plan_sock.close(0)
        result_sock.close(linger=500)
        ctx.term()


def main() -> None:
    spec = json.loads(os.environ["NVLLM_WORKER_SPEC"])
    logging.basicConfig(level=os.environ.get("NVLLM_LOG_LEVEL", "WARNING"),
                        format=f"%(asctime)s nvllm-worker-{spec['rank']} %(levelname)s "
                               "%(message)s")
    set_process_title(f"nvllm-worker-{spec['rank']}")
    if spec.get("parent_pid"):
        die_with_parent(spec["parent_pid"])
    # The launcher stops workers with SIGTERM; Ctrl-C in a terminal reaches the whole
    # process group, and the leader handles it, so workers ignore SIGINT.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        run_worker(spec)
    except Exception:
        sys.exit(1)


if __name__ == "__main__":
    main()
