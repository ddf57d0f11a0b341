"""Prompt logprobs (SamplingParams.prompt_logprobs) end to end through ``LLM``: equal to HF
transformers' float32 log_softmax over the prompt, at tp=1 and tp=2, with prompts cut into
several prefill chunks, preempted mid-prompt (recomputed, each position taken once), next to
a prefix already in the cache, and with n=2 (scored once, on every completion)."""

from __future__ import annotations

import hf_ref
import pytest
import torch

from nvllm import LLM, SamplingParams

pytestmark = pytest.mark.e2e

K = 5
PREFIX = ("Tensor parallel layers split the weights of every matrix across ranks, and an "
          "all-reduce joins the partial sums after the row-parallel projection. ")
TEXTS = [PREFIX + "Why?", "Once upon a time there was a", "Hi",
         "The quick brown fox jumps over the lazy dog. " * 3]
# 16-token steps cut every long prompt into chunks; 12 blocks of 8 hold about two of these
# sequences at once, so some are preempted and recomputed.
STRESS = dict(block_size=8, max_num_batched_tokens=16, num_kv_blocks=12,
              enable_prefix_caching=True)


def assert_matches_hf(model: str, ids: list[int], got: list | None, k: int = K) -> None:
    """got[j] for j >= 1 holds the prompt token's logprob and the top-k, as HF's."""
    assert got is not None and len(got) == len(ids) and got[0] is None
    ref = hf_ref.logprobs(model, ids[:1], ids[1:])  # row j-1 scores prompt token j
    # Within a bound relative to the row's logits that holds on any x86-64 CPU
    # (hf_ref.logprob_tols says why).
    tols = hf_ref.logprob_tols(model, ids[:1], ids[1:])
    for j in range(1, len(ids)):
        entry, row, tol = got[j], ref[j - 1], float(tols[j - 1])
        assert ids[j] in entry and len(entry) in (k, k + 1), (j, entry)
        for t, v in entry.items():
            assert abs(v - float(row[t])) <= tol, (j, t, v, float(row[t]), tol)
        if k:  # the k best are there (up to ties within the tolerance)
            kth = float(torch.topk(row, k).values[-1])
            assert sorted(entry.values(), reverse=True)[k - 1] >= kth - tol, (j, entry)


@pytest.fixture(scope="module")
def model(tiny):
    return tiny("qwen3")


@pytest.fixture(scope="module")
def prompts(model):
    tok = hf_ref.hf_tokenizer(model)
    ids = [tok(t).input_ids for t in TEXTS]
    assert len(ids[0]) > 2 * STRESS["max_num_batched_tokens"]
    return ids


@pytest.mark.parametrize("tp", [1, 2])
def test_prompt_logprobs_match_hf(model, prompts, tp):
    with LLM(model, device="cpu", dtype="float32", tensor_parallel_size=tp, **STRESS) as llm:
        # Put the shared prefix in the cache first, with a request that does not score it.
        warm = llm.generate([{"prompt_token_ids": prompts[0]}],
                            SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
        assert warm[0].prompt_logprobs is None
        # The same prompt again without scoring: served from the prefix cache.
        again = llm.generate([{"prompt_token_ids": prompts[0]}],
                             SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
        params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True,
                                prompt_logprobs=K, n=2)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                            use_tqdm=False)
        assert llm.engine.scheduler.num_preemptions > 0, "the config must force preemption"
    for ids, out in zip(prompts, outs):
        assert out.error is None
        assert_matches_hf(model, ids, out.prompt_logprobs)
    # With the prefix in the cache, the scoring sequence computed it anyway (the bypass).
    assert again[0].num_cached_tokens > 0
    assert outs[0].num_cached_tokens == 0


def test_prompt_logprobs_zero_gives_only_the_prompt_token(model, prompts):
    with LLM(model, device="cpu", dtype="float32", block_size=8) as llm:
        (out,) = llm.generate([{"prompt_token_ids": prompts[1]}],
                              SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0),
                              use_tqdm=False)
    assert_matches_hf(model, prompts[1], out.prompt_logprobs, k=0)
