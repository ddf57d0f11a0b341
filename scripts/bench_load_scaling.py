"""Work per request at two load sizes: does any process get slower per request as the
number of queued ZMQ streams grows (issue 22's 20,000-stream slump)?

One in-process leader (an EngineServer thread over an LLM on the `qwen3` tiny preset, as
tests/e2e/test_load.py serves it) takes N concurrent streams from client processes
(tests/support/load_clients.py, AsyncClient), once per size in --sizes. For each size it
prints requests/s and the CPU seconds per request of the leader's serve thread, of the
client processes and of the worker processes, the engine steps per request and the
workers' own time per step (StepResult.worker_time_s), then the ratio of the last size to
the first: a figure near 1.0 is flat (linear total work), one that grows with the size is
a per-request cost that grows with the number of live requests.

    python scripts/bench_load_scaling.py --sizes 2000,20000
    python scripts/bench_load_scaling.py --sizes 2000,8000 --profile /tmp/prof  # cProfile
        # of the serve thread per size (leader-N.prof; read with python -m pstats)

Wall-clock figures (req/s, worker time per step) follow whatever else the machine runs;
the CPU seconds per request are the figures to compare between runs.
"""

from __future__ import annotations

import argparse
import ast
import cProfile
import json
import os
import pathlib
import resource
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from statistics import median

ROOT = pathlib.Path(__file__).resolve().parents[1]
CLIENTS = ROOT / "tests" / "support" / "load_clients.py"
MAX_TOKENS = 4  # as the load test
TICK = os.sysconf("SC_CLK_TCK")


def proc_cpu(path: str) -> float:
    """utime + stime of a /proc/.../stat, in seconds (0 if it is gone)."""
    try:
        with open(path) as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / TICK


def run_clients(endpoint: str, total: int, processes: int) -> int:
    per = -(-total // processes)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(ROOT), os.environ.get("PYTHONPATH", "")]))
    procs = [subprocess.Popen([sys.executable, str(CLIENTS), "zmq", endpoint, str(k * per),
                               str(min(per, total - k * per)), str(MAX_TOKENS)],
                              stdout=subprocess.PIPE, text=True, env=env)
             for k in range(processes) if k * per < total]
    done = 0
    for p in procs:
        out, _ = p.communicate(timeout=3600)
        if p.returncode != 0:
            raise SystemExit(f"a client process failed ({p.returncode})")
        rows = json.loads(out)
        bad = [r for r in rows if r[1:] != [1, MAX_TOKENS, None]]
        if bad:
            raise SystemExit(f"{len(bad)} requests not served exactly once, e.g. {bad[:3]}")
        done += len(rows)
    return done


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="2000,20000",
                    help="comma-separated numbers of concurrent ZMQ streams (default: %(default)s)")
    ap.add_argument("--processes", type=int, default=4,
                    help="client processes sharing the streams (default: %(default)s)")
    ap.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                    help="an EngineConfig field for the served engine (repeatable), e.g. "
                         "cpu_threads=1; values are read as Python literals")
    ap.add_argument("--profile", metavar="DIR",
                    help="cProfile the leader's serve thread; DIR/leader-N.prof per size")
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    options = {}
    for kv in args.option:
        key, _, value = kv.partition("=")
        try:
            options[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            options[key] = value
    sys.path.insert(0, str(ROOT))
    from nvllm import LLM
    from nvllm.launch.tiny import ensure_tiny_checkpoint
    from nvllm.leader.server import EngineServer

    with tempfile.TemporaryDirectory() as tmp:
        llm = LLM(str(ensure_tiny_checkpoint("qwen3", tmp)), device="cpu", dtype="float32",
                  max_num_seqs=256, max_num_batched_tokens=2048,
                  max_queued_requests=max(sizes) + 100, **options)
        server = EngineServer(llm.engine)
        engine = llm.engine
        step_log: list[tuple[bool, float]] = []  # per applied result: (admits any, worker s)
        admitting: deque[bool] = deque()  # per plan in flight
        send, apply = engine._send, engine._apply_oldest_result

        def logged_send(sched):
            admitting.append(any(not seq.on_worker for seq, _ in sched.scheduled))
            send(sched)

        def logged_apply(out, cancelled):
            apply(out, cancelled)
            step_log.append((admitting.popleft(), engine.last_step.worker_time_s))
        engine._send, engine._apply_oldest_result = logged_send, logged_apply
        stop = threading.Event()
        profiles: dict[int, cProfile.Profile] = {}
        current: list[int] = [0]
        switch = threading.Event()  # the serve thread swaps profilers between sizes

        def serve() -> None:
            if args.profile is None:
                return server.serve(stop)
            # One profiler per size: the loop below sets `current` and `switch` between
            # sizes, and the serve loop is wrapped so the swap happens on its own thread.
            orig_step = server._step

            def step() -> None:
                if switch.is_set():
                    switch.clear()
                    for p in profiles.values():
                        p.disable()
                    if current[0]:
                        profiles.setdefault(current[0], cProfile.Profile()).enable()
                orig_step()
            server._step = step
            server.serve(stop)

        thread = threading.Thread(target=serve, daemon=True)
        thread.start()
        tid = thread.native_id
        rows = []
        try:
            run_clients(server.endpoint, 20, 1)  # warm up: first steps, allocator
            for n in sizes:
                if args.profile:
                    current[0] = n
                    switch.set()
                workers = [f"/proc/{pid}/stat" for pid in llm.worker_pids]
                leader0 = proc_cpu(f"/proc/self/task/{tid}/stat")
                workers0 = sum(map(proc_cpu, workers))
                kids0 = resource.getrusage(resource.RUSAGE_CHILDREN)
                step0, wt0 = llm.engine.last_step.step_id, llm.engine.total_worker_s
                step_log.clear()
                t0 = time.monotonic()
                got = run_clients(server.endpoint, n, args.processes)
                wall = time.monotonic() - t0
                while llm.engine.has_unfinished_requests():  # the last step's bookkeeping
                    time.sleep(0.01)
                kids1 = resource.getrusage(resource.RUSAGE_CHILDREN)
                steps = llm.engine.last_step.step_id - step0
                rows.append(dict(
                    n=n, got=got, wall_s=wall, req_s=n / wall,
                    leader_ms=1e3 * (proc_cpu(f"/proc/self/task/{tid}/stat") - leader0) / n,
                    client_ms=1e3 * (kids1.ru_utime + kids1.ru_stime - kids0.ru_utime
                                     - kids0.ru_stime) / n,
                    worker_ms=1e3 * (sum(map(proc_cpu, workers)) - workers0) / n,
                    steps_per_req=steps / n,
                    worker_ms_per_step=1e3 * (llm.engine.total_worker_s - wt0) / max(steps, 1),
                    admit_ms=1e3 * median([w for a, w in step_log if a] or [0]),
                    decode_ms=1e3 * median([w for a, w in step_log if not a] or [0])))
                r = rows[-1]
                print(f"{n:>7} streams: {r['wall_s']:6.1f} s, {r['req_s']:6.0f} req/s; CPU ms "
                      f"per request: leader {r['leader_ms']:.3f}, clients {r['client_ms']:.3f}, "
                      f"workers {r['worker_ms']:.3f}; {r['steps_per_req']:.4f} steps/request, "
                      f"workers {r['worker_ms_per_step']:.1f} ms/step (median: "
                      f"{r['admit_ms']:.1f} admitting, {r['decode_ms']:.1f} decode-only)",
                      flush=True)
            if args.profile:
                current[0] = 0
                switch.set()
                time.sleep(0.3)
        finally:
            stop.set()
            thread.join(30)
            server.close()
            llm.shutdown()
        if args.profile:
            os.makedirs(args.profile, exist_ok=True)
            for n, p in profiles.items():
                p.dump_stats(os.path.join(args.profile, f"leader-{n}.prof"))
        if len(rows) > 1:
            a, b = rows[0], rows[-1]
            print(f"ratio {b['n']} / {a['n']} streams (1.0 = flat per request): "
                  f"req/s {b['req_s'] / a['req_s']:.2f}x; CPU per request: leader "
                  f"{b['leader_ms'] / a['leader_ms']:.2f}x, clients "
                  f"{b['client_ms'] / a['client_ms']:.2f}x, workers "
                  f"{b['worker_ms'] / max(a['worker_ms'], 1e-9):.2f}x; worker time per step "
                  f"{b['worker_ms_per_step'] / max(a['worker_ms_per_step'], 1e-9):.2f}x")


if __name__ == "__main__":
    main()
