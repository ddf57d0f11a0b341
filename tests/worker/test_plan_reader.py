"""The worker's plan reader, inline (CPU) and on its own thread (GPU): plans arrive in
order, garbage frames are dropped, and a lost connection becomes an error from get()."""

from __future__ import annotations

import pytest
import zmq

from nvllm.common import worker_protocol as protocol
from nvllm.common.zmq_utils import bind_random, make_socket
from nvllm.worker.main import PlanConnectionWatch, PlanReader


@pytest.fixture
def pair():
    ctx = zmq.Context()
    push = make_socket(ctx, zmq.PUSH)
    endpoint = bind_random(push, "127.0.0.1")
    pull = make_socket(ctx, zmq.PULL, max_msg_bytes=1 << 16)
    yield ctx, push, pull, endpoint
    ctx.destroy(linger=0)


@pytest.mark.parametrize("threaded", [False, True])
def test_plans_in_order_garbage_dropped(pair, threaded, caplog):
    ctx, push, pull, endpoint = pair
    watch = PlanConnectionWatch(pull, 5.0, 1 << 16)
    pull.connect(endpoint)
    reader = PlanReader(pull, watch, 0, 1 << 16, threaded=threaded)
    try:
        plans = [protocol.StepPlan.of(i, [], [protocol.RunningSeq(i, 1, [])], []) for i in (1, 2)]
        push.send(protocol.encode(plans[0]))
        push.send(b"\x93garbage")
        push.send(protocol.encode(plans[1]))
        push.send(protocol.encode(protocol.Shutdown()))
        assert [reader.get() for _ in range(3)] == [*plans, protocol.Shutdown()]
    finally:
        reader.close()
    assert "dropping malformed plan frame" in caplog.text
    if threaded:
        assert not reader.thread.is_alive()


@pytest.mark.parametrize("threaded", [False, True])
def test_lost_connection_is_an_error(pair, threaded):
    ctx, push, pull, endpoint = pair
    watch = PlanConnectionWatch(pull, 0.2, 1 << 16)
    pull.connect(endpoint)
    reader = PlanReader(pull, watch, 0, 1 << 16, threaded=threaded)
    try:
        push.send(protocol.encode(protocol.InitKVCache(4)))
        assert reader.get() == protocol.InitKVCache(4)
        # Over the reader's frame limit: ZMQ drops the connection and does not redial.
        push.send(b"x" * (1 << 17))
        with pytest.raises(ConnectionError, match="lost the plan connection"):
            reader.get()
    finally:
        reader.close()
