"""``POST /v1/completions``: a prompt (a string, token ids, or a batch of either) with ``n``
completions each, as one JSON reply or a stream of ``text_completion`` chunks. Choice
indexes run prompt by prompt: prompt i's completion k is choice ``i * n + k``."""

from __future__ import annotations

import time
import uuid

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from nvllm.common.outputs import CompletionDelta
from nvllm.launch.openai import fanout, structured
from nvllm.launch.openai.errors import ApiError
from nvllm.launch.openai.logprobs import completion_logprobs
from nvllm.launch.openai.schemas import CompletionBody, leader_params, parse_body
from nvllm.launch.openai.sse import Envelope, stream_fanout
from nvllm.launch.openai.state import GatewayState
from nvllm.launch.openai.tokens import TokenText

router = APIRouter()


def _prompts(body: CompletionBody) -> list[str | list[int]]:
    """The request's prompts, one leader request each."""
    p = body.prompt
    prompts: list[str | list[int]]
    if isinstance(p, str) or (p and isinstance(p[0], int)):
        prompts = [p]
    else:
        prompts = list(p)
    if not prompts:
        raise ApiError(400, "prompt is empty", param="prompt", code="invalid_value")
    for q in prompts:
        if isinstance(q, list) and not q:  # (the schema bounds each id)
            raise ApiError(400, "a token-id prompt must be a non-empty list of "
                                "non-negative integers", param="prompt", code="invalid_value")
    return prompts


class _Logprobs:
    """Each completion's logprobs objects, with text offsets running on across chunks."""

    def __init__(self, tokens: TokenText | None, top_n: int | None) -> None:
        self.tokens, self.top_n = tokens, top_n
        self.offsets: dict[tuple[int, int], int] = {}

    def __call__(self, key: tuple[int, int], ids: list[int], lps: list | None) -> dict | None:
        if self.tokens is None:
            return None
        out, self.offsets[key] = completion_logprobs(
            self.tokens, ids, lps or [None] * len(ids), self.top_n, self.offsets.get(key, 0))
        return out


@router.post("/completions")
async def completions(request: Request) -> Response:
    state: GatewayState = request.app.state.gateway
    body = await parse_body(request, CompletionBody, state)
    prompts = _prompts(body)
    max_tokens = body.max_completion_tokens or body.max_tokens or 16  # OpenAI's default
    params = leader_params(body, body.logprobs, max_tokens)
    if (constraint := structured.constraint(body)) is not None:
        params["structured_outputs"] = constraint[1]
    tokens = await state.tokens() if body.logprobs is not None else None
    jobs = [fanout.Job(q, params, body.priority, body.ttl_ms) for q in prompts]
    envelope = Envelope(f"cmpl-{uuid.uuid4().hex}", "text_completion", int(time.time()),
                        await state.served_name())
    try:
        fan = await fanout.start(request, state.client, jobs)
    except fanout.Disconnected:
        return Response(status_code=499)
    except ApiError as e:
        raise structured.blame(e, constraint[0]) if constraint else e from None
    logprobs, n = _Logprobs(tokens, body.logprobs), body.n

    if body.stream:
        def choice(i: int, d: CompletionDelta) -> dict:
            return {"index": i * n + d.index, "text": d.text,
                    "logprobs": logprobs((i, d.index), d.token_ids, d.logprobs),
                    "finish_reason": d.finish_reason}

        return stream_fanout(fan, envelope, choice, include_usage=body.include_usage,
                             with_token_ids=tokens is not None,
                             trace=state.trace)

    try:
        accs = await fanout.await_leader(request, fan, fanout.collect(fan))
    except fanout.Disconnected:
        return Response(status_code=499)
    choices = [{"index": i * n + k, "text": a.text,
                "logprobs": logprobs((i, k), a.token_ids, a.logprobs),
                "finish_reason": a.finish_reason}
               for (i, k), a in sorted(accs.items())]
    return JSONResponse(envelope(choices, usage=fanout.usage(accs)))
