"""OpenAI-style error objects: ``ApiError``, and the mapping of request-validation errors
and leader errors (docs/protocol.md, error codes) onto it."""

from __future__ import annotations

import asyncio
import logging
import re
from typing import Any

from fastapi.responses import JSONResponse
from pydantic import ValidationError

from nvllm.common.client import ClientError
from nvllm.common.errors import EngineDeadError, RequestRejected

logger = logging.getLogger("nvllm.gateway")


class ApiError(Exception):
    """An error answered as an OpenAI-style error object."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, type_: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = (
            status, message, param, code, type_)

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


# What each union-typed field accepts, for the one message a failed union gets.
_UNION_FORMS = {"prompt": "a string, a list of token ids, or a non-empty list of either "
                          "(not mixed)",
                "stop": "a string or a list of strings",
                "content": "a string or a list of content parts",
                "tool_choice": '"none", "auto", "required" or {"type": "function", '
                               '"function": {"name": ...}}',
                "guided_json": "a JSON schema (an object or its JSON text)",
                "json": "a JSON schema (an object or its JSON text)",
                "schema": "a JSON schema (an object or its JSON text)"}


def _path(loc: tuple) -> str:
    """A validation error's field path. Unions add the member type to the location
    ("prompt", "str"): name only the fields."""
    return ".".join(p for p in map(str, loc)
                    if not re.fullmatch(r"[a-z]+\[.*\]|str|int|float|bool", p))


def from_validation(e: ValidationError) -> ApiError:
    """The first problem of a request body that does not validate, as a 400."""
    err = e.errors()[0]
    if err["type"] == "json_invalid":
        return ApiError(400, f"the body is not valid JSON: {err['msg']}", code="invalid_json")
    errors = e.errors()
    paths = {_path(x["loc"]) for x in errors}
    if len(errors) > 1 and err["loc"] and (
            len(paths) == 1 or len({x["loc"][:1] for x in errors}) == 1):
        # Every member of a union failed (e.g. prompt, structured_outputs.json): one message,
        # not one per member, naming the field (the deepest one they share).
        name = paths.pop() if len(paths) == 1 else str(err["loc"][0])
        form = _UNION_FORMS.get(name.rpartition(".")[2], "one of the accepted forms")
        return ApiError(400, f"{name}: must be {form}", param=name, code="invalid_value")
    param = _path(err["loc"])
    more = f" (and {len(errors) - 1} more problem(s))" if len(errors) > 1 else ""
    return ApiError(400, f"{param or 'body'}: {err['msg']}{more}", param=param or None,
                    code="invalid_value")


_FIELD_RE = re.compile(r"SamplingParams\.(\w+)|\b(\w+)\b must", re.ASCII)


def from_leader(e: Exception) -> ApiError:
    """Map a leader error (see docs/protocol.md, error codes) to an HTTP error."""
    if isinstance(e, RequestRejected):
        return ApiError(400, str(e), code="rejected")
    if isinstance(e, EngineDeadError):
        return ApiError(503, f"engine unavailable: {e}", code="engine_unavailable",
                        type_="server_error")
    if isinstance(e, ClientError):
        if e.code == "invalid_request":
            m = _FIELD_RE.search(e.message)
            return ApiError(400, e.message, param=(m.group(1) or m.group(2)) if m else None,
                            code="invalid_value")
        if e.code == "overloaded":
            return ApiError(503, e.message, code="overloaded", type_="server_error")
        return ApiError(500, f"leader error {e.code}: {e.message}", code=e.code,
                        type_="server_error")
    if isinstance(e, (TimeoutError, asyncio.TimeoutError)):
        return ApiError(504, "the engine did not answer in time", code="timeout",
                        type_="server_error")
    logger.exception("unexpected error", exc_info=e)
    return ApiError(500, f"internal error: {type(e).__name__}: {e}", type_="server_error")
