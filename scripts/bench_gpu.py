#!/usr/bin/env python
"""GPU throughput: nvllm against HF transformers on the same device and checkpoint.

A Qwen3-0.6B-shaped checkpoint with random bf16 weights (built once, here), nano-vllm's
benchmark workload (256 sequences, input and output lengths uniform in 100-1024,
ignore_eos), run through ``nvllm-bench throughput`` in a child process (so its memory is
gone before HF loads), then HF transformers static ``generate`` (one left-padded batch)
on the first --hf-seqs requests of the same workload. Prints output tok/s of each and
the ratio; the project's goal on one H200 is 20,000 output tok/s.

    python scripts/bench_gpu.py [--json FILE] [--num-seqs 256] [--hf-seqs 64] [--eager-too]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import torch

QWEN3_06B = dict(arch="qwen3", vocab_size=151936, hidden_size=1024, intermediate_size=3072,
                 num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                 head_dim=128, tie_word_embeddings=True, max_position_embeddings=4096,
                 dtype="bfloat16")
GOAL_TOK_S = 20_000


def nvllm_run(model: str, args, eager: bool) -> dict:
    cmd = [sys.executable, "-m", "nvllm.launch.bench", "throughput", "--model", model,
           "--device", "cuda", "--dtype", "bfloat16", "--num-seqs", str(args.num_seqs),
           "--input-len", args.input_len, "--output-len", args.output_len, "--json"]
    if eager:
        cmd.append("--enforce-eager")
    out = subprocess.run(cmd, check=True, capture_output=True, text=True,
                         timeout=args.timeout).stdout
    return json.loads(out.strip().splitlines()[-1])


def hf_run(model: str, args) -> dict:
    from transformers import AutoModelForCausalLM

    from nvllm.launch.bench import RANGE, left_padded, make_workload

    # The same requests nvllm-bench made (same ranges, seed 0).
    wl = make_workload(args.num_seqs, RANGE.convert(args.input_len, None, None),
                       RANGE.convert(args.output_len, None, None), QWEN3_06B["vocab_size"], 0)
    prompts, outs = wl.prompts[:args.hf_seqs], wl.output_lens[:args.hf_seqs]
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.bfloat16).cuda().eval()
    ids, mask = (t.cuda() for t in left_padded(prompts))
    with torch.no_grad():
        hf.generate(ids[:2, -8:], attention_mask=mask[:2, -8:], max_new_tokens=4,
                    do_sample=False, pad_token_id=0)  # warm-up
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        hf.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=max(outs),
                    min_new_tokens=max(outs), pad_token_id=0)
        torch.cuda.synchronize()
        dt = time.perf_counter() - t0
    # Useful tokens only: each request wanted its own length; the padded rest is waste.
    return {"seqs": len(prompts), "output_tokens": sum(outs), "s": dt,
            "output_tok_s": sum(outs) / dt}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--num-seqs", type=int, default=256)
    ap.add_argument("--input-len", default="100-1024")
    ap.add_argument("--output-len", default="100-1024")
    ap.add_argument("--hf-seqs", type=int, default=64,
                    help="HF runs the first this many requests (its padded batch is slow)")
    ap.add_argument("--eager-too", action="store_true",
                    help="also run nvllm with --enforce-eager (no CUDA graphs)")
    ap.add_argument("--timeout", type=float, default=300)
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_gpu.py needs a CUDA device")
    from nvllm.launch.tiny import make_tiny_checkpoint

    model = os.environ.get("NVLLM_BENCH_GPU_MODEL", "/tmp/nvllm-qwen3-0.6b-random")
    if not os.path.exists(os.path.join(model, "config.json")):
        t0 = time.perf_counter()
        make_tiny_checkpoint(model, **QWEN3_06B)
        print(f"built {model} in {time.perf_counter() - t0:.0f} s", flush=True)
    res: dict = {"device": torch.cuda.get_device_name(), "model": "Qwen3-0.6B-shaped bf16",
                 "workload": {"seqs": args.num_seqs, "input": args.input_len,
                              "output": args.output_len}}
    res["nvllm"] = nvllm_run(model, args, eager=False)
    print(f"nvllm: {res['nvllm']['output_tok_s']:.0f} output tok/s "
          f"({res['nvllm']['elapsed_s']:.1f} s)", flush=True)
    if args.eager_too:
        res["nvllm_eager"] = nvllm_run(model, args, eager=True)
        print(f"nvllm --enforce-eager: {res['nvllm_eager']['output_tok_s']:.0f} output tok/s",
              flush=True)
    res["hf_static"] = hf_run(model, args)
    ratio = res["nvllm"]["output_tok_s"] / res["hf_static"]["output_tok_s"]
    res["ratio_vs_hf_static"] = ratio
    res["goal_tok_s"] = GOAL_TOK_S
    met = "met" if res["nvllm"]["output_tok_s"] >= GOAL_TOK_S else "NOT met"
    print(f"HF static generate ({res['hf_static']['seqs']} seqs): "
          f"{res['hf_static']['output_tok_s']:.0f} output tok/s; nvllm/HF = {ratio:.2f}x; "
          f"goal {GOAL_TOK_S} tok/s: {met}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)


if __name__ == "__main__":
    main()
