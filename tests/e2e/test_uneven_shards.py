"""Head counts tp does not divide (nvllm/worker/sharding.py: by KV group): greedy tokens
equal HF float32 at tp 2 and 3 under forced chunked prefill and preemption, for 9 / 3
(SmolLM2-135M's heads, with an intermediate size and a vocabulary no tp divides), 14 / 2
and 28 / 4 query / KV heads."""

from __future__ import annotations

import json

import hf_ref
import pytest

from nvllm import LLM, SamplingParams

pytestmark = pytest.mark.e2e

MAX_TOKENS = 12
TEXTS = ["The quick brown fox jumps over the lazy dog. " * 3, "Once upon a time",
         "Tensor parallel layers split the weights of every matrix across ranks."]
# 12 blocks of 8 tokens, a 32-token step budget: chunked prefill and preemption.
STRESS = dict(enable_prefix_caching=True, max_num_batched_tokens=32)
BLOCKS = 12


@pytest.mark.parametrize("tp", [2, 3])
@pytest.mark.parametrize("preset", ["llama-9h3kv", "qwen3-14h2kv", "qwen2-28h4kv"])
def test_uneven_head_shards_equal_hf_under_preemption(tiny, preset, tp):
    model = tiny(preset)
    tok = hf_ref.hf_tokenizer(model)
    prompts = [tok(t).input_ids for t in TEXTS]
    kw = dict(num_kv_blocks=BLOCKS)
    if (preset, tp) == ("llama-9h3kv", 2):
        # No num_kv_blocks: rank 0 holds 2 KV heads, rank 1 one, so the same memory holds
        # half the blocks on rank 0: the engine must size the cache by the fuller rank.
        cfg = json.load(open(f"{model}/config.json"))
        head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]
        rank0_block = 2 * cfg["num_hidden_layers"] * 8 * 2 * head_dim * 4
        kw = dict(cpu_kv_cache_gib=BLOCKS * rank0_block / 2**30)
    with LLM(model, device="cpu", dtype="float32", block_size=8, tensor_parallel_size=tp,
             **STRESS, **kw) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS),
                            use_tqdm=False)
        assert llm.engine.kv.num_blocks == BLOCKS
        assert llm.engine.scheduler.num_preemptions > 0, "the config must force preemption"
        assert llm.engine.kv.num_free_blocks == BLOCKS, "leaked KV blocks"
    for p, o in zip(prompts, outs):
        assert o.error is None
        ref = hf_ref.generate(model, p, MAX_TOKENS)
        assert hf_ref.greedy_mismatch(model, p, o.token_ids, ref) is None
