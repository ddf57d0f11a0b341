"""CUDA end-to-end checks (skipped without a GPU; run by scripts/device_check.sh).

float32 on CUDA must equal HF token for token (the Triton kernels use IEEE fp32 dots).
bfloat16 cannot: near-ties flip under rounding. The criterion for bf16, against HF run in
float32 on the engine's own output (teacher forcing): every generated token is within
HF's top-5 at its position, and at least 90% of them are HF's top-1.
"""

from __future__ import annotations

import pytest
import torch

from nvllm import LLM, SamplingParams

pytestmark = [pytest.mark.e2e,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

PROMPTS = ["The capital of France is", "Once upon a time, in a small village by the sea,",
           "List three prime numbers:", "Tensor parallel layers split every matrix " * 6]


def hf_fp32(model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).cuda().eval()
    return tok, model


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_cuda_fp32_exact(tiny, arch, backend):
    model_dir = tiny(arch)
    tok, hf = hf_fp32(model_dir)
    ids = [tok(p).input_ids for p in PROMPTS]
    with LLM(model_dir, device="cuda", dtype="float32", attention_backend=backend,
             block_size=16, max_num_batched_tokens=64, num_kv_blocks=24) as llm:
        outs = llm.generate([{"prompt_token_ids": i} for i in ids],
                            SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)
    for i, out in zip(ids, outs):
        ref = hf.generate(torch.tensor([i]).cuda(), do_sample=False, max_new_tokens=24,
                          pad_token_id=0)[0, len(i):].tolist()
        assert out.token_ids == ref


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_cuda_bf16_top5_agreement(tiny, arch):
    model_dir = tiny(arch)
    tok, hf = hf_fp32(model_dir)
    ids = [tok(p).input_ids for p in PROMPTS]
    with LLM(model_dir, device="cuda", dtype="bfloat16") as llm:
        assert llm.config.attention_backend == "auto"
        outs = llm.generate([{"prompt_token_ids": i} for i in ids],
                            SamplingParams(temperature=0, max_tokens=32, ignore_eos=True),
                            use_tqdm=False)
    top1 = total = 0
    for i, out in zip(ids, outs):
        full = torch.tensor([i + out.token_ids]).cuda()
        with torch.no_grad():
            logits = hf(full).logits[0, len(i) - 1:-1]  # the logits each token was drawn from
        top5 = logits.topk(5, dim=-1).indices.tolist()
        for pos, t in enumerate(out.token_ids):
            assert t in top5[pos], f"token {t} at {pos} is outside HF fp32's top-5"
            top1 += t == top5[pos][0]
            total += 1
    assert top1 / total >= 0.9, f"only {top1}/{total} tokens are HF's top-1"


def test_cuda_graphs_equal_eager(tiny):
    """Decode steps replayed from CUDA graphs (the default with the Triton backend) give
    the eager tokens, at batch sizes on and between the captured ones."""
    model_dir = tiny("qwen3")
    prompts = [{"prompt_token_ids": [5 + i] * (3 + i % 7)} for i in range(21)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    got = []
    for eager in (True, False):
        with LLM(model_dir, device="cuda", dtype="float32", enforce_eager=eager,
                 max_num_seqs=24) as llm:
            # One prompt at a time, then all: decode batches of 1 and of 21 (padded to 24).
            single = llm.generate(prompts[:1], params, use_tqdm=False)
            outs = llm.generate(prompts, params, use_tqdm=False)
        got.append([o.token_ids for o in single + outs])
    assert got[0] == got[1]
