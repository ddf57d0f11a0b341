"""/v1/completions echo and prompt logprobs against a real engine (in-process, tiny qwen3,
float32, 16-token prefill chunks) behind a gateway process, checked against HF: the
request lm-evaluation-harness's loglikelihood sends, read the way its parse_logprobs reads
it; echo streamed; vLLM's prompt_logprobs field on completions and chat."""

from __future__ import annotations

import json
import signal
import subprocess

import hf_ref
import httpx
import pytest
import served
from subproc import free_port, stop_process, wait_healthy

from nvllm import LLM
from nvllm.launch.openai.process import start_gateway_process

pytestmark = pytest.mark.e2e

NAME = "tiny-qwen3"
# Logprobs are compared with HF's within hf_ref.logprob_tols: a bound relative to each
# row's logit magnitude, derived there, that holds on any x86-64 CPU torch supports (an
# absolute 1e-4 failed on a Xeon with AMX by 9%).
CONTEXTS = ["The capital of France is", "Tensor parallel layers split the weights of every "
            "matrix across ranks, and an all-reduce joins the partial sums; then"]
CONTINUATIONS = [" Paris", " the row-parallel projection ends"]


@pytest.fixture(scope="module")
def base(tiny, tmp_path_factory):
    model = tiny("qwen3")
    s = served.serve(LLM(model, device="cpu", dtype="float32", block_size=8,
                         max_num_batched_tokens=16))
    gateway = None
    try:
        port = free_port()
        with open(tmp_path_factory.mktemp("echo") / "gateway.log", "w") as log:
            gateway = start_gateway_process(s.endpoint, "127.0.0.1", port, NAME, stdout=log,
                                            stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, gateway, 60)
        yield url
    finally:
        if gateway is not None:
            stop_process(gateway, signal.SIGTERM)
        served.teardown(s)


@pytest.fixture(scope="module")
def model(tiny):
    return tiny("qwen3")


def post(base: str, route: str, body: dict) -> dict:
    r = httpx.post(base + route, json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def parse_logprobs(out: dict, ctxlens: list[int]) -> list[tuple[float, bool]]:
    """lm-evaluation-harness 0.4's LocalCompletionsAPI.parse_logprobs, as it reads a reply."""
    res = []
    for choice, ctxlen in zip(sorted(out["choices"], key=lambda c: c["index"]), ctxlens):
        tokens_logprobs = choice["logprobs"]["token_logprobs"][ctxlen:-1]
        top_logprobs = choice["logprobs"]["top_logprobs"][ctxlen:-1]
        is_greedy = all(tok == max(top.values())
                        for tok, top in zip(tokens_logprobs, top_logprobs))
        res.append((sum(tokens_logprobs), is_greedy))
    return res


def test_lm_eval_loglikelihood_request_matches_hf(base, model):
    tok = hf_ref.hf_tokenizer(model)
    ctx = [tok(c).input_ids for c in CONTEXTS]
    whole = [c + tok(x, add_special_tokens=False).input_ids
             for c, x in zip(ctx, CONTINUATIONS)]
    # lm-eval's _create_payload for loglikelihood (a batch of token-id prompts).
    out = post(base, "/v1/completions", {"model": NAME, "prompt": whole, "temperature": 0,
                                         "max_tokens": 1, "logprobs": 1, "seed": 1234,
                                         "echo": True})
    got = parse_logprobs(out, [len(c) for c in ctx])
    for ids, c, choice, (total, greedy) in zip(whole, ctx, out["choices"], got):
        ref = hf_ref.logprobs(model, ids[:1], ids[1:])  # row j - 1 scores token j
        tol = hf_ref.logprob_tols(model, ids[:1], ids[1:])
        want = [float(ref[j - 1, ids[j]]) for j in range(len(c), len(ids))]
        assert abs(total - sum(want)) <= float(tol[len(c) - 1:].sum())
        assert greedy == all(int(ref[j - 1].argmax()) == ids[j]
                             for j in range(len(c), len(ids)))
        lp = choice["logprobs"]
        assert len(lp["tokens"]) == len(ids) + 1  # the prompt, then the generated token
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        for j in range(1, len(ids)):
            assert abs(lp["token_logprobs"][j] - float(ref[j - 1, ids[j]])) <= tol[j - 1]
            assert len(lp["top_logprobs"][j]) in (1, 2)
        assert choice["text"].startswith(tok.decode(ids))
        assert lp["text_offset"] == sorted(lp["text_offset"])
        assert "".join(lp["tokens"]) == choice["text"]


def test_echo_streams_the_prompt_in_each_choices_first_chunk(base, model):
    tok = hf_ref.hf_tokenizer(model)
    prompt = CONTEXTS[1]
    ids = tok(prompt).input_ids
    body = {"model": NAME, "prompt": prompt, "max_tokens": 3, "temperature": 0, "n": 2,
            "echo": True, "logprobs": 2, "stream": True, "ignore_eos": True}
    chunks: dict[int, list[dict]] = {0: [], 1: []}
    with httpx.stream("POST", base + "/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                for c in json.loads(line[6:])["choices"]:
                    chunks[c["index"]].append(c)
    ref = hf_ref.logprobs(model, ids[:1], ids[1:])
    tol = hf_ref.logprob_tols(model, ids[:1], ids[1:])
    for choice in chunks.values():
        first = choice[0]
        assert first["text"].startswith(prompt)
        lp = first["logprobs"]
        assert lp["token_logprobs"][0] is None and len(lp["tokens"]) >= len(ids)
        for j in range(1, len(ids)):
            assert abs(lp["token_logprobs"][j] - float(ref[j - 1, ids[j]])) <= tol[j - 1]
        assert all(not c["text"].startswith(prompt) for c in choice[1:])
        offsets = [o for c in choice for o in c["logprobs"]["text_offset"]]
        assert offsets == sorted(offsets) and len(offsets) == len(ids) + 3
    # Without logprobs, echo is the text alone.
    out = post(base, "/v1/completions", {**body, "stream": False, "logprobs": None})
    assert all(c["text"].startswith(prompt) and c["logprobs"] is None for c in out["choices"])


def test_vllm_prompt_logprobs_on_completions_and_chat(base, model):
    tok = hf_ref.hf_tokenizer(model)
    ids = tok(CONTEXTS[0]).input_ids
    out = post(base, "/v1/completions", {"model": NAME, "prompt": ids, "max_tokens": 1,
                                         "prompt_logprobs": 3})
    (choice,) = out["choices"]
    plp = choice["prompt_logprobs"]
    ref = hf_ref.logprobs(model, ids[:1], ids[1:])
    tol = hf_ref.logprob_tols(model, ids[:1], ids[1:])
    assert plp[0] is None and len(plp) == len(ids) and choice["logprobs"] is None
    for j in range(1, len(ids)):
        entry = plp[j]
        assert str(ids[j]) in entry and len(entry) in (3, 4)
        for t, v in entry.items():
            assert abs(v["logprob"] - float(ref[j - 1, int(t)])) <= tol[j - 1]
            assert isinstance(v["decoded_token"], str)
        ranks = sorted(v["rank"] for v in entry.values() if v["rank"] is not None)
        assert ranks == [1, 2, 3]
    chat = post(base, "/v1/chat/completions", {
        "model": NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
        "prompt_logprobs": 0})
    assert chat["prompt_logprobs"][0] is None
    assert all(len(e) == 1 for e in chat["prompt_logprobs"][1:])
    r = httpx.post(base + "/v1/completions", json={"model": NAME, "prompt": "x", "stream": True,
                                                   "prompt_logprobs": 1}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs"
    r = httpx.post(base + "/v1/chat/completions", json={
        "model": NAME, "messages": [{"role": "user", "content": "hi"}], "echo": True},
        timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "echo"
