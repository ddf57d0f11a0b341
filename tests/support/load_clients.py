"""Load clients, run as processes by e2e load tests (python load_clients.py KIND ...):
each prints one JSON line, a list of [request index, finals, tokens, error] per request.

  zmq  ENDPOINT FIRST COUNT MAX_TOKENS   COUNT concurrent streams over one AsyncClient
  http BASE FIRST COUNT MAX_TOKENS       COUNT concurrent SSE streams of /v1/completions
"""

from __future__ import annotations

import asyncio
import json
import sys


async def zmq_streams(endpoint: str, first: int, count: int, max_tokens: int) -> list:
    from nvllm.common.client import AsyncClient

    c = AsyncClient(endpoint, timeout_s=300)  # per message: a lost one fails
    params = {"temperature": 0, "max_tokens": max_tokens, "ignore_eos": True}

    async def one(i: int) -> list:
        finals = tokens = 0
        error = None
        try:
            async for d in c.stream([3 + i % 997, 5, 7 + i % 13], params):
                tokens += len(d.token_ids)
                finals += d.finish_reason is not None
        except Exception as e:  # an error message is a terminal message too: count it
            error = repr(e)
        return [i, finals, tokens, error]

    try:
        return await asyncio.gather(*(one(i) for i in range(first, first + count)))
    finally:
        c.close()


async def http_streams(base: str, first: int, count: int, max_tokens: int) -> list:
    import httpx

    limits = httpx.Limits(max_connections=count, max_keepalive_connections=count)
    async with httpx.AsyncClient(base_url=base, timeout=600, limits=limits) as http:
        async def one(i: int) -> list:
            finals = tokens = done = 0
            error = None
            body = {"prompt": [3 + i % 997, 5, 7], "max_tokens": max_tokens,
                    "temperature": 0, "ignore_eos": True, "stream": True,
                    "stream_options": {"include_usage": True}}
            try:
                async with http.stream("POST", "/v1/completions", json=body) as r:
                    if r.status_code != 200:
                        return [i, 0, 0, f"HTTP {r.status_code}: {await r.aread()!r}"]
                    async for line in r.aiter_lines():
                        if not line.startswith("data: "):
                            continue
                        if line == "data: [DONE]":
                            done += 1
                            continue
                        chunk = json.loads(line[6:])
                        if "error" in chunk:
                            error = json.dumps(chunk["error"])
                        if chunk.get("usage"):  # the last chunk: tokens of every choice
                            tokens += chunk["usage"]["completion_tokens"]
                        for ch in chunk.get("choices", []):
                            finals += ch.get("finish_reason") is not None
            except Exception as e:
                error = repr(e)
            if done != 1 and error is None:
                error = f"{done} [DONE] lines"
            return [i, finals, tokens, error]

        return await asyncio.gather(*(one(i) for i in range(first, first + count)))


if __name__ == "__main__":
    kind, where, first, count, max_tokens = sys.argv[1:6]
    run = zmq_streams if kind == "zmq" else http_streams
    print(json.dumps(asyncio.run(run(where, int(first), int(count), int(max_tokens)))))
