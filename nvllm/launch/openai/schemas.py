"""Request bodies (strict pydantic models, output constraints and tools among them), the
one place that says which OpenAI fields are refused or accepted-and-ignored, the size
limits, the checks a schema cannot express, and the SamplingParams map each body becomes
for the leader. Reading and parsing a body into these models is body.py's."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Annotated, Any, Literal, TypeVar

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    field_validator,
    model_validator,
)

from nvllm.common.client_limits import MAX_LOGPROBS  # logprobs, top_logprobs
from nvllm.common.client_protocol import depth_exceeds
from nvllm.launch.openai.errors import ApiError

if TYPE_CHECKING:
    pass

# ---- limits ------------------------------------------------------------------------------
# The gateway's own bounds, so a hostile body never makes it build or forward a huge list.
# The leader enforces its own limits too (max_model_len, the vocabulary, its frame size,
# SamplingParams.validate); these only have to be at least as loose as any useful request.
MAX_BODY_BYTES = 16 << 20  # --max-body-bytes: ~10x a 128k-token prompt as JSON token ids
MAX_PROMPTS = 256  # prompts in one /v1/completions batch
MAX_PROMPT_TOKEN_IDS = 1 << 20  # ids in one token-id prompt
MAX_STOP = 16  # stop strings
MAX_STOP_CHARS = 1024  # characters in one stop string
MAX_STOP_TOKEN_IDS = 1024
MAX_LOGIT_BIAS = 1024  # logit_bias entries (the leader's own bound is --max-logit-bias)
MAX_N = 128
MAX_MESSAGES = 4096
MAX_CONTENT_PARTS = 256  # content parts in one message
MAX_INT32 = 2**31 - 1  # every other integer field: token ids, counts, lengths
_MAX_SEED = 2**63 - 1
# Output constraints and tools. The leader compiles every constraint and has its own limit;
# these keep a body from making the gateway build (tool_choice "required") or forward more.
MAX_CONSTRAINT_CHARS = 64 << 10  # a JSON schema (as compact JSON text), a regex, a grammar
MAX_SCHEMA_DEPTH = 64  # a JSON schema's nesting: nothing recurses past it, here or there
MAX_CHOICES = 256  # strings in a choice constraint
MAX_CHOICE_CHARS = 1024  # characters in one of them
MAX_TOOLS = 128
MAX_TOOL_CALLS = 256  # tool calls in one message of the conversation

# ---- OpenAI fields we do not implement: refused, never silently ignored ------------------
# name -> the values that change nothing (sent by clients that fill in defaults); any other
# value gets 400 naming the field. best_of is accepted only equal to n (checked below).
UNSUPPORTED: dict[str, tuple] = {
    # tools, tool_choice, parallel_tool_calls: refused on /v1/completions (ChatBody has them)
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "functions": (None, []),
    "function_call": (None, "none"),
    "parallel_tool_calls": (None,),  # any value: without tools it only confuses
    "suffix": (None, ""),
    "best_of": (None,),
    "prediction": (None,),
    "audio": (None,),
    "modalities": (None, ["text"]),
    "web_search_options": (None,),
    "reasoning_effort": (None,),
    "verbosity": (None,),
    "use_beam_search": (None, False),  # vLLM's
    "truncate_prompt_tokens": (None,),  # vLLM's
}
# Fields that change nothing here and that clients send: accepted and dropped.
ACCEPTED_IGNORED = frozenset({
    "safety_identifier", "store", "metadata", "service_tier",
    "prompt_cache_key", "prompt_cache_retention",
})
# A request-supplied chat template is code run on the gateway (jinja2's sandbox stops
# attribute abuse, not `{% for i in range(10**9) %}`): refused without the operator's
# --trust-request-chat-template.
CHAT_TEMPLATE_FIELDS = ("chat_template", "chat_template_kwargs.chat_template")
# apply_chat_template's own arguments, never taken from chat_template_kwargs:
# nvllm/common/chat.py's RESERVED_TEMPLATE_KWARGS (body.py's screen refuses them first).
Int32 = Annotated[int, Field(ge=0, le=MAX_INT32)]
TokenId = Annotated[int, Field(ge=0, le=MAX_INT32)]
StopString = Annotated[str, Field(max_length=MAX_STOP_CHARS)]


def _no_constant(name: str) -> float:
    raise ValueError(f"{name} is not a JSON number")


class _Body(BaseModel):
    # strict: "0.5" is not a temperature and true is not an n. Unknown keys are refused
    # (the top level gets a clearer message from screen() first).
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Body):
    include_usage: bool = False
    continuous_usage_stats: bool | None = None  # vLLM bench's; usage comes at the end


def _compact(schema: dict) -> str:
    """A JSON schema as compact JSON text, within the depth and size limits (a ValueError
    names the limit)."""
    if depth_exceeds(schema, MAX_SCHEMA_DEPTH):
        raise ValueError(f"the schema nests more than {MAX_SCHEMA_DEPTH} levels deep")
    try:
        text = json.dumps(schema, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError, RecursionError):
        raise ValueError("the schema is not JSON") from None
    if len(text) > MAX_CONSTRAINT_CHARS:
        raise ValueError(f"the schema is {len(text)} characters as JSON, more than the limit "
                         f"of {MAX_CONSTRAINT_CHARS}")
    return text


def _schema_dict(schema: dict) -> dict:
    _compact(schema)
    return schema


def _schema_text(schema: dict | str) -> str:
    """A JSON schema (an object, or its JSON text) as compact JSON text, within the limits:
    what the leader's structured_outputs.json takes."""
    if isinstance(schema, str):
        if len(schema) > MAX_CONSTRAINT_CHARS:
            raise ValueError(f"the schema is {len(schema)} characters, more than the limit "
                             f"of {MAX_CONSTRAINT_CHARS}")
        try:
            schema = json.loads(schema, parse_constant=_no_constant)
        except (ValueError, RecursionError):
            raise ValueError("the schema text is not valid JSON") from None
        if not isinstance(schema, dict):
            raise ValueError("a JSON schema must be a JSON object")
    return _compact(schema)


SchemaDict = Annotated[dict[str, Any], AfterValidator(_schema_dict)]
SchemaText = Annotated[dict[str, Any] | str, AfterValidator(_schema_text)]
ConstraintText = Annotated[str, Field(min_length=1, max_length=MAX_CONSTRAINT_CHARS)]
def _choices_total(choices: list[str]) -> list[str]:
    n = sum(map(len, choices))
    if n > MAX_CONSTRAINT_CHARS:
        raise ValueError(f"the choices are {n} characters together, more than the limit of "
                         f"{MAX_CONSTRAINT_CHARS}")
    return choices


Choices = Annotated[list[Annotated[str, Field(min_length=1, max_length=MAX_CHOICE_CHARS)]],
                    Field(min_length=1, max_length=MAX_CHOICES), AfterValidator(_choices_total)]


class JsonSchemaFormat(_Body):
    name: str = Field(min_length=1, max_length=64)
    description: str | None = Field(None, max_length=MAX_CONSTRAINT_CHARS)
    schema_: SchemaText = Field(alias="schema")
    strict: bool | None = None  # the output always matches the schema here


class ResponseFormat(_Body):
    """OpenAI's: text (no constraint), json_object, or json_schema (with its json_schema)."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_iff_json_schema(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError('json_schema goes with type "json_schema", and only there')
        return self


class StructuredOutputs(_Body):
    """vLLM's structured_outputs (exactly one field set; nvllm/launch/openai/structured.py
    checks that and names what is wrong)."""

    json_: SchemaText | None = Field(None, alias="json")
    json_object: bool | None = None
    regex: ConstraintText | None = None
    grammar: ConstraintText | None = None  # EBNF in xgrammar's syntax, rule `root`
    choice: Choices | None = None


class SamplingBody(_Body):
    """What both generation routes accept: sampling, limits, streaming, nvllm extras."""

    model: str | None = None
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1, le=MAX_INT32)
    min_p: float | None = Field(None, ge=0, le=1)
    max_tokens: int | None = Field(None, ge=1, le=MAX_INT32)
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_INT32)
    stop: StopString | list[StopString] | None = Field(None, max_length=MAX_STOP)
    seed: int | None = Field(None, ge=0, le=_MAX_SEED)
    n: int = Field(1, ge=1, le=MAX_N)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    stream: bool = False
    stream_options: StreamOptions | None = None
    # nvllm / vLLM extras
    ignore_eos: bool | None = None
    min_tokens: int | None = Field(None, ge=0, le=MAX_INT32)
    repetition_penalty: float | None = Field(None, gt=0, le=100)
    priority: int = Field(0, ge=-(2**31), le=MAX_INT32)  # only with --allow-priority
    ttl_ms: int | None = Field(None, ge=1, le=MAX_INT32)
    # OpenAI's end-user id: behind a data-parallel router, one user's requests stay on one
    # replica (the client wire's routing_key, bounded as its request ids are).
    user: str | None = Field(None, max_length=256)
    stop_token_ids: list[TokenId] | None = Field(None, max_length=MAX_STOP_TOKEN_IDS)
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    # OpenAI's: token id (a decimal string, as JSON keys are) -> a bias in [-100, 100].
    # Checked whole below, so an error names logit_bias, never a key the client sent.
    logit_bias: dict[str, Any] | None = Field(None, max_length=MAX_LOGIT_BIAS)
    # output constraints: at most one of these (structured.py)
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: SchemaText | None = None  # vLLM's older spellings of structured_outputs
    guided_regex: ConstraintText | None = None
    guided_choice: Choices | None = None
    guided_grammar: ConstraintText | None = None
    # vLLM's: score the prompt (top-k per token); the reply's prompt_logprobs. Not streamed.
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)

    @field_validator("logit_bias")
    @classmethod
    def _token_id_keys_and_bounded_values(cls, v: dict[str, Any] | None
                                          ) -> dict[str, Any] | None:
        if v is None:
            return v
        if not all(k.isascii() and k.isdigit() and len(k) <= 10 and int(k) <= MAX_INT32
                   for k in v):
            raise ValueError(f"keys must be token ids: decimal strings of integers in "
                             f"[0, {MAX_INT32}]")
        # Not bool (an int to Python); the range check also refuses inf from 1e400.
        if not all(type(x) in (int, float) and -100 <= x <= 100 for x in v.values()):
            raise ValueError("values must be numbers in [-100, 100]")
        if len({int(k) for k in v}) < len(v):
            raise ValueError("two keys name the same token id")
        return v

    @property
    def include_usage(self) -> bool:
        """Whether a stream ends with a usage chunk."""
        return bool(self.stream_options and self.stream_options.include_usage)


TokenIds = Annotated[list[TokenId], Field(max_length=MAX_PROMPT_TOKEN_IDS)]


class CompletionBody(SamplingBody):
    prompt: (str | TokenIds | Annotated[list[str], Field(max_length=MAX_PROMPTS)]
             | Annotated[list[TokenIds], Field(max_length=MAX_PROMPTS)])
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    # Each choice's text (and, with logprobs, its logprobs object) starts with the prompt.
    echo: bool = False


class ContentPart(_Body):
    type: str
    text: str | None = None


ToolName = Annotated[str, Field(pattern=r"^[A-Za-z0-9_.\-]{1,64}$")]


class FunctionDef(_Body):
    name: ToolName
    description: str | None = Field(None, max_length=MAX_CONSTRAINT_CHARS)
    parameters: SchemaDict | None = None  # None: no arguments
    strict: bool | None = None  # forced calls always match; auto ones are parsed as they come


class Tool(_Body):
    type: Literal["function"]
    function: FunctionDef


class FunctionName(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: FunctionName


class CalledFunction(_Body):
    name: str
    arguments: str  # JSON text


class MessageToolCall(_Body):
    """A tool call of an earlier assistant turn, sent back in the conversation."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(_Body):
    role: str
    content: str | Annotated[list[ContentPart], Field(max_length=MAX_CONTENT_PARTS)] | None \
        = None
    name: str | None = None
    tool_calls: Annotated[list[MessageToolCall], Field(max_length=MAX_TOOL_CALLS)] | None = None
    tool_call_id: str | None = None  # role "tool": the call this is the result of


class ChatBody(SamplingBody):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # vLLM's: leave the final (assistant) turn open
    echo: bool = False  # vLLM's (echo the last message): only false is supported
    chat_template: str | None = None  # only with --trust-request-chat-template
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Tool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None


BodyT = TypeVar("BodyT", bound=_Body)


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
    if body.prompt_logprobs is not None and body.stream:  # as vLLM
        raise ApiError(400, "prompt_logprobs are not available when stream is true",
                       param="prompt_logprobs", code="invalid_value")


def leader_params(body: SamplingBody, logprobs: int | None, max_tokens: int,
                  prompt_logprobs: int | None = None) -> dict:
    """The SamplingParams map sent to the leader: only what the request set, so the leader's
    defaults (and its validation) stay the single source of truth. `prompt_logprobs`:
    the top-k to score the prompt with (the body's, or what echo with logprobs needs)."""
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
    if body.logit_bias:  # {} changes nothing: not sent
        p["logit_bias"] = {int(k): float(v) for k, v in body.logit_bias.items()}
    if prompt_logprobs is not None:
        p["prompt_logprobs"] = prompt_logprobs
    return p
