"""A real worker process driven by a stand-in leader: hostile frames on the plan socket
are dropped or answered with an error, and the worker's state stays intact."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import time

import msgpack
import pytest
import zmq

from nvllm.common import worker_protocol as protocol
from nvllm.common.config import EngineConfig

pytestmark = pytest.mark.e2e

MAX_PLAN_BYTES = 64 << 10


class FakeLeader:
    def __init__(self, model: str, tmp_path, hb_timeout_s: float = 600.0) -> None:
        self.ctx = zmq.Context()
        self.plan = self.ctx.socket(zmq.PUSH)
        self.result = self.ctx.socket(zmq.PULL)
        self.hb = self.ctx.socket(zmq.ROUTER)
        for s in (self.plan, self.result, self.hb):
            s.setsockopt(zmq.LINGER, 0)
        eps = [f"tcp://127.0.0.1:{s.bind_to_random_port('tcp://127.0.0.1')}"
               for s in (self.plan, self.result, self.hb)]
        # Nobody answers heartbeats here: a long timeout keeps the worker from leaving.
        config = EngineConfig(model=model, device="cpu", dtype="float32", block_size=4,
                              heartbeat_timeout_s=hb_timeout_s).finalize()
        self.vocab = config.model_info.vocab_size
        spec = {"world_size": 1, "config": config.to_dict(), "plan_endpoints": [eps[0]],
                "result_endpoint": eps[1], "heartbeat_endpoint": eps[2],
                "rendezvous": {"file": str(tmp_path / "store")}, "rank": 0, "local_rank": 0,
                "local_world_size": 1, "parent_pid": os.getpid(),
                "max_plan_bytes": MAX_PLAN_BYTES}
        self.proc = subprocess.Popen([sys.executable, "-m", "nvllm.worker.main"],
                                     env=dict(os.environ, NVLLM_WORKER_SPEC=json.dumps(spec)),
                                     stderr=subprocess.PIPE, text=True)

    def send(self, msg) -> None:
        self.plan.send(msg if isinstance(msg, bytes) else protocol.encode(msg))

    def recv(self, timeout_s: float = 60):
        assert self.result.poll(int(timeout_s * 1000)), "no answer from the worker"
        return protocol.decode(self.result.recv())

    def quiet(self, timeout_s: float = 1.0) -> bool:
        return not self.result.poll(int(timeout_s * 1000))

    def close(self) -> str:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30)
        self.ctx.destroy(0)
        return self.proc.stderr.read()


def new_seq(seq_id, tokens, blocks, n=None, computed=0):
    return protocol.NewSeq(seq_id, tokens, len(tokens), computed,
                           len(tokens) - computed if n is None else n, blocks,
                           protocol.WorkerSampling())


def test_worker_survives_hostile_plan_frames(tiny, tmp_path):
    leader = FakeLeader(tiny("qwen3"), tmp_path)
    try:
        assert leader.recv(120).stage == "loaded"
        # Undecodable frames are logged and dropped: no answer, no crash.
        for frame in (b"\xc1\x00garbage", b"\x93\x01", pickle.dumps({"step": 1}),
                      msgpack.packb([99, 1]), msgpack.packb([1, "x", [], [], []]),
                      msgpack.packb({"kind": 1})):
            leader.send(frame)
        assert leader.quiet() and leader.proc.poll() is None
        # A plan before the KV cache exists is refused, with the step id.
        leader.send(protocol.StepPlan.of(1, [new_seq(0, [1, 2, 3], [0])], [], []))
        err = leader.recv()
        assert isinstance(err, protocol.WorkerError) and err.step_id == 1
        assert "before the KV cache" in err.message
        leader.send(protocol.InitKVCache(16))
        assert leader.recv().stage == "kv"

        bad = {
            "outside the vocabulary": protocol.StepPlan.of(2, [new_seq(0, [1, leader.vocab], [0])],
                                                        [], []),
            "outside the KV cache": protocol.StepPlan.of(3, [new_seq(0, [1, 2], [16])], [], []),
            "block(s) of 4": protocol.StepPlan.of(4, [new_seq(0, list(range(1, 10)), [0])], [],
                                               []),
            "not held": protocol.StepPlan.of(5, [], [protocol.RunningSeq(7, 1, [])], []),
            "appears twice": protocol.StepPlan.of(6, [new_seq(0, [1], [0]), new_seq(0, [2], [1])],
                                               [], []),
        }
        for words, plan in bad.items():
            leader.send(plan)
            err = leader.recv()
            assert isinstance(err, protocol.WorkerError), words
            assert err.step_id == plan.step_id and words in err.message, err.message
        # The state is untouched: a valid sequence runs, then continues as a delta.
        leader.send(protocol.StepPlan.of(7, [new_seq(0, [5, 6, 7, 8, 9], [0, 1])], [], []))
        first = leader.recv()
        assert isinstance(first, protocol.StepResult) and first.seq_ids == [0]
        # The worker kept the token it sampled: the delta carries only the count.
        leader.send(protocol.StepPlan.of(8, [], [protocol.RunningSeq(0, 1, [])], []))
        second = leader.recv()
        assert isinstance(second, protocol.StepResult) and second.seq_ids == [0]
        leader.send(protocol.Shutdown())
        assert leader.proc.wait(timeout=30) == 0
    finally:
        log = leader.close()
    assert "dropping malformed plan frame" in log and "rejecting step 2" in log


def _answer_heartbeat(leader: FakeLeader) -> None:
    if leader.hb.poll(100):
        ident, _ = leader.hb.recv_multipart()
        leader.hb.send_multipart([ident, b""])


def test_an_oversized_plan_is_dropped_and_reported(tiny, tmp_path):
    """ZMQ drops a frame over the limit before Python sees it (and the connection with
    it): the worker tells the leader it lost its plan channel instead of waiting forever."""
    leader = FakeLeader(tiny("qwen3"), tmp_path, hb_timeout_s=2.0)
    hb_answers = True
    try:
        t0 = time.monotonic()
        while not leader.result.poll(0):  # answer heartbeats while it loads (a slow
            _answer_heartbeat(leader)     # load must not cost the worker its leader)
            assert time.monotonic() - t0 < 120, "worker never loaded"
        assert leader.recv().stage == "loaded"
        leader.send(b"\x00" * (2 * MAX_PLAN_BYTES))
        t0 = time.monotonic()
        while True:  # answer heartbeats meanwhile, so only the plan channel is at stake
            _answer_heartbeat(leader)
            if leader.result.poll(0):
                break
            assert time.monotonic() - t0 < 30, "worker never reported the lost channel"
        err = leader.recv()
        assert isinstance(err, protocol.WorkerError)
        assert f"over the {MAX_PLAN_BYTES}-byte limit" in err.message
        assert leader.proc.wait(timeout=30) == 1
        assert hb_answers
    finally:
        leader.close()
