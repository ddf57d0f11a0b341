"""``nvllm-serve``: an OpenAI-compatible HTTP gateway in front of a running nvllm leader.

The gateway is its own process: it attaches to the leader's client endpoint as an ordinary
ZMQ client (``AsyncClient``, protocol in docs/protocol.md), so a crashing or restarted HTTP
server never takes the engine down, and the engine never runs HTTP code. Routes:

- ``POST /v1/completions``: prompt as a string, a token-id list, or a batch of either;
  ``n``; ``stream`` as server-sent events (``data: {...}`` ... ``data: [DONE]``).
- ``POST /v1/chat/completions``: the model's chat template (from its tokenizer) is applied
  here and the prompt is sent as token ids.
- ``GET /v1/models``, ``GET /health`` (200 once the leader says it is ready, else 503),
  ``GET /metrics`` (the leader's Prometheus text plus the gateway's own counters).

Every request becomes one leader request per prompt (``n`` completions each). A client
that disconnects aborts its leader requests, so an abandoned request frees its KV blocks.

Binding HTTP to anything but loopback requires ``--api-key``; a leader started with
``--curve-key-dir`` needs the same option here (the gateway is one of its clients).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import secrets
import socket
import subprocess
import sys
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import click
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from nvllm.common.client import AsyncClient, ClientError, StreamDelta
from nvllm.common.errors import EngineDeadError, RequestRejected
from nvllm.common.proc import die_with_parent, set_process_title
from nvllm.common.zmq_utils import is_loopback, load_client_keys

logger = logging.getLogger("nvllm.gateway")

PROMETHEUS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
HEALTH_TIMEOUT_S = 2.0
CONTROL_TIMEOUT_S = 10.0  # info / metrics: the leader answers these between engine steps
DISCONNECT_POLL_S = 0.25
_MAX_SEED = 2**63 - 1
_FINISH_REASONS = {"stop": "stop", "length": "length"}  # everything else passes through

# Tasks the gateway starts and does not await (leader-request pumps); a strong reference
# keeps them from being garbage-collected mid-flight.
_BACKGROUND: set[asyncio.Task] = set()


# --------------------------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------------------------


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


def _from_validation(e: ValidationError) -> ApiError:
    err = e.errors()[0]
    if err["type"] == "json_invalid":
        return ApiError(400, f"the body is not valid JSON: {err['msg']}", code="invalid_json")
    errors = e.errors()
    if len({x["loc"][:1] for x in errors}) == 1 and len(errors) > 1 and err["loc"]:
        # Every member of a union failed (e.g. prompt): one message, not one per member.
        name = str(err["loc"][0])
        forms = {"prompt": "a string, a list of token ids, or a non-empty list of either "
                           "(not mixed)",
                 "stop": "a string or a list of strings",
                 "content": "a string or a list of content parts"}
        return ApiError(400, f"{name}: must be {forms.get(name, 'one of the accepted forms')}",
                        param=name, code="invalid_value")
    loc = [str(p) for p in err["loc"]]
    # Unions add the member type to the location ("prompt", "str"): name only the field path.
    param = ".".join(p for p in loc if not re.fullmatch(r"[a-z]+\[.*\]|str|int|float|bool", p))
    more = f" (and {len(errors) - 1} more problem(s))" if len(errors) > 1 else ""
    return ApiError(400, f"{param or 'body'}: {err['msg']}{more}", param=param or None,
                    code="invalid_value")


_FIELD_RE = re.compile(r"SamplingParams\.(\w+)|\b(\w+)\b must", re.ASCII)


def _from_leader(e: Exception) -> ApiError:
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


# --------------------------------------------------------------------------------------------
# Request bodies
# --------------------------------------------------------------------------------------------


class _Body(BaseModel):
    # strict: "0.5" is not a temperature and true is not an n. Unknown keys (user, tools...)
    # are ignored like OpenAI's optional features we do not implement.
    model_config = ConfigDict(extra="ignore", strict=True)


class StreamOptions(_Body):
    include_usage: bool = False


class _SamplingBody(_Body):
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


class CompletionBody(_SamplingBody):
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


class ChatBody(_SamplingBody):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None


def _leader_params(body: _SamplingBody, logprobs: int | None, max_tokens: int) -> dict:
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


# --------------------------------------------------------------------------------------------
# Gateway state: one leader connection, its info, the tokenizer
# --------------------------------------------------------------------------------------------


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: byte -> the printable character a BPE token spells it
    with (transformers no longer exports it from one stable place)."""
    bs = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("\xa1"), ord("\xac") + 1))
          + list(range(ord("\xae"), ord("\xff") + 1)))
    cs = bs[:]
    extra = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + extra)
            extra += 1
    return dict(zip(bs, map(chr, cs)))


class _Tokens:
    """Token text for logprobs. Byte-level BPE tokens map back to their exact bytes (a token
    may hold part of a UTF-8 character); other tokenizers decode the single token."""

    def __init__(self, tokenizer: Any) -> None:
        self.tok = tokenizer
        self._cache: dict[int, tuple[str, list[int]]] = {}
        self._byte_decoder: dict[str, int] | None = None
        with contextlib.suppress(Exception):
            if type(tokenizer.backend_tokenizer.decoder).__name__ == "ByteLevel":
                self._byte_decoder = {c: b for b, c in _bytes_to_unicode().items()}

    def __call__(self, tid: int) -> tuple[str, list[int]]:
        hit = self._cache.get(tid)
        if hit is not None:
            return hit
        piece = None
        with contextlib.suppress(Exception):
            piece = self.tok.convert_ids_to_tokens(int(tid))
        if piece is None:  # a model id the tokenizer has no token for
            out = ("", [])
        elif self._byte_decoder is not None and all(c in self._byte_decoder for c in piece):
            raw = bytes(self._byte_decoder[c] for c in piece)
            out = (raw.decode("utf-8", errors="replace"), list(raw))
        else:
            text = self.tok.decode([int(tid)], skip_special_tokens=False)
            out = (text, list(text.encode("utf-8")))
        self._cache[tid] = out
        return out


@dataclass
class GatewayConfig:
    endpoint: str
    model_name: str | None = None
    api_key: str | None = None
    tokenizer: str | None = None  # default: the path in the leader's info()["model"]
    curve_key_dir: str | None = None  # CURVE keys for the leader connection


class _State:
    def __init__(self, cfg: GatewayConfig) -> None:
        self.cfg = cfg
        self.client: AsyncClient | None = None
        self._info: dict | None = None
        self._tokenizer: Any = None
        self._tokens: _Tokens | None = None
        self._lock = asyncio.Lock()

    async def info(self) -> dict:
        if self._info is None:
            try:
                info = await asyncio.wait_for(self.client.info(), CONTROL_TIMEOUT_S)
            except (asyncio.TimeoutError, TimeoutError):
                raise ApiError(503, f"the engine at {self.cfg.endpoint} does not answer",
                               code="engine_unavailable", type_="server_error") from None
            self._info = info
        return self._info

    async def served_name(self) -> str:
        return self.cfg.model_name or str((await self.info()).get("model"))

    async def check_model(self, name: str | None) -> None:
        if name is None:
            return
        info = await self.info()
        if name not in {await self.served_name(), str(info.get("model"))}:
            raise ApiError(404, f"the model '{name}' does not exist; this server serves "
                                f"'{await self.served_name()}'", param="model",
                           code="model_not_found")

    async def tokenizer(self) -> Any:
        if self._tokenizer is None:
            async with self._lock:
                if self._tokenizer is None:
                    info = await self.info()
                    path = self.cfg.tokenizer or str(info.get("model_path") or info["model"])

                    def load() -> Any:
                        from transformers import AutoTokenizer

                        return AutoTokenizer.from_pretrained(path)

                    try:
                        tok = await asyncio.to_thread(load)
                    except Exception as e:
                        raise ApiError(500, f"cannot load the tokenizer from {path!r} (start "
                                            f"nvllm-serve with --tokenizer): {e}",
                                       type_="server_error") from e
                    self._tokens = _Tokens(tok)
                    self._tokenizer = tok
        return self._tokenizer

    async def tokens(self) -> _Tokens:
        await self.tokenizer()
        return self._tokens


# --------------------------------------------------------------------------------------------
# Running leader requests
# --------------------------------------------------------------------------------------------


@dataclass
class _Job:
    prompt: str | list[int]
    params: dict
    priority: int = 0
    ttl_ms: int | None = None


class _Fanout:
    """One leader request per prompt, pumped concurrently by background tasks into one
    queue. ``cancel()`` cancels the pumps; cancelling a pump closes its
    ``AsyncClient.stream``, whose ``finally`` sends ``abort`` to the leader. The pumps are
    plain asyncio tasks, outside the HTTP handler's (anyio) cancel scope, so that abort is
    sent even while the handler itself is being cancelled."""

    def __init__(self, client: AsyncClient, jobs: list[_Job]) -> None:
        self.client = client
        self.queue: asyncio.Queue = asyncio.Queue()
        self._buffer: deque = deque()
        self._open = len(jobs)
        self._cancelled = False
        self.tasks = [asyncio.create_task(self._pump(i, j)) for i, j in enumerate(jobs)]
        for t in self.tasks:
            _BACKGROUND.add(t)
            t.add_done_callback(_BACKGROUND.discard)

    async def _pump(self, i: int, job: _Job) -> None:
        stream = self.client.stream(job.prompt, job.params, priority=job.priority,
                                    ttl_ms=job.ttl_ms)
        try:
            async for d in stream:
                if self._cancelled:
                    break
                self.queue.put_nowait((i, d))
        except asyncio.CancelledError:
            raise
        except Exception as e:  # handed to the consumer, which answers with an error
            self.queue.put_nowait((i, e))
        finally:
            # After a `break` this runs the stream's own finally, which sends the abort;
            # after a cancellation or the last delta the stream is closed already.
            await stream.aclose()
            self.queue.put_nowait((i, None))

    def cancel(self) -> None:
        # The flag backs up Task.cancel(): on Python < 3.12 asyncio.wait_for (which
        # AsyncClient.stream awaits each message with) swallows a cancellation that lands
        # just as a message arrives, and the stream would run to its end. With the flag the
        # pump stops at the next delta instead and closes the stream, which aborts.
        # Once only: a second Task.cancel() could interrupt the stream's abort in flight.
        if self._cancelled:
            return
        self._cancelled = True
        for t in self.tasks:
            t.cancel()

    async def first(self) -> None:
        """Wait until every request has answered once (first tokens, or an error, which is
        raised), so that e.g. a ``rejected`` prompt becomes a 4xx, not a broken stream."""
        answered: set[int] = set()
        while len(answered) < len(self.tasks):
            i, item = await self.queue.get()
            if isinstance(item, BaseException):
                raise item
            answered.add(i)
            self._buffer.append((i, item))

    def __aiter__(self) -> _Fanout:
        return self

    async def __anext__(self) -> tuple[int, StreamDelta]:
        while True:
            if self._buffer:
                i, item = self._buffer.popleft()
            elif self._open:
                i, item = await self.queue.get()
            else:
                raise StopAsyncIteration
            if item is None:
                self._open -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                return i, item


class _Disconnected(Exception):
    pass


async def _unless_disconnected(request: Request, aw: Any, on_disconnect: Callable) -> Any:
    """Await `aw`, polling the HTTP connection: a client that goes away gets its work
    cancelled (``on_disconnect``) instead of running to completion for nobody."""
    task = asyncio.ensure_future(aw)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                on_disconnect()
                task.cancel()
                raise _Disconnected()
    except asyncio.CancelledError:
        on_disconnect()
        task.cancel()
        raise


async def _await_leader(request: Request, fan: _Fanout, aw: Any) -> Any:
    """Await leader work for `fan` while watching the HTTP connection: a hang-up cancels
    the fan-out (raises _Disconnected); a leader error cancels it and becomes an ApiError."""
    try:
        return await _unless_disconnected(request, aw, fan.cancel)
    except _Disconnected:
        raise
    except Exception as e:
        fan.cancel()
        raise _from_leader(e) from e


@dataclass
class _Acc:
    """One completion's output, accumulated from its deltas."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    finish_reason: str | None = None
    usage: dict | None = None

    def add(self, d: StreamDelta) -> None:
        self.text += d.text
        self.token_ids.extend(d.token_ids)
        if d.logprobs:
            self.logprobs.extend(d.logprobs)
        if d.finish_reason is not None:
            self.finish_reason = d.finish_reason
            self.usage = d.usage or {}


async def _collect(fan: _Fanout) -> dict[tuple[int, int], _Acc]:
    accs: dict[tuple[int, int], _Acc] = {}
    async for i, d in fan:
        accs.setdefault((i, d.index), _Acc()).add(d)
    return accs


def _usage(finals: dict[tuple[int, int], _Acc | StreamDelta]) -> dict:
    """prompt tokens once per prompt (each completion's final message repeats them),
    completion tokens summed over completions."""
    prompt: dict[int, int] = {}
    cached: dict[int, int] = {}
    completion = 0
    for (i, _), a in finals.items():
        u = a.usage or {}
        prompt[i] = int(u.get("prompt_tokens", 0))
        cached[i] = int(u.get("cached_tokens", 0) or 0)
        ntok = len(a.token_ids) if isinstance(a, _Acc) else 0
        completion += int(u.get("completion_tokens", ntok))
    p = sum(prompt.values())
    return {"prompt_tokens": p, "completion_tokens": completion, "total_tokens": p + completion,
            "prompt_tokens_details": {"cached_tokens": sum(cached.values())}}


def _finish(reason: str | None) -> str | None:
    return None if reason is None else _FINISH_REASONS.get(reason, reason)


def _lp_items(entry: Any) -> list[tuple[int, float]]:
    """One token's logprobs map (token id -> logprob; ids may arrive as strings) as pairs."""
    if not entry:
        return []
    items = entry.items() if isinstance(entry, dict) else entry
    return [(int(t), float(v)) for t, v in items]


def _completion_logprobs(tokens: _Tokens, token_ids: list[int], entries: list, top_n: int,
                         offset: int) -> tuple[dict, int]:
    """OpenAI legacy-completions logprobs for these tokens; returns (it, next text offset)."""
    out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                            "text_offset": []}
    for tid, entry in zip(token_ids, entries):
        items = _lp_items(entry)
        text = tokens(tid)[0]
        lp = dict(items).get(tid)
        top = sorted(items, key=lambda kv: -kv[1])[:top_n]
        if lp is not None and tid not in {t for t, _ in top}:
            top.append((tid, lp))  # the sampled token is always listed, like vLLM
            top.sort(key=lambda kv: -kv[1])
        out["tokens"].append(text)
        out["token_logprobs"].append(lp)
        shown: dict[str, float] = {}
        for t, v in top:  # best first: two ids with the same text keep the higher logprob
            shown.setdefault(tokens(t)[0], v)
        out["top_logprobs"].append(shown)
        out["text_offset"].append(offset)
        offset += len(text)
    return out, offset


def _chat_logprobs(tokens: _Tokens, token_ids: list[int], entries: list, top_n: int) -> dict:
    content = []
    for tid, entry in zip(token_ids, entries):
        items = _lp_items(entry)
        text, raw = tokens(tid)
        lp = dict(items).get(tid)
        top = sorted(items, key=lambda kv: -kv[1])[:top_n]
        content.append({
            "token": text, "logprob": lp, "bytes": raw,
            "top_logprobs": [{"token": tokens(t)[0], "logprob": v, "bytes": tokens(t)[1]}
                             for t, v in top]})
    return {"content": content}


class _EventStream(StreamingResponse):
    """Server-sent events whose leader requests end with the response, however it ends.

    When the HTTP client hangs up, Starlette cancels the send loop; the event generator may
    be parked at a ``yield`` then, and its ``finally`` would only run whenever the garbage
    collector gets to it. Cancelling the pumps here (synchronously, so it works inside a
    cancelled scope) aborts the leader requests at once."""

    def __init__(self, events: AsyncIterator[str], fan: _Fanout) -> None:
        super().__init__(events, media_type="text/event-stream",
                         headers={"cache-control": "no-cache"})
        self._fan = fan

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._fan.cancel()  # a no-op for pumps that already finished


def _sse(obj: dict | str) -> str:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n"


# --------------------------------------------------------------------------------------------
# The app
# --------------------------------------------------------------------------------------------


def _gateway_metrics() -> tuple[Any, Any, Callable[[], bytes]]:
    from prometheus_client import (
        CollectorRegistry,
        Counter,
        Histogram,
        disable_created_metrics,
        generate_latest,
    )

    disable_created_metrics()  # the *_created series only add noise to every scrape
    reg = CollectorRegistry()
    requests = Counter("nvllm_gateway_http_requests", "HTTP requests answered by the gateway",
                       ["route", "status"], registry=reg)
    latency = Histogram("nvllm_gateway_http_request_seconds",
                        "Time to the start of the HTTP response", ["route"], registry=reg)
    return requests, latency, lambda: generate_latest(reg)


_ROUTES = {"/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics"}


class _CountRequests:
    """Pure ASGI middleware (BaseHTTPMiddleware would get between streaming responses and
    the disconnect signal the abort path relies on)."""

    def __init__(self, app: Any, requests: Any, latency: Any) -> None:
        self.app, self.requests, self.latency = app, requests, latency

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        route = scope.get("path", "") if scope.get("path") in _ROUTES else "other"
        t0 = time.perf_counter()

        async def counting_send(message: dict) -> None:
            if message["type"] == "http.response.start":
                self.requests.labels(route, str(message["status"])).inc()
                self.latency.labels(route).observe(time.perf_counter() - t0)
            await send(message)

        await self.app(scope, receive, counting_send)


def create_app(cfg: GatewayConfig) -> FastAPI:
    """The gateway's ASGI app; the leader connection opens at startup."""
    state = _State(cfg)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state.client = AsyncClient(cfg.endpoint, curve_key_dir=cfg.curve_key_dir)
        try:
            yield
        finally:
            state.client.close()

    app = FastAPI(title="nvllm OpenAI-compatible gateway", lifespan=lifespan)
    app.state.gateway = state
    requests_total, latency, gateway_metrics_text = _gateway_metrics()
    app.add_middleware(_CountRequests, requests=requests_total, latency=latency)

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, e: ApiError) -> JSONResponse:
        return e.response()

    @app.exception_handler(404)
    async def _not_found(request: Request, e: Exception) -> JSONResponse:
        return ApiError(404, f"no route {request.method} {request.url.path}",
                        code="not_found").response()

    @app.exception_handler(405)
    async def _bad_method(request: Request, e: Exception) -> JSONResponse:
        return ApiError(405, f"{request.method} is not allowed on {request.url.path}",
                        code="method_not_allowed").response()

    async def check_key(request: Request) -> None:
        if cfg.api_key is None:
            return
        auth = request.headers.get("authorization", "")
        scheme, _, token = auth.partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(
                token.strip().encode(), cfg.api_key.encode()):
            raise ApiError(401, "missing or wrong API key (send Authorization: Bearer KEY)",
                           code="invalid_api_key")

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(check_key)])

    @app.get("/health")
    async def health() -> Response:
        try:
            h = await asyncio.wait_for(state.client.health(), HEALTH_TIMEOUT_S)
        except (asyncio.TimeoutError, TimeoutError):
            return JSONResponse({"status": "unavailable",
                                 "reason": f"no answer from {cfg.endpoint}"}, 503)
        except Exception as e:
            return JSONResponse({"status": "unavailable", "reason": str(e)}, 503)
        if h.get("ready"):
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "unavailable", "reason": h.get("reason")}, 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        try:
            text = await asyncio.wait_for(state.client.metrics(), CONTROL_TIMEOUT_S)
        except (asyncio.TimeoutError, TimeoutError):
            raise ApiError(503, f"no metrics from {cfg.endpoint}", code="engine_unavailable",
                           type_="server_error") from None
        except Exception as e:
            raise _from_leader(e) from e
        if text and not text.endswith("\n"):
            text += "\n"
        body = text.encode() + gateway_metrics_text()
        return Response(body, media_type=PROMETHEUS_CONTENT_TYPE,
                        headers={"content-type": PROMETHEUS_CONTENT_TYPE})

    @v1.get("/models")
    async def models() -> dict:
        info = await state.info()
        return {"object": "list", "data": [{
            "id": await state.served_name(), "object": "model", "created": 0,
            "owned_by": "nvllm", "root": str(info.get("model")),
            "max_model_len": info.get("max_model_len")}]}

    async def parse(request: Request, model: type[BaseModel]) -> Any:
        raw = await request.body()
        try:
            body = model.model_validate_json(raw or b"{}")
        except ValidationError as e:
            raise _from_validation(e) from None
        await state.check_model(body.model)
        info = await state.info()
        limit = info.get("max_model_len")
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
        return body

    async def start(request: Request, jobs: list[_Job]) -> _Fanout:
        fan = _Fanout(state.client, jobs)
        await _await_leader(request, fan, fan.first())
        return fan

    def include_usage(body: _SamplingBody) -> bool:
        return bool(body.stream_options and body.stream_options.include_usage)

    @v1.post("/completions")
    async def completions(request: Request) -> Response:
        body: CompletionBody = await parse(request, CompletionBody)
        if body.echo:
            raise ApiError(400, "echo is not supported", param="echo", code="unsupported")
        if body.suffix:
            raise ApiError(400, "suffix is not supported", param="suffix", code="unsupported")
        if body.best_of is not None and body.best_of != body.n:
            raise ApiError(400, "best_of other than n is not supported", param="best_of",
                           code="unsupported")
        prompts: list[str | list[int]]
        p = body.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            prompts = [p]
        else:
            prompts = list(p)
        if not prompts:
            raise ApiError(400, "prompt is empty", param="prompt", code="invalid_value")
        for q in prompts:
            if isinstance(q, list) and (not q or any(t < 0 for t in q)):
                raise ApiError(400, "a token-id prompt must be a non-empty list of "
                                    "non-negative integers", param="prompt",
                               code="invalid_value")
        max_tokens = body.max_completion_tokens or body.max_tokens or 16  # OpenAI's default
        params = _leader_params(body, body.logprobs, max_tokens)
        tokens = await state.tokens() if body.logprobs is not None else None
        jobs = [_Job(q, params, body.priority, body.ttl_ms) for q in prompts]
        rid, created, name = f"cmpl-{uuid.uuid4().hex}", int(time.time()), \
            await state.served_name()
        n = body.n
        try:
            fan = await start(request, jobs)
        except _Disconnected:
            return Response(status_code=499)

        def choice_logprobs(acc_offsets: dict, key: tuple[int, int], d_ids: list[int],
                            d_lps: list | None) -> dict | None:
            if tokens is None:
                return None
            lps, acc_offsets[key] = _completion_logprobs(
                tokens, d_ids, d_lps or [None] * len(d_ids), body.logprobs,
                acc_offsets.get(key, 0))
            return lps

        if body.stream:
            async def events() -> AsyncIterator[str]:
                offsets: dict[tuple[int, int], int] = {}
                finals: dict[tuple[int, int], StreamDelta] = {}
                try:
                    async for i, d in fan:
                        if not (d.text or d.finish_reason is not None
                                or (tokens is not None and d.token_ids)):
                            continue  # e.g. text held back while it may be a stop string
                        key = (i, d.index)
                        if d.finish_reason is not None:
                            finals[key] = d
                        yield _sse({"id": rid, "object": "text_completion",
                                    "created": created, "model": name, "choices": [{
                                        "index": i * n + d.index, "text": d.text,
                                        "logprobs": choice_logprobs(offsets, key, d.token_ids,
                                                                    d.logprobs),
                                        "finish_reason": _finish(d.finish_reason)}]})
                    if include_usage(body):
                        yield _sse({"id": rid, "object": "text_completion", "created": created,
                                    "model": name, "choices": [], "usage": _usage(finals)})
                except Exception as e:  # mid-stream: the status line is already sent
                    yield _sse(_from_leader(e).body())
                finally:
                    fan.cancel()  # no-op when finished; aborts when the client went away
                yield _sse("[DONE]")

            return _EventStream(events(), fan)

        try:
            accs = await _await_leader(request, fan, _collect(fan))
        except _Disconnected:
            return Response(status_code=499)
        choices = []
        for (i, k), a in sorted(accs.items()):
            choices.append({"index": i * n + k, "text": a.text,
                            "logprobs": choice_logprobs({}, (i, k), a.token_ids, a.logprobs),
                            "finish_reason": _finish(a.finish_reason)})
        return JSONResponse({"id": rid, "object": "text_completion", "created": created,
                             "model": name, "choices": choices, "usage": _usage(accs)})

    @v1.post("/chat/completions")
    async def chat_completions(request: Request) -> Response:
        body: ChatBody = await parse(request, ChatBody)
        if body.top_logprobs is not None and not body.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs",
                           code="invalid_value")
        tok = await state.tokenizer()
        if not getattr(tok, "chat_template", None):
            raise ApiError(400, "the model's tokenizer has no chat template",
                           param="messages", code="no_chat_template")
        messages = []
        for j, m in enumerate(body.messages):
            content = m.content
            if isinstance(content, list):
                if any(part.type != "text" for part in content):
                    raise ApiError(400, "only text content parts are supported",
                                   param=f"messages.{j}.content", code="unsupported")
                content = "\n".join(part.text or "" for part in content)
            msg = {"role": m.role, "content": content or ""}
            if m.name is not None:
                msg["name"] = m.name
            messages.append(msg)
        try:
            text = tok.apply_chat_template(messages, tokenize=False,
                                           add_generation_prompt=body.add_generation_prompt,
                                           **(body.chat_template_kwargs or {}))
        except Exception as e:
            raise ApiError(400, f"cannot apply the chat template: {e}", param="messages",
                           code="chat_template_error") from e
        # The template already holds the special tokens it wants: encode without adding
        # more (a second BOS), and send ids so the leader does not tokenize it again.
        prompt_ids = list(tok(text, add_special_tokens=False)["input_ids"])
        limit = int((await state.info()).get("max_model_len") or 0)
        max_tokens = body.max_completion_tokens or body.max_tokens or max(
            1, limit - len(prompt_ids))  # OpenAI's default: up to the context length
        lp = (body.top_logprobs or 0) if body.logprobs else None
        params = _leader_params(body, lp, max_tokens)
        tokens = await state.tokens() if body.logprobs else None
        rid, created, name = f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), \
            await state.served_name()
        try:
            fan = await start(request, [_Job(prompt_ids, params, body.priority, body.ttl_ms)])
        except _Disconnected:
            return Response(status_code=499)

        def logprobs_of(ids: list[int], lps: list | None) -> dict | None:
            if tokens is None:
                return None
            return _chat_logprobs(tokens, ids, lps or [None] * len(ids), body.top_logprobs or 0)

        def chunk(choices: list[dict], **extra: Any) -> str:
            return _sse({"id": rid, "object": "chat.completion.chunk", "created": created,
                         "model": name, "choices": choices, **extra})

        if body.stream:
            async def events() -> AsyncIterator[str]:
                finals: dict[tuple[int, int], StreamDelta] = {}
                try:
                    for k in range(body.n):
                        yield chunk([{"index": k, "delta": {"role": "assistant", "content": ""},
                                      "logprobs": None, "finish_reason": None}])
                    async for i, d in fan:
                        if not (d.text or d.finish_reason is not None
                                or (tokens is not None and d.token_ids)):
                            continue
                        if d.finish_reason is not None:
                            finals[(i, d.index)] = d
                        delta = {"content": d.text} if d.text else {}
                        yield chunk([{"index": d.index, "delta": delta,
                                      "logprobs": logprobs_of(d.token_ids, d.logprobs),
                                      "finish_reason": _finish(d.finish_reason)}])
                    if include_usage(body):
                        yield chunk([], usage=_usage(finals))
                except Exception as e:
                    yield _sse(_from_leader(e).body())
                finally:
                    fan.cancel()
                yield _sse("[DONE]")

            return _EventStream(events(), fan)

        try:
            accs = await _await_leader(request, fan, _collect(fan))
        except _Disconnected:
            return Response(status_code=499)
        choices = [{"index": k, "message": {"role": "assistant", "content": a.text},
                    "logprobs": logprobs_of(a.token_ids, a.logprobs),
                    "finish_reason": _finish(a.finish_reason)}
                   for (_, k), a in sorted(accs.items())]
        return JSONResponse({"id": rid, "object": "chat.completion", "created": created,
                             "model": name, "choices": choices, "usage": _usage(accs)})

    app.include_router(v1)
    return app


# --------------------------------------------------------------------------------------------
# Process entry points
# --------------------------------------------------------------------------------------------


def check_http_host(host: str, api_key: str | None) -> None:
    """Refuse to expose the HTTP API beyond this machine without a key."""
    if not api_key and not is_loopback(host):
        raise ValueError(f"binding the HTTP gateway to {host} needs authentication: pass "
                         "--api-key KEY (or set NVLLM_API_KEY); clients then send "
                         "'Authorization: Bearer KEY'")


def start_gateway_process(endpoint: str, host: str, port: int, model_name: str | None = None,
                          *, api_key: str | None = None, curve_key_dir: str | None = None,
                          log_level: str = "warning", **popen_kwargs: Any) -> subprocess.Popen:
    """Start ``python -m nvllm.launch.http_gateway`` attached to `endpoint`; the caller owns
    the process (terminate it, then wait). Raises ValueError at once (no process) for a
    non-loopback `host` without `api_key`."""
    check_http_host(host, api_key)
    cmd = [sys.executable, "-m", "nvllm.launch.http_gateway", "--endpoint", endpoint,
           "--host", host, "--port", str(port), "--log-level", log_level]
    if model_name:
        cmd += ["--model-name", model_name]
    if curve_key_dir:
        cmd += ["--curve-key-dir", str(curve_key_dir)]
    env = dict(popen_kwargs.pop("env", None) or os.environ, NVLLM_PARENT_PID=str(os.getpid()))
    if api_key:  # by environment, not argv: ps shows every user a process's arguments
        env["NVLLM_API_KEY"] = api_key
    return subprocess.Popen(cmd, env=env, **popen_kwargs)


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)  # connections made before uvicorn's loop runs wait in the backlog
    return sock


@click.command(context_settings={"show_default": True, "help_option_names": ["-h", "--help"]})
@click.option("--endpoint", required=True,
              help="The leader's client endpoint (nvllm-launch prints it: tcp://HOST:PORT).")
@click.option("--host", default="127.0.0.1",
              help="HTTP bind address (loopback by default; any other needs --api-key).")
@click.option("--port", default=8000, type=int, help="HTTP port (0: any free port).")
@click.option("--model-name", default=None,
              help="Model name clients use (default: the leader's model path).")
@click.option("--api-key", default=None, envvar="NVLLM_API_KEY",
              help="Require 'Authorization: Bearer KEY' on /v1/*.")
@click.option("--tokenizer", default=None,
              help="Tokenizer path for chat templates and logprob tokens (default: the "
                   "leader's model path).")
@click.option("--curve-key-dir", default=None, envvar="NVLLM_CURVE_KEY_DIR",
              type=click.Path(exists=True, file_okay=False),
              help="CURVE keys for a leader started with --curve-key-dir: this folder's "
                   "server.key and client.key_secret (env NVLLM_CURVE_KEY_DIR).")
@click.option("--log-level", default="info",
              type=click.Choice(["debug", "info", "warning", "error"]))
def main(endpoint: str, host: str, port: int, model_name: str | None, api_key: str | None,
         tokenizer: str | None, curve_key_dir: str | None, log_level: str) -> None:
    """OpenAI-compatible HTTP server for a running nvllm engine."""
    try:
        check_http_host(host, api_key)
        if curve_key_dir:
            load_client_keys(curve_key_dir)  # fail here, not in the app's startup
    except (OSError, ValueError) as e:
        raise click.UsageError(str(e)) from None
    set_process_title("nvllm-http")
    if os.environ.get("NVLLM_PARENT_PID"):  # started by nvllm-launch: go when it goes
        die_with_parent(int(os.environ["NVLLM_PARENT_PID"]))
    import uvicorn

    logging.basicConfig(level=log_level.upper(),
                        format="%(asctime)s nvllm-serve %(levelname)s %(message)s")
    app = create_app(GatewayConfig(endpoint, model_name, api_key, tokenizer, curve_key_dir))
    sock = _bind(host, port)
    config = uvicorn.Config(app, log_level=log_level, access_log=log_level == "debug",
                            timeout_graceful_shutdown=5)
    server = uvicorn.Server(config)
    shown = f"[{host}]" if ":" in host else host
    click.echo(f"nvllm-serve on http://{shown}:{sock.getsockname()[1]} -> {endpoint}")
    sys.stdout.flush()
    server.run(sockets=[sock])


if __name__ == "__main__":
    main()
