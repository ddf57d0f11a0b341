"""The gateway's own Prometheus series (requests by route and status, time to the start of
each response), counted by a pure ASGI middleware and appended to the leader's /metrics."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

PROMETHEUS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_ROUTES = {"/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics"}


def gateway_metrics() -> tuple[Any, Any, Callable[[], bytes]]:
    """(requests counter, latency histogram, their exposition text) in a private registry."""
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


class CountRequests:
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
