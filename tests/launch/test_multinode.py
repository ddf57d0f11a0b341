"""Launch anywhere: two "nodes" on loopback, torchrun, and the SLURM job script under a
faked SLURM environment all give the tp=1 greedy output; liveness across nodes."""

from __future__ import annotations

import os
import re
import signal
import stat
import subprocess
import sys
import time

import pytest
from subproc import free_port, read_until, stop_process

from nvllm.launch.worker import dist_env, expand_nodelist

pytestmark = pytest.mark.e2e

LAUNCH = [sys.executable, "-m", "nvllm.launch.cli"]
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PROMPT = "The capital of France is"
GEN = ["--prompt", PROMPT, "--max-tokens", "12", "--device", "cpu"]


@pytest.fixture(scope="module")
def expected(tiny) -> str:
    """The tp=1 greedy text, as nvllm-launch prints it."""
    out = subprocess.run([*LAUNCH, "--model", tiny("qwen3"), *GEN], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return generated(out.stdout)


def generated(stdout: str) -> str:
    m = re.search(r"--- '" + re.escape(PROMPT) + r"'\n(.*)\(12 tokens, length\)", stdout)
    assert m, stdout
    return m.group(1).strip()


def test_two_nodes_on_loopback_match_tp1(tiny, expected, procs, tmp_path):
    from nvllm.common.zmq_utils import generate_keys

    # CURVE on the worker sockets, as a real multi-node run needs beyond loopback.
    keys = ["--curve-key-dir", str(generate_keys(tmp_path / "keys"))]
    port = free_port()
    # Node 1 first: it waits for node 0's leader to publish the engine spec.
    node1 = subprocess.Popen([*LAUNCH, "--nnodes", "2", "--node-rank", "1", "--master-port",
                              str(port), *keys], stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
    try:
        node0 = subprocess.run([*LAUNCH, "--model", tiny("qwen3"), "--tp", "2", "--nnodes", "2",
                                "--master-addr", "127.0.0.1", "--master-port", str(port), *keys,
                                *GEN], capture_output=True, text=True, timeout=180)
        assert node0.returncode == 0, node0.stderr
        assert generated(node0.stdout) == expected
        # The leader shut the group down: node 1's launcher and its worker exit cleanly.
        assert node1.wait(timeout=30) == 0
        assert "node 1: started ranks [1]" in node1.stdout.read()
    finally:
        stop_process(node1, signal.SIGKILL)


def test_data_parallel_replicas_on_two_nodes_on_loopback_match_tp1(tiny, expected,
                                                                     tmp_path):
    """The head runs replica 0 and the router; "node 1" runs replica 1 and registers it;
    CURVE keys the registration and the router's links. Greedy output through the
    router equals one engine's, on both replicas; SIGTERM stops both launches cleanly."""
    from nvllm import Client
    from nvllm.common.zmq_utils import generate_keys

    keys = str(generate_keys(tmp_path / "keys"))
    rpc = str(free_port())
    common = ["--model", tiny("qwen3"), "--device", "cpu", "--data-parallel-size", "2",
              "--data-parallel-size-local", "1", "--data-parallel-address", "127.0.0.1",
              "--data-parallel-rpc-port", rpc, "--curve-key-dir", keys,
              "--router-policy", "round_robin"]
    nodes = [subprocess.Popen([*LAUNCH, *common, "--data-parallel-start-rank", str(rank)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for rank in (1, 0)]  # node 1 first: it retries until the head listens
    try:
        assert "registered with 127.0.0.1:" + rpc in read_until(nodes[0], "registered", 120)
        head = read_until(nodes[1], r"serving on tcp://", 120)
        endpoint = re.search(r"serving on (tcp://\S+);", head)[1]
        with Client(endpoint, timeout_s=60, curve_key_dir=keys) as c:
            outs = [c.generate(PROMPT, {"max_tokens": 12, "temperature": 0.0})
                    for _ in range(2)]  # round robin: one on each replica
            assert [repr(o.outputs[0].text) for o in outs] == [expected] * 2  # as printed
            served = c.metrics()
        assert all(f'nvllm_router:replica_up{{replica="{r}"}} 1.0' in served for r in (0, 1))
        for node in nodes:
            node.send_signal(signal.SIGTERM)
        assert [node.wait(timeout=30) for node in nodes] == [0, 0]
    finally:
        for node in nodes:
            stop_process(node, signal.SIGKILL)


def test_torchrun_matches_tp1(tiny, expected):
    out = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
         "-m", "nvllm.launch.worker", "--model", tiny("qwen3"), *GEN],
        capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "tp=2" in out.stdout
    assert generated(out.stdout) == expected


def test_unauthenticated_binds_beyond_loopback_are_refused_up_front(tiny):
    for args, words in ((["--host", "0.0.0.0"], "--curve-key-dir"),
                        (["--nnodes", "2", "--master-port", "5", "--master-addr", "10.9.9.9"],
                         "--master-addr 10.9.9.9"),
                        (["--http-port", "1", "--http-host", "0.0.0.0"], "--api-key")):
        out = subprocess.run([*LAUNCH, "--model", tiny("qwen3"), *args], capture_output=True,
                             text=True, timeout=60)
        assert out.returncode == 2 and words in out.stderr, out.stderr


def test_slurm_env_translation():
    assert expand_nodelist("gpu[01-03,07],login1") == ["gpu01", "gpu02", "gpu03", "gpu07",
                                                       "login1"]
    assert expand_nodelist("n[8-10]") == ["n8", "n9", "n10"]
    env = dist_env({"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1",
                    "SLURM_JOB_NODELIST": "gpu[07-08]", "SLURM_TASKS_PER_NODE": "4(x2)",
                    "SLURM_JOB_ID": "123456"})
    assert env == {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4",
                   "MASTER_ADDR": "gpu07", "MASTER_PORT": "23456"}
    # torchrun's variables win when both are present (srun inside torchrun, or the reverse).
    tr = dist_env({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "h",
                   "MASTER_PORT": "1", "SLURM_PROCID": "1"})
    assert tr["RANK"] == "0" and tr["LOCAL_WORLD_SIZE"] == "2"
    with pytest.raises(RuntimeError, match="torchrun"):
        dist_env({})


def test_data_parallel_node_flags_place_replica_r_on_node_r_tp_over_devices():
    from nvllm.launch.dp_nodes import node_flags

    args = ["--model", "m", "--tp", "2", "--data-parallel-size", "3"]
    slurm = {"SLURM_NTASKS": "2", "SLURM_LOCALID": "0", "SLURM_JOB_NODELIST": "gpu[07-08]",
             "SLURM_TASKS_PER_NODE": "1(x2)", "SLURM_JOB_ID": "123456"}

    def flags(node: int) -> list[str]:
        return node_flags(args, dict(slurm, SLURM_PROCID=str(node)), devices_per_node=4)[
            len(args):]

    # 4 devices / tp 2: replicas 0, 1 on node 0 (gpu07, the head), replica 2 on node 1.
    common = ["--data-parallel-address", "gpu07", "--data-parallel-rpc-port", "23457"]
    assert flags(0) == ["--data-parallel-size-local", "2", "--data-parallel-start-rank", "0",
                        *common]
    assert flags(1) == ["--data-parallel-size-local", "1", "--data-parallel-start-rank", "2",
                        *common]
    with pytest.raises(ValueError, match="needs more devices than a node has"):
        node_flags(["--tp=8"], dict(slurm, SLURM_PROCID="0"), devices_per_node=4)
    with pytest.raises(ValueError, match="the job has 2"):
        node_flags([*args, "-dp", "5"], dict(slurm, SLURM_PROCID="0"), devices_per_node=4)


FAKE_SRUN = """#!/bin/bash
# Stands in for srun on one machine: SLURM_NTASKS local tasks, each told its rank.
pids=()
for ((i = 0; i < SLURM_NTASKS; i++)); do
    [ "$1" = "--kill-on-bad-exit=1" ] && shift
    SLURM_PROCID=$i SLURM_LOCALID=$i "$@" > "$FAKE_SLURM_LOG.$i" 2>&1 &
    pids+=($!)
done
rc=0
for p in "${pids[@]}"; do wait "$p" || rc=$?; done
cat "$FAKE_SLURM_LOG".*
exit $rc
"""


def test_sbatch_script_under_fake_slurm(tiny, expected, tmp_path):
    srun = tmp_path / "bin" / "srun"
    srun.parent.mkdir()
    srun.write_text(FAKE_SRUN)
    srun.chmod(srun.stat().st_mode | stat.S_IXUSR)
    job_id = str(free_port())  # MASTER_PORT = 20000 + job id % 20000: likely free
    env = dict(os.environ, PATH=f"{srun.parent}:{os.environ['PATH']}", SLURM_JOB_ID=job_id,
               SLURM_NTASKS="2", SLURM_TASKS_PER_NODE="2", SLURM_JOB_NODELIST="localhost",
               SLURM_JOB_NUM_NODES="1", NVLLM_PYTHON=sys.executable,
               FAKE_SLURM_LOG=str(tmp_path / "task"))
    env.pop("MASTER_ADDR", None)
    env.pop("MASTER_PORT", None)
    out = subprocess.run(["bash", os.path.join(REPO, "scripts/slurm/nvllm.sbatch"),
                          "--model", tiny("qwen3"), *GEN], capture_output=True, text=True,
                         timeout=240, env=env)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    port = 20000 + int(job_id) % 20000
    assert f"leader on localhost (rendezvous port {port})" in out.stdout
    assert "tp=2" in out.stdout
    assert generated(out.stdout) == expected


def test_remote_worker_death_and_leader_death_are_detected(tiny, procs):
    """Serving across two nodes: a remote worker's death ends in-flight requests with
    engine_unavailable naming the rank within 5 s; the leader's death makes the remote
    workers exit on their own."""
    from nvllm.common.client import Client
    from nvllm.common.errors import EngineDeadError

    port = free_port()
    node0 = subprocess.Popen([*LAUNCH, "--model", tiny("qwen3"), "--tp", "2", "--nnodes", "2",
                              "--master-port", str(port), "--device", "cpu"],
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    node1 = subprocess.Popen([*LAUNCH, "--nnodes", "2", "--node-rank", "1", "--master-port",
                              str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        text = read_until(node0, r"serving on tcp://", 120)
        endpoint = re.search(r"serving on (tcp://\S+);", text).group(1)
        deadline = time.monotonic() + 30
        while not (remote := procs.worker_pids_of(node1.pid)):
            assert time.monotonic() < deadline
            time.sleep(0.1)
        with Client(endpoint, timeout_s=60) as client:
            assert client.generate("Hi", {"max_tokens": 4, "ignore_eos": True}).finished
            stream = client.stream("Once upon a time", {"max_tokens": 1000, "ignore_eos": True})
            next(stream)
            os.kill(remote[0], signal.SIGKILL)
            t0 = time.monotonic()
            with pytest.raises(EngineDeadError) as e:
                for _ in stream:
                    pass
            assert time.monotonic() - t0 < 5.0
            assert str(e.value).startswith("worker rank 1 "), e.value
            assert client.health()["ready"] is False
        assert node1.wait(timeout=30) != 0  # its worker died: the node's launcher says so
    finally:
        stop_process(node0, signal.SIGKILL)
        stop_process(node1, signal.SIGKILL)


def test_remote_workers_exit_when_the_leader_dies(tiny, procs):
    port = free_port()
    node0 = subprocess.Popen([*LAUNCH, "--model", tiny("qwen3"), "--tp", "2", "--nnodes", "2",
                              "--master-port", str(port), "--device", "cpu",
                              "--heartbeat-timeout", "2"],
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    node1 = subprocess.Popen([*LAUNCH, "--nnodes", "2", "--node-rank", "1", "--master-port",
                              str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        read_until(node0, r"serving on tcp://", 120)
        remote = procs.worker_pids_of(node1.pid)
        assert remote
        node0.kill()  # SIGKILL: no shutdown message reaches anyone
        node0.wait()
        deadline = time.monotonic() + 10
        while any(procs.pid_alive(p) for p in remote):
            assert time.monotonic() < deadline, "remote worker outlived its leader"
            time.sleep(0.1)
        assert node1.wait(timeout=10) != 0
    finally:
        stop_process(node0, signal.SIGKILL)
        stop_process(node1, signal.SIGKILL)


def test_each_replica_on_a_node_gets_its_own_devices():
    from nvllm.launch.data_parallel import replica_devices

    assert [replica_devices(s, 2, None, 6) for s in range(3)] == ["0,1", "2,3", "4,5"]
    assert replica_devices(1, 2, "4,5,6,7", 4) == "6,7"
    assert replica_devices(1, 2, "4,5", 2) is None  # too few: replicas share them
