"""Running one HTTP request's leader requests: one per prompt (``n`` completions each),
pumped concurrently into one stream of ``(prompt index, delta)``; watching the HTTP
connection meanwhile so that a client that goes away aborts them; collecting whole
completions and their usage for non-streaming replies."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fastapi import Request

from nvllm.common.client import AsyncClient
from nvllm.common.outputs import CompletionAccumulator, CompletionDelta
from nvllm.launch.openai.errors import from_leader

DISCONNECT_POLL_S = 0.25
MAX_PENDING_DELTAS = 256  # per HTTP request, between the leader and the HTTP response

# Tasks the gateway starts and does not await (leader-request pumps); a strong reference
# keeps them from being garbage-collected mid-flight.
_BACKGROUND: set[asyncio.Task] = set()


@dataclass
class Job:
    """One leader request: a prompt (text or token ids) and its SamplingParams map."""

    prompt: str | list[int]
    params: dict
    priority: int = 0
    ttl_ms: int | None = None
    routing_key: str | None = None  # the OpenAI user: one replica per user (router)


class Fanout:
    """One leader request per prompt, pumped concurrently by background tasks into one
    queue. ``cancel()`` cancels the pumps; cancelling a pump closes its
    ``AsyncClient.stream``, whose ``finally`` sends ``abort`` to the leader. The pumps are
    plain asyncio tasks, outside the HTTP handler's (anyio) cancel scope, so that abort is
    sent even while the handler itself is being cancelled."""

    def __init__(self, client: AsyncClient, jobs: list[Job]) -> None:
        self.client = client
        self.queue: asyncio.Queue = asyncio.Queue()
        # Deltas taken from the leader but not yet by the HTTP side. A slow HTTP reader
        # stops its pumps here, its messages pile up in the AsyncClient, and past the
        # client's max_buffered only its request is aborted: the gateway keeps reading.
        self._room = asyncio.Semaphore(MAX_PENDING_DELTAS)
        self._buffer: deque = deque()
        self._open = len(jobs)
        self._cancelled = False
        self.tasks = [asyncio.create_task(self._pump(i, j)) for i, j in enumerate(jobs)]
        for t in self.tasks:
            _BACKGROUND.add(t)
            t.add_done_callback(_BACKGROUND.discard)

    async def _pump(self, i: int, job: Job) -> None:
        stream = self.client.stream(job.prompt, job.params, priority=job.priority,
                                    ttl_ms=job.ttl_ms, routing_key=job.routing_key)
        try:
            async for d in stream:
                if self._cancelled:
                    break
                await self._room.acquire()
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

    def __aiter__(self) -> Fanout:
        return self

    async def __anext__(self) -> tuple[int, CompletionDelta]:
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
                self._room.release()
                return i, item


class Disconnected(Exception):
    """The HTTP client went away while its leader requests ran (answered with 499)."""


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
                raise Disconnected()
    except asyncio.CancelledError:
        on_disconnect()
        task.cancel()
        raise


async def await_leader(request: Request, fan: Fanout, aw: Any) -> Any:
    """Await leader work for `fan` while watching the HTTP connection: a hang-up cancels
    the fan-out (raises Disconnected); a leader error cancels it and becomes an ApiError."""
    try:
        return await _unless_disconnected(request, aw, fan.cancel)
    except Disconnected:
        raise
    except Exception as e:
        fan.cancel()
        raise from_leader(e) from e


async def start(request: Request, client: AsyncClient, jobs: list[Job]) -> Fanout:
    """Submit `jobs` and wait for every one's first answer (see ``Fanout.first``)."""
    fan = Fanout(client, jobs)
    await await_leader(request, fan, fan.first())
    return fan


async def collect(fan: Fanout) -> dict[tuple[int, int], CompletionAccumulator]:
    """Every completion whole, by (prompt index, completion index)."""
    accs: dict[tuple[int, int], CompletionAccumulator] = {}
    async for i, d in fan:
        accs.setdefault((i, d.index), CompletionAccumulator(d.index)).add(d)
    return accs


def usage(finals: dict[tuple[int, int], CompletionAccumulator | CompletionDelta]) -> dict:
    """prompt tokens once per prompt (each completion's final message repeats them),
    completion tokens summed over completions."""
    prompt: dict[int, int] = {}
    cached: dict[int, int] = {}
    completion = 0
    for (i, _), a in finals.items():
        u = a.usage or {}
        prompt[i] = int(u.get("prompt_tokens", 0))
        cached[i] = int(u.get("cached_tokens", 0) or 0)
        ntok = len(a.token_ids) if isinstance(a, CompletionAccumulator) else 0
        completion += int(u.get("completion_tokens", ntok))
    p = sum(prompt.values())
    return {"prompt_tokens": p, "completion_tokens": completion, "total_tokens": p + completion,
            "prompt_tokens_details": {"cached_tokens": sum(cached.values())}}
