"""The RL admin routes, with vLLM's paths and query parameters (its dev-mode ``/pause``,
``/resume``, ``/is_paused``, ``/sleep``, ``/wake_up``, ``/is_sleeping`` and
``/weight_info``) and SGLang's weight-update routes (``/init_weight_update_group``,
``/update_weights_from_distributed``, ``/update_weights_from_path`` alias
``/update_weights_from_disk``, JSON bodies), each one leader call through the gateway's
AsyncClient (docs/rl.md). They sit behind the API key like ``/v1`` (create_app).

Every parameter is a query parameter, checked here before anything reaches the leader:
a known name, a value from a short list, each given at most once (``tags`` at most once
per tag); anything else is a 400 naming the parameter. A call the engine's state does
not allow now (sleeping twice, resuming while asleep, ...) is a 409 saying why.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal, TypeVar

import msgspec
from fastapi import APIRouter, Request
from msgspec import Meta

from nvllm.common import client_limits as cl
from nvllm.common import weight_transfer as wt
from nvllm.common.client import ClientError
from nvllm.common.client_limits import INT64_MAX, Int64
from nvllm.common.sleep_mode import PAUSE_MODES, WAKE_TAGS
from nvllm.common.weight_transfer import WeightUpdateError
from nvllm.launch.openai.body import read_body
from nvllm.launch.openai.errors import ApiError, from_leader
from nvllm.launch.openai.state import GatewayState

router = APIRouter()
T = TypeVar("T")

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
        if e.code == "bad_op":  # a router refuses the process-group messages, saying why
            raise ApiError(400, e.message, code=e.code) from None
        raise from_leader(e) from e
    except WeightUpdateError as e:  # the update was refused, nothing changed
        raise ApiError(400, str(e), code="weights_refused") from None
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


# The weight-update routes (SGLang's names and JSON bodies): each body decodes into a
# bounded type (the bounds of nvllm/common/client_limits.py, as the leader's decoder), so
# a malformed or oversized field is a 400 naming it before anything reaches the leader.
_name = Annotated[str, Meta(min_length=1, max_length=wt.MAX_WEIGHT_NAME_CHARS)]
_dim = Annotated[int, Meta(ge=0, le=INT64_MAX)]
_many = Meta(max_length=cl.MAX_TENSORS_PER_UPDATE)
_Version = Int64 | Annotated[str, Meta(max_length=wt.WEIGHT_VERSION_MAX_CHARS)] | None


class InitWeightUpdateGroupBody(msgspec.Struct, forbid_unknown_fields=True):
    master_address: Annotated[str, Meta(min_length=1, max_length=cl.MAX_MASTER_ADDRESS_CHARS)]
    master_port: Annotated[int, Meta(ge=cl.MIN_PORT, le=cl.MAX_PORT)]
    rank_offset: Annotated[int, Meta(ge=1, le=cl.MAX_GROUP_WORLD_SIZE - 1)]
    world_size: Annotated[int, Meta(ge=2, le=cl.MAX_GROUP_WORLD_SIZE)]
    group_name: Annotated[str, Meta(min_length=1, max_length=cl.MAX_GROUP_NAME_CHARS)] = \
        "weight_update_group"
    backend: Literal["gloo", "nccl"] | None = None
    timeout_s: Annotated[float, Meta(gt=0, le=cl.MAX_GROUP_TIMEOUT_S)] = 60.0


class UpdateWeightsFromDistributedBody(msgspec.Struct, forbid_unknown_fields=True):
    names: Annotated[list[_name], _many]  # type: ignore[valid-type]
    dtypes: Annotated[list[Literal["float32", "float16", "bfloat16"]], _many]
    shapes: Annotated[list[Annotated[list[_dim], Meta(  # type: ignore[valid-type]
        max_length=cl.MAX_TENSOR_DIMS)]], _many]
    weight_version: _Version = None


class UpdateWeightsFromPathBody(msgspec.Struct, forbid_unknown_fields=True):
    """`path`, or SGLang's /update_weights_from_disk name for it, `model_path`."""

    path: Annotated[str, Meta(min_length=1, max_length=cl.MAX_PATH_CHARS)] | None = None
    model_path: Annotated[str, Meta(min_length=1, max_length=cl.MAX_PATH_CHARS)] | None = None
    weight_version: _Version = None


_FIELD = re.compile(r"`\$\.([A-Za-z_]+)|field `([A-Za-z_]+)`")
_MAX_BODY_BYTES = cl.MAX_TENSORS_PER_UPDATE * (wt.MAX_WEIGHT_NAME_CHARS + 200)


async def _body(request: Request, kind: type[T]) -> T:
    """The JSON body as `kind`; a 400 naming the first field that does not fit."""
    _params(request, {})
    raw = await read_body(request, min(_state(request).cfg.max_body_bytes, _MAX_BODY_BYTES))
    try:
        return msgspec.json.decode(raw or b"{}", type=kind)
    except msgspec.ValidationError as e:
        m = _FIELD.search(str(e))
        field = (m.group(1) or m.group(2))[:MAX_VALUE_CHARS * 2] if m else None
        raise ApiError(400, str(e)[:300], param=field, code="invalid_value") from None
    except msgspec.DecodeError as e:
        raise ApiError(400, f"the body is not a JSON object: {str(e)[:200]}",
                       code="invalid_json") from None


@router.post("/init_weight_update_group")
async def init_weight_update_group(request: Request) -> dict:
    """Join a trainer's weight-update process group (rank 0 is the trainer); answers once
    every worker joined."""
    b = await _body(request, InitWeightUpdateGroupBody)
    await _call(_state(request).client.init_weight_update_group(
        b.master_address, b.master_port, b.rank_offset, b.world_size, b.group_name,
        b.backend, b.timeout_s))
    return {"success": True, "message": f"joined {b.group_name}"}


@router.post("/update_weights_from_distributed")
async def update_weights_from_distributed(request: Request) -> dict:
    """Receive the tensors the trainer broadcasts over the group (in this order) and
    commit them; generation must be paused."""
    b = await _body(request, UpdateWeightsFromDistributedBody)
    if not len(b.names) == len(b.dtypes) == len(b.shapes):
        raise ApiError(400, "names, dtypes and shapes need one entry per tensor",
                       param="names", code="invalid_value")
    version = await _call(_state(request).client.update_weights_from_distributed(
        b.names, b.dtypes, b.shapes, b.weight_version))
    return {"success": True, "weight_version": version}


@router.post("/update_weights_from_path")
@router.post("/update_weights_from_disk")
async def update_weights_from_path(request: Request) -> dict:
    """Load a checkpoint folder on the workers' hosts; generation must be paused."""
    b = await _body(request, UpdateWeightsFromPathBody)
    if (b.path is None) == (b.model_path is None):
        raise ApiError(400, "give the checkpoint folder as exactly one of path or "
                            "model_path", param="path", code="invalid_value")
    version = await _call(_state(request).client.update_weights_from_path(
        b.path or b.model_path, b.weight_version))
    return {"success": True, "weight_version": version}
