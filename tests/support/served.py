"""An in-process engine served over ZMQ for e2e tests (an EngineServer thread over an
LLM), and a wait for it to be idle."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

from nvllm import LLM
from nvllm.leader.server import EngineServer


def serve(llm: LLM) -> SimpleNamespace:
    server = EngineServer(llm.engine)
    stop = threading.Event()
    thread = threading.Thread(target=server.serve, args=(stop,), daemon=True)
    thread.start()
    return SimpleNamespace(llm=llm, server=server, endpoint=server.endpoint, stop=stop,
                           thread=thread)


def teardown(s: SimpleNamespace) -> None:
    s.stop.set()
    s.thread.join(30)
    s.server.close()
    s.llm.shutdown()


def wait_idle(llm: LLM, timeout: float = 15.0) -> None:
    """Until no request is left in the engine and every KV block is free again."""
    kv = llm.engine.kv
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not llm.engine.requests and kv.num_free_blocks == kv.num_blocks:
            return
        time.sleep(0.05)
    raise AssertionError(f"engine not idle: {len(llm.engine.requests)} requests, "
                         f"{kv.num_blocks - kv.num_free_blocks} blocks held")
