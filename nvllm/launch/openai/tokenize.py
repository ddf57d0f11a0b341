"""``/tokenize`` and ``/detokenize`` with vLLM's request and response shapes.

``POST /tokenize`` takes either ``{"prompt": str, "add_special_tokens": true}`` or the
chat form ``{"messages": [...], "add_generation_prompt": true, "continue_final_message":
false, "add_special_tokens": false, "chat_template_kwargs": {...}, "tools": [...]}``
(rendered exactly as ``/v1/chat/completions`` renders it), plus ``"return_token_strs"``; it answers
``{"count", "max_model_len", "tokens", "token_strs"}``. ``POST /detokenize`` takes
``{"tokens": [int, ...]}`` and answers ``{"prompt": str}``. Both sit behind the API key
like ``/v1`` and read their body within the gateway's byte limit. Plain text and token
ids go to the leader (its ``tokenize`` / ``detokenize`` ops: the engine's own tokenizer,
so the gateway holds no second copy of it); the chat form renders in the gateway's render
pool, as ``/v1/chat/completions`` does, and so does everything when the gateway was given
its own ``--tokenizer`` or sits in front of a data-parallel router.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Annotated, Any

from fastapi import APIRouter, Request
from pydantic import Field

from nvllm.common.client import ClientError
from nvllm.launch.openai.body import parse_plain_body
from nvllm.launch.openai.chat import render_ids
from nvllm.launch.openai.errors import ApiError, from_leader
from nvllm.launch.openai.schemas import (
    MAX_MESSAGES,
    MAX_PROMPT_TOKEN_IDS,
    MAX_TOOLS,
    ChatMessage,
    TokenId,
    Tool,
    _Body,
)
from nvllm.launch.openai.state import GatewayState

router = APIRouter()


class TokenizeCompletionBody(_Body):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatBody(_Body):
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False  # the template holds the special tokens it wants
    chat_template: str | None = None  # only with --trust-request-chat-template
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Tool] | None = Field(None, max_length=MAX_TOOLS)
    return_token_strs: bool = False


class DetokenizeBody(_Body):
    model: str | None = None
    tokens: Annotated[list[TokenId], Field(max_length=MAX_PROMPT_TOKEN_IDS)]


def _tokenize(tok: Any, body: TokenizeCompletionBody | TokenizeChatBody) -> list[int]:
    """CPU-bound: runs in the render pool."""
    if isinstance(body, TokenizeChatBody):
        return render_ids(tok, body, body.add_special_tokens)
    return list(tok(body.prompt, add_special_tokens=body.add_special_tokens)["input_ids"])


async def _ask_leader(state: GatewayState, call: Callable[[], Awaitable[Any]]) -> Any:
    """The leader's answer; None where the gateway tokenizes itself (see
    GatewayState.leader_tokenizes)."""
    if not state.leader_tokenizes:
        return None
    try:
        return await call()
    except ClientError as e:
        if e.code == "bad_op":  # a data-parallel router, or a leader that predates the op
            state.leader_refused_tokenize()
            return None
        raise from_leader(e) from e
    except Exception as e:
        raise from_leader(e) from e


@router.post("/tokenize")
async def tokenize(request: Request) -> dict:
    state: GatewayState = request.app.state.gateway
    body = await parse_plain_body(
        request, state, lambda raw: TokenizeChatBody if isinstance(raw, dict)
        and "messages" in raw else TokenizeCompletionBody)
    info = await state.info()
    got = None
    if isinstance(body, TokenizeCompletionBody):  # plain text: the leader's tokenizer
        got = await _ask_leader(state, lambda: state.client.tokenize(
            body.prompt, add_special_tokens=body.add_special_tokens,
            return_token_strs=body.return_token_strs))
    if got is not None:
        ids, strs = got["token_ids"], got.get("token_strs")
    else:
        tok = await state.tokenizer()
        ids = await state.render(_tokenize, tok, body)
        strs = tok.convert_ids_to_tokens(ids) if body.return_token_strs else None
    return {"count": len(ids), "max_model_len": info.get("max_model_len"), "tokens": ids,
            "token_strs": strs}


@router.post("/detokenize")
async def detokenize(request: Request) -> dict:
    state: GatewayState = request.app.state.gateway
    body = await parse_plain_body(request, state, lambda raw: DetokenizeBody)
    vocab = int((await state.info()).get("vocab_size") or 0)
    for j, t in enumerate(body.tokens):
        if vocab and t >= vocab:
            raise ApiError(400, f"tokens.{j} is {t}, outside the vocabulary (0..{vocab - 1})",
                           param=f"tokens.{j}", code="invalid_value")
    text = await _ask_leader(state, lambda: state.client.detokenize(body.tokens))
    if text is None:
        tok = await state.tokenizer()
        text = await state.render(tok.decode, body.tokens)
    return {"prompt": text}
