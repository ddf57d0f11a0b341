#!/usr/bin/env python
"""How closely nvllm in bfloat16 tracks HF transformers in float32, on CPU.

nvllm generates greedily in bfloat16; HF then runs in float32 over each prompt plus
nvllm's own output (teacher forcing), and each generated token is checked against HF's
top-5 and top-1 at its position: the tolerance tests/e2e/test_cuda.py and
tests/e2e/test_engine_api.py assert (every token in the top-5, >= 90% the top-1), here
measured on a benchmark-sized model. Prints the two shares and the worst position.

    python scripts/bf16_vs_hf.py [--model DIR] [--num-seqs 16] [--output 64] [--tp 1]
"""

from __future__ import annotations

import argparse
import random

import torch


def hf_bf16_greedy(model: str, prompts: list[list[int]], n: int) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.bfloat16).eval()
    outs = []
    with torch.no_grad():
        for p in prompts:
            ids = hf.generate(torch.tensor([p]), do_sample=False, max_new_tokens=n,
                              min_new_tokens=n, pad_token_id=0)
            outs.append(ids[0, len(p):].tolist())
    return outs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", help="checkpoint folder (default: the qwen3-36m tiny preset)")
    ap.add_argument("--num-seqs", type=int, default=16)
    ap.add_argument("--input", type=int, nargs=2, default=(16, 256))
    ap.add_argument("--output", type=int, default=64)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--attention-backend", default="auto",
                    help="nvllm's kernels (auto, cpu, torch)")
    ap.add_argument("--hf-bf16", action="store_true",
                    help="measure HF itself in bfloat16 instead of nvllm (the model's own "
                         "sensitivity to bfloat16)")
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM

    from nvllm import LLM, SamplingParams
    from nvllm.launch.tiny import ensure_tiny_checkpoint

    model = args.model or str(ensure_tiny_checkpoint("qwen3-36m"))
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    vocab = hf.config.vocab_size
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randint(*args.input))]
               for _ in range(args.num_seqs)]
    params = SamplingParams(temperature=0, max_tokens=args.output, ignore_eos=True)
    if args.hf_bf16:
        outs = hf_bf16_greedy(model, prompts, args.output)
    else:
        with LLM(model, device="cpu", dtype="bfloat16", tensor_parallel_size=args.tp,
                 attention_backend=args.attention_backend) as llm:
            outs = [o.token_ids for o in llm.generate(
                [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]
    top1 = top5 = total = 0
    worst = (float("inf"), None)  # (log-prob gap to HF's top-1, where)
    with torch.no_grad():
        for i, (p, out) in enumerate(zip(prompts, outs)):
            ids = torch.tensor([p + list(out)])
            logp = hf(ids).logits[0, len(p) - 1:-1].float().log_softmax(-1)
            best = logp.topk(5, dim=-1)
            for pos, t in enumerate(out):
                top1 += t == best.indices[pos, 0].item()
                top5 += t in best.indices[pos].tolist()
                total += 1
                gap = (logp[pos, t] - best.values[pos, 0]).item()
                if gap < worst[0]:
                    worst = (gap, (i, pos))
    who = "HF" if args.hf_bf16 else f"nvllm ({args.attention_backend} kernels)"
    print(f"bfloat16 {who} vs float32 HF, {args.num_seqs} sequences x {args.output} tokens "
          f"(tp={args.tp}): {top5}/{total} in HF's top-5 ({top5 / total:.1%}), "
          f"{top1}/{total} HF's top-1 ({top1 / total:.1%}); largest log-prob gap to the "
          f"top-1 {-worst[0]:.3f} (sequence {worst[1][0]}, token {worst[1][1]})")


if __name__ == "__main__":
    main()
