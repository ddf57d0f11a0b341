"""nvllm/common/chat.py, the one chat rendering LLM.chat and /v1/chat/completions share:
equal to transformers' own apply_chat_template, continue_final_message leaves the final
turn open, no second BOS when the template writes one, a tokenizer built in code with the
template given apart (as a GGUF file's would be), and every refusal names its field."""

from __future__ import annotations

import pytest

from nvllm.common.chat import ChatError, chat_prompt_ids, encode_rendered, render_chat
from nvllm.launch.tiny_tokenizer import CHATML_TEMPLATE

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
PREFILL = [*CHAT, {"role": "assistant", "content": "The answer is"}]
TOOLS = [{"type": "function", "function": {"name": "now", "description": "The time",
                                           "parameters": {"type": "object", "properties": {}}}}]


@pytest.fixture(scope="module")
def tok(tiny):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny("qwen3-tools"))


def hf_ids(tok, messages, **kw) -> list[int]:
    return tok(tok.apply_chat_template(messages, tokenize=False, **kw),
               add_special_tokens=False)["input_ids"]


def test_renders_as_transformers_does(tok):
    assert chat_prompt_ids(tok, CHAT) == hf_ids(tok, CHAT, add_generation_prompt=True)
    assert chat_prompt_ids(tok, CHAT, add_generation_prompt=False) == hf_ids(tok, CHAT)
    assert chat_prompt_ids(tok, CHAT, tools=TOOLS) == hf_ids(
        tok, CHAT, tools=TOOLS, add_generation_prompt=True)
    assert "# Tools" in render_chat(tok, CHAT, tools=TOOLS)
    # text parts are joined; content None is ""; tool-call arguments become an object
    calls = [{"id": "c1", "type": "function",
              "function": {"name": "now", "arguments": '{"tz": "UTC"}'}}]
    turns = [{"role": "user", "content": [{"type": "text", "text": "a"},
                                          {"type": "text", "text": "b"}]},
             {"role": "assistant", "content": None, "tool_calls": calls},
             {"role": "tool", "content": "12:00", "tool_call_id": "c1"}]
    plain = [{"role": "user", "content": "a\nb"},
             {"role": "assistant", "content": "", "tool_calls": [
                 {**calls[0], "function": {"name": "now", "arguments": {"tz": "UTC"}}}]},
             {"role": "tool", "content": "12:00", "tool_call_id": "c1"}]
    assert render_chat(tok, turns) == tok.apply_chat_template(
        plain, tokenize=False, add_generation_prompt=True)
    assert turns[0]["content"][0] == {"type": "text", "text": "a"}  # the caller's, unchanged


def test_continue_final_message_leaves_the_last_turn_open(tok):
    ids = chat_prompt_ids(tok, PREFILL, add_generation_prompt=False,
                          continue_final_message=True)
    assert ids == hf_ids(tok, PREFILL, continue_final_message=True)
    closed = chat_prompt_ids(tok, PREFILL, add_generation_prompt=False)
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    assert closed[:len(ids)] == ids and closed[len(ids)] == im_end
    assert ids[-1] != im_end and tok.decode(ids).endswith("<|im_start|>assistant\nThe answer is")
    # an empty final message continues from the bare assistant header
    empty = [*CHAT, {"role": "assistant", "content": ""}]
    assert render_chat(tok, empty, add_generation_prompt=False, continue_final_message=True
                       ).endswith("<|im_start|>assistant\n")


def test_template_and_its_variables(tok):
    template = "{{ greeting }}{% for m in messages %}[{{ m.role }}:{{ m.content }}]{% endfor %}"
    got = render_chat(tok, CHAT, chat_template=template,
                      chat_template_kwargs={"greeting": "Ahoy"})
    assert got == "Ahoy[system:Be brief.][user:Hi there]"
    # vLLM's: a chat_template in chat_template_kwargs wins
    assert render_chat(tok, CHAT, chat_template="x", chat_template_kwargs={
        "chat_template": "{{ messages | length }}"}) == "2"


def test_a_bos_the_template_writes_is_not_doubled(tok):
    """A tokenizer that adds BOS by itself (most Llama-style ones do), and a template that
    writes it too: the prompt starts with one."""
    import copy

    from tokenizers.processors import TemplateProcessing

    bos = copy.deepcopy(tok)
    bos_id = bos.convert_tokens_to_ids(bos.bos_token)
    bos._tokenizer.post_processor = TemplateProcessing(
        single=f"{bos.bos_token} $A", special_tokens=[(bos.bos_token, bos_id)])
    assert bos("x")["input_ids"][0] == bos_id  # it does add one
    ids = chat_prompt_ids(bos, CHAT, chat_template="{{ bos_token }}" + CHATML_TEMPLATE)
    assert ids[0] == bos_id and ids[1] != bos_id
    assert ids == bos.apply_chat_template(CHAT, chat_template="{{ bos_token }}"
                                          + CHATML_TEMPLATE, add_generation_prompt=True,
                                          return_dict=False)
    assert encode_rendered(bos, "x", add_special_tokens=True)[0] == bos_id


def test_any_tokenizer_with_the_template_given(tok):
    """A tokenizer built in code with no template of its own (as one read from a GGUF file
    may be) renders with the template passed in, the same ids."""
    from transformers import PreTrainedTokenizerFast

    bare = PreTrainedTokenizerFast(tokenizer_object=tok.backend_tokenizer,
                                   bos_token=tok.bos_token, eos_token=tok.eos_token)
    assert not bare.chat_template
    with pytest.raises(ChatError) as e:
        render_chat(bare, CHAT)
    assert (e.value.param, e.value.code) == ("chat_template", "no_chat_template")
    assert chat_prompt_ids(bare, PREFILL, chat_template=tok.chat_template,
                           add_generation_prompt=False, continue_final_message=True
                           ) == hf_ids(tok, PREFILL, continue_final_message=True)


REFUSED = [
    ({"add_generation_prompt": True, "continue_final_message": True},
     PREFILL, "continue_final_message", "set add_generation_prompt to false"),
    ({"add_generation_prompt": False, "continue_final_message": True},
     CHAT, "messages.1.role", "must be the assistant's; it is 'user'"),
    ({}, [], "messages", "is empty"),
    ({}, "hello", "messages", "must be a list of messages"),
    ({}, [{"role": "user", "content": "x"}, "y"], "messages.1", "must be a dict"),
    ({}, [{"content": "x"}], "messages.0.role", "non-empty string"),
    ({}, [{"role": "user", "content": 3}], "messages.0.content", "a string or a list"),
    ({}, [{"role": "user", "content": [{"type": "image_url"}]}], "messages.0.content",
     "only text content parts"),
    ({}, [{"role": "user", "content": "x", "tool_calls": []}], "messages.0.tool_calls",
     "only assistant messages have tool_calls"),
    ({}, [{"role": "assistant", "content": "", "tool_calls": [{"function": {}}]}],
     "messages.0.tool_calls.0", '"function"'),
    ({"tools": {"name": "f"}}, CHAT, "tools", "must be a list"),
    ({"tools": ["f"]}, CHAT, "tools.0", "must be a dict"),
    ({"chat_template_kwargs": {"add_generation_prompt": False}}, CHAT,
     "chat_template_kwargs.add_generation_prompt", "cannot set"),
    ({"chat_template_kwargs": ["x"]}, CHAT, "chat_template_kwargs", "must be a dict"),
    ({"add_generation_prompt": "yes"}, CHAT, "add_generation_prompt", "true or false"),
    ({"chat_template": "{{ raise_exception('no system messages') }}"}, CHAT, "messages",
     "cannot apply the chat template: no system messages"),
]


@pytest.mark.parametrize("options,messages,param,message", REFUSED,
                         ids=[r[2] + "-" + str(i) for i, r in enumerate(REFUSED)])
def test_refusals_name_the_field(tok, options, messages, param, message):
    with pytest.raises(ValueError) as e:
        render_chat(tok, messages, **options)
    assert isinstance(e.value, ChatError) and e.value.param == param
    assert message in str(e.value) and str(e.value).startswith(param + ": ")


def test_a_batch_error_names_the_conversation():
    e = ChatError("messages.1.role", "bad").within(3)
    assert (e.param, str(e)) == ("messages.3.1.role", "messages.3.1.role: bad")
    assert ChatError("messages", "is empty").within(2).param == "messages.2"
    assert ChatError("tools", "x").within(2).param == "tools"
