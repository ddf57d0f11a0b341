"""``kv_cache_dtype="bfloat16"`` under a float32 run (CPU): keys and values are rounded to
bfloat16 once, when stored, and every attention reads them back exactly. The oracle is HF
transformers in float32 with a cache that rounds what it stores the same way: greedy
output equals it token for token at tp=1 and tp=2, on the native kernel with and without
the KV mirror and on the torch reference, under chunked prefill, preemption and prefix
hits. The config refuses the combinations no kernel reads."""

from __future__ import annotations

import functools

import pytest
import torch

from nvllm.common.config import EngineConfig, kv_cache_dtype
from tests.e2e.test_exactness import MAX_TOKENS, STRESS, prompts_for, run_engine

pytestmark = pytest.mark.e2e


@functools.cache
def hf_greedy_bf16_cache(model_dir: str) -> tuple[tuple[int, ...], ...]:
    from transformers import AutoModelForCausalLM, DynamicCache

    class RoundingCache(DynamicCache):
        """What the layers store is rounded to bfloat16 (and read back as float32)."""

        def update(self, key_states, value_states, layer_idx, *args, **kwargs):
            def r(t):
                return t.to(torch.bfloat16).to(t.dtype)

            return super().update(r(key_states), r(value_states), layer_idx, *args, **kwargs)

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    outs = []
    with torch.no_grad():
        for ids in prompts_for(model_dir):
            gen = model.generate(torch.tensor([ids]), do_sample=False,
                                 max_new_tokens=MAX_TOKENS, pad_token_id=0,
                                 cache=RoundingCache(config=model.config))
            outs.append(tuple(gen[0, len(ids):].tolist()))
    return tuple(outs)


@pytest.mark.parametrize("tp,backend,mirror", [
    (1, "cpu", False), (1, "cpu", True), (2, "cpu", False), (1, "torch", True),
])
def test_a_bfloat16_cache_equals_hf_with_a_rounding_cache(tiny, tp, backend, mirror):
    model = tiny("qwen3")
    first, second, llm = run_engine(model, tensor_parallel_size=tp, attention_backend=backend,
                                    cpu_kv_mirror=mirror, kv_cache_dtype="bfloat16", **STRESS)
    ref = hf_greedy_bf16_cache(model)
    for got in (first, second):
        for i, (g, r) in enumerate(zip(got, ref)):
            assert g == list(r), f"prompt {i}: engine {g} != HF (bf16 cache) {list(r)}"
    assert llm.stats["preemptions"] > 0 and llm.stats["second_batch_hits"] > 0


def test_the_config_admits_only_what_a_kernel_reads(tiny):
    model = tiny("qwen3")
    cfg = EngineConfig(model, device="cpu", dtype="float32", kv_cache_dtype="bfloat16").finalize()
    assert kv_cache_dtype(cfg) == torch.bfloat16
    auto = EngineConfig(model, device="cpu", dtype="bfloat16").finalize()
    assert auto.kv_cache_dtype == "bfloat16"
    for kw in (dict(dtype="bfloat16", kv_cache_dtype="float32"),
               dict(dtype="float32", kv_cache_dtype="float16")):
        with pytest.raises(ValueError, match=r"bfloat16 under float32 on CPU only; use "
                                             r"kv_cache_dtype='auto'"):
            EngineConfig(model, device="cpu", **kw).finalize()
    with pytest.raises(ValueError, match="not triton; use attention_backend='auto'"):
        EngineConfig(model, device="cpu", dtype="float32", kv_cache_dtype="bfloat16",
                     attention_backend="triton").finalize()
