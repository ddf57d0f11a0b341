"""``POST /v1/completions``: a prompt (a string, token ids, or a batch of either) with ``n``
completions each, as one JSON reply or a stream of ``text_completion`` chunks. Choice
indexes run prompt by prompt: prompt i's completion k is choice ``i * n + k``.

``echo`` starts each choice's text with its prompt (in a stream: its first chunk), and with
``logprobs`` its logprobs object with the prompt's tokens (the first one's logprob and top
entry null), as vLLM does; this is what lm-evaluation-harness's loglikelihood requests read.
vLLM's ``prompt_logprobs`` adds each choice's ``prompt_logprobs`` list (not streamed)."""

from __future__ import annotations

import time
import uuid

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from nvllm.common.outputs import CompletionDelta
from nvllm.launch.openai import fanout, structured
from nvllm.launch.openai.body import parse_body
from nvllm.launch.openai.errors import ApiError
from nvllm.launch.openai.logprobs import (
    completion_logprobs,
    prompt_completion_logprobs,
    vllm_prompt_logprobs,
)
from nvllm.launch.openai.schemas import CompletionBody, leader_params
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


def _prompt_texts(tok, prompts: list[str | list[int]], ids: bool
                  ) -> tuple[list[str], list[str | list[int]]]:
    """Each prompt's text (a token-id prompt decoded) and, with `ids`, the prompts as token
    ids, tokenized here as the leader would: the echoed logprobs are then of exactly the
    tokens the leader scores. CPU-bound: runs in the gateway's render pool."""
    texts = [q if isinstance(q, str) else tok.decode(q, skip_special_tokens=False)
             for q in prompts]
    if ids:
        prompts = [list(tok(q).input_ids) if isinstance(q, str) else q for q in prompts]
    return texts, prompts


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

    def echoed(self, key: tuple[int, int], ids: list[int], plps: list | None) -> dict | None:
        """The echoed prompt's logprobs object (`plps`: the leader's prompt_logprobs);
        called before self() for the choice's first tokens, whose offsets follow it."""
        if self.tokens is None:
            return None
        head, self.offsets[key] = prompt_completion_logprobs(
            self.tokens, ids, plps or [None] * len(ids), self.top_n or 0)
        return head

    @staticmethod
    def join(head: dict | None, rest: dict | None) -> dict | None:
        if head is None or rest is None:
            return head or rest
        return {k: head[k] + rest[k] for k in head}


@router.post("/completions")
async def completions(request: Request) -> Response:
    state: GatewayState = request.app.state.gateway
    body = await parse_body(request, CompletionBody, state)
    prompts = _prompts(body)
    max_tokens = body.max_completion_tokens or body.max_tokens or 16  # OpenAI's default
    # Echo with logprobs covers the prompt's tokens: the leader scores them (as vLLM does,
    # with the logprobs' top-k unless prompt_logprobs says otherwise).
    echo_lps = body.echo and body.logprobs is not None
    plp = body.prompt_logprobs if body.prompt_logprobs is not None else (
        body.logprobs if echo_lps else None)
    params = leader_params(body, body.logprobs, max_tokens, plp)
    if (constraint := structured.constraint(body)) is not None:
        params["structured_outputs"] = constraint[1]
    tokens = (await state.tokens()
              if body.logprobs is not None or body.prompt_logprobs is not None else None)
    texts: list[str] = []
    if body.echo or plp is not None:
        texts, prompts = await state.render(_prompt_texts, await state.tokenizer(), prompts,
                                            plp is not None)
    jobs = [fanout.Job(q, params, body.priority, body.ttl_ms, body.user) for q in prompts]
    envelope = Envelope(f"cmpl-{uuid.uuid4().hex}", "text_completion", int(time.time()),
                        await state.served_name())
    try:
        fan = await fanout.start(request, state.client, jobs)
    except fanout.Disconnected:
        return Response(status_code=499)
    except ApiError as e:
        raise structured.blame(e, constraint[0]) if constraint else e from None
    logprobs = _Logprobs(tokens if body.logprobs is not None else None, body.logprobs)
    n = body.n
    echoed: set[tuple[int, int]] = set()

    def text_and_logprobs(i: int, k: int, text: str, ids: list[int], lps: list | None,
                          plps: list | None) -> tuple[str, dict | None]:
        """A choice's text and logprobs; the first of each choice echoes the prompt."""
        head = None
        if body.echo and (i, k) not in echoed:
            echoed.add((i, k))
            text = texts[i] + text
            if echo_lps:
                head = logprobs.echoed((i, k), list(prompts[i]), plps)
        return text, _Logprobs.join(head, logprobs((i, k), ids, lps))

    if body.stream:
        def choice(i: int, d: CompletionDelta) -> dict:
            text, lps = text_and_logprobs(i, d.index, d.text, d.token_ids, d.logprobs,
                                          d.prompt_logprobs)
            return {"index": i * n + d.index, "text": text, "logprobs": lps,
                    "finish_reason": d.finish_reason}

        return stream_fanout(fan, envelope, choice, include_usage=body.include_usage,
                             with_token_ids=body.logprobs is not None,
                             trace=state.trace)

    try:
        accs = await fanout.await_leader(request, fan, fanout.collect(fan))
    except fanout.Disconnected:
        return Response(status_code=499)
    choices = []
    for (i, k), a in sorted(accs.items()):
        text, lps = text_and_logprobs(i, k, a.text, a.token_ids, a.logprobs, a.prompt_logprobs)
        c = {"index": i * n + k, "text": text, "logprobs": lps, "finish_reason": a.finish_reason}
        if body.prompt_logprobs is not None:  # vLLM's field, when asked for by name
            c["prompt_logprobs"] = (None if a.prompt_logprobs is None else vllm_prompt_logprobs(
                tokens, list(prompts[i]), a.prompt_logprobs, body.prompt_logprobs))
        choices.append(c)
    return JSONResponse(envelope(choices, usage=fanout.usage(accs)))
