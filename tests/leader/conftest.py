"""Fixtures shared by the leader tests (helpers live in tests/support/leader_sim.py and
tests/support/fake_workers.py)."""

from __future__ import annotations

import pytest
import zmq
from fake_workers import BLOCK, NUM_BLOCKS, FakeWorkers
from leader_sim import Sim, assert_no_leak
from transformers import AutoTokenizer

from nvllm.common import worker_protocol as protocol
from nvllm.common.config import EngineConfig
from nvllm.leader.engine import LLMEngine
from nvllm.leader.executor import Executor


@pytest.fixture
def make_sim():
    """Sim factory; after the test every sequence is aborted and no block may be held."""
    sims: list[Sim] = []

    def factory(*args, sim_class: type[Sim] = Sim, **kwargs) -> Sim:
        sims.append(sim_class(*args, **kwargs))
        return sims[-1]

    yield factory
    for sim in sims:
        sim.drain()
        sim.check_ref_counts()
        assert_no_leak(sim.kv)


@pytest.fixture(scope="module")
def tokenizer(tiny):
    return AutoTokenizer.from_pretrained(tiny("qwen3"))


@pytest.fixture(params=["sync", "async"])
def scheduling(request) -> str:
    """The scheduling mode of the engines `make_engine` builds: every engine test runs in
    both. A test that counts steps or plans exactly pins one mode by parametrizing this
    name itself, e.g. ``@pytest.mark.parametrize("scheduling", ["sync"])`` (with a comment
    saying why); "explicit" makes every make_engine call pass async_scheduling."""
    return request.param


@pytest.fixture
def make_engine(tiny, tokenizer, scheduling):
    engines: list[LLMEngine] = []
    assert scheduling in ("sync", "async", "explicit"), scheduling

    def factory(choose=None, **overrides) -> tuple[LLMEngine, FakeWorkers]:
        the = tokenizer(" the", add_special_tokens=False).input_ids[0]
        workers = FakeWorkers(choose or (lambda sid, fs: the))
        if scheduling == "explicit":
            assert "async_scheduling" in overrides, "this test chooses the mode per engine"
        kw = dict(device="cpu", block_size=BLOCK, num_kv_blocks=NUM_BLOCKS,
                  log_stats_interval_s=3600.0, async_scheduling=scheduling == "async")
        kw.update(overrides)
        config = EngineConfig(tiny("qwen3"), **kw).finalize()
        engine = LLMEngine(config, Executor(config, lambda: workers), tokenizer)
        assert not workers.inbox  # both ready stages consumed
        engines.append(engine)
        return engine, workers

    yield factory
    for engine in engines:
        for rid in list(engine.requests):
            engine.abort_request(rid)
        assert engine.kv.num_free_blocks == engine.kv.num_blocks
        engine.shutdown()
        assert isinstance(engine.workers.other[-1], protocol.Shutdown)


@pytest.fixture
def serve_engine(make_engine):
    """serve_engine(**engine_options) -> (engine, server, dealer): a server on 127.0.0.1
    (random port) and a client for it, closed after the test."""
    from nvllm.leader.server import EngineServer

    opened = []

    def factory(**overrides):
        engine, _ = make_engine(**overrides)
        server = EngineServer(engine, host="127.0.0.1", port=0)
        ctx = zmq.Context()
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        opened.append((server, ctx, dealer))
        dealer.connect(server.endpoint)
        return engine, server, dealer

    yield factory
    for server, ctx, dealer in opened:
        dealer.close(0)
        ctx.term()
        server.close()
