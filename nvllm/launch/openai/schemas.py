"""Request bodies (strict pydantic models), their checks against the served model, and
the SamplingParams map each body becomes for the leader."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, TypeVar

from fastapi import Request
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from nvllm.launch.openai.errors import ApiError, from_validation

if TYPE_CHECKING:
    from nvllm.launch.openai.state import GatewayState

_MAX_SEED = 2**63 - 1


class _Body(BaseModel):
    # strict: "0.5" is not a temperature and true is not an n. Unknown keys (user, tools...)
    # are ignored like OpenAI's optional features we do not implement.
    model_config = ConfigDict(extra="ignore", strict=True)


class StreamOptions(_Body):
    include_usage: bool = False


class SamplingBody(_Body):
    """What both generation routes accept: sampling, limits, streaming, nvllm extras."""

    model: str | None = None
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0, le=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    stop: str | list[str] | None = Field(None, max_length=64)
    seed: int | None = Field(None, ge=0, le=_MAX_SEED)
    n: int = Field(1, ge=1, le=128)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    stream: bool = False
    stream_options: StreamOptions | None = None
    # nvllm / vLLM extras
    ignore_eos: bool | None = None
    min_tokens: int | None = Field(None, ge=0)
    repetition_penalty: float | None = Field(None, gt=0, le=100)
    priority: int = Field(0, ge=-(2**31), le=2**31 - 1)
    ttl_ms: int | None = Field(None, ge=1, le=2**31 - 1)
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None

    @property
    def include_usage(self) -> bool:
        """Whether a stream ends with a usage chunk."""
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionBody(SamplingBody):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    best_of: int | None = Field(None, ge=1)
    suffix: str | None = None


class ContentPart(_Body):
    type: str
    text: str | None = None


class ChatMessage(_Body):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None


class ChatBody(SamplingBody):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None


BodyT = TypeVar("BodyT", bound=SamplingBody)


async def parse_body(request: Request, model: type[BodyT], state: GatewayState) -> BodyT:
    """The request's body as `model`, checked against the served model and its limits."""
    raw = await request.body()
    try:
        body = model.model_validate_json(raw or b"{}")
    except ValidationError as e:
        raise from_validation(e) from None
    await state.check_model(body.model)
    check_body(body, (await state.info()).get("max_model_len"))
    return body


def check_body(body: SamplingBody, limit: int | None) -> None:
    """What the schema cannot say: limits against the context length and each other."""
    mt = body.max_completion_tokens or body.max_tokens
    if limit and mt is not None and mt > limit:
        name = "max_completion_tokens" if body.max_completion_tokens else "max_tokens"
        raise ApiError(400, f"{name} is {mt}, more than the model's context length "
                            f"({limit})", param=name, code="invalid_value")
    if body.min_tokens is not None and mt is not None and body.min_tokens > mt:
        raise ApiError(400, f"min_tokens ({body.min_tokens}) is more than max_tokens "
                            f"({mt})", param="min_tokens", code="invalid_value")
    if body.stream_options is not None and not body.stream:
        raise ApiError(400, "stream_options needs stream: true", param="stream_options",
                       code="invalid_value")
    if body.stop_token_ids is not None and any(t < 0 for t in body.stop_token_ids):
        raise ApiError(400, "stop_token_ids must be non-negative", param="stop_token_ids",
                       code="invalid_value")


def leader_params(body: SamplingBody, logprobs: int | None, max_tokens: int) -> dict:
    """The SamplingParams map sent to the leader: only what the request set, so the leader's
    defaults (and its validation) stay the single source of truth."""
    p: dict[str, Any] = {"n": body.n, "max_tokens": max_tokens}
    for name in ("temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty",
                 "frequency_penalty", "ignore_eos", "min_tokens", "repetition_penalty",
                 "stop_token_ids", "include_stop_str_in_output", "skip_special_tokens"):
        v = getattr(body, name)
        if v is not None:
            p[name] = v
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    stop = [s for s in stop if s]
    if stop:
        p["stop"] = stop
    if logprobs is not None:
        p["logprobs"] = logprobs
    return p
