"""Reading a request body and parsing it into one of schemas.py's models: the size limit
enforced while reading, JSON decoding (bigger bodies in a worker thread, off the event
loop), the screen of refused and unknown fields, and the checks against the served
model."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from fastapi import Request
from pydantic import ValidationError

from nvllm.common.chat import RESERVED_TEMPLATE_KWARGS
from nvllm.launch.openai.errors import ApiError, from_validation
from nvllm.launch.openai.schemas import (
    ACCEPTED_IGNORED,
    UNSUPPORTED,
    BodyT,
    _no_constant,
    check_body,
)

if TYPE_CHECKING:
    from nvllm.launch.openai.state import GatewayState

PARSE_INLINE_BYTES = 64 << 10  # bigger bodies are parsed in a worker thread


async def read_body(request: Request, limit: int) -> bytes:
    """The body, read chunk by chunk and refused (413) as soon as it passes `limit` bytes;
    a Content-Length over the limit is refused before reading anything."""
    def too_big() -> ApiError:
        return ApiError(413, f"the request body is larger than the gateway's limit of "
                             f"{limit} bytes (nvllm-serve --max-body-bytes)",
                        param=None, code="request_too_large")

    declared = request.headers.get("content-length")
    if declared is not None and declared.strip().isdigit() and int(declared) > limit:
        raise too_big()
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_big()
        chunks.append(chunk)
    return b"".join(chunks)


def _neutral(name: str, value: Any, raw: dict) -> bool:
    if name == "best_of":
        return value is None or value == raw.get("n", 1)
    return any(value == v and type(value) is type(v) for v in UNSUPPORTED[name])


def screen(raw: Any, model: type[BodyT], *, trust_template: bool = False,
           allow_priority: bool = False) -> dict:
    """The top-level fields `model` validates; refused fields (unsupported, unknown, a
    request chat template or priority the operator did not allow) raise ApiError 400."""
    if not isinstance(raw, dict):
        raise ApiError(400, "the body must be a JSON object", code="invalid_value")
    out = {}
    for name, value in raw.items():
        if name in model.model_fields:
            out[name] = value
        elif name in UNSUPPORTED:
            if not _neutral(name, value, raw):
                raise ApiError(400, f"{name} is not supported by this server", param=name,
                               code="unsupported_parameter")
        elif name not in ACCEPTED_IGNORED:
            raise ApiError(400, f"unrecognized request field: {name}", param=str(name),
                           code="unknown_parameter")
    if "priority" in out and not allow_priority:
        raise ApiError(400, "priority is not allowed over HTTP on this server (the operator "
                            "enables it with --allow-priority)", param="priority",
                       code="unsupported_parameter")
    kwargs = out.get("chat_template_kwargs")
    if isinstance(kwargs, dict):
        for key in kwargs:
            if key in RESERVED_TEMPLATE_KWARGS:
                raise ApiError(400, f"chat_template_kwargs cannot set {key}",
                               param=f"chat_template_kwargs.{key}", code="invalid_value")
    templates = [("chat_template", out.get("chat_template")),
                 ("chat_template_kwargs.chat_template",
                  kwargs.get("chat_template") if isinstance(kwargs, dict) else None)]
    for param, template in templates:
        if template is not None and not trust_template:
            raise ApiError(400, f"{param}: a chat template from the request is not allowed "
                                "on this server (the operator enables it with "
                                "--trust-request-chat-template)", param=param,
                           code="unsupported_parameter")
    return out


_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def _has_lone_surrogate(data: Any) -> bool:
    """Whether a decoded body holds a string with a lone UTF-16 surrogate ("\\ud800" is
    valid JSON, but not text: nothing downstream can encode it). Iterative."""
    stack = [data]
    while stack:
        o = stack.pop()
        if isinstance(o, str):
            try:
                o.encode()
            except UnicodeEncodeError:
                return True
        elif isinstance(o, dict):
            stack.extend(o)
            stack.extend(o.values())
        elif isinstance(o, list):
            stack.extend(o)
    return False


def parse(raw: bytes, model: type[BodyT] | Callable[[Any], type[BodyT]], *,
          trust_template: bool = False, allow_priority: bool = False) -> BodyT:
    """Bytes -> a validated body (CPU-bound: big bodies run it in a worker thread).
    model may be a function of the decoded JSON that picks the body's type."""
    try:
        data = json.loads(raw or b"{}", parse_constant=_no_constant)
    except RecursionError:
        raise ApiError(400, "the body is nested too deeply", code="invalid_json") from None
    except ValueError as e:  # JSONDecodeError, NaN, an integer of over 4300 digits
        raise ApiError(400, f"the body is not valid JSON: {e}", code="invalid_json") from None
    if _SURROGATE_ESCAPE.search(raw) and _has_lone_surrogate(data):
        raise ApiError(400, "the body is not valid JSON text: a string holds a lone UTF-16 "
                            "surrogate escape", code="invalid_json")
    if not isinstance(model, type):
        model = model(data)
    data = screen(data, model, trust_template=trust_template, allow_priority=allow_priority)
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise from_validation(e) from None
    except RecursionError:
        raise ApiError(400, "the body is nested too deeply", code="invalid_json") from None


async def parse_body(request: Request, model: type[BodyT], state: GatewayState) -> BodyT:
    """The request's body as `model`, checked against the served model and its limits."""
    body = await parse_plain_body(request, state, model)
    check_body(body, (await state.info()).get("max_model_len"))
    return body


async def parse_plain_body(request: Request, state: GatewayState,
                           model: type[BodyT] | Callable[[Any], type[BodyT]]) -> BodyT:
    """The request's body as `model` (see parse), checked against the served model."""
    cfg = state.cfg
    raw = await read_body(request, cfg.max_body_bytes)
    kw = {"trust_template": cfg.trust_request_chat_template,
          "allow_priority": cfg.allow_priority}
    if len(raw) > PARSE_INLINE_BYTES:
        body = await asyncio.to_thread(parse, raw, model, **kw)
    else:
        body = parse(raw, model, **kw)
    await state.check_model(body.model)
    return body
