"""``python -m nvllm.launch.worker [nvllm-launch options]``: one rank started by torchrun
or srun.

It reads torchrun's RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and
MASTER_PORT, or translates SLURM's (SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID,
SLURM_JOB_NODELIST: its first host is the master) when started by srun. Global rank 0
also starts the leader, ``nvllm-launch --leader-only`` with this command's options (it
prints the client endpoint); then every rank reads the engine spec the leader publishes
in the rendezvous store and runs as a worker until the leader shuts the group down.
"""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys

logger = logging.getLogger("nvllm.launch.worker")


def expand_nodelist(nodelist: str) -> list[str]:
    """SLURM's compressed host list ("gpu[01-03,07],login1") -> its host names in order."""
    hosts: list[str] = []
    for m in re.finditer(r"([^,\[]+)(?:\[([^\]]+)\])?([^,]*)", nodelist):
        prefix, ranges, suffix = m.groups()
        if not prefix and not ranges:
            continue
        if ranges is None:
            hosts.append(prefix + suffix)
            continue
        for part in ranges.split(","):
            lo, _, hi = part.partition("-")
            for i in range(int(lo), int(hi or lo) + 1):
                hosts.append(f"{prefix}{i:0{len(lo)}d}{suffix}")
    return hosts


def slurm_port(job_id: str) -> int:
    """A rendezvous port per job, so two jobs sharing a node do not collide."""
    return 20000 + int(job_id) % 20000


def dist_env(environ: dict[str, str]) -> dict[str, str]:
    """The torchrun-style environment of this task, from torchrun's or SLURM's variables."""
    if "RANK" in environ:
        keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
        missing = [k for k in keys if k not in environ]
        if missing:
            raise RuntimeError(f"RANK is set but {', '.join(missing)} is not: start this "
                               "entry with torchrun (or srun) or set them all")
        out = {k: environ[k] for k in keys}
        out["LOCAL_WORLD_SIZE"] = environ.get("LOCAL_WORLD_SIZE", environ["WORLD_SIZE"])
        return out
    if "SLURM_PROCID" in environ:
        per_node = environ.get("SLURM_NTASKS_PER_NODE") or environ.get(
            "SLURM_TASKS_PER_NODE", "1").split("(")[0].split(",")[0]
        hosts = expand_nodelist(environ["SLURM_JOB_NODELIST"])
        return {
            "RANK": environ["SLURM_PROCID"], "WORLD_SIZE": environ["SLURM_NTASKS"],
            "LOCAL_RANK": environ["SLURM_LOCALID"], "LOCAL_WORLD_SIZE": per_node,
            "MASTER_ADDR": environ.get("MASTER_ADDR") or hosts[0],
            "MASTER_PORT": environ.get("MASTER_PORT")
            or str(slurm_port(environ.get("SLURM_JOB_ID", "0"))),
        }
    raise RuntimeError("no RANK or SLURM_PROCID in the environment: start this entry with "
                       "torchrun --nproc-per-node N -m nvllm.launch.worker ... or with srun")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    env = dist_env(dict(os.environ))
    rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
    logging.basicConfig(level=os.environ.get("NVLLM_LOG_LEVEL", "WARNING"),
                        format=f"%(asctime)s nvllm-worker-{rank} %(levelname)s %(message)s")
    if "--help" in argv or "-h" in argv:
        print(__doc__)
        return 0
    addr, port = env["MASTER_ADDR"], int(env["MASTER_PORT"])
    leader = None
    if rank == 0:
        # Our options last: the group's size and rendezvous are torchrun's, not the user's.
        cmd = [sys.executable, "-m", "nvllm.launch.cli", *argv, "--leader-only",
               "--tp", str(world), "--master-addr", addr, "--master-port", str(port)]
        leader = subprocess.Popen(cmd, env=dict(os.environ, NVLLM_PARENT_PID=str(os.getpid())),
                                  stdin=subprocess.DEVNULL)
    from nvllm.common.config import engine_default
    from nvllm.launch.spawn import connect_store, read_group_spec
    from nvllm.worker.main import worker_entry

    timeout_s = float(os.environ.get("NVLLM_WORKER_START_TIMEOUT")
                      or engine_default("worker_start_timeout_s"))
    code = 0
    try:
        spec = read_group_spec(connect_store(addr, port, timeout_s), timeout_s)
        if spec["world_size"] != world:
            raise RuntimeError(f"the leader expects {spec['world_size']} workers but this job "
                               f"has WORLD_SIZE={world}")
        spec.update(rank=rank, local_rank=int(env["LOCAL_RANK"]),
                    local_world_size=int(env["LOCAL_WORLD_SIZE"]), parent_pid=None)
        worker_entry(spec)
    except SystemExit as e:
        code = int(e.code or 0)
    except Exception as e:
        logger.error("rank %d: %s", rank, e)
        code = 1
    finally:
        if leader is not None:
            try:
                leader_code = leader.wait(timeout=30 if code == 0 else 5)
            except subprocess.TimeoutExpired:
                leader.terminate()
                leader_code = leader.wait()
            code = code or leader_code
    return code


if __name__ == "__main__":
    sys.exit(main())
