"""HF transformers float32 references for the end-to-end sampling tests: greedy decoding
with the worker sampler's frequency/presence penalties, and teacher-forced logprobs with
the tolerance rounding allows them (logprob_tols)."""

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
def logits(model_dir: str, prompt: list[int], output: list[int]) -> torch.Tensor:
    """[len(output), vocab] float32 logits each output token was drawn from (teacher
    forcing on the engine's own output)."""
    model = hf_model(model_dir)
    return model(torch.tensor([prompt + output])).logits[0, len(prompt) - 1:-1].float()


def logprobs(model_dir: str, prompt: list[int], output: list[int]) -> torch.Tensor:
    """[len(output), vocab] float32 log_softmax of logits(model_dir, prompt, output)."""
    return torch.log_softmax(logits(model_dir, prompt, output), dim=-1)


EPS32 = torch.finfo(torch.float32).eps


def longest_sum(model_dir: str, num_tokens: int) -> int:
    """The most terms one float32 reduction of a forward pass over num_tokens tokens adds:
    a projection's input width (hidden, intermediate, heads * head_dim) or an attention
    row's keys."""
    cfg = hf_model(model_dir).config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return max(cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads * head_dim,
               num_tokens)


def logprob_tols(model_dir: str, prompt: list[int], output: list[int]) -> torch.Tensor:
    """[len(output)]: how far an engine's float32 logprobs of each row may be from HF's
    float32 ones on any x86-64 CPU torch supports, from rounding alone.

    The two differ only in the order of their float32 sums (oneDNN/MKL GEMM blockings,
    AVX2, AVX-512 or AMX kernels, SDPA tilings, nvllm's native ops: all differ by CPU). A
    sum of n terms in any order is within n*eps*sum|terms| of the exact one (Higham's
    gamma_n bound, no assumption on the order), n at most longest_sum; the RMSNorm before
    the head rescales the hidden state, so the logits z carry that relative error at the
    scale of the row, max|z|. A logprob is z_t - logsumexp(z), and logsumexp is
    1-Lipschitz in the max norm: the logits' error counts twice. The logsumexp's own sum
    of V positive terms adds V*eps. So |dlogprob| <= 2*n*eps*max|z| + V*eps.

    tiny qwen3 (n = 128, V = 1024, max|z| about 30-40): about 1.2e-3. Measured: at most
    21*eps*max|z| (about 1e-4) on an AVX-512 AMD EPYC; 1.09e-4 on a Xeon with AMX (issue
    27: past the absolute 1e-4 this replaces). A precision bug (a float16 or bfloat16
    rounding in the float32 path) moves logprobs by about 2**-10*max|z| = 8192*eps*max|z|
    or more, 30 times this bound."""
    z = logits(model_dir, prompt, output)
    n = longest_sum(model_dir, len(prompt) + len(output))
    return 2 * n * EPS32 * z.abs().amax(dim=-1) + z.shape[-1] * EPS32


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
