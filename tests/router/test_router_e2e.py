"""The router in front of two tiny replicas (tp 1, CPU, each an EngineServer over an LLM
in this process): a multi-tenant workload's cached-prompt fraction with cache_aware
against round_robin, greedy output equal to one engine's, identical prompts spread by
load, sticky keys, control messages, and a replica whose leader goes away."""

from __future__ import annotations

import asyncio
import random
import threading
import time
from types import SimpleNamespace

import pytest
from served import serve, teardown

from nvllm import LLM, AsyncClient, Client
from nvllm.common.errors import EngineDeadError
from nvllm.router.policy import CacheAwareConfig
from nvllm.router.server import Router, RouterConfig

pytestmark = pytest.mark.e2e

TENANTS, PER_TENANT, SYSTEM_LEN, QUESTION_LEN = 5, 4, 400, 12
GREEDY = {"temperature": 0.0, "max_tokens": 4, "ignore_eos": True}
# 90 blocks of 16: about three tenants' prefixes (and what runs) per replica, so a
# replica that sees all five (round-robin) evicts each before its next use.
KV_BLOCKS = 90


@pytest.fixture(scope="module")
def replicas(tiny):
    # One after the other, from this thread: a worker dies with the thread that started
    # it (PR_SET_PDEATHSIG), so a pool thread cannot start them side by side.
    servers = []
    try:
        for _ in range(2):
            servers.append(serve(LLM(tiny("qwen3"), device="cpu", dtype="float32",
                                     num_kv_blocks=KV_BLOCKS, client_timeout_s=5.0)))
        yield servers
    finally:
        for s in servers:
            teardown(s)


def start_router(endpoints: list[str], policy: str, **kw) -> SimpleNamespace:
    router = Router(endpoints, RouterConfig(policy=policy, **kw))
    stop = threading.Event()
    thread = threading.Thread(target=router.serve, args=(stop,), daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not router.ready():
        assert time.monotonic() < deadline, "the replicas never answered health"
        time.sleep(0.05)
    return SimpleNamespace(router=router, endpoint=router.endpoint, stop=stop, thread=thread)


def stop_router(r: SimpleNamespace) -> None:
    r.stop.set()
    r.thread.join(30)
    r.router.close()


@pytest.fixture
def routed(replicas):
    started: list[SimpleNamespace] = []

    def start(policy: str, **kw) -> SimpleNamespace:
        started.append(start_router([s.endpoint for s in replicas], policy, **kw))
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


def test_cache_aware_keeps_tenants_cached_and_output_matches_one_engine(replicas, routed):
    rr_prompts, ca_prompts = workload(1), workload(2)  # fresh prefixes for each policy
    rr = asyncio.run(run_all(routed("round_robin").endpoint, rr_prompts, TENANTS))
    ca = asyncio.run(run_all(routed("cache_aware").endpoint, ca_prompts, TENANTS))
    rr_frac, ca_frac = cached_fraction(rr), cached_fraction(ca)
    print(f"cached fraction: cache_aware {ca_frac:.2f}, round_robin {rr_frac:.2f}")
    assert ca_frac >= 0.8 and ca_frac >= 1.5 * rr_frac
    ref = asyncio.run(run_all(replicas[0].endpoint, rr_prompts + ca_prompts, 8))
    assert [o.outputs[0].token_ids for o in rr + ca] == [o.outputs[0].token_ids for o in ref]


def test_identical_prompts_spread_over_both_replicas(replicas, routed):
    r = routed("cache_aware", cache_aware=CacheAwareConfig(balance_abs_threshold=4))
    prompt = workload(3)[0]
    outs = asyncio.run(run_all(r.endpoint, [prompt] * 32, 32))
    assert len({tuple(o.outputs[0].token_ids) for o in outs}) == 1
    routed_n = r.router.decisions
    assert routed_n["load_override"] > 0
    text = Client(r.endpoint, timeout_s=30).metrics()
    per = [float(line.split()[-1]) for line in text.splitlines()
           if line.startswith('nvllm:request_success_total{replica=') and 'reason="length"' in line]
    assert len(per) == 2 and max(per) <= 0.75 * sum(per), text


def test_a_routing_key_sticks_and_control_messages_answer_for_all(replicas, routed):
    r = routed("round_robin")
    with Client(r.endpoint, timeout_s=60) as c:
        for _ in range(4):
            c.generate([5, 6, 7], GREEDY, routing_key="tenant-a")
        assert r.router.decisions["sticky"] == 3
        info = c.info()
        assert info["ready"] and info["kv_capacity_tokens"] == 2 * KV_BLOCKS * 16
        assert c.health() == {"op": "health", "ready": True}
        text = c.metrics()
    assert 'nvllm_router:requests_routed_total{policy="round_robin",decision="sticky"} 3.0' \
        in text
    assert text.count("# TYPE nvllm:prompt_tokens_total counter") == 1
    assert 'replica="0"' in text and 'replica="1"' in text


class DyingLeader:
    """A leader that answers info and health, starts every request with one token, and
    then, told to, closes its socket as a SIGKILLed leader's does."""

    def __init__(self) -> None:
        import msgpack
        import zmq

        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.endpoint = f"tcp://127.0.0.1:{self.sock.bind_to_random_port('tcp://127.0.0.1')}"
        self.started, self.stop = threading.Event(), threading.Event()
        answers = {"info": {"op": "info", "v": 1, "model": "m", "model_path": None,
                            "max_model_len": 1024, "vocab_size": 1024,
                            "kv_capacity_tokens": 1024, "block_size": 16,
                            "tensor_parallel_size": 1, "ready": True},
                   "health": {"op": "health", "ready": True}}

        def serve() -> None:
            while not self.stop.is_set():
                if not self.sock.poll(20):
                    continue
                peer, frame = self.sock.recv_multipart()
                msg = msgpack.unpackb(frame)
                reply = answers.get(msg["op"])
                if msg["op"] == "submit":
                    reply = {"op": "output", "id": msg["id"], "index": 0, "token_ids": [5],
                             "text": "x", "logprobs": None, "finish_reason": None}
                    self.started.set()
                if reply is not None:
                    self.sock.send_multipart([peer, msgpack.packb(reply)])
            self.sock.close(0)
            self.ctx.term()

        self.thread = threading.Thread(target=serve, daemon=True)
        self.thread.start()

    def die(self) -> None:
        self.stop.set()
        self.thread.join(10)


def test_a_lost_replica_fails_its_requests_once_and_gets_no_more(replicas):
    """Replica 0's leader goes away mid-request: that request ends with exactly one error,
    the router stops routing there, and replica 1 (real) serves the next requests."""
    dying = DyingLeader()
    r = start_router([dying.endpoint, replicas[0].endpoint], "round_robin")
    try:
        with Client(r.endpoint, timeout_s=60) as c:
            stream = c.stream([9] * 20, GREEDY)
            assert next(stream).token_ids == [5]
            dying.die()
            with pytest.raises(EngineDeadError, match="replica 0 went away"):
                next(stream)
            assert r.router.failed_by_replica_loss == 1
            assert c.health()["reason"].startswith("1 of 2 replicas up (replica 0: ")
            outs = [c.generate([1, 2, 3], GREEDY) for _ in range(3)]
            assert all(len(o.outputs[0].token_ids) == 4 for o in outs)
            assert r.router.decisions["round_robin"] == 4 and r.router.links[1].load == 0
    finally:
        stop_router(r)
