#!/usr/bin/env python
"""nvllm's OpenAI gateway vs ``vllm serve``, measured by vLLM's own ``vllm bench serve``.

For each dtype and round: start ``nvllm-launch --http-port`` (gateway + leader + one
worker), run the client against its ``/v1/completions``, stop it; then the same with
``vllm serve``. Same checkpoint (the ``qwen3-36m`` tiny preset, whose tokenizer names every
id), same client command, so neither side's client is ours. Prints, per dtype, the median
ratio of output tok/s (nvllm / vLLM) with its range, and the median TTFT, TPOT and ITL of
each server. ``scripts/serve_vs_vllm.sh`` runs this; see it for the flags.

The client: ``vllm bench serve --backend vllm --dataset-name random --random-input-len 256
--random-output-len 128 --num-prompts 64 --max-concurrency 16 --ignore-eos``, then the same
at concurrency 1 with 8 prompts (one user's TPOT). The client's own CPU time is printed
beside each run's duration: it shares the 2 cores with the server it measures.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import resource
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from vllm_peer import ensure, peer_env  # noqa: E402

NAME = "bench"  # the served model name on both servers
METRICS = ("median_ttft_ms", "median_tpot_ms", "median_itl_ms")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(port: int, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with code {proc.returncode} while starting")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1)
    raise RuntimeError(f"server not ready after {timeout:.0f} s")


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM the server's process group and wait until every process in it is gone
    (SIGKILL after 30 s), so no server's shutdown overlaps the next one's run."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + 30
    while True:
        proc.poll()  # reap the group's leader
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            return
        if time.monotonic() > deadline:
            os.killpg(proc.pid, signal.SIGKILL)
            deadline = float("inf")
        time.sleep(0.2)


def server_command(engine: str, args, dtype: str, port: int, peer_bin: pathlib.Path) -> list[str]:
    if engine == "nvllm":
        return ["nvllm-launch", "--model", args.model, "--device", "cpu", "--dtype", dtype,
                "--max-model-len", str(args.max_model_len), "--http-port", str(port),
                "--http-host", "127.0.0.1", "--served-model-name", NAME,
                "--log-level", "WARNING"]
    return [str(peer_bin / "vllm"), "serve", args.model, "--served-model-name", NAME,
            "--host", "127.0.0.1", "--port", str(port), "--dtype", dtype,
            "--max-model-len", str(args.max_model_len), "--seed", "0"]


def client_cpu_s() -> float:
    """CPU seconds of this process's reaped children (the bench client, once it exits)."""
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def one_run(engine: str, args, dtype: str, conc: int, peer_bin: pathlib.Path,
            out: pathlib.Path) -> dict:
    port = free_port()
    log = open(out / f"{engine}-{dtype}-{port}.log", "w")
    env = peer_env() if engine == "vllm" else dict(os.environ)
    trace = out / f"trace-{dtype}-{port}"  # --trace: nvllm's per-hop timestamps
    if engine == "nvllm" and args.trace:
        env["NVLLM_TRACE"] = str(trace)
    t0 = time.monotonic()
    proc = subprocess.Popen(server_command(engine, args, dtype, port, peer_bin), env=env,
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_ready(port, proc, args.start_timeout)
        startup = time.monotonic() - t0
        result = out / f"{engine}-{dtype}-{port}.json"
        cmd = [str(peer_bin / "vllm"), "bench", "serve", "--backend", "vllm",
               "--base-url", f"http://127.0.0.1:{port}", "--model", NAME,
               "--tokenizer", args.model, "--dataset-name", "random",
               "--random-input-len", str(args.input_len),
               "--random-output-len", str(args.output_len),
               "--num-prompts", str(args.num_prompts if conc > 1 else args.num_prompts_c1),
               "--max-concurrency", str(conc), "--ignore-eos", "--seed", "0",
               "--save-result", "--result-dir", str(out), "--result-filename", result.name]
        cpu0 = client_cpu_s()
        r = subprocess.run(cmd, env=peer_env(), text=True, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, timeout=args.bench_timeout)
        client_cpu = client_cpu_s() - cpu0
        if r.returncode != 0 or not result.exists():
            sys.stderr.write(r.stdout[-6000:])
            raise RuntimeError(f"vllm bench serve against {engine} failed ({r.returncode})")
        res = json.loads(result.read_text())
    finally:
        stop(proc)
        log.close()
    if engine == "nvllm" and args.trace:
        from nvllm.launch.trace_report import one_line, summarize
        print(f"  trace {dtype}: {one_line(summarize(str(trace)))}", flush=True)
    if res.get("failed", 0):
        raise RuntimeError(f"{res['failed']} requests failed against {engine}; see {out}")
    return {"startup_s": startup, "output_tok_s": res["output_throughput"],
            "client_cpu_s": client_cpu, "duration_s": res["duration"],
            **{m: res[m] for m in METRICS}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"],
                    choices=["float32", "bfloat16"])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--model", help="checkpoint folder (default: the qwen3-36m tiny preset; "
                    "a .gguf: first scripts/gguf_to_hf.py, vLLM reads no GGUF here)")
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[16, 1])
    ap.add_argument("--num-prompts-c1", type=int, default=8,
                    help="prompts at concurrency 1 (one stream: its TPOT is the figure)")
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--start-timeout", type=float, default=600)
    ap.add_argument("--bench-timeout", type=float, default=1200)
    ap.add_argument("--json", help="also write every run's figures here")
    ap.add_argument("--trace", action="store_true",
                    help="trace nvllm's hops (NVLLM_TRACE) and print them after each run")
    args = ap.parse_args()
    peer_bin = ensure().parent
    if args.model is None:
        from nvllm.launch.tiny import ensure_tiny_checkpoint
        args.model = str(ensure_tiny_checkpoint("qwen3-36m"))
    out = pathlib.Path(tempfile.mkdtemp(prefix="nvllm-serve-vs-vllm-"))
    print(f"model {args.model}; {args.num_prompts} prompts of {args.input_len} tokens, "
          f"{args.output_len} out, concurrency {args.concurrency}; logs in {out}", flush=True)
    results: dict = {}
    for dtype in args.dtypes:
        for conc in args.concurrency:
            key = f"{dtype} c={conc}"
            rows = results[key] = {"nvllm": [], "vllm": [], "ratio": []}
            for r in range(args.rounds):
                for engine in ("nvllm", "vllm"):
                    rows[engine].append(one_run(engine, args, dtype, conc, peer_bin, out))
                a, b = rows["nvllm"][-1], rows["vllm"][-1]
                rows["ratio"].append(a["output_tok_s"] / b["output_tok_s"])
                print(f"  {key} round {r + 1}: " + "; ".join(
                    f"{e} {x['output_tok_s']:.0f} tok/s, TTFT {x['median_ttft_ms']:.0f} ms, "
                    f"TPOT {x['median_tpot_ms']:.1f} ms, ITL {x['median_itl_ms']:.1f} ms, "
                    f"client CPU {x['client_cpu_s']:.0f}/{x['duration_s']:.0f} s"
                    for e, x in (("nvllm", a), ("vLLM", b))) + f": {rows['ratio'][-1]:.2f}x",
                    flush=True)
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(results, indent=2))
    print("online nvllm/vLLM output tok/s (median, range; median ms nvllm/vLLM):")
    for key, rows in results.items():
        ratio = rows["ratio"]
        med = {e: {k: statistics.median(x[k] for x in rows[e])
                   for k in ("output_tok_s", *METRICS)} for e in ("nvllm", "vllm")}
        lat = ", ".join(f"{k.split('_')[1].upper()} {med['nvllm'][k]:.1f}/{med['vllm'][k]:.1f}"
                        for k in METRICS)
        print(f"  {key}: {statistics.median(ratio):.2f}x ({min(ratio):.2f}-{max(ratio):.2f}) "
              f"[{med['nvllm']['output_tok_s']:.0f} vs {med['vllm']['output_tok_s']:.0f} "
              f"tok/s; {lat}]")


if __name__ == "__main__":
    main()
