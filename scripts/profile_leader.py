"""Where the leader's time goes while serving: py-spy samples of the leader process,
bucketed by the step-loop phase each sample is in.

Starts ``nvllm-launch`` (tiny model by default), drives it with ``nvllm-bench serve`` at a
fixed concurrency, samples the leader with ``py-spy record --idle --format raw`` during the
run, and prints milliseconds per engine step in each phase (samples x period / steps) and
the bench's ITL.

    python scripts/profile_leader.py --concurrency 16 --concurrency 64 [--model tiny:llama]
"""

from __future__ import annotations

import collections
import json
import os
import re
import subprocess
import sys
import tempfile
import time

import click

# First frame (from the outermost) that matches decides the bucket.
PHASES = [
    ("wait_result", ("recv_result",)),
    ("schedule", ("Scheduler.schedule", "schedule (nvllm/leader/scheduler.py")),
    ("plan_build", ("PlanBuilder.build", "build (nvllm/leader/plan_builder.py")),
    ("plan_send", ("Executor.send", "send (nvllm/leader/executor.py", "broadcast")),
    ("update", ("update_from_output",)),
    ("output", ("OutputProcessor.process", "process (nvllm/leader/output_processor.py",
                "add_prompt_logprobs")),
    ("emit", ("_emit (nvllm/leader/server.py",)),
    ("drain", ("_drain", "_handle (nvllm/leader/server.py")),
    ("idle_poll", ("poll", "_wait_for_work")),
]


def bucket(stack: str) -> str:
    frames = stack.split(";")
    for name, keys in PHASES:
        if any(k in f for f in frames for k in keys):
            return name
    return "other"


def launch(model: str, extra: list[str]) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-c", "from nvllm.launch.cli import launch; launch()",
           "--model", model, "--device", "cpu", "--dtype", "float32", "--port", "0",
           "--log-stats-interval-s", "1000", *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for line in proc.stdout:
        m = re.search(r"serving on (\S+);", line)
        if m:
            return proc, m.group(1)
    raise RuntimeError("server did not start")


def run_once(endpoint: str, pid: int, conc: int, num: int, out_len: int, rate: int):
    raw = tempfile.mktemp(suffix=".txt")
    spy = subprocess.Popen(["py-spy", "record", "-p", str(pid), "--idle", "--format", "raw",
                            "-r", str(rate), "-o", raw, "--nonblocking"],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(1.0)
    res = subprocess.run(
        [sys.executable, "-c", "from nvllm.launch.bench import bench; bench()", "serve",
         "--endpoint", endpoint, "--num-prompts", str(num), "--max-concurrency", str(conc),
         "--input-len", "16-64", "--output-len", str(out_len), "--json"],
        capture_output=True, text=True, check=True)
    spy.send_signal(2)
    spy.wait()
    bench = json.loads(res.stdout.strip().splitlines()[-1])
    counts = collections.Counter()
    with open(raw) as f:
        for line in f:
            stack, _, n = line.rstrip().rpartition(" ")
            if "MainThread" in stack.split(";")[0] or "Thread" not in stack.split(";")[0]:
                counts[bucket(stack)] += int(n)
    os.unlink(raw)
    return bench, counts


@click.command()
@click.option("--model", default="tiny:llama")
@click.option("--concurrency", multiple=True, type=int, default=[16, 64])
@click.option("--repeats", default=3)
@click.option("--out-len", default=128)
@click.option("--rate", default=250)
@click.option("--extra", default="", help="More nvllm-launch options, space-separated.")
def main(model, concurrency, repeats, out_len, rate, extra):
    proc, endpoint = launch(model, extra.split())
    try:
        for r in range(repeats):
            for conc in concurrency:
                bench, counts = run_once(endpoint, proc.pid, conc, conc * 3, out_len, rate)
                steps = bench["output_tokens"] / conc  # one token per stream per step
                per_step = {k: round(v * 1000 / rate / steps, 3) for k, v in counts.items()}
                print(json.dumps({"repeat": r, "conc": conc, "itl_p50": bench["itl_ms"]["p50"],
                                  "itl_mean": bench["itl_ms"]["mean"],
                                  "tok_s": round(bench["output_tok_s"], 1),
                                  "ms_per_step": per_step}), flush=True)
    finally:
        proc.send_signal(2)
        proc.wait(timeout=60)


if __name__ == "__main__":
    main()
