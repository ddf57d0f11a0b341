"""Data-parallel replicas on several nodes: where each node's replicas serve, and how the
head node's router learns their endpoints.

Every node runs ``nvllm-launch --data-parallel-size N --data-parallel-size-local L
--data-parallel-start-rank R --data-parallel-address HEAD --data-parallel-rpc-port P``
(vLLM's flags). The head (start rank 0) runs replicas 0..L-1 and, once every replica
is known, the router; it listens on HEAD:P (``collect_endpoints``) for the other nodes.
Another node starts replicas R..R+L-1 on the address it reaches HEAD from
(``local_address``), and once they serve sends their endpoints to HEAD:P
(``register_endpoints``) until the head acknowledges them. Ports are the replicas' own,
kept across restarts (the supervisor restarts a replica on its port), so the router's
list stays true while each node's launch lives.

With a CURVE key folder the registration socket is keyed as the client endpoint is (it
admits DIR/clients/ keys; a node registers with DIR/client.key_secret), and so are the
replicas, whose only client is the router: a host that can reach the ports but has no
key neither registers a replica nor submits to one.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from dataclasses import dataclass

import msgspec
import zmq

from nvllm.common.zmq_utils import check_curve_bind, curve_client, curve_server

logger = logging.getLogger(__name__)

RESEND_S = 2.0  # a node re-sends its registration until the head acknowledges it


@dataclass(frozen=True, slots=True)
class Placement:
    """Which replicas this node runs, and where the head is."""

    size: int  # --data-parallel-size: replicas over all nodes
    local: int  # --data-parallel-size-local: replicas on this node
    start_rank: int  # --data-parallel-start-rank: the first of them
    address: str  # --data-parallel-address: the head node's
    rpc_port: int  # --data-parallel-rpc-port: the head's registration port

    @property
    def head(self) -> bool:
        return self.start_rank == 0

    @property
    def ranks(self) -> range:
        return range(self.start_rank, self.start_rank + self.local)

    def check(self) -> None:
        """ValueError naming the flag to fix."""
        if not 1 <= self.local <= self.size:
            raise ValueError(f"--data-parallel-size-local {self.local} must be 1.."
                             f"{self.size} (--data-parallel-size)")
        if self.start_rank + self.local > self.size:
            raise ValueError(f"--data-parallel-start-rank {self.start_rank} + "
                             f"--data-parallel-size-local {self.local} exceeds "
                             f"--data-parallel-size {self.size}")
        if self.local < self.size and not self.rpc_port:
            raise ValueError("replicas on several nodes need --data-parallel-rpc-port (a "
                             "free port on the head node, --data-parallel-address)")


def local_address(head: str) -> str:
    """This host's address on the route to `head` (127.0.0.1 when `head` is loopback):
    where this node's replicas bind, and what the head's router connects to."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((socket.gethostbyname(head), 9))  # UDP: no packet is sent
        return s.getsockname()[0]


def collect_endpoints(placement: Placement, curve_key_dir: str | os.PathLike | None,
                      timeout_s: float) -> dict[int, str]:
    """On the head: the endpoints of the replicas the other nodes run, by rank, as they
    register on --data-parallel-address:--data-parallel-rpc-port; TimeoutError naming the
    missing ranks after `timeout_s`."""
    check_curve_bind(placement.address, curve_key_dir,
                     "the data-parallel registration port (--data-parallel-address)")
    expected = set(range(placement.size)) - set(placement.ranks)
    found: dict[int, str] = {}
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 1000)  # the last acknowledgement goes out
    sock.setsockopt(zmq.MAXMSGSIZE, 1 << 16)
    auth = curve_server(ctx, sock, curve_key_dir) if curve_key_dir is not None else None
    try:
        sock.bind(f"tcp://{placement.address}:{placement.rpc_port}")
        deadline = time.monotonic() + timeout_s
        while not expected <= set(found):
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"replicas {sorted(expected - set(found))} did not register on "
                    f"{placement.address}:{placement.rpc_port} within {timeout_s:.0f} s: "
                    f"start nvllm-launch on their nodes with the same --data-parallel-"
                    f"address/--data-parallel-rpc-port (and --curve-key-dir)")
            if not sock.poll(100):
                continue
            peer, frame = sock.recv_multipart()
            try:
                ranks = msgspec.msgpack.decode(frame, type=dict[int, str])
            except msgspec.DecodeError as e:
                logger.warning("ignoring a registration that is not {rank: endpoint}: %s", e)
                continue
            unknown = set(ranks) - expected
            if unknown:
                logger.error("ignoring replicas %s: not ranks another node runs (%s)",
                             sorted(unknown), sorted(expected))
            for rank in set(ranks) & expected:
                found[rank] = ranks[rank]
            logger.info("node registered replicas %s", {r: found[r] for r in ranks
                                                         if r in found})
            sock.send_multipart([peer, b"ok"])
    finally:
        sock.close()
        if auth is not None:
            auth.stop()
        ctx.term()
    return found


def register_endpoints(placement: Placement, endpoints: dict[int, str],
                       curve_key_dir: str | os.PathLike | None, timeout_s: float) -> None:
    """On another node: send this node's replica endpoints to the head until it
    acknowledges them; TimeoutError after `timeout_s` (the head is not up, or refused our
    key: CURVE refusals are silent)."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if curve_key_dir is not None:
        curve_client(sock, curve_key_dir)
    try:
        sock.connect(f"tcp://{placement.address}:{placement.rpc_port}")
        frame = msgspec.msgpack.encode(endpoints)
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                sock.send(frame, flags=zmq.NOBLOCK)
            except zmq.Again:  # not connected yet: the next turn tries again
                pass
            if sock.poll(int(RESEND_S * 1000)):
                sock.recv()
                return
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"the head node {placement.address}:{placement.rpc_port} did not "
                    f"acknowledge replicas {sorted(endpoints)} in {timeout_s:.0f} s (is its "
                    f"launch up, and this node's key in its {curve_key_dir or 'DIR'}/clients/?)")
    finally:
        sock.close()
        ctx.term()


def _flag_value(argv: list[str], names: tuple[str, ...], default: int) -> int:
    """The int value of the last of `names` in argv (``--x V`` or ``--x=V``)."""
    value = default
    for i, arg in enumerate(argv):
        name, eq, rest = arg.partition("=")
        if name in names:
            value = int(rest if eq else argv[i + 1])
    return value


def node_flags(argv: list[str], environ: dict[str, str], devices_per_node: int) -> list[str]:
    """This node's nvllm-launch flags when one task per node was started by torchrun
    (``--nproc-per-node 1``) or srun (``--ntasks-per-node 1``): node rank and count from
    RANK/WORLD_SIZE or SLURM's, the head at MASTER_ADDR, registering on MASTER_PORT + 1
    (torchrun's own store holds MASTER_PORT); replica
    r on node r*T // devices_per_node, as the node launcher places tensor-parallel ranks."""
    from nvllm.launch.worker import dist_env

    env = dist_env(environ)
    node, nnodes = int(env["RANK"]), int(env["WORLD_SIZE"])
    tp = _flag_value(argv, ("--tp", "--tensor-parallel-size"), 1)
    size = _flag_value(argv, ("--data-parallel-size", "-dp"), 1)
    per_node = devices_per_node // tp
    if per_node < 1:
        raise ValueError(f"--tp {tp} needs more devices than a node has ({devices_per_node}; "
                         f"NVLLM_DEVICES_PER_NODE): a replica spans one node")
    if size > per_node * nnodes:
        raise ValueError(f"--data-parallel-size {size} x --tp {tp} needs "
                         f"{-(-size // per_node)} nodes of {devices_per_node} devices; "
                         f"the job has {nnodes}")
    start = node * per_node
    if start >= size:
        raise ValueError(f"node {node} has no replica: --data-parallel-size {size} fills "
                         f"{-(-size // per_node)} nodes of {per_node}; start fewer nodes")
    return [*argv, "--data-parallel-size-local", str(min(per_node, size - start)),
            "--data-parallel-start-rank", str(start),
            "--data-parallel-address", env["MASTER_ADDR"],
            "--data-parallel-rpc-port", str(int(env["MASTER_PORT"]) + 1)]


def _devices_per_node(environ: dict[str, str]) -> int:
    if environ.get("NVLLM_DEVICES_PER_NODE"):
        return int(environ["NVLLM_DEVICES_PER_NODE"])
    try:
        import torch

        return max(1, torch.cuda.device_count())
    except ImportError:
        return 1


def main(argv: list[str] | None = None) -> None:
    """``python -m nvllm.launch.dp_nodes [nvllm-launch options]``: one per node (the job
    scripts scripts/torchrun_dp.sh, scripts/slurm/nvllm-dp.sbatch); execs nvllm-launch with
    this node's data-parallel flags."""
    import sys

    argv = list(sys.argv[1:] if argv is None else argv)
    environ = dict(os.environ)
    flags = node_flags(argv, environ, _devices_per_node(environ))
    os.execv(sys.executable, [sys.executable, "-m", "nvllm.launch.cli", *flags])


if __name__ == "__main__":
    main()
