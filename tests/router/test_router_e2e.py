"""nvllm-launch --data-parallel-size 2 (two tiny replicas at tp 1 on the CPU behind its
router), and in-process routers with other policies over the same replicas: a
multi-tenant workload's cached-prompt fraction with cache_aware against round_robin,
greedy output equal to one engine's, identical prompts spread by load, sticky keys,
control messages, a replica whose leader goes away (its requests resumed on the other,
the replica restarted), a router that goes away (restarted without the replicas), and a
clean SIGINT."""

from __future__ import annotations

import asyncio
import os
import random
import re
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
from fake_leader import StallingLeader
from routers import start_router, stop_router, wait_for
from subproc import free_port, read_until, stop_process, wait_healthy

from nvllm import AsyncClient, Client
from nvllm.common.errors import EngineDeadError
from nvllm.router.policy import CacheAwareConfig

pytestmark = pytest.mark.e2e

TENANTS, PER_TENANT, SYSTEM_LEN, QUESTION_LEN = 5, 4, 400, 12
GREEDY = {"temperature": 0.0, "max_tokens": 4, "ignore_eos": True}
# 90 blocks of 16: about three tenants' prefixes (and what runs) per replica, so a
# replica that sees all five (round-robin) evicts each before its next use.
KV_BLOCKS = 90


@pytest.fixture(scope="module")
def launched(tiny):
    """nvllm-launch --data-parallel-size 2: its router's endpoint and pid, its replicas'
    own endpoints (for in-process routers with other policies) and pids."""
    http_port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "nvllm.launch.cli", "--model", tiny("qwen3"),
         "--data-parallel-size", "2", "--tp", "1", "--device", "cpu", "--dtype", "float32",
         "--num-kv-blocks", str(KV_BLOCKS), "--client-timeout-s", "5",
         "--router-policy", "cache_aware", "--http-port", str(http_port)],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        text = read_until(proc, r"serving on tcp://", 300)
        text += proc.stdout.readline()  # the replicas, printed right after
        assert "HTTP gateway" in proc.stdout.readline()  # ... and the gateway
        m = re.search(r"2 replicas \(pids \[(\d+), (\d+)\]\) at \['(\S+)', '(\S+)'\]", text)
        assert m is not None, text
        yield SimpleNamespace(proc=proc, pids=[int(m[1]), int(m[2])],
                              router_pid=int(re.search(r"router pid (\d+)", text)[1]),
                              replicas=[m[3], m[4]], http=f"http://127.0.0.1:{http_port}",
                              endpoint=re.search(r"serving on (tcp://\S+);", text)[1])
    finally:
        stop_process(proc, signal.SIGKILL)


@pytest.fixture
def routed(launched):
    """An in-process router with another policy, over the launched replicas."""
    started: list[SimpleNamespace] = []

    def start(policy: str, **kw) -> SimpleNamespace:
        started.append(start_router(launched.replicas, policy, **kw))
        return started[-1]

    yield start
    for r in started:
        stop_router(r)


def workload(seed: int) -> list[list[int]]:
    """Tenants' requests interleaved (t0, t1, ..., t4, t0, ...): each prompt is its
    tenant's system prompt and a question of its own."""
    rng = random.Random(seed)
    systems = [[rng.randrange(3, 1000) for _ in range(SYSTEM_LEN)] for _ in range(TENANTS)]
    return [s + [rng.randrange(3, 1000) for _ in range(QUESTION_LEN)]
            for _ in range(PER_TENANT) for s in systems]


async def run_all(endpoint: str, prompts, concurrency: int, **kw) -> list:
    """Every prompt through one AsyncClient, `concurrency` at a time, in order."""
    client = AsyncClient(endpoint, timeout_s=120)
    sem = asyncio.Semaphore(concurrency)

    async def one(p):
        async with sem:
            return await client.generate(p, GREEDY, **kw)

    try:
        return await asyncio.gather(*(one(p) for p in prompts))
    finally:
        client.close()


def cached_fraction(outs) -> float:
    """Cached prompt tokens over what an ideal router would cache: every request's prefix
    but each tenant's first."""
    ideal = (len(outs) - TENANTS) * SYSTEM_LEN
    return sum(o.num_cached_tokens for o in outs) / ideal


def test_cache_aware_keeps_tenants_cached_and_output_matches_one_engine(launched, routed):
    rr_prompts, ca_prompts = workload(1), workload(2)  # fresh prefixes for each policy
    rr = asyncio.run(run_all(routed("round_robin").endpoint, rr_prompts, TENANTS))
    ca = asyncio.run(run_all(launched.endpoint, ca_prompts, TENANTS))  # the launch's router
    rr_frac, ca_frac = cached_fraction(rr), cached_fraction(ca)
    print(f"cached fraction: cache_aware {ca_frac:.2f}, round_robin {rr_frac:.2f}")
    assert ca_frac >= 0.8 and ca_frac >= 1.5 * rr_frac
    ref = asyncio.run(run_all(launched.replicas[0], rr_prompts + ca_prompts, 8))
    assert [o.outputs[0].token_ids for o in rr + ca] == [o.outputs[0].token_ids for o in ref]


def test_identical_prompts_spread_over_both_replicas(routed):
    r = routed("cache_aware", cache_aware=CacheAwareConfig(balance_abs_threshold=4))
    prompt = workload(3)[0]
    outs = asyncio.run(run_all(r.endpoint, [prompt] * 32, 32))
    assert len({tuple(o.outputs[0].token_ids) for o in outs}) == 1
    assert r.router.decisions["load_override"] > 0
    per = [r.router.routed_to[i] for i in range(2)]
    assert sum(per) == 32 and max(per) <= 0.75 * 32, per


def test_a_routing_key_sticks_and_control_messages_answer_for_all(launched):
    with Client(launched.endpoint, timeout_s=60) as c:
        before = c.metrics()
        for _ in range(4):
            c.generate([5, 6, 7], GREEDY, routing_key="tenant-a")
        info = c.info()
        assert info["ready"] and info["kv_capacity_tokens"] == 2 * KV_BLOCKS * 16
        assert c.health() == {"op": "health", "ready": True}
        text = c.metrics()
    sticky = 'nvllm_router:requests_routed_total{policy="cache_aware",decision="sticky"}'
    assert metric(text, sticky) - metric(before, sticky) == 3
    assert text.count("# TYPE nvllm:prompt_tokens_total counter") == 1
    assert 'replica="0"' in text and 'replica="1"' in text


def test_the_http_gateway_serves_through_the_router(launched):
    """The gateway attaches to the router unchanged; one OpenAI user's requests stay on
    one replica, so the second finds the first's prefix cached."""
    import httpx

    wait_healthy(launched.http, launched.proc, 60)
    prompt = workload(4)[0]
    body = {"prompt": prompt, "max_tokens": 2, "temperature": 0, "user": "carol"}
    usage = [httpx.post(f"{launched.http}/v1/completions", json=body, timeout=60).json()
             ["usage"] for _ in range(2)]
    assert usage[0]["prompt_tokens_details"]["cached_tokens"] == 0
    assert usage[1]["prompt_tokens_details"]["cached_tokens"] >= SYSTEM_LEN


def test_a_lost_replicas_request_resumes_on_the_other(launched):
    """Replica 0 (a fake) streams one token and its leader goes away: the request resumes
    on replica 1 (real) from that token, ends once after max_tokens in all, and the
    router routes nothing more to replica 0."""
    dying = StallingLeader()
    r = start_router([dying.endpoint, launched.replicas[0]], "round_robin")
    try:
        with Client(r.endpoint, timeout_s=60) as c:
            stream = c.stream([9] * 20, GREEDY)
            assert next(stream).token_ids == [5]
            dying.die()
            rest = list(stream)
            assert [d.finish_reason for d in rest][-1] == "length"
            assert sum(len(d.token_ids) for d in rest) == 3
            assert (r.router.replayed, r.router.failed_by_replica_loss) == ({0: 1}, {})
            assert c.health()["reason"].startswith("1 of 2 replicas up (replica 0: ")
            outs = [c.generate([1, 2, 3], GREEDY) for _ in range(3)]
            assert all(len(o.outputs[0].token_ids) == 4 for o in outs)
            assert r.router.decisions["round_robin"] == 4
            wait_for(lambda: r.router.links[1].load == 0)
    finally:
        stop_router(r)


def test_a_killed_router_comes_back_on_its_port_and_the_replicas_stay(launched, procs):
    """SIGKILL the router with a request in flight: its client fails it once the
    connection is gone past LINK_GRACE_S, the launcher starts the router again on its
    port after that, and the same client's next requests are served by the same
    replicas (their processes untouched)."""
    with Client(launched.endpoint, timeout_s=60) as c:
        stream = c.stream([60] * 8, {"temperature": 0.0, "max_tokens": 400,
                                     "ignore_eos": True})
        next(stream)
        os.kill(launched.router_pid, signal.SIGKILL)
        # Lost past the grace, or (on a loaded machine, where the grace can outlast the
        # launcher's restart delay) answered by a router with a new boot id.
        with pytest.raises(EngineDeadError, match="lost the connection|restarted"):
            list(stream)
        deadline = time.monotonic() + 60
        while True:
            try:
                out = c.generate([1, 2, 3], GREEDY)
                break
            except EngineDeadError:  # not back yet, or back with no replica up yet
                assert time.monotonic() < deadline, "the router did not come back"
                time.sleep(0.5)
        assert len(out.outputs[0].token_ids) == 4
        assert c.health() == {"op": "health", "ready": True}
    assert all(procs.pid_alive(p) for p in launched.pids)


def test_a_sigkilled_replica_is_replayed_restarted_and_everything_stops(launched, procs):
    """SIGKILL replica 1's leader while several greedy streams run on both: each stream
    ends exactly once, its tokens and text equal one engine's (no token or character
    repeated or missing); the launcher removes what the dead replica left in /dev/shm and
    starts it again on its port, the router routes to it again; SIGINT then stops every
    process, the restarted ones too."""
    workers = [w for pid in launched.pids for w in procs.worker_pids_of(pid)]
    assert len(workers) == 2
    long = {"temperature": 0.0, "max_tokens": 120, "ignore_eos": True}
    prompts = [[50 + k] * 8 for k in range(6)]

    async def load() -> list:
        client = AsyncClient(launched.endpoint, timeout_s=120)
        started = [asyncio.Event() for _ in prompts]

        async def one(k: int):
            ids, text, ends = [], "", []
            try:
                async for d in client.stream(prompts[k], long):
                    started[k].set()
                    ids += d.token_ids
                    text += d.text
                    if d.finish_reason is not None:
                        ends.append(d.finish_reason)
            except EngineDeadError as e:
                ends.append(str(e))
            return ids, text, ends

        tasks = [asyncio.create_task(one(k)) for k in range(len(prompts))]
        for e in started:  # every stream has shown tokens: those on replica 1 resume
            await e.wait()
        os.kill(launched.pids[1], signal.SIGKILL)
        try:
            return await asyncio.gather(*tasks)
        finally:
            client.close()

    got = asyncio.run(load())
    assert all(ends == ["length"] for _, _, ends in got), [e for _, _, e in got]
    with Client(launched.replicas[0], timeout_s=60) as one_engine:
        ref = [one_engine.generate(p, long).outputs[0] for p in prompts]
    assert [(ids, text) for ids, text, _ in got] == [(o.token_ids, o.text) for o in ref]
    deadline = time.monotonic() + 20
    while any(procs.pid_alive(w) for w in workers[1:]) or owned_segments(
            [launched.pids[1], workers[1]]):
        assert time.monotonic() < deadline, "the dead replica's processes or segments stayed"
        time.sleep(0.2)
    with Client(launched.endpoint, timeout_s=60) as c:
        deadline = time.monotonic() + 120
        while c.health() != {"op": "health", "ready": True}:  # replica 1 is back
            assert time.monotonic() < deadline, c.health()
            time.sleep(0.5)
        for k in range(4):  # no shared prefix, least loaded, ties in turn: two reach it
            c.generate([700 + k, 8, 9], GREEDY)
        text = c.metrics()
    assert metric(text, 'nvllm_router:requests_replayed_total{replica="1"}') >= 1
    assert metric(text, 'nvllm_router:requests_replayed_total{replica="0"}') == 0
    assert metric(text, 'nvllm_router:requests_failed_replica_lost_total{replica="1"}') == 0
    assert metric(text, 'nvllm:prompt_tokens_total{replica="1"') > 0  # counted since restart
    restarted = [p for p in procs_of(launched.proc.pid) if p not in launched.pids + workers]
    assert restarted
    launched.proc.send_signal(signal.SIGINT)
    assert launched.proc.wait(60) == 0
    assert not any(procs.pid_alive(p) for p in launched.pids + workers + restarted)


def procs_of(root: int) -> list[int]:
    """`root`'s live descendants."""
    out = subprocess.run(["ps", "-eo", "pid=,ppid="], capture_output=True, text=True,
                         check=True).stdout
    children: dict[int, list[int]] = {}
    for line in out.splitlines():
        pid, ppid = map(int, line.split())
        children.setdefault(ppid, []).append(pid)
    found, stack = [], [root]
    while stack:
        for c in children.get(stack.pop(), ()):
            found.append(c)
            stack.append(c)
    return found


def owned_segments(pids: list[int]) -> list[str]:
    return [n for n in os.listdir("/dev/shm")
            if n.startswith("nvllm-") and n.split("-")[2] in {str(p) for p in pids}]


def metric(text: str, name: str) -> float:
    return next(float(line.split()[-1]) for line in text.splitlines()
                if line.startswith(name))
