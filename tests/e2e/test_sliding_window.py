"""Sliding-window models against HF transformers float32, token for token, generating
far past the window (32) with chunked prefill: a fully windowed Mistral (whose blocks
behind the window go back to the pool) and a Qwen2 whose layers mix windowed and full
attention (which keeps every block), at tp 1 (and the Mistral at tp 2); a second identical
batch, served from the prefix cache, equals the first."""

from __future__ import annotations

import pytest
import torch
from hf_ref import generate

from nvllm import LLM, SamplingParams
from nvllm.common.utils import cdiv

pytestmark = pytest.mark.e2e

WINDOW, MAX_TOKENS, BLOCK, BUDGET = 32, 200, 8, 16
PROMPTS = [list(range(5, 55)), [7, 8, 9]]  # a prompt longer than the window, and a short one


@pytest.mark.parametrize("preset,tp", [("mistral-sw", 1), ("qwen2-sw", 1), ("mistral-sw", 2)])
def test_windowed_models_equal_hf(tiny, preset, tp):
    model = tiny(preset)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS)
    llm = LLM(model, device="cpu", dtype="float32", block_size=BLOCK, tensor_parallel_size=tp,
              max_num_batched_tokens=BUDGET)
    info = llm.engine.config.model_info
    full = preset.startswith("mistral")
    assert info.layer_windows == ([WINDOW] * 2 if full else [None, WINDOW, WINDOW])
    assert llm.engine.config.max_model_len > WINDOW  # no longer capped at the window
    kv, held, usage = llm.engine.kv, [], []
    allocate, set_state = kv.allocate_slots, llm.engine.metrics.set_state

    def allocate_and_count(seq, *args):
        ok = allocate(seq, *args)
        held.append(kv.blocks_held(seq))
        return ok

    def record_usage(running, waiting, kv_usage):  # the nvllm:kv_cache_usage_perc gauge
        usage.append(kv_usage)
        set_state(running, waiting, kv_usage)

    kv.allocate_slots = allocate_and_count
    llm.engine.metrics.set_state = record_usage
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    with llm:
        first = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        if full:  # blocks given back behind the window must not break prefix hits
            hits = kv.stats.hits
            again = llm.generate(prompts[:1], params, use_tqdm=False)
            assert kv.stats.hits > hits and again[0].outputs[0].token_ids == first[0]
    # A fully windowed model holds the window and a step's tokens; a mixed one, all.
    longest = cdiv(len(PROMPTS[0]) + MAX_TOKENS - 1, BLOCK)
    bound = cdiv(WINDOW + BUDGET, BLOCK) + 1
    if full:
        assert max(held) <= bound < longest
        # The exported usage shows it too: both sequences together within two bounds.
        assert 0 < max(usage) * kv.num_blocks <= 2 * bound
    else:
        assert max(held) == longest
        assert max(usage) * kv.num_blocks >= longest
    for i, (p, got) in enumerate(zip(PROMPTS, first)):
        assert got == generate(model, p, MAX_TOKENS, min_new_tokens=MAX_TOKENS), f"prompt {i}"


@pytest.mark.parametrize("preset", ["mistral-sw", "qwen2-sw"])
def test_hf_reference_applies_the_window(tiny, preset):
    """The reference itself slides: without the window HF generates something else past it
    (so the equality above is not that of two full-attention models)."""
    from transformers import AutoModelForCausalLM

    model = tiny(preset)
    off = (dict(sliding_window=None) if preset == "mistral-sw"
           else dict(layer_types=["full_attention"] * 3))
    full = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32, **off).eval()
    with torch.no_grad():
        out = full.generate(torch.tensor([PROMPTS[0]]), do_sample=False, max_new_tokens=60,
                            min_new_tokens=60, pad_token_id=0)[0, len(PROMPTS[0]):].tolist()
    assert out != generate(model, PROMPTS[0], 60, min_new_tokens=60)


@pytest.mark.parametrize("backend,kw", [
    ("torch", {}),
    ("cpu", {"num_kv_blocks": 12, "max_num_seqs": 4}),  # forced preemption
], ids=["torch_backend", "preemption"])
def test_windowed_mistral_on_the_torch_backend_and_under_preemption(tiny, backend, kw):
    """The reference kernels apply the window in a whole engine too; and a windowed
    sequence preempted after giving blocks back recomputes exactly (12 blocks of 8 hold
    two sequences' windows, not four)."""
    model = tiny("mistral-sw")
    prompts = [list(range(5 + i, 45 + i)) for i in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=100, min_tokens=100)
    with LLM(model, device="cpu", dtype="float32", block_size=BLOCK,
             max_num_batched_tokens=BUDGET, attention_backend=backend, **kw) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                            use_tqdm=False)
        if kw:
            assert llm.engine.scheduler.num_preemptions > 0
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == generate(model, p, 100, min_new_tokens=100)
