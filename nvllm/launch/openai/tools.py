"""Tool calling on ``/v1/chat/completions``: what a request's ``tools``, ``tool_choice`` and
``parallel_tool_calls`` mean for its prompt, its output constraint and its reply.

- ``none`` (or no tools): the tools still reach the chat template (the model knows them,
  as in vLLM), the reply is plain content.
- ``auto`` (the default with tools): the model writes what it wants; a tool parser
  (tool_parsers.py, by --tool-call-parser) finds calls in its text.
- a named function, or ``required``: forced, as vLLM does, through structured output: the
  leader holds the text to that function's parameters schema, or to a JSON array of
  ``{"name", "parameters"}`` over the tools (``required_schema``), so the arguments always
  validate. finish_reason is ``tool_calls`` when such a reply ends with a stop.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from nvllm.launch.openai.errors import ApiError
from nvllm.launch.openai.schemas import (
    MAX_CONSTRAINT_CHARS,
    ChatBody,
    NamedToolChoice,
)
from nvllm.launch.openai.tool_calls import CallMachine, Delta, NamedCall, RequiredCalls
from nvllm.launch.openai.tool_parsers import make_parser

NO_PARAMETERS = {"type": "object", "properties": {}}
_DEFS = ("$defs", "definitions")


@dataclass
class ToolPlan:
    mode: str  # "none", "auto", "named" or "required"
    tools: list[dict] = field(default_factory=list)  # for the chat template
    name: str | None = None  # the named function
    parallel: bool = True  # parallel_tool_calls
    constraint: dict | None = None  # the forced structured_outputs map

    @property
    def active(self) -> bool:
        """Whether the reply's text is read for calls."""
        return self.mode != "none"

    def machine(self, parser: str) -> CallMachine:
        """A fresh machine that turns one completion's text into content and calls."""
        if self.mode == "named":
            return NamedCall(self.name)
        if self.mode == "required":
            return RequiredCalls()
        return make_parser(parser, None if self.parallel else 1)


def plan(body: ChatBody) -> ToolPlan:
    """The request's tool plan; a 400 for a choice without tools or naming a function
    that is not among them, and for parallel_tool_calls without tools."""
    tools = body.tools or []
    choice = body.tool_choice
    if not tools:
        for name, v in (("tool_choice", choice), ("parallel_tool_calls", body.parallel_tool_calls)):
            if v is not None and v != "none":
                raise ApiError(400, f"{name} needs tools", param=name, code="invalid_value")
        return ToolPlan("none")
    listed = [t.model_dump(exclude_none=True) for t in tools]
    parallel = body.parallel_tool_calls is not False
    names = [t.function.name for t in tools]
    if len(set(names)) != len(names):
        raise ApiError(400, "tools: two functions have the same name", param="tools",
                       code="invalid_value")
    if isinstance(choice, NamedToolChoice):
        name = choice.function.name
        if name not in names:
            raise ApiError(400, f"tool_choice names the function {name!r}, which is not "
                                "among tools", param="tool_choice.function.name",
                           code="invalid_value")
        params = tools[names.index(name)].function.parameters or NO_PARAMETERS
        return ToolPlan("named", listed, name, parallel, {"json": _text(params)})
    if choice == "required":
        return ToolPlan("required", listed, None, parallel,
                        {"json": _text(required_schema(body))})
    return ToolPlan(choice or "auto", listed, None, parallel)


def required_schema(body: ChatBody) -> dict[str, Any]:
    """The JSON schema tool_choice "required" holds the output to, as vLLM's: a non-empty
    array (of one without parallel_tool_calls) of {"name": a function, "parameters": its
    parameters}. Each function's $defs / definitions move to the root, where its
    "#/$defs/..." references point."""
    defs: dict[str, dict] = {}
    items = []
    for t in body.tools or []:
        params = dict(t.function.parameters or NO_PARAMETERS)
        for key in _DEFS:
            for name, sub in (params.pop(key, None) or {}).items():
                if defs.setdefault(key, {}).setdefault(name, sub) != sub:
                    raise ApiError(400, f"tools: two functions define {key}/{name} "
                                        "differently (tool_choice \"required\" puts every "
                                        "function's in one schema)", param="tools",
                                   code="invalid_value")
        items.append({"type": "object",
                      "properties": {"name": {"type": "string", "enum": [t.function.name]},
                                     "parameters": params},
                      "required": ["name", "parameters"], "additionalProperties": False})
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
    if body.parallel_tool_calls is False:
        schema["maxItems"] = 1
    return {**schema, **defs}


def _text(schema: dict) -> str:
    text = json.dumps(schema, separators=(",", ":"), ensure_ascii=False)
    if len(text) > MAX_CONSTRAINT_CHARS:
        raise ApiError(400, f"tools: the schema tool_choice needs is {len(text)} characters "
                            f"as JSON, more than the limit of {MAX_CONSTRAINT_CHARS}",
                       param="tools", code="invalid_value")
    return text


def finish_reason(machine: CallMachine, reason: str | None) -> str | None:
    """A stop after tool calls is OpenAI's "tool_calls"."""
    return "tool_calls" if reason == "stop" and machine.calls else reason


def reply(tp: ToolPlan, parser: str, text: str, reason: str | None
          ) -> tuple[dict[str, Any], str | None]:
    """(the assistant message, the finish reason) of one whole completion. Under
    "required", text that is not the whole JSON array (cut by max_tokens) is content."""
    if not tp.active or (tp.mode == "required" and not _is_json(text)):
        return {"role": "assistant", "content": text}, reason
    m = tp.machine(parser)
    d: Delta = m.feed(text).merge(m.finish())
    return d.message(), finish_reason(m, reason)


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
        return True
    except (ValueError, RecursionError):
        return False
