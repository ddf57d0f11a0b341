"""An in-process router (nvllm/router/server.py) on a thread, for router tests."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

from nvllm.router.server import Router, RouterConfig


def start_router(endpoints: list[str], policy: str = "round_robin", *,
                 wait_ready: bool = True, curve_key_dir: str | None = None,
                 **kw) -> SimpleNamespace:
    router = Router(endpoints, RouterConfig(policy=policy, **kw),
                    curve_key_dir=curve_key_dir)
    stop = threading.Event()
    thread = threading.Thread(target=router.serve, args=(stop,), daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while wait_ready and not router.ready():
        assert time.monotonic() < deadline, "the replicas never answered health"
        time.sleep(0.02)
    return SimpleNamespace(router=router, endpoint=router.endpoint, stop=stop, thread=thread)


def stop_router(r: SimpleNamespace) -> None:
    r.stop.set()
    r.thread.join(30)
    assert not r.thread.is_alive()
    r.router.close()


def wait_for(cond, timeout_s: float = 10.0) -> None:
    """Until cond() holds: the router thread changes its state after it sends."""
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.01)
