"""The gateway's ASGI app: state and leader connection (opened with the app), error
handlers, the request-counting middleware, ``/health``, ``/metrics``, ``/v1/models``, the
API key check on every route but ``/health``, the two generation routes
(``completions``, ``chat``), and the RL admin routes (``admin``)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from collections.abc import AsyncIterator

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response

from nvllm.common.client import AsyncClient
from nvllm.launch.openai import admin, chat, completions, tokenize
from nvllm.launch.openai.errors import ApiError, from_leader
from nvllm.launch.openai.metrics import PROMETHEUS_CONTENT_TYPE, CountRequests, gateway_metrics
from nvllm.launch.openai.state import CONTROL_TIMEOUT_S, GatewayConfig, GatewayState

__all__ = ["GatewayConfig", "GatewayState", "create_app"]

HEALTH_TIMEOUT_S = 2.0
logger = logging.getLogger("nvllm.gateway")


def _add_error_handlers(app: FastAPI) -> None:
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


def _key_check(state: GatewayState):
    """The dependency that requires the API key, when there is one."""

    async def check_key(request: Request) -> None:
        if state.cfg.api_key is None:
            return
        auth = request.headers.get("authorization", "")
        scheme, _, token = auth.partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(
                token.strip().encode(), state.cfg.api_key.encode()):
            raise ApiError(401, "missing or wrong API key (send Authorization: Bearer KEY)",
                           code="invalid_api_key")

    return Depends(check_key)


def _v1_router(state: GatewayState) -> APIRouter:
    """/v1/*: behind the API key when there is one."""
    v1 = APIRouter(prefix="/v1", dependencies=[_key_check(state)])

    @v1.get("/models")
    async def models() -> dict:
        info = await state.info()
        return {"object": "list", "data": [{
            "id": await state.served_name(), "object": "model", "created": 0,
            "owned_by": "nvllm", "root": str(info.get("model")),
            "max_model_len": info.get("max_model_len")}]}

    v1.include_router(completions.router)
    v1.include_router(chat.router)
    return v1


def _add_health_and_metrics(app: FastAPI, state: GatewayState) -> None:
    """/health answers every caller, so it says only ok or unavailable (the reason goes to
    the log); /metrics needs the API key like /v1."""
    requests_total, latency, gateway_metrics_text = gateway_metrics()
    app.add_middleware(CountRequests, requests=requests_total, latency=latency)
    endpoint = state.cfg.endpoint
    last_reason: list[str | None] = [None]

    @app.get("/health")
    async def health() -> Response:
        try:
            h = await asyncio.wait_for(state.client.health(), HEALTH_TIMEOUT_S)
            reason = None if h.get("ready") else f"engine not ready: {h.get('reason')}"
        except (asyncio.TimeoutError, TimeoutError):
            reason = f"no answer from {endpoint}"
        except Exception as e:
            reason = f"{type(e).__name__}: {e}"
        if reason != last_reason[0]:  # log changes, not every probe
            if reason is not None:
                logger.warning("health: unavailable: %s", reason)
            last_reason[0] = reason
        if reason is None:
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "unavailable"}, 503)

    @app.get("/metrics", dependencies=[_key_check(state)])
    async def metrics() -> Response:
        try:
            text = await asyncio.wait_for(state.client.metrics(), CONTROL_TIMEOUT_S)
        except (asyncio.TimeoutError, TimeoutError):
            raise ApiError(503, f"no metrics from {endpoint}", code="engine_unavailable",
                           type_="server_error") from None
        except Exception as e:
            raise from_leader(e) from e
        if text and not text.endswith("\n"):
            text += "\n"
        body = text.encode() + gateway_metrics_text()
        return Response(body, media_type=PROMETHEUS_CONTENT_TYPE,
                        headers={"content-type": PROMETHEUS_CONTENT_TYPE})


def create_app(cfg: GatewayConfig) -> FastAPI:
    """The gateway's ASGI app; the leader connection opens at startup."""
    state = GatewayState(cfg)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state.client = AsyncClient(cfg.endpoint, curve_key_dir=cfg.curve_key_dir,
                                   trace=state.trace)
        try:
            yield
        finally:
            state.client.close()
            if state.trace is not None:
                state.trace.flush()
            state.render_pool.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="nvllm OpenAI-compatible gateway", lifespan=lifespan)
    app.state.gateway = state
    _add_health_and_metrics(app, state)
    _add_error_handlers(app)
    app.include_router(_v1_router(state))
    # vLLM serves these at the root, not under /v1.
    app.include_router(tokenize.router, dependencies=[_key_check(state)])
    # RL admin routes (pause, resume, sleep, wake_up, weight_info), at the root as vLLM's.
    app.include_router(admin.router, dependencies=[_key_check(state)])
    return app
