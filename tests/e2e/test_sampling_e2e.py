"""Sampling parameters, logprobs and prefix-cache accounting end to end through ``LLM``
(tp=1, CPU, tiny qwen3, float32), with HF transformers float32 as the oracle. Each
parameter is checked in a way that fails if it is dropped on its way to the workers."""

from __future__ import annotations

import hf_ref
import pytest

from nvllm import LLM, SamplingParams

pytestmark = pytest.mark.e2e

MAX_TOKENS = 12
TEXTS = ["The capital of France is", "Once upon a time"]


@pytest.fixture(scope="module")
def model(tiny):
    return tiny("qwen3")


@pytest.fixture(scope="module")
def llm(model):
    with LLM(model, device="cpu", dtype="float32", block_size=8) as engine:
        yield engine


@pytest.fixture(scope="module")
def prompts(model):
    tok = hf_ref.hf_tokenizer(model)
    return [tok(t).input_ids for t in TEXTS]


def gen(llm, prompts, **kw) -> list[list[int]]:
    params = SamplingParams(**{"max_tokens": MAX_TOKENS, "ignore_eos": True, **kw})
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert all(o.error is None for o in outs)
    return [o.token_ids for o in outs]


@pytest.fixture(scope="module")
def greedy(llm, prompts):
    return gen(llm, prompts, temperature=0)


@pytest.mark.parametrize("filt", [{"top_k": 1}, {"min_p": 1.0}], ids=["top_k", "min_p"])
def test_top_k_1_and_min_p_1_make_sampling_greedy(llm, prompts, greedy, filt):
    free = gen(llm, prompts, temperature=1.0, seed=3)
    assert free != greedy, "seeded sampling at T=1 must differ from greedy for this check"
    assert gen(llm, prompts, temperature=1.0, seed=3, **filt) == greedy


def test_repetition_penalty_matches_hf(llm, model, prompts, greedy):
    # Without ignore_eos: HF generate stops at eos as the engine does.
    got = [o.token_ids for o in llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(temperature=0, max_tokens=MAX_TOKENS, repetition_penalty=1.5),
        use_tqdm=False)]
    want = [hf_ref.generate(model, p, MAX_TOKENS, repetition_penalty=1.5) for p in prompts]
    assert got == want
    assert got != greedy, "the penalty must change the greedy output for this check"


@pytest.mark.parametrize("pen", [{"frequency_penalty": 1.5}, {"presence_penalty": 1.5}],
                         ids=["frequency", "presence"])
def test_frequency_and_presence_penalties_match_a_step_by_step_reference(
        llm, model, prompts, greedy, pen):
    got = gen(llm, prompts, temperature=0, **pen)
    want = [hf_ref.greedy(model, p, MAX_TOKENS, **pen) for p in prompts]
    assert got == want
    assert got != greedy, "the penalty must change the greedy output for this check"


def test_logprobs_match_hf_log_softmax(llm, model, prompts):
    # Sampled (T=1, seeded), so the sampled token is not always the top one.
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=1.0, seed=11, max_tokens=MAX_TOKENS,
                                       ignore_eos=True, logprobs=3), use_tqdm=False)
    not_top = 0
    for p, o in zip(prompts, outs):
        c = o.outputs[0]
        ref = hf_ref.logprobs(model, p, c.token_ids)
        tol = hf_ref.logprob_tols(model, p, c.token_ids)  # relative: hf_ref says why
        assert len(c.logprobs) == len(c.token_ids) == MAX_TOKENS
        for pos, (tok, lps) in enumerate(zip(c.token_ids, c.logprobs)):
            assert tok in lps, f"the sampled token is missing at {pos}"
            top3 = ref[pos].topk(3).indices.tolist()
            assert set(lps) - {tok} <= set(top3) and set(top3) <= set(lps)
            for t, v in lps.items():
                assert abs(v - float(ref[pos, t])) <= tol[pos], (pos, t)
            not_top += tok != top3[0]
    assert not_top > 0, "no sampled token below the top-1: the check would be weak"


def test_a_repeated_prompt_reports_cached_tokens(llm, model):
    tok = hf_ref.hf_tokenizer(model)
    ids = tok("A prompt long enough to fill several KV blocks of eight tokens each, so "
              "that its second run is served from the prefix cache. " * 2).input_ids
    p = SamplingParams(temperature=0, max_tokens=2)
    first = llm.generate([{"prompt_token_ids": ids}], p, use_tqdm=False)[0]
    second = llm.generate([{"prompt_token_ids": ids}], p, use_tqdm=False)[0]
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens >= len(ids) - 8 > 0
    assert second.token_ids == first.token_ids


def test_logit_bias_forces_its_row_only_and_logprobs_stay_raw(llm, model, prompts, greedy):
    """One batch: prompt 0 with logit_bias {t: +100} (t a token greedy never picks) gives t
    at every step, with the logprobs of the unbiased model; prompt 1, unbiased, gives what
    it gives alone. A -100 bias on prompt 1's first greedy token makes it pick another."""
    t = next(t for t in range(300, 1000) if t not in greedy[0])
    both = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        [SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True,
                        logit_bias={str(t): 100}, logprobs=1),
         SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)],
        use_tqdm=False)
    assert both[0].token_ids == [t] * MAX_TOKENS
    assert both[1].token_ids == gen(llm, prompts[1:], temperature=0)[0] == greedy[1]
    ref = hf_ref.logprobs(model, prompts[0], both[0].token_ids)
    tol = hf_ref.logprob_tols(model, prompts[0], both[0].token_ids)
    for pos, lps in enumerate(both[0].outputs[0].logprobs):
        assert abs(lps[t] - float(ref[pos, t])) <= tol[pos], pos
        assert lps[t] < float(ref[pos].max()), "t must not be the model's own pick"
    banned = gen(llm, prompts[1:], temperature=0, logit_bias={greedy[1][0]: -100})[0]
    assert banned[0] != greedy[1][0]
