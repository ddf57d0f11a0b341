"""/tokenize and /detokenize (nvllm/launch/openai/tokenize.py) against the fake leader:
plain text and ids are the leader's to tokenize, so the gateway loads no tokenizer for
them; the chat form, a gateway given its own --tokenizer, and a leader that refuses the
ops (a data-parallel router) use the gateway's own."""

from __future__ import annotations

from transformers import AutoTokenizer


def test_text_and_ids_go_to_the_leader_and_no_tokenizer_is_loaded(gateway, leader):
    c = gateway()
    got = c.post("/tokenize", json={"prompt": "hi there", "add_special_tokens": False,
                                    "return_token_strs": True})
    assert got.status_code == 200, got.text
    assert got.json() == {"count": 3, "max_model_len": 1024, "tokens": [7, 8, 9],
                          "token_strs": ["t7", "t8", "t9"]}
    got = c.post("/detokenize", json={"tokens": [7, 8]})
    assert got.json() == {"prompt": "from the leader"}
    asked = [(m["op"], m.get("prompt"), m.get("add_special_tokens"), m.get("token_ids"))
             for m in leader.controls]
    assert asked == [("tokenize", "hi there", False, None), ("detokenize", None, None, [7, 8])]
    assert c.app.state.gateway._tokenizer is None


def test_a_refusing_leader_falls_back_to_the_gateways_tokenizer(gateway, leader, tiny):
    leader.refuse_tokenize = True
    tok = AutoTokenizer.from_pretrained(tiny("qwen3"))
    c = gateway()
    for _ in range(2):
        got = c.post("/tokenize", json={"prompt": "hi there"})
        assert got.status_code == 200, got.text
        assert got.json()["tokens"] == tok("hi there")["input_ids"]
    assert c.post("/detokenize", json={"tokens": [100, 200]}).json() == \
        {"prompt": tok.decode([100, 200])}
    assert len(leader.controls) == 1  # asked once, then it remembers


def test_the_gateways_own_tokenizer_and_the_chat_form_stay_in_the_gateway(gateway, leader,
                                                                          tiny):
    tok = AutoTokenizer.from_pretrained(tiny("qwen3"))
    own = gateway(tokenizer=tiny("qwen3"))
    assert own.post("/tokenize", json={"prompt": "hi"}).json()["tokens"] == \
        tok("hi")["input_ids"]
    chat = gateway().post("/tokenize", json={"messages": [{"role": "user",
                                                            "content": "hi"}]})
    assert chat.status_code == 200, chat.text
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                   add_generation_prompt=True)
    assert chat.json()["tokens"] == tok(text, add_special_tokens=False)["input_ids"]
    assert leader.controls == []
