#!/usr/bin/env python
"""nvllm vs HF transformers on one CPU/GPU, same checkpoint and workload, in one run.

Prints each throughput and the ratios: nvllm (tp=1) against HF static ``generate`` (one
left-padded batch) and HF ``generate_batch`` (its continuous batching), and the model
FLOP utilization against a matmul probe of the model's own shape measured in the same run.
Only the tokens each request asked for count as output (HF's batched runs generate the
longest request's length for every row: that padding is what continuous batching avoids).

    python scripts/bench_vs_hf.py [--num-seqs 48] [--input 32 512] [--output 32 256]
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time

import torch

# A Qwen3-shaped checkpoint of ~42M parameters (also scripts/bench_steps.py's).
SHAPE = dict(arch="qwen3", vocab_size=16384, hidden_size=512, intermediate_size=1536,
             num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
             head_dim=64, max_position_embeddings=2048)


def probe_gflops(hidden: int, inter: int, tokens: int, dtype: torch.dtype) -> float:
    a = torch.randn(tokens, hidden, dtype=dtype)
    b = torch.randn(hidden, inter, dtype=dtype)
    for _ in range(3):
        a @ b
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < 1.0:
        a @ b
        n += 1
    return 2 * tokens * hidden * inter * n / (time.perf_counter() - t0) / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--num-seqs", type=int, default=48)
    ap.add_argument("--input", type=int, nargs=2, default=(32, 512))
    ap.add_argument("--output", type=int, nargs=2, default=(32, 256))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--skip-generate-batch", action="store_true")
    ap.add_argument("--no-async-scheduling", action="store_true",
                    help="nvllm applies each step's result before sending the next plan")
    ap.add_argument("--nvllm-only", action="store_true",
                    help="run nvllm alone (e.g. --num-seqs 256 to measure the workers' idle "
                         "share with every sequence running)")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM, GenerationConfig

    from nvllm import LLM, SamplingParams
    from nvllm.launch.bench import left_padded
    from nvllm.launch.tiny import make_tiny_checkpoint
    from nvllm.worker.cpu_malloc import keep_freed_memory

    # The HF peer runs in this process: give it the malloc settings nvllm's workers use,
    # or its speed depends on how glibc's heap happens to adapt (±40% between runs).
    keep_freed_memory()
    shape = SHAPE
    model_dir = make_tiny_checkpoint(tempfile.mkdtemp(prefix="nvllm-bench-"), **shape)
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(3, 16384) for _ in range(rng.randint(*args.input))]
               for _ in range(args.num_seqs)]
    outs = [rng.randint(*args.output) for _ in range(args.num_seqs)]
    n_in, n_out = sum(map(len, prompts)), sum(outs)
    res: dict = {"workload": {"seqs": args.num_seqs, "prompt_tokens": n_in,
                              "output_tokens": n_out}}
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    params = sum(p.numel() for p in hf.parameters())
    res["params"] = params

    # nvllm, tp=1.
    with LLM(str(model_dir), device="cpu", dtype="float32",
             async_scheduling=not args.no_async_scheduling) as llm:
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
        llm.engine.reset_step_totals()
        t0 = time.perf_counter()
        got = llm.generate([{"prompt_token_ids": p} for p in prompts],
                           [SamplingParams(temperature=0, max_tokens=o, ignore_eos=True)
                            for o in outs], use_tqdm=False)
        dt = time.perf_counter() - t0
        idle = llm.engine.worker_idle_share  # (the engine goes with the `with`)
    assert sum(len(g.token_ids) for g in got) == n_out
    res["nvllm"] = {"s": dt, "output_tok_s": n_out / dt, "total_tok_s": (n_in + n_out) / dt,
                    "worker_idle_share": idle}
    if args.nvllm_only:
        print(json.dumps(res, indent=2))
        print(f"nvllm {res['nvllm']['output_tok_s']:.1f} output tok/s; workers idle "
              f"{res['nvllm']['worker_idle_share']:.1%} of step time")
        return

    # HF static generate: one left-padded batch, every row runs to the longest output.
    ids, mask = left_padded(prompts)
    with torch.no_grad():
        t0 = time.perf_counter()
        hf.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=max(outs),
                    min_new_tokens=max(outs), pad_token_id=0)
        dt = time.perf_counter() - t0
    res["hf_static"] = {"s": dt, "output_tok_s": n_out / dt}

    if not args.skip_generate_batch:
        cfg = GenerationConfig(max_new_tokens=max(outs), do_sample=False, eos_token_id=-1,
                               pad_token_id=0)
        with torch.no_grad():
            t0 = time.perf_counter()
            hf.generate_batch(prompts, generation_config=cfg, warmup=False)
            dt = time.perf_counter() - t0
        res["hf_generate_batch"] = {"s": dt, "output_tok_s": n_out / dt}

    gflops = probe_gflops(shape["hidden_size"], shape["intermediate_size"], 256, torch.float32)
    res["probe_gflops"] = gflops
    res["nvllm_mfu"] = 2 * params * (n_in + n_out) / res["nvllm"]["s"] / 1e9 / gflops
    res["ratio_vs_hf_static"] = res["nvllm"]["output_tok_s"] / res["hf_static"]["output_tok_s"]
    if "hf_generate_batch" in res:
        res["ratio_vs_hf_generate_batch"] = (res["nvllm"]["output_tok_s"]
                                             / res["hf_generate_batch"]["output_tok_s"])
    print(json.dumps(res, indent=2))
    print(f"nvllm {res['nvllm']['output_tok_s']:.1f} output tok/s = "
          f"{res['ratio_vs_hf_static']:.2f}x HF static generate"
          + (f", {res['ratio_vs_hf_generate_batch']:.2f}x HF generate_batch"
             if "hf_generate_batch" in res else "")
          + f"; MFU {res['nvllm_mfu']:.2f} of a {gflops:.0f} GFLOP/s matmul probe")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)


if __name__ == "__main__":
    main()
