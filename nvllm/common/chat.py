"""Chat prompts: a conversation (OpenAI-style message dicts) through a chat template, to
text and to prompt token ids, by one set of functions for every caller: ``LLM.chat``
(nvllm/llm.py) and the gateway's ``/v1/chat/completions`` and ``/tokenize``
(nvllm/launch/openai), so both render a conversation to the same ids.

The tokenizer is any object with Hugging Face's two calls,
``apply_chat_template(conversation, tokenize=False, chat_template=...,
add_generation_prompt=..., continue_final_message=..., tools=..., **kwargs) -> str`` and
``tokenizer(text, add_special_tokens=False)["input_ids"]``, however it was obtained (a
checkpoint folder, a GGUF file's metadata, built in code): nothing here reads a path, a
config or a model name. The template comes from the ``chat_template`` argument or the
tokenizer's own.

A conversation or an option the template cannot take raises ``ChatError`` (a ValueError)
whose ``param`` names the field, as the gateway's 400s do (``messages.2.role``,
``continue_final_message``).
"""

from __future__ import annotations

import json
from typing import Any

# apply_chat_template's own arguments (and the conversation's names): never taken from
# chat_template_kwargs, where they would override what the caller's own fields say.
RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "tools", "documents", "add_generation_prompt", "continue_final_message",
    "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask", "tokenizer_kwargs", "messages"})


class ChatError(ValueError):
    """A conversation or chat option the template cannot take. ``param`` is the field's
    path (``messages.0.content``; a batch of conversations prefixes the conversation's
    index: ``messages.1.0.content``), ``code`` the OpenAI-style error code."""

    def __init__(self, param: str, message: str, code: str = "invalid_value") -> None:
        super().__init__(f"{param}: {message}")
        self.param, self.message, self.code = param, message, code

    def within(self, index: int) -> ChatError:
        """This error for conversation `index` of a batch."""
        if self.param == "messages" or self.param.startswith("messages."):
            return ChatError(f"messages.{index}{self.param[len('messages'):]}", self.message,
                             self.code)
        return self


def render_chat(tokenizer: Any, messages: Any, *, chat_template: str | None = None,
                add_generation_prompt: bool = True, continue_final_message: bool = False,
                tools: list[dict] | None = None,
                chat_template_kwargs: dict[str, Any] | None = None) -> str:
    """The conversation through the chat template, as text (with the special tokens the
    template writes). `chat_template` overrides the tokenizer's (so does a
    ``chat_template`` key of chat_template_kwargs, as in vLLM); the other
    chat_template_kwargs reach the template as variables (``enable_thinking``); `tools`
    (function definitions, OpenAI's shape) reach it as ``tools``. With
    continue_final_message the final message, which must be the assistant's, is left open
    (no end-of-turn after it) for the model to continue; it cannot be combined with
    add_generation_prompt, which opens a new assistant turn (both as in vLLM)."""
    for name, v in (("add_generation_prompt", add_generation_prompt),
                    ("continue_final_message", continue_final_message)):
        if not isinstance(v, bool):
            raise ChatError(name, f"must be true or false, got {type(v).__name__}")
    if continue_final_message and add_generation_prompt:
        raise ChatError("continue_final_message",
                        "cannot be combined with add_generation_prompt (which opens a new "
                        "assistant turn): set add_generation_prompt to false to continue "
                        "the final message")
    conversation = template_messages(messages)
    if continue_final_message and conversation[-1]["role"] != "assistant":
        raise ChatError(f"messages.{len(conversation) - 1}.role",
                        "continue_final_message continues the final message, which must be "
                        f"the assistant's; it is {conversation[-1]['role']!r}")
    kwargs = _template_kwargs(chat_template_kwargs)
    template = kwargs.pop("chat_template", None) or chat_template
    if template is not None and not isinstance(template, str):
        raise ChatError("chat_template", f"must be a string, got {type(template).__name__}")
    if not template and hasattr(tokenizer, "chat_template") and not tokenizer.chat_template:
        # (a tokenizer without the attribute answers for its template itself)
        raise ChatError("chat_template", "the tokenizer has no chat template: give one",
                        code="no_chat_template")
    if tools is not None:
        kwargs["tools"] = _tools(tools)
    try:
        text = tokenizer.apply_chat_template(
            conversation, tokenize=False, chat_template=template or None,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message, **kwargs)
    except Exception as e:
        raise ChatError("messages", f"cannot apply the chat template: {e}",
                        code="chat_template_error") from e
    if not isinstance(text, str):
        raise ChatError("chat_template", "the chat template did not render to text",
                        code="chat_template_error")
    return text


def encode_rendered(tokenizer: Any, text: str, add_special_tokens: bool = False
                    ) -> list[int]:
    """A rendered chat as token ids. The template already wrote the special tokens it
    wants (a BOS among them): by default none are added (no second BOS)."""
    return list(tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])


def chat_prompt_ids(tokenizer: Any, messages: Any, **options: Any) -> list[int]:
    """render_chat's text (same options) as prompt token ids: what LLM.chat and
    /v1/chat/completions send the engine."""
    return encode_rendered(tokenizer, render_chat(tokenizer, messages, **options))


def template_messages(messages: Any) -> list[dict[str, Any]]:
    """The conversation checked and put as chat templates take it: content a string (text
    parts joined by newlines, None as ""), an assistant's tool calls with their arguments
    as an object where they are JSON text of one (templates write them with tojson, as
    vLLM passes them). Other keys (name, tool_call_id, reasoning_content, ...) pass as
    given. The caller's dicts are not changed."""
    if isinstance(messages, (str, bytes, dict)) or not isinstance(messages, (list, tuple)):
        raise ChatError("messages", "must be a list of messages (dicts with a role and a "
                                    f"content), got {type(messages).__name__}")
    if not messages:
        raise ChatError("messages", "is empty: give at least one message")
    out = []
    for j, m in enumerate(messages):
        where = f"messages.{j}"
        if not isinstance(m, dict):
            raise ChatError(where, "must be a dict with a role and a content, got "
                                   f"{type(m).__name__}")
        role = m.get("role")
        if not isinstance(role, str) or not role:
            raise ChatError(f"{where}.role", "must be a non-empty string")
        msg = dict(m)
        msg["content"] = _content(m.get("content"), f"{where}.content")
        calls = m.get("tool_calls")
        if calls is None:
            msg.pop("tool_calls", None)
        elif role != "assistant":
            raise ChatError(f"{where}.tool_calls", "only assistant messages have tool_calls")
        else:
            msg["tool_calls"] = _calls(calls, f"{where}.tool_calls")
        for key in ("name", "tool_call_id"):
            if msg.get(key, "") is None:
                del msg[key]
        out.append(msg)
    return out


def _content(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, (list, tuple)):
        raise ChatError(where, "must be a string or a list of content parts, got "
                               f"{type(content).__name__}")
    texts = []
    for k, part in enumerate(content):
        if not isinstance(part, dict):
            raise ChatError(f"{where}.{k}", "a content part must be a dict")
        if part.get("type") != "text":
            raise ChatError(where, "only text content parts are supported",
                            code="unsupported")
        text = part.get("text")
        if text is not None and not isinstance(text, str):
            raise ChatError(f"{where}.{k}.text", "must be a string")
        texts.append(text or "")
    return "\n".join(texts)


def _calls(calls: Any, where: str) -> list[dict[str, Any]]:
    if not isinstance(calls, (list, tuple)):
        raise ChatError(where, "must be a list of tool calls")
    out = []
    for k, c in enumerate(calls):
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ChatError(f"{where}.{k}", 'must be {"type": "function", "function": '
                                            '{"name": ..., "arguments": ...}}')
        args = fn.get("arguments")
        if isinstance(args, str):
            try:
                parsed = json.loads(args)
            except (ValueError, RecursionError):
                parsed = None
            if isinstance(parsed, dict):
                args = parsed
        out.append({"id": c.get("id"), "type": c.get("type") or "function",
                    "function": {"name": fn["name"], "arguments": args}})
    return out


def _tools(tools: Any) -> list[dict]:
    if not isinstance(tools, (list, tuple)):
        raise ChatError("tools", f"must be a list of tools, got {type(tools).__name__}")
    for i, t in enumerate(tools):
        if not isinstance(t, dict):
            raise ChatError(f"tools.{i}", 'must be a dict ({"type": "function", '
                                          '"function": {"name": ...}})')
    return list(tools)


def _template_kwargs(kwargs: Any) -> dict[str, Any]:
    if kwargs is None:
        return {}
    if not isinstance(kwargs, dict):
        raise ChatError("chat_template_kwargs", f"must be a dict, got {type(kwargs).__name__}")
    for key in kwargs:
        if not isinstance(key, str):
            raise ChatError("chat_template_kwargs", "keys must be strings")
        if key in RESERVED_TEMPLATE_KWARGS:
            raise ChatError(f"chat_template_kwargs.{key}", f"cannot set {key} (it is an "
                                                           "argument of its own)")
    return dict(kwargs)
