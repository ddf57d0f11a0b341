"""Mixture-of-experts models against HF transformers float32, greedy, token for token (or
up to a near-tie, hf_ref.greedy_mismatch): tensor-parallel or expert-parallel experts, at
tp 1 and 2, plain and under forced chunked prefill, preemption and a second identical
batch from the prefix cache. qwen3-moe runs the full matrix (but tp 1 with expert
parallelism, which is tp 1 without it), mixtral a pairwise cover."""

from __future__ import annotations

import functools

import hf_ref
import pytest
import torch

from nvllm import LLM, SamplingParams

pytestmark = pytest.mark.e2e

MAX_TOKENS = 16
TEXTS = [
    "You are a careful assistant. Answer in one short sentence, say when you do not know, "
    "and never invent facts. What is the capital of France?",
    "You are a careful assistant. Answer in one short sentence, say when you do not know, "
    "and never invent facts. How many legs does a spider have?",
    "Hi",
    "The quick brown fox jumps over the lazy dog. " * 4,
    "Once upon a time",
]
# 32-token steps chunk the long prompts; 24 blocks of 8 tokens hold about two sequences.
STRESS = dict(enable_prefix_caching=True, max_num_batched_tokens=32, num_kv_blocks=24)
PLAIN = dict(enable_prefix_caching=False)


@functools.cache
def prompts_for(model_dir: str) -> tuple[tuple[int, ...], ...]:
    tok = hf_ref.hf_tokenizer(model_dir)
    return tuple(tuple(tok(t).input_ids) for t in TEXTS)


@functools.cache
def hf_greedy(model_dir: str) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(hf_ref.generate(model_dir, list(p), MAX_TOKENS))
                 for p in prompts_for(model_dir))


def check(model_dir: str, outs) -> None:
    for p, got, ref in zip(prompts_for(model_dir), outs, hf_greedy(model_dir)):
        assert (why := hf_ref.greedy_mismatch(model_dir, list(p), got, list(ref))) is None, why


def run(model_dir: str, tp: int, ep: bool, stress: bool, **kw) -> None:
    prompts = [{"prompt_token_ids": list(p)} for p in prompts_for(model_dir)]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    with LLM(model_dir, device="cpu", dtype="float32", block_size=8, tensor_parallel_size=tp,
             enable_expert_parallel=ep, **(STRESS if stress else PLAIN), **kw) as llm:
        first = llm.generate(prompts, params, use_tqdm=False)
        if stress:
            hits = llm.engine.kv.stats.hits
            second = llm.generate(prompts, params, use_tqdm=False)
            assert llm.engine.kv.stats.hits > hits, "the second batch must hit the prefix cache"
            assert llm.engine.scheduler.num_preemptions > 0, "the config must force preemption"
            assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks, "leaked blocks"
    assert all(o.error is None for o in first)
    check(model_dir, [o.token_ids for o in first])
    if stress:
        check(model_dir, [o.token_ids for o in second])


@pytest.mark.parametrize("stress", [False, True], ids=["plain", "stress"])
@pytest.mark.parametrize("tp,ep", [(1, False), (2, False), (2, True)],
                         ids=["tp1", "tp2-tp-experts", "tp2-ep"])
def test_qwen3_moe_exact(tiny, tp, ep, stress):
    """5 experts top-3 (3 + 2 per rank with expert parallelism), a dense layer, one KV head.
    (tp 1 with expert parallelism holds the very same shard, tests/worker/test_moe.py.)"""
    model = tiny("qwen3-moe")
    if stress:
        assert max(map(len, prompts_for(model))) > STRESS["max_num_batched_tokens"]
    run(model, tp, ep, stress)


@pytest.mark.parametrize("tp,ep,stress", [(1, False, False), (1, True, True),
                                          (2, False, True), (2, True, False)])
def test_mixtral_exact(tiny, tp, ep, stress):
    run(tiny("mixtral"), tp, ep, stress)


def test_qwen3_moe_renormalised_top_k_exact_in_micro_batches(tiny):
    """norm_topk_prob=True (Qwen3-30B-A3B's setting) and decoder_sparse_step=2, every step
    cut into two micro-batches whose all-reduces overlap."""
    run(tiny("qwen3-moe-norm"), 2, True, False, micro_batch_min_tokens=1)


def test_near_tie_helper_rejects_a_clear_mismatch(tiny):
    model = tiny("qwen3-moe")
    p = list(prompts_for(model)[2])
    ref = list(hf_greedy(model)[2])
    row = hf_ref.hf_model(model)(torch.tensor([p + ref[:3]])).logits[0, -1]
    worst = int(row.argmin())
    assert hf_ref.greedy_mismatch(model, p, ref[:3] + [worst] + ref[4:], ref) is not None
    assert hf_ref.greedy_mismatch(model, p, ref, ref) is None
