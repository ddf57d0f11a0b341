"""``POST /v1/chat/completions``: the messages (and tools) go through the model's chat
template here (from its tokenizer; the rendering is nvllm/common/chat.py's, shared with
``LLM.chat``) and reach the leader as token ids; ``n`` completions,
as one ``chat.completion`` or a stream of ``chat.completion.chunk`` objects, their text
read for tool calls when the request has tools (tools.py). vLLM's ``prompt_logprobs``
scores the rendered prompt: a top-level ``prompt_logprobs`` list in the reply (not
streamed), as vLLM gives it."""

from __future__ import annotations

import dataclasses
import time
import uuid
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from nvllm.common.chat import ChatError, encode_rendered, render_chat
from nvllm.common.outputs import CompletionDelta
from nvllm.launch.openai import fanout, structured, tools
from nvllm.launch.openai.body import parse_body
from nvllm.launch.openai.errors import ApiError
from nvllm.launch.openai.logprobs import chat_logprobs, vllm_prompt_logprobs
from nvllm.launch.openai.schemas import ChatBody, leader_params
from nvllm.launch.openai.sse import Envelope, stream_fanout
from nvllm.launch.openai.state import GatewayState
from nvllm.launch.openai.tool_calls import CallMachine, Delta
from nvllm.launch.openai.tool_parsers import pick_parser

router = APIRouter()


def render_ids(tok: Any, body: Any, add_special_tokens: bool = False) -> list[int]:
    """body's conversation through the chat template, as prompt token ids: the shared
    rendering (nvllm/common/chat.py, which LLM.chat calls too) of a ChatBody or the
    /tokenize chat form (messages, add_generation_prompt, continue_final_message,
    chat_template, chat_template_kwargs, tools), a 400 naming the field where it cannot
    take them. CPU-bound (and a template from the request, when the operator trusts
    those, may run long): called in the gateway's render pool, never on the event loop.
    The template holds the special tokens it wants: none are added (no second BOS)."""
    messages = [m.model_dump(exclude_none=True) for m in body.messages]
    tool_defs = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
    try:
        text = render_chat(tok, messages, chat_template=body.chat_template,
                           add_generation_prompt=body.add_generation_prompt,
                           continue_final_message=body.continue_final_message,
                           tools=tool_defs, chat_template_kwargs=body.chat_template_kwargs)
        return encode_rendered(tok, text, add_special_tokens)
    except ChatError as e:
        raise ApiError(400, str(e), param=e.param, code=e.code) from None


@router.post("/chat/completions")
async def chat_completions(request: Request) -> Response:
    state: GatewayState = request.app.state.gateway
    body = await parse_body(request, ChatBody, state)
    if body.echo:
        raise ApiError(400, "echo is not supported by this server on chat completions",
                       param="echo", code="unsupported_parameter")
    if body.top_logprobs is not None and not body.logprobs:
        raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs",
                       code="invalid_value")
    tp = tools.plan(body)
    constraint = structured.constraint(
        body, ("tool_choice", tp.constraint) if tp.constraint else None)
    parser = pick_parser(state.cfg.tool_call_parser, await state.tokenizer()) \
        if tp.mode == "auto" else ""
    prompt_ids = await state.render(render_ids, await state.tokenizer(), body)
    limit = int((await state.info()).get("max_model_len") or 0)
    max_tokens = body.max_completion_tokens or body.max_tokens or max(
        1, limit - len(prompt_ids))  # OpenAI's default: up to the context length
    lp = (body.top_logprobs or 0) if body.logprobs else None
    params = leader_params(body, lp, max_tokens, body.prompt_logprobs)
    if constraint is not None:
        params["structured_outputs"] = constraint[1]
    job = fanout.Job(prompt_ids, params, body.priority, body.ttl_ms, body.user)
    tokens = await state.tokens() if body.logprobs else None
    ptokens = await state.tokens() if body.prompt_logprobs is not None else None
    envelope = Envelope(f"chatcmpl-{uuid.uuid4().hex}", "chat.completion.chunk",
                        int(time.time()), await state.served_name())
    try:
        fan = await fanout.start(request, state.client, [job])
    except fanout.Disconnected:
        return Response(status_code=499)
    except ApiError as e:
        raise structured.blame(e, constraint[0]) if constraint else e from None

    def logprobs(ids: list[int], lps: list | None) -> dict | None:
        if tokens is None:
            return None
        return chat_logprobs(tokens, ids, lps or [None] * len(ids), body.top_logprobs or 0)

    if body.stream:
        machines: dict[int, CallMachine] = {}

        def choice(_: int, d: CompletionDelta) -> dict | None:
            delta, reason = ({"content": d.text} if d.text else {}), d.finish_reason
            if tp.active:  # content and calls as the text comes (tool_calls.py)
                if d.index not in machines:
                    machines[d.index] = tp.machine(parser)
                m = machines[d.index]
                out = m.feed(d.text) if d.text else Delta()
                if reason is not None:
                    out.merge(m.finish())
                    reason = tools.finish_reason(m, reason)
                delta = out.chunk()
                if not delta and reason is None and not (tokens is not None and d.token_ids):
                    return None  # held back: it may be a call
            return {"index": d.index, "delta": delta,
                    "logprobs": logprobs(d.token_ids, d.logprobs), "finish_reason": reason}

        roles = [{"index": k, "delta": {"role": "assistant", "content": ""},
                  "logprobs": None, "finish_reason": None} for k in range(body.n)]
        return stream_fanout(fan, envelope, choice, include_usage=body.include_usage,
                             with_token_ids=tokens is not None, first_choices=roles,
                             trace=state.trace)

    try:
        accs = await fanout.await_leader(request, fan, fanout.collect(fan))
    except fanout.Disconnected:
        return Response(status_code=499)
    choices = []
    for (_, k), a in sorted(accs.items()):
        message, reason = tools.reply(tp, parser, a.text, a.finish_reason)
        choices.append({"index": k, "message": message,
                        "logprobs": logprobs(a.token_ids, a.logprobs), "finish_reason": reason})
    reply = dataclasses.replace(envelope, object="chat.completion")
    extra = {}
    if ptokens is not None:  # vLLM's: the rendered prompt's, once per response
        plps = next((a.prompt_logprobs for a in accs.values() if a.prompt_logprobs), None)
        extra["prompt_logprobs"] = None if plps is None else vllm_prompt_logprobs(
            ptokens, prompt_ids, plps, body.prompt_logprobs or 0)
    return JSONResponse(reply(choices, usage=fanout.usage(accs), **extra))
