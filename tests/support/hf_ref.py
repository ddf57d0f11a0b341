"""HF transformers float32 references for the end-to-end sampling tests: greedy decoding
with the worker sampler's frequency/presence penalties, and teacher-forced logprobs."""

from __future__ import annotations

import functools
import pathlib

import torch


@functools.cache
def hf_model(model_dir: str):
    """HF float32 model of a checkpoint folder, or of a .gguf file (transformers' own
    dequantization of it), loaded once per test session."""
    from transformers import AutoModelForCausalLM

    if model_dir.endswith(".gguf"):
        p = pathlib.Path(model_dir)
        return AutoModelForCausalLM.from_pretrained(str(p.parent), gguf_file=p.name,
                                                    dtype=torch.float32).eval()
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@functools.cache
def hf_tokenizer(model_dir: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


@torch.no_grad()
def greedy(model_dir: str, prompt: list[int], max_tokens: int, *, frequency_penalty=0.0,
           presence_penalty=0.0) -> list[int]:
    """Greedy tokens, step by step: logits - freq * count - pres * (count > 0), counted over
    the OUTPUT tokens only (as nvllm/worker/sampler.py, and vLLM, do)."""
    model = hf_model(model_dir)
    ids = list(prompt)
    out: list[int] = []
    for _ in range(max_tokens):
        row = model(torch.tensor([ids])).logits[0, -1].float()
        if out:
            counts = torch.bincount(torch.tensor(out), minlength=row.shape[0]).float()
            row = row - frequency_penalty * counts - presence_penalty * (counts > 0).float()
        t = int(row.argmax())
        out.append(t)
        ids.append(t)
    return out


@torch.no_grad()
def generate(model_dir: str, prompt: list[int], max_tokens: int, **kw) -> list[int]:
    """HF generate, greedy (it stops at eos, as nvllm does without ignore_eos)."""
    model = hf_model(model_dir)
    gen = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=max_tokens,
                         pad_token_id=0, **kw)
    return gen[0, len(prompt):].tolist()


@torch.no_grad()
def logprobs(model_dir: str, prompt: list[int], output: list[int]) -> torch.Tensor:
    """[len(output), vocab] float32 log_softmax of the logits each output token was drawn
    from (teacher forcing on the engine's own output)."""
    model = hf_model(model_dir)
    logits = model(torch.tensor([prompt + output])).logits[0, len(prompt) - 1:-1].float()
    return torch.log_softmax(logits, dim=-1)


# A mismatch is a near-tie when HF's float32 logits of the two tokens differ by less than
# this share of the row's largest |logit|: summation-order noise (tensor-parallel partial
# sums, grouped experts) can flip such a choice, and nothing after it compares.
NEAR_TIE = 1e-4


@torch.no_grad()
def greedy_mismatch(model_dir: str, prompt: list[int], got: list[int], ref: list[int]
                    ) -> str | None:
    """None when `got` (engine greedy) equals `ref` (HF greedy), or agrees with it up to a
    near-tie at the first differing position (the rest is not compared); else why not."""
    for j, (g, r) in enumerate(zip(got, ref)):
        if g != r:
            row = hf_model(model_dir)(torch.tensor([prompt + ref[:j]])).logits[0, -1].float()
            gap = float((row[g] - row[r]).abs())
            limit = NEAR_TIE * float(row.abs().max())
            if gap < limit:
                return None
            return (f"token {j}: engine {g}, HF {r}; logit gap {gap:.3g} >= near-tie "
                    f"{limit:.3g} (engine {got}, HF {ref})")
    if len(got) != len(ref):
        return f"lengths differ: engine {got}, HF {ref}"
    return None
