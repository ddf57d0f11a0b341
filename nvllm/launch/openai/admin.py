"""The RL admin routes, with vLLM's paths and query parameters (its dev-mode ``/pause``,
``/resume``, ``/is_paused``, ``/sleep``, ``/wake_up``, ``/is_sleeping`` and
``/weight_info``), each one leader call through the gateway's AsyncClient
(docs/rl.md). They sit behind the API key like ``/v1`` (create_app).

Every parameter is a query parameter, checked here before anything reaches the leader:
a known name, a value from a short list, each given at most once (``tags`` at most once
per tag); anything else is a 400 naming the parameter. A call the engine's state does
not allow now (sleeping twice, resuming while asleep, ...) is a 409 saying why.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from nvllm.common.client import ClientError
from nvllm.common.sleep_mode import PAUSE_MODES, WAKE_TAGS
from nvllm.launch.openai.errors import ApiError, from_leader
from nvllm.launch.openai.state import GatewayState

router = APIRouter()

MAX_VALUE_CHARS = 16  # the longest value any parameter here takes is "scheduling"
_BOOLS = {"true": True, "1": True, "false": False, "0": False}


def _params(request: Request, allowed: dict[str, tuple[str, ...] | None],
            repeat: tuple[str, ...] = ()) -> dict[str, list[str]]:
    """The query parameters, each a known name with known values (None: booleans);
    only the names in `repeat` may come more than once, never the same value twice."""
    q = request.query_params
    out: dict[str, list[str]] = {}
    for name in q:
        if name not in allowed:
            raise ApiError(400, f"unknown parameter {name[:MAX_VALUE_CHARS]!r}: "
                                f"{request.url.path} takes {sorted(allowed) or 'none'}",
                           param=name[:MAX_VALUE_CHARS], code="unknown_parameter")
    for name, values in allowed.items():
        got = q.getlist(name)
        most = len(values or ()) if name in repeat else 1
        if len(got) > most or len(set(got)) < len(got):
            raise ApiError(400, f"{name}: given {len(got)} times (at most {most}, each "
                                "value once)", param=name, code="invalid_value")
        for v in got:
            ok = v.lower() in _BOOLS if values is None else v in values
            if not ok:
                want = "true or false" if values is None else " | ".join(values)
                raise ApiError(400, f"{name}: {v[:MAX_VALUE_CHARS]!r} is not one of "
                                    f"{want}", param=name, code="invalid_value")
        if got:
            out[name] = got
    return out


async def _call(coro: Any) -> Any:
    try:
        return await coro
    except ClientError as e:
        if e.code in ("bad_state", "resumed"):
            raise ApiError(409, e.message, code=e.code) from None
        raise from_leader(e) from e
    except Exception as e:
        raise from_leader(e) from e


def _state(request: Request) -> GatewayState:
    return request.app.state.gateway


@router.post("/pause")
async def pause(request: Request) -> dict:
    """vLLM's pause_generation: mode (abort | wait | keep, default abort) and
    clear_cache (default true); answers once paused (wait: once the running finished)."""
    p = _params(request, {"mode": PAUSE_MODES, "clear_cache": None})
    mode = p.get("mode", ["abort"])[0]
    clear = _BOOLS[p.get("clear_cache", ["true"])[0].lower()]
    await _call(_state(request).client.pause_generation(mode, clear))
    return {"status": "paused"}


@router.post("/resume")
async def resume(request: Request) -> dict:
    _params(request, {})
    await _call(_state(request).client.resume_generation())
    return {"status": "resumed"}


@router.get("/is_paused")
async def is_paused(request: Request) -> dict:
    _params(request, {})
    return {"is_paused": (await _call(_state(request).client.engine_state()))["is_paused"]}


@router.post("/sleep")
async def sleep(request: Request) -> dict:
    """level (1 | 2, default 1) and mode (as /pause's); answers the bytes freed."""
    p = _params(request, {"level": ("1", "2"), "mode": PAUSE_MODES})
    report = await _call(_state(request).client.sleep(int(p.get("level", ["1"])[0]),
                                                      p.get("mode", ["abort"])[0]))
    return report.to_dict()


@router.post("/wake_up")
async def wake_up(request: Request) -> dict:
    """tags (weights, kv_cache, scheduling; repeat the parameter; none: all); answers
    the bytes allocated again."""
    p = _params(request, {"tags": WAKE_TAGS}, repeat=("tags",))
    return (await _call(_state(request).client.wake_up(p.get("tags")))).to_dict()


@router.get("/is_sleeping")
async def is_sleeping(request: Request) -> dict:
    _params(request, {})
    return {"is_sleeping": (await _call(_state(request).client.engine_state()))[
        "is_sleeping"]}


@router.get("/weight_info")
async def weight_info(request: Request) -> dict:
    """The weight_version in force (null until the first update)."""
    _params(request, {})
    return {"weight_version": (await _call(_state(request).client.engine_state()))[
        "weight_version"]}
