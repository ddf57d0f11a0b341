"""vLLM's sleep, wake_up and is_sleeping over the client wire: mixins of ``nvllm.Client``
and ``nvllm.AsyncClient`` (nvllm/common/client.py), which send the messages and raise on
an ``error`` answer (``bad_state``: a ClientError saying why the engine cannot now)."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from nvllm.common import client_protocol as cp
from nvllm.common.sleep_mode import SleepReport

if TYPE_CHECKING:
    from nvllm.common.client import AsyncClient, Client

_REPORT_FIELDS = [f.name for f in dataclasses.fields(SleepReport)]


def _report(answer: dict[str, Any]) -> SleepReport:
    return SleepReport(**{k: answer[k] for k in _REPORT_FIELDS})


class SleepClient:
    """Client's sleep and wake (see LLM.sleep / LLM.wake_up for the semantics)."""

    def sleep(self: Client, level: int = 1, mode: str = "abort") -> SleepReport:
        """Returns once every rank freed its memory (for "wait": after the running
        requests finished), with the bytes freed."""
        return _report(self._request(cp.Sleep(level=level, mode=mode), cp.Slept))

    def wake_up(self: Client, tags: list[str] | None = None) -> SleepReport:
        return _report(self._request(cp.WakeUp(tags=tags), cp.WokeUp))

    def is_sleeping(self: Client) -> bool:
        return self.engine_state()["is_sleeping"]

    def engine_state(self: Client) -> dict[str, Any]:
        """is_sleeping, is_paused, level, asleep, weights_missing, weight_version."""
        return self._request(cp.StateRequest(), cp.EngineState)

    def get_weight_version(self: Client) -> int | str | None:
        return self.engine_state()["weight_version"]


class AsyncSleepClient:
    """AsyncClient's, as Client's."""

    async def sleep(self: AsyncClient, level: int = 1, mode: str = "abort") -> SleepReport:
        return _report(await self._request(cp.Sleep(level=level, mode=mode)))

    async def wake_up(self: AsyncClient, tags: list[str] | None = None) -> SleepReport:
        return _report(await self._request(cp.WakeUp(tags=tags)))

    async def is_sleeping(self: AsyncClient) -> bool:
        return (await self.engine_state())["is_sleeping"]

    async def engine_state(self: AsyncClient) -> dict[str, Any]:
        return await self._request(cp.StateRequest())

    async def get_weight_version(self: AsyncClient) -> int | str | None:
        return (await self.engine_state())["weight_version"]
