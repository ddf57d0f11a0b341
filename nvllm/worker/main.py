"""Worker process: one tensor-parallel rank.

Started by the leader's launcher as ``python -m nvllm.worker.main`` with its spec (JSON)
in $NVLLM_WORKER_SPEC, or in-process by ``nvllm.launch.worker`` (torchrun, srun), which
reads the spec from the rendezvous store.

It loads its weight shard, reports how many KV blocks fit, allocates what the leader
decides, then executes step plans until told to shut down. It never decides anything.
A failure is reported to the leader (with its traceback) before the process exits. The
worker exits by itself when its parent dies or the leader stops answering heartbeats,
so no worker outlives its engine.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable
from datetime import timedelta

import msgpack
import torch
import torch.distributed as dist
import zmq

from nvllm.common import trace, worker_protocol
from nvllm.common.config import EngineConfig
from nvllm.common.errors import ProtocolError
from nvllm.common.pageout import page_out_libraries
from nvllm.common.proc import die_with_parent, freeze_startup_objects, set_process_title
from nvllm.common.transport import ArrayReader
from nvllm.common.zmq_utils import make_socket
from nvllm.worker.cpu_malloc import keep_freed_memory, trim_after_load, trim_after_step
from nvllm.worker.model_runner import InvalidPlan, ModelRunner
from nvllm.worker.parallel import TPContext
from nvllm.worker.shm_allreduce import attach as attach_shm_allreduce
from nvllm.worker.sleep import WorkerSleep
from nvllm.worker.thread_tuner import ThreadTuner
from nvllm.worker.weight_sources import MESSAGES as WEIGHT_SOURCE_MESSAGES
from nvllm.worker.weight_sources import WeightSources
from nvllm.worker.weight_update import WeightUpdateError, WeightUpdater

logger = logging.getLogger("nvllm.worker")

RECV_POLL_MS = 500
# A plan is kilobytes; a frame beyond this is hostile or broken, and ZMQ drops it.
MAX_PLAN_BYTES = 256 << 20


def heartbeat_loop(ctx: zmq.Context, endpoint: str, rank: int, timeout_s: float,
                   secure: Callable[[zmq.Socket], None], stop: threading.Event) -> None:
    """Ping the leader every timeout/8 s; exit the process if it stops answering.

    Runs in its own thread so a long step or a stuck collective does not silence it: the
    leader tells a slow worker from a dead one, and a worker whose leader (or whose
    leader's host) is gone does not wait forever.
    """
    sock = make_socket(ctx, zmq.DEALER, max_msg_bytes=1024)
    secure(sock)
    sock.connect(endpoint)
    ping = msgpack.packb([rank, os.getpid(), socket.gethostname()])
    last_answer = time.monotonic()
    interval = max(0.05, timeout_s / 8)
    while not stop.is_set():
        try:
            sock.send(ping, flags=zmq.NOBLOCK)
        except zmq.Again:
            pass
        deadline = time.monotonic() + interval
        while (left := deadline - time.monotonic()) > 0:
            if sock.poll(int(left * 1000) + 1):
                sock.recv()
                last_answer = time.monotonic()
        now = time.monotonic()
        if now - deadline > timeout_s / 2:
            # We overslept: this process was not running (SIGSTOP, Ctrl-Z together with
            # the leader, a frozen VM). The silence is ours; give the leader a fresh timeout.
            last_answer = now
        if now - last_answer > timeout_s and not stop.is_set():
            logger.error("rank %d: the leader has not answered heartbeats for %.1f s; "
                         "exiting", rank, now - last_answer)
            os._exit(3)
    sock.close(0)


class PlanConnectionWatch:
    """ZMQ drops the connection of a peer that sends a frame over MAXMSGSIZE and does not
    reconnect it; a plan socket in that state would wait forever. A disconnect not undone
    within grace_s becomes an error the leader hears about (and the worker exits)."""

    def __init__(self, sock: zmq.Socket, grace_s: float, max_bytes: int) -> None:
        self.mon = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECTED)
        self.grace_s, self.max_bytes = grace_s, max_bytes
        self.lost_at: float | None = None

    def check(self) -> None:
        from zmq.utils.monitor import recv_monitor_message

        while self.mon.poll(0):
            event = recv_monitor_message(self.mon)["event"]
            self.lost_at = time.monotonic() if event == zmq.EVENT_DISCONNECTED else None
        if self.lost_at is not None and time.monotonic() - self.lost_at > self.grace_s:
            raise ConnectionError(
                f"lost the plan connection to the leader for {self.grace_s:.0f} s (a plan "
                f"frame over the {self.max_bytes}-byte limit, or the network)")


class PlanReader:
    """Takes plans off the plan socket and decodes them.

    Threaded (on GPU), plan N+1 is received, decoded and type-checked on its own thread
    while step N runs on the device. On CPU the step's compute owns every core and a
    reader thread only preempts it (measured: about 10% fewer tokens/s), so plans are
    read inline. A lost connection surfaces from ``get`` as the watch's exception.
    """

    def __init__(self, sock: zmq.Socket, watch: PlanConnectionWatch, rank: int,
                 max_bytes: int, threaded: bool) -> None:
        self.sock, self.watch, self.rank, self.max_bytes = sock, watch, rank, max_bytes
        self.thread = None
        if threaded:
            self.inbox: queue.Queue = queue.Queue()
            self.stop = threading.Event()
            self.thread = threading.Thread(target=self._run, daemon=True, name="plan-reader")
            self.thread.start()

    def _read_one(self):
        """The next message, or None after a quiet poll interval or a malformed frame."""
        # Poll, never block: the heartbeat thread ends the process if the leader dies.
        if not self.sock.poll(RECV_POLL_MS):
            self.watch.check()
            return None
        try:
            return worker_protocol.decode(self.sock.recv(), self.max_bytes)
        except ProtocolError as e:
            logger.error("rank %d: dropping malformed plan frame: %s", self.rank, e)
            return None

    def _run(self) -> None:
        while not self.stop.is_set():
            try:
                msg = self._read_one()
            except Exception as e:  # the connection watch's verdict, or a closed socket
                self.inbox.put(e)
                return
            if msg is not None:
                self.inbox.put(msg)
                if isinstance(msg, worker_protocol.Shutdown):
                    return

    def get(self):
        if self.thread is None:
            while (msg := self._read_one()) is None:
                pass
            return msg
        msg = self.inbox.get()
        if isinstance(msg, Exception):
            raise msg
        return msg

    def close(self) -> None:
        if self.thread is not None:
            self.stop.set()
            self.thread.join(timeout=2 * RECV_POLL_MS / 1000)


def init_distributed(spec: dict, backend: str, timeout_s: float) -> None:
    """Join the torch.distributed group: a FileStore on one host, a TCPStore across nodes."""
    rank, world = spec["rank"], spec["world_size"]
    rdzv = spec["rendezvous"]
    timeout = timedelta(seconds=timeout_s)
    if "file" in rdzv:
        dist.init_process_group(backend, init_method=f"file://{rdzv['file']}", rank=rank,
                                world_size=world, timeout=timeout)
        return
    host, port = rdzv["tcp"]
    store = dist.TCPStore(host, port, is_master=False, timeout=timeout)
    dist.init_process_group(backend, store=dist.PrefixStore(rdzv["prefix"], store),
                            rank=rank, world_size=world, timeout=timeout)


def pin_to_cores(local_rank: int, threads: int) -> None:
    """Pin this process (before torch starts its threads, which inherit it) to the
    local_rank-th run of `threads` cores among those it may use; a no-op when there are
    too few or the platform cannot."""
    try:
        cores = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return
    mine = cores[local_rank * threads:(local_rank + 1) * threads]
    if len(mine) < threads:
        logger.warning("cpu_pin_workers: rank %d needs cores %d-%d of %d: not pinned",
                       local_rank, local_rank * threads, (local_rank + 1) * threads - 1,
                       len(cores))
        return
    os.sched_setaffinity(0, mine)


def run_worker(spec: dict) -> None:
    rank, world = spec["rank"], spec["world_size"]
    config = EngineConfig(**dict(spec["config"]))
    config.model = spec.get("model_override") or config.model
    config.resolve_source()
    local_rank = spec.get("local_rank", rank)
    if config.device == "cuda":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        backend = "nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"
        threads = config.cpu_threads or max(
            1, (os.cpu_count() or 1) // spec.get("local_world_size", world))
        if config.cpu_pin_workers:
            pin_to_cores(local_rank, threads)
        torch.set_num_threads(threads)
        if config.cpu_malloc_reuse:
            keep_freed_memory()
    # What keep_freed_memory keeps of a big prefill goes back after it.
    trim_steps = device.type == "cpu" and config.cpu_malloc_reuse
    torch.manual_seed(config.seed)

    ctx = zmq.Context()
    secure = _curve_client(spec.get("curve_key_dir"))
    max_plan_bytes = spec.get("max_plan_bytes") or MAX_PLAN_BYTES
    plan_sock = make_socket(ctx, zmq.PULL, max_msg_bytes=max_plan_bytes)
    result_sock = make_socket(ctx, zmq.PUSH)
    for s in (plan_sock, result_sock):
        secure(s)
    watch = PlanConnectionWatch(plan_sock, config.heartbeat_timeout_s, max_plan_bytes)
    plan_sock.connect(spec["plan_endpoints"][rank])
    result_sock.connect(spec["result_endpoint"])
    stop_heartbeats = threading.Event()
    hb = threading.Thread(target=heartbeat_loop, daemon=True, name="heartbeat",
                          args=(ctx, spec["heartbeat_endpoint"], rank,
                                config.heartbeat_timeout_s, secure, stop_heartbeats))
    hb.start()
    step_id = 0
    reader = tp = sources = None
    tr = trace.tracer("worker") if rank == 0 else None  # rank 0 sends the results
    arrays = ArrayReader()  # maps the leader's plan ring (read-only) on first use
    try:
        if world > 1:
            init_distributed(spec, backend, config.step_timeout_s)
            tp = TPContext(rank, world, dist.group.WORLD)
            if device.type == "cpu" and spec.get("shm_allreduce"):
                tp.shm = attach_shm_allreduce(spec["shm_allreduce"], rank, world, tp.group,
                                              config.step_timeout_s)
        else:
            tp = TPContext()
        runner = ModelRunner(config, tp, device)
        sleeper = WorkerSleep(runner)  # sleep / wake_up (nvllm/worker/sleep.py)
        if device.type == "cpu" and world == 1 and config.cpu_thread_tuning \
                and torch.get_num_threads() > 1:
            runner.threads = ThreadTuner(torch.get_num_threads())
        result_sock.send(worker_protocol.encode(worker_protocol.WorkerReady(
            rank, "loaded", runner.available_kv_blocks(), *runner.load_stats)))
        reader = PlanReader(plan_sock, watch, rank, max_plan_bytes,
                            threaded=device.type == "cuda")
        while True:
            msg = reader.get()
            if isinstance(msg, worker_protocol.Shutdown):
                break
            if isinstance(msg, worker_protocol.InitKVCache):
                runner.init_kv_cache(msg.num_blocks)
                if device.type == "cpu":
                    trim_after_load(rank)
                freeze_startup_objects()
                if config.page_out_libraries:
                    page_out_libraries(f"rank {rank}")
                result_sock.send(worker_protocol.encode(
                    worker_protocol.WorkerReady(rank, "kv", msg.num_blocks)))
            elif isinstance(msg, worker_protocol.LoadGrammars):
                runner.load_grammars(msg)
            elif isinstance(msg, (worker_protocol.WeightChunk, worker_protocol.CommitWeights,
                                  worker_protocol.AbortWeights)):
                ack = update_weights(runner.weights, msg, rank)
                if ack is not None:
                    result_sock.send(worker_protocol.encode(ack))
            elif isinstance(msg, WEIGHT_SOURCE_MESSAGES):  # a trainer's group, a path
                if sources is None:
                    sources = WeightSources(runner.weights, device, rank)
                result_sock.send(worker_protocol.encode(sources.handle(msg)))
            elif isinstance(msg, (worker_protocol.SleepWorker, worker_protocol.WakeWorker)):
                result_sock.send(worker_protocol.encode(sleeper.handle(msg, rank)))
            elif isinstance(msg, worker_protocol.StepPlan):
                step_id = msg.step_id
                try:
                    result = runner.execute(msg, arrays)  # copies out of the ring first
                except InvalidPlan as e:  # nothing was touched: say so and carry on
                    logger.error("rank %d: rejecting step %d: %s", rank, step_id, e)
                    result_sock.send(worker_protocol.encode(worker_protocol.WorkerError(
                        rank, step_id, f"invalid plan: {e}", "")))
                    continue
                if result is not None:
                    data = worker_protocol.encode(result)
                    if tr is not None:
                        tr.event("result_sent", step=step_id)
                    result_sock.send(data)
                if trim_steps:  # while the leader reads the result
                    trim_after_step(runner.step_tokens)
            else:
                logger.error("rank %d: ignoring a %s on the plan socket", rank,
                             type(msg).__name__)
    except Exception as e:
        result_sock.send(worker_protocol.encode(worker_protocol.WorkerError(
            rank, step_id, f"{type(e).__name__}: {e}", traceback.format_exc())))
        time.sleep(0.2)  # let ZMQ flush the error before the process exits
        raise
    finally:
        if reader is not None:
            reader.close()
        if tr is not None:
            tr.close()
        arrays.close()
        stop_heartbeats.set()
        hb.join(timeout=2)
        if sources is not None:
            sources.close()
        if tp is not None and tp.shm is not None:
            tp.shm.close()
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass
        # Closes every socket (monitors included); a last error still gets 0.5 s to leave.
        ctx.destroy(linger=500)


def update_weights(weights: WeightUpdater, msg, rank: int
                   ) -> worker_protocol.WeightsAck | None:
    """One weight-update message on this rank; the answer the leader waits for (a chunk
    or a commit), with the refusal's reason when the rank refused (and staged nothing)."""
    if isinstance(msg, worker_protocol.AbortWeights):
        weights.abort(msg.update_id)
        return None
    commit = isinstance(msg, worker_protocol.CommitWeights)
    try:
        if commit:
            weights.commit(msg.update_id)
        else:
            weights.stage(msg)
    except WeightUpdateError as e:
        logger.error("rank %d: weight update %d refused: %s", rank, msg.update_id, e)
        return worker_protocol.WeightsAck(rank, msg.update_id, -1 if commit else msg.chunk,
                                          str(e) or "refused")
    return worker_protocol.WeightsAck(rank, msg.update_id, -1 if commit else msg.chunk,
                                      "", weights.staged_bytes)


def _curve_client(key_dir: str | None) -> Callable[[zmq.Socket], None]:
    """With a key folder, every socket to the leader is a CURVE client with the workers'
    keypair DIR/worker.key_secret (the only key the leader's worker sockets admit) of the
    server DIR/server.key. Without one, the endpoints are ipc paths in the leader's
    private folder (one host) or loopback tcp."""
    if not key_dir:
        return lambda s: None
    from nvllm.common.zmq_utils import curve_worker

    return lambda s: curve_worker(s, key_dir)


def worker_entry(spec: dict) -> None:
    """Name the process, tie it to its parent, run; exit code 1 on failure."""
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
        logger.exception("rank %d failed", spec["rank"])
        sys.exit(1)


def main() -> None:
    worker_entry(json.loads(os.environ["NVLLM_WORKER_SPEC"]))


if __name__ == "__main__":
    main()
