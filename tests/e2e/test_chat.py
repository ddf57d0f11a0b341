"""LLM.chat end to end, and the same conversations over /v1/chat/completions on the same
engine (tiny qwen3-tools, CPU, one LLM for the module): both render one set of prompt
token ids (nvllm/common/chat.py), continue_final_message leaves the final assistant turn
open on both, a batch comes back in order, greedy chat is generate on the rendered
prompt, and the refusals name their field before any request starts."""

from __future__ import annotations

import contextlib

import pytest
from served import serve

from nvllm import LLM, SamplingParams
from nvllm.common.chat import ChatError

pytestmark = pytest.mark.e2e

CHAT = [{"role": "system", "content": "Be brief."},
        {"role": "user", "content": "The quick brown fox"}]
PREFILL = [*CHAT, {"role": "assistant", "content": "It jumps over"}]
TOOLS = [{"type": "function", "function": {"name": "now", "description": "The time",
                                           "parameters": {"type": "object", "properties": {}}}}]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
CASES = {  # name -> (messages, LLM.chat options, the same in an HTTP body)
    "plain": (CHAT, {}, {}),
    "continue": (PREFILL, {"add_generation_prompt": False, "continue_final_message": True},
                 {"add_generation_prompt": False, "continue_final_message": True}),
    "tools": (CHAT, {"tools": TOOLS}, {"tools": TOOLS}),
}


@pytest.fixture(scope="module")
def llm(tiny):
    with LLM(tiny("qwen3-tools"), device="cpu", dtype="float32") as llm:
        yield llm


@pytest.fixture(scope="module")
def tok(llm):
    return llm.tokenizer


def hf_ids(tok, messages, **kw) -> list[int]:
    """transformers' own rendering, tokenized without adding special tokens."""
    return tok(tok.apply_chat_template(messages, tokenize=False, **kw),
               add_special_tokens=False)["input_ids"]


@contextlib.contextmanager
def gateway(llm):
    """The gateway in process in front of this LLM's engine, served over ZMQ for the
    block; the LLM is left as it was (LLM.chat works on it again after)."""
    from fastapi.testclient import TestClient

    from nvllm.launch.openai.app import GatewayConfig, create_app

    s = serve(llm)
    try:
        with TestClient(create_app(GatewayConfig(s.endpoint, "tiny"))) as c:
            yield c
    finally:
        s.stop.set()
        s.thread.join(30)
        s.server.close()


def test_chat_and_http_render_the_same_prompt_ids(llm, tok):
    """Per case: LLM.chat's prompt ids are transformers' rendering, and the HTTP route's
    are the same ids: /tokenize's, usage.prompt_tokens, and the ids the engine scored
    (prompt_logprobs=0 names each position's prompt token), with the same scores and the
    same greedy reply."""
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, prompt_logprobs=0)
    offline = {}
    for name, (messages, options, _) in CASES.items():
        (out,) = llm.chat(messages, params, use_tqdm=False, **options)
        hf_options = {"add_generation_prompt": True, **options}
        assert out.prompt_token_ids == hf_ids(tok, messages, **hf_options), name
        assert out.prompt == tok.apply_chat_template(messages, tokenize=False, **hf_options)
        offline[name] = out
    with gateway(llm) as c:
        for name, (messages, _, extra) in CASES.items():
            want = offline[name]
            ids = want.prompt_token_ids
            got = c.post("/tokenize", json={"messages": messages, **extra})
            assert got.status_code == 200, got.text
            assert got.json()["tokens"] == ids, name
            r = c.post("/v1/chat/completions", json={
                "messages": messages, "max_tokens": 8, "temperature": 0.0,
                "ignore_eos": True, "prompt_logprobs": 0, **extra})
            assert r.status_code == 200, r.text
            body = r.json()
            assert body["usage"]["prompt_tokens"] == len(ids), name
            scored = body["prompt_logprobs"]
            assert scored[0] is None and len(scored) == len(ids)
            assert [int(next(iter(e))) for e in scored[1:]] == ids[1:], name
            for e, mine in zip(scored[1:], want.prompt_logprobs[1:]):
                ((tid, v),) = e.items()
                assert abs(v["logprob"] - mine[int(tid)]) < 1e-4
            if name != "tools":  # tools: "auto" reads the reply for calls
                assert body["choices"][0]["message"]["content"] == want.text, name
    assert llm.chat(CHAT, GREEDY, use_tqdm=False)[0].text == offline["plain"].text  # again


def test_continue_final_message_has_no_end_of_turn(llm, tok):
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    (cont,) = llm.chat(PREFILL, GREEDY, use_tqdm=False, add_generation_prompt=False,
                       continue_final_message=True)
    (closed,) = llm.chat(PREFILL, GREEDY, use_tqdm=False, add_generation_prompt=False)
    ids = cont.prompt_token_ids
    assert ids == hf_ids(tok, PREFILL, continue_final_message=True)
    assert ids[-1] != im_end and closed.prompt_token_ids[:len(ids) + 1] == [*ids, im_end]
    assert cont.prompt.endswith("<|im_start|>assistant\nIt jumps over")


def test_a_batch_comes_back_in_order_and_greedy_chat_is_generate(llm, tok):
    convs = [[{"role": "user", "content": "x " * (8 - 3 * i)}] for i in range(3)]
    convs.append(PREFILL[:2] + [{"role": "user", "content": "Why?"}])
    per = [SamplingParams(temperature=0.0, max_tokens=2 + i, ignore_eos=True)
           for i in range(len(convs))]
    outs = llm.chat(convs, per, use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == [
        hf_ids(tok, c, add_generation_prompt=True) for c in convs]
    assert [len(o.token_ids) for o in outs] == [2, 3, 4, 5]
    ref = llm.generate([{"prompt_token_ids": o.prompt_token_ids} for o in outs], per,
                       use_tqdm=False)
    assert [(o.token_ids, o.text) for o in outs] == [(r.token_ids, r.text) for r in ref]


def test_template_options_reach_the_template(llm):
    template = "{{ greeting }}{% for m in messages %}{{ m.content }}{% endfor %}"
    (out,) = llm.chat(CHAT, GREEDY, use_tqdm=False, chat_template=template,
                      chat_template_kwargs={"greeting": "Hello "})
    assert out.prompt == "Hello Be brief.The quick brown fox"
    (tools,) = llm.chat(CHAT, GREEDY, use_tqdm=False, tools=TOOLS)
    assert '"name": "now"' in tools.prompt


@pytest.mark.parametrize("messages,options,param", [
    (PREFILL, {"continue_final_message": True}, "continue_final_message"),
    (CHAT, {"add_generation_prompt": False, "continue_final_message": True},
     "messages.1.role"),
    ([CHAT, [{"role": "user"}, {"content": "x"}]], {}, "messages.1.1.role"),
    (CHAT, {"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs.tools"),
    ("hello", {}, "messages"),
])
def test_refusals_name_the_field_and_start_nothing(llm, messages, options, param):
    with pytest.raises(ValueError) as e:
        llm.chat(messages, GREEDY, use_tqdm=False, **options)
    assert isinstance(e.value, ChatError) and e.value.param == param, e.value
    assert not llm.engine.requests


def test_http_refusals_name_the_field(llm):
    with gateway(llm) as c:
        for body, param in (
                ({"messages": PREFILL, "continue_final_message": True},
                 "continue_final_message"),
                ({"messages": CHAT, "add_generation_prompt": False,
                  "continue_final_message": True}, "messages.1.role")):
            for path in ("/v1/chat/completions", "/tokenize"):
                r = c.post(path, json={**body, "max_tokens": 2} if path[1] == "v" else body)
                assert r.status_code == 400, r.text
                assert r.json()["error"]["param"] == param, r.text
