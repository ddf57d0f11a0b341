#!/usr/bin/env python
"""nvllm vs vLLM's CPU build, offline (``LLM.generate`` on both), float32 and bfloat16.

Same checkpoint (the ``qwen3-36m`` tiny preset unless --model), same requests (token ids,
greedy, ``ignore_eos``), each engine in a fresh process, interleaved: nvllm, vLLM, nvllm,
vLLM, ... for --rounds rounds per dtype, so drift on a noisy machine hits both. A round's
ratio is nvllm's output tok/s over the vLLM run beside it; the line printed per dtype is
the median ratio with its range. Start-up (weights, warm-up, vLLM's torch.compile) is
reported but not counted.

    python scripts/bench_vs_vllm.py [--rounds 3] [--dtypes float32 bfloat16]

The peer's venv is created on first use (scripts/vllm_peer.py, several minutes).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import random
import statistics
import subprocess
import sys
import time

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # vllm_peer sits beside this script


def workload(args) -> tuple[list[list[int]], list[int]]:
    """Deterministic prompts (token ids 3..vocab-1) and output lengths."""
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(3, args.vocab) for _ in range(rng.randint(*args.input))]
               for _ in range(args.num_seqs)]
    return prompts, [rng.randint(*args.output) for _ in range(args.num_seqs)]


def timed_generate(llm, sampling_params, prompts, outs) -> tuple[float, list]:
    """One LLM.generate of the workload (the same call on both engines), timed."""
    t0 = time.perf_counter()
    got = llm.generate([{"prompt_token_ids": p} for p in prompts],
                       [sampling_params(temperature=0, max_tokens=o, ignore_eos=True)
                        for o in outs], use_tqdm=False)
    return time.perf_counter() - t0, got


def run_nvllm(args, prompts, outs) -> dict:
    from nvllm import LLM, SamplingParams

    t0 = time.perf_counter()
    extra = {"cpu_threads": args.nvllm_threads} if args.nvllm_threads else {}
    with LLM(args.model, device="cpu", dtype=args.dtype, **extra) as llm:
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4), use_tqdm=False)
        start = time.perf_counter() - t0
        dt, got = timed_generate(llm, SamplingParams, prompts, outs)
    return {"startup_s": start, "s": dt, "tokens": sum(len(g.token_ids) for g in got)}


def run_vllm(args, prompts, outs) -> dict:
    from vllm import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(model=args.model, dtype=args.dtype, seed=0, max_model_len=args.max_model_len)
    llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=4),
                 use_tqdm=False)
    start = time.perf_counter() - t0
    dt, got = timed_generate(llm, SamplingParams, prompts, outs)
    return {"startup_s": start, "s": dt, "tokens": sum(len(g.outputs[0].token_ids) for g in got)}


def child(args) -> None:
    prompts, outs = workload(args)
    res = (run_nvllm if args.child == "nvllm" else run_vllm)(args, prompts, outs)
    if res["tokens"] != sum(outs):
        raise SystemExit(f"{args.child} made {res['tokens']} tokens, {sum(outs)} asked for")
    res["output_tok_s"] = res["tokens"] / res["s"]
    print("RESULT " + json.dumps(res), flush=True)


def spawn(engine: str, python: str, args, dtype: str) -> dict:
    cmd = [python, __file__, "--child", engine, "--dtype", dtype, "--model", args.model,
           "--num-seqs", str(args.num_seqs), "--seed", str(args.seed),
           "--vocab", str(args.vocab), "--max-model-len", str(args.max_model_len),
           "--input", *map(str, args.input), "--output", *map(str, args.output),
           "--nvllm-threads", str(args.nvllm_threads)]
    if engine == "vllm":
        from vllm_peer import peer_env
        env = peer_env()
    else:
        env = dict(os.environ)
    r = subprocess.run(cmd, env=env, text=True, stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, timeout=args.timeout)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
    if r.returncode != 0 or not lines:
        sys.stderr.write(r.stdout[-6000:])
        raise SystemExit(f"{engine} ({dtype}) failed with exit code {r.returncode}")
    return json.loads(lines[-1][len("RESULT "):])


def summary(values: list[float]) -> str:
    return f"{statistics.median(values):.2f}x ({min(values):.2f}-{max(values):.2f})"


def parent(args) -> None:
    from vllm_peer import ensure

    peer = str(ensure())
    if args.model is None:
        from nvllm.launch.tiny import ensure_tiny_checkpoint
        args.model = str(ensure_tiny_checkpoint("qwen3-36m"))
    cfg = json.loads((pathlib.Path(args.model) / "config.json").read_text())
    args.vocab = cfg["vocab_size"]
    args.max_model_len = min(cfg.get("max_position_embeddings", 2048),
                             args.input[1] + args.output[1] + 64)
    prompts, outs = workload(args)
    print(f"model {args.model}; {args.num_seqs} requests, {sum(map(len, prompts))} prompt "
          f"and {sum(outs)} output tokens; {args.rounds} interleaved rounds", flush=True)
    results: dict = {}
    for dtype in args.dtypes:
        rows = results[dtype] = {"nvllm": [], "vllm": [], "ratio": []}
        for r in range(args.rounds):
            a = spawn("nvllm", sys.executable, args, dtype)
            b = spawn("vllm", peer, args, dtype)
            rows["nvllm"].append(a)
            rows["vllm"].append(b)
            rows["ratio"].append(a["output_tok_s"] / b["output_tok_s"])
            print(f"  {dtype} round {r + 1}: nvllm {a['output_tok_s']:.1f} tok/s "
                  f"(start-up {a['startup_s']:.1f} s), vLLM {b['output_tok_s']:.1f} tok/s "
                  f"(start-up {b['startup_s']:.1f} s): {rows['ratio'][-1]:.2f}x", flush=True)
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(results, indent=2))
    parts = []
    for dtype, rows in results.items():
        med = {e: statistics.median(x["output_tok_s"] for x in rows[e]) for e in ("nvllm", "vllm")}
        parts.append(f"{dtype} {summary(rows['ratio'])} [nvllm {med['nvllm']:.0f} vs vLLM "
                     f"{med['vllm']:.0f} tok/s]")
    print("offline nvllm/vLLM output tok/s: " + "; ".join(parts))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"],
                    choices=["float32", "bfloat16"])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--num-seqs", type=int, default=48)
    ap.add_argument("--input", type=int, nargs=2, default=(32, 384))
    ap.add_argument("--output", type=int, nargs=2, default=(32, 192))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", help="checkpoint folder (default: the qwen3-36m tiny preset; "
                    "a .gguf: first scripts/gguf_to_hf.py, vLLM reads no GGUF here)")
    ap.add_argument("--nvllm-threads", type=int, default=0,
                    help="nvllm's torch threads per worker (default: automatic)")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per engine run")
    ap.add_argument("--json", help="also write every run's figures here")
    # Set by the parent for its children.
    ap.add_argument("--child", choices=["nvllm", "vllm"], help=argparse.SUPPRESS)
    ap.add_argument("--dtype", help=argparse.SUPPRESS)
    ap.add_argument("--vocab", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--max-model-len", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    (child if args.child else parent)(args)


if __name__ == "__main__":
    main()
