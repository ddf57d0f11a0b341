"""Soak: many requests with random prompt/output lengths, random aborts and TTLs over many
client connections. Every request gets exactly one terminal message per completion, the
engine ends with every KV block free, and it still serves. NVLLM_SOAK_REQUESTS scales it
(the issue's full run is 2,000; CI runs 400)."""

from __future__ import annotations

import asyncio
import os
import random
import threading
import time

import pytest

from nvllm import LLM
from nvllm.common.client import AsyncClient
from nvllm.common.errors import NvllmError
from nvllm.leader.server import EngineServer

pytestmark = pytest.mark.e2e

NUM_REQUESTS = int(os.environ.get("NVLLM_SOAK_REQUESTS", "400"))
NUM_CONNECTIONS = 20


class Timeout(Exception):
    pass


async def aborted_job(endpoint: str, job: dict) -> tuple[int, int, list[str]]:
    """A job aborted after a few tokens, over its own DEALER speaking docs/protocol.md:
    (finals, errors, problems). It must end with exactly one terminal message (finish_reason
    "abort", unless it finished by itself first) and nothing after it, which a `health`
    round trip, answered after everything sent before it, makes observable."""
    import msgpack
    import zmq
    import zmq.asyncio

    ctx = zmq.asyncio.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    problems: list[str] = []

    async def send(msg: dict) -> None:
        await sock.send(msgpack.packb({"v": 1, **msg}, use_bin_type=True))

    async def recv() -> dict:
        """The next message other than a pong; pings every second while waiting (a silent
        client has its requests aborted)."""
        deadline = time.monotonic() + 120
        while True:
            if await sock.poll(1000):
                m = msgpack.unpackb(await sock.recv(), raw=False, strict_map_key=False)
                if m.get("op") != "pong":
                    return m
            elif time.monotonic() > deadline:
                raise Timeout("no message in 120 s")
            else:
                await send({"op": "ping"})

    finals = errors = n = 0
    try:
        await send({"op": "submit", "id": "a", "prompt_token_ids": job["prompt"],
                    "params": job["params"], "ttl_ms": job["ttl_ms"]})
        sent_abort = False
        while not (finals or errors):
            m = await recv()
            if m["op"] == "error":
                errors += 1
            elif m["op"] == "output":
                n += len(m["token_ids"])
                if m["finish_reason"] is not None:
                    finals += 1
                    if sent_abort and m["finish_reason"] not in ("abort", "length", "stop",
                                                                 "timeout"):
                        problems.append(f"finish_reason {m['finish_reason']}")
                    job["finish_reason"] = m["finish_reason"]
            if not sent_abort and n >= job["abort_after"] and not (finals or errors):
                await send({"op": "abort", "id": "a"})
                sent_abort = True
        await send({"op": "health"})
        while (m := await recv())["op"] != "health":
            problems.append(f"after the terminal message: {m}")
    finally:
        sock.close()
    return finals, errors, problems


async def one_connection(endpoint: str, jobs: list[dict], report: list) -> None:
    client = AsyncClient(endpoint, timeout_s=120)

    async def run(job: dict) -> None:
        t0 = time.monotonic()
        finals, errors, n, problems = 0, 0, 0, []
        try:
            if job["abort_after"] is not None:
                finals, errors, problems = await aborted_job(endpoint, job)
            else:
                async for d in client.stream(job["prompt"], job["params"],
                                             ttl_ms=job["ttl_ms"]):
                    n += len(d.token_ids)
                    finals += d.finish_reason is not None
        except (TimeoutError, asyncio.TimeoutError, Timeout) as e:  # a hang, not an answer
            problems.append(f"timed out: {e!r}")
        except NvllmError as e:  # the leader's error message is a terminal message too
            errors += 1
            job["error"] = repr(e)
        report.append((job, finals, errors, time.monotonic() - t0, problems))

    await asyncio.gather(*(run(j) for j in jobs))
    client.close()


def test_soak(tiny):
    rng = random.Random(0)
    llm = LLM(tiny("qwen3"), device="cpu", dtype="float32", num_kv_blocks=256, block_size=8,
              max_num_seqs=64, max_num_batched_tokens=512)
    server = EngineServer(llm.engine)
    stop = threading.Event()
    thread = threading.Thread(target=server.serve, args=(stop,), daemon=True)
    thread.start()
    try:
        jobs = []
        for i in range(NUM_REQUESTS):
            jobs.append({
                "prompt": [rng.randrange(3, 1000) for _ in range(rng.randint(1, 200))],
                "params": {"temperature": rng.choice([0.0, 0.8]), "seed": i,
                           "max_tokens": rng.randint(1, 64), "ignore_eos": rng.random() < 0.5},
                "ttl_ms": rng.choice([None, None, None, rng.randint(20, 2000)]),
                "abort_after": rng.choice([None, None, None, rng.randint(1, 10)]),
            })
        report: list = []
        t0 = time.monotonic()

        async def main() -> None:
            await asyncio.gather(*(one_connection(server.endpoint, jobs[k::NUM_CONNECTIONS],
                                                  report) for k in range(NUM_CONNECTIONS)))

        asyncio.run(main())
        wall = time.monotonic() - t0
        assert len(report) == NUM_REQUESTS
        for job, finals, errors, _, problems in report:
            assert not problems, (job, problems)
            # Exactly one terminal message: a final output, or an error.
            assert finals + errors == 1, (job, finals, errors)
        aborted = [j for j, *_ in report if j["abort_after"] is not None]
        assert sum(j.get("finish_reason") == "abort" for j in aborted) > len(aborted) // 2
        kv = llm.engine.kv
        deadline = time.monotonic() + 10
        while (llm.engine.requests or kv.num_free_blocks != kv.num_blocks) \
                and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not llm.engine.requests
        assert kv.num_free_blocks == kv.num_blocks
        assert all(b.ref_cnt == 0 for b in kv.pool.blocks)
        lat = sorted(r[3] for r in report)
        print(f"\nsoak: {NUM_REQUESTS} requests over {NUM_CONNECTIONS} connections in "
              f"{wall:.1f}s = {NUM_REQUESTS / wall:.1f} req/s; p50 {lat[len(lat) // 2]:.2f}s, "
              f"p99 {lat[int(len(lat) * 0.99)]:.2f}s")
        # Still serving afterwards.
        from nvllm.common.client import Client

        with Client(server.endpoint, timeout_s=60) as c:
            assert c.generate("still there?", {"max_tokens": 4}).finish_reason in (
                "length", "stop")
    finally:
        stop.set()
        thread.join(30)
        server.close()
        llm.shutdown()
