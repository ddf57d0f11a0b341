"""The heart of it: greedy output equals HF transformers token for token (float32),
at tp=1 and tp=2, with prefix caching on and off, with forced chunked prefill and
forced preemption, and on a second identical batch served from the prefix cache."""

from __future__ import annotations

import functools
import os

import pytest
import torch

from nvllm import LLM, SamplingParams

pytestmark = pytest.mark.e2e

MAX_TOKENS = 24
SYSTEM = ("You are a careful assistant. Answer in one short sentence, say when you do not "
          "know, and never invent facts about people, places or numbers. ")
QUESTIONS = [
    "What is the capital of France?",
    "How many legs does a spider have?",
    "Why is the sky blue during the day?",
    "Name a prime number larger than ten.",
]
OTHERS = [
    "Hi",
    "The quick brown fox jumps over the lazy dog. " * 5,
    "Once upon a time",
    "Tensor parallel layers split the weights of every matrix across ranks, and an "
    "all-reduce joins the partial sums after the row-parallel projection.",
]


@functools.cache
def prompts_for(model_dir: str) -> tuple[tuple[int, ...], ...]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    texts = [SYSTEM + q for q in QUESTIONS] + OTHERS + [SYSTEM + QUESTIONS[0] + " Why?"]
    return tuple(tuple(tok(t).input_ids) for t in texts)


@functools.cache
def hf_greedy(model_dir: str) -> tuple[tuple[int, ...], ...]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    outs = []
    with torch.no_grad():
        for ids in prompts_for(model_dir):
            gen = model.generate(torch.tensor([ids]), do_sample=False,
                                 max_new_tokens=MAX_TOKENS, pad_token_id=0)
            outs.append(tuple(gen[0, len(ids):].tolist()))
    return tuple(outs)


def run_engine(model_dir: str, only: list[int] | None = None, **kwargs
               ) -> tuple[list[list[int]], list[list[int]], LLM]:
    """Both batches' tokens; `only`: the indices of prompts_for's prompts to run."""
    prompts = [{"prompt_token_ids": list(p)} for i, p in enumerate(prompts_for(model_dir))
               if only is None or i in only]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    llm = LLM(model_dir, device="cpu", dtype="float32", block_size=8, **kwargs)
    with llm:
        first = llm.generate(prompts, params, use_tqdm=False)
        hits_before = llm.engine.kv.stats.hits
        second = llm.generate(prompts, params, use_tqdm=False)
        stats = {
            "preemptions": llm.engine.scheduler.num_preemptions,
            "second_batch_hits": llm.engine.kv.stats.hits - hits_before,
            "free_blocks": llm.engine.kv.num_free_blocks,
            "num_blocks": llm.engine.kv.num_blocks,
        }
    assert all(o.error is None for o in first + second)
    llm.stats = stats
    return [o.token_ids for o in first], [o.token_ids for o in second], llm


def assert_exact(model_dir: str, got: list[list[int]], only: list[int] | None = None
                 ) -> None:
    ref = [r for i, r in enumerate(hf_greedy(model_dir)) if only is None or i in only]
    assert len(got) == len(ref)
    for i, (g, r) in enumerate(zip(got, ref)):
        assert g == list(r), f"prompt {i}: engine {g} != HF {list(r)}"


# Stress config: budget of 32 tokens forces chunked prefill of the long prompts;
# 24 blocks of 8 tokens hold only ~two sequences at once, forcing preemption.
STRESS = dict(enable_prefix_caching=True, max_num_batched_tokens=32, num_kv_blocks=24)
PLAIN = dict(enable_prefix_caching=False)


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_exact_under_chunking_preemption_and_prefix_hits(tiny, arch, tp):
    model = tiny(arch)
    assert max(len(p) for p in prompts_for(model)) > STRESS["max_num_batched_tokens"]
    first, second, llm = run_engine(model, tensor_parallel_size=tp, **STRESS)
    assert_exact(model, first)
    assert_exact(model, second)
    assert llm.stats["preemptions"] > 0, "the stress config must force preemption"
    assert llm.stats["second_batch_hits"] > 0, "the second batch must hit the prefix cache"
    assert llm.stats["free_blocks"] == llm.stats["num_blocks"], "leaked KV blocks"


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_exact_without_prefix_caching(tiny, arch, tp):
    model = tiny(arch)
    first, second, llm = run_engine(model, tensor_parallel_size=tp, **PLAIN)
    assert_exact(model, first)
    assert_exact(model, second)
    assert llm.stats["second_batch_hits"] == 0


@pytest.mark.parametrize("variant", ["synchronous", "micro-batches"])
def test_exact_with_synchronous_scheduling_or_micro_batches(tiny, variant):
    """The default engine sends plan N+1 before it has plan N's tokens (async scheduling)
    and runs one batch per step at this size. Synchronous steps, and every step cut into
    two micro-batches whose all-reduces overlap, give the same greedy tokens."""
    kw = (dict(async_scheduling=False) if variant == "synchronous"
          else dict(micro_batch_min_tokens=1))
    model = tiny("qwen3")
    first, second, llm = run_engine(model, tensor_parallel_size=2, **STRESS, **kw)
    assert_exact(model, first)
    assert_exact(model, second)
    assert llm.stats["preemptions"] > 0 and llm.stats["free_blocks"] == llm.stats["num_blocks"]


def test_exact_with_every_plan_by_reference(tiny, monkeypatch):
    """Plans whose ids travel through the shared-memory ring (normally only big ones,
    here every one): exact, with preemption, prefix hits, and the ring's regions
    acknowledged and reused."""
    from nvllm.common import plan_arrays

    monkeypatch.setattr(plan_arrays, "MIN_BULK_BYTES", 0)
    model = tiny("qwen2")
    prompts = [{"prompt_token_ids": list(p)} for p in prompts_for(model)]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    with LLM(model, device="cpu", dtype="float32", block_size=8, tensor_parallel_size=2,
             plan_shm_mib=1, **STRESS) as llm:
        first = llm.generate(prompts, params, use_tqdm=False)
        second = llm.generate(prompts, params, use_tqdm=False)
        writer = llm.engine.executor.plan_writer
        assert writer.num_shm > 100 and writer.num_inline == 0
        assert llm.engine.scheduler.num_preemptions > 0
        name = writer.name
    assert_exact(model, [o.token_ids for o in first])
    assert_exact(model, [o.token_ids for o in second])
    assert not os.path.exists(f"/dev/shm/{name}"), "the plan ring outlived the engine"


def test_seeded_sampling_agrees_across_tp_and_scheduling(tiny):
    """Random sampling (seeded): rank 0 samples and every rank keeps rank 0's tokens, so
    tp=2 continues exactly as tp=1, synchronous or not."""
    model = tiny("llama")
    prompts = [{"prompt_token_ids": list(p)} for p in prompts_for(model)]
    params = [SamplingParams(temperature=1.0, top_p=0.9, seed=100 + i, max_tokens=16, n=2)
              for i in range(len(prompts))]
    got = []
    for kw in (dict(tensor_parallel_size=1), dict(tensor_parallel_size=2),
               dict(tensor_parallel_size=2, async_scheduling=False,
                    micro_batch_min_tokens=1)):
        with LLM(model, device="cpu", dtype="float32", block_size=8, **kw) as llm:
            outs = llm.generate(prompts, params, use_tqdm=False)
        got.append([[c.token_ids for c in o.outputs] for o in outs])
    assert got[0] == got[1] == got[2]
    assert got[0][0][0] != got[0][0][1], "the two seeded completions should differ"


@pytest.mark.parametrize("mirror", ["tight", "off"])
def test_exact_with_the_cpu_kv_mirror_tight_or_off(tiny, mirror):
    """The CPU torch backend keeps running sequences' K/V contiguous within a budget.
    A budget of 2.5 minimal copies makes sequences take, grow, lose and rebuild theirs
    (from the pages, after prefix hits and preemptions) while others gather; off, every
    sequence gathers. Both must stay exact."""
    import json

    model = tiny("qwen3")
    cfg = json.load(open(f"{model}/config.json"))
    one = 2 * cfg["num_hidden_layers"] * 64 * cfg["num_key_value_heads"] * cfg["head_dim"] * 4
    kw = (dict(cpu_kv_cache_gib=2.5 * one / 2**30) if mirror == "tight"
          else dict(cpu_kv_mirror=False))
    first, second, llm = run_engine(model, **STRESS, **kw)
    assert_exact(model, first)
    assert_exact(model, second)
    assert llm.stats["preemptions"] > 0 and llm.stats["second_batch_hits"] > 0


@pytest.mark.parametrize("preset,tp", [
    ("qwen3-odd-vocab", 2),  # vocab 1031: shards padded
    ("llama-1kv", 2),  # one KV head, two ranks: KV heads replicated
    ("qwen3-sharded", 2),  # sharded safetensors index
    ("llama3", 2),  # Llama-3 rope scaling, tied embeddings
    ("mistral", 1),
])
def test_exact_checkpoint_variants(tiny, preset, tp):
    model = tiny(preset)
    first, _, _ = run_engine(model, tensor_parallel_size=tp, **STRESS)
    assert_exact(model, first)


def test_string_prompts_match_token_prompts(tiny):
    from transformers import AutoTokenizer

    model = tiny("qwen3")
    tok = AutoTokenizer.from_pretrained(model)
    texts = [SYSTEM + q for q in QUESTIONS[:2]] + ["naïve café — 東京"]
    with LLM(model, device="cpu", dtype="float32") as llm:
        outs = llm.generate(texts, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    for text, out in zip(texts, outs):
        assert out.prompt == text
        assert out.prompt_token_ids == tok(text).input_ids
        assert out.text == tok.decode(out.token_ids, skip_special_tokens=True)
        assert out.finish_reason in ("stop", "length")


def test_exact_with_triton_backend(tiny):
    """Every op through the Triton kernels (on CPU: the workers run them interpreted, so
    five of the prompts: three sharing the system prompt, the long one, whose prefill is
    chunked, and the one extending a cached prompt)."""
    pytest.importorskip("triton")
    model = tiny("qwen3")
    only = [0, 1, 2, 5, 8]
    first, second, llm = run_engine(model, only, tensor_parallel_size=2,
                                    attention_backend="triton", **STRESS)
    assert_exact(model, first, only)
    assert_exact(model, second, only)
    assert llm.stats["preemptions"] > 0 and llm.stats["second_batch_hits"] > 0
