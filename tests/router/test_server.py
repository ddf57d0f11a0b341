"""The router's wire behaviour against fake leaders (no model): request ids renamed and
given back, n completions, aborts and silent clients forwarded, bad frames answered
without reaching a replica, control messages, and no replica up."""

from __future__ import annotations

import time

import msgpack
import pytest
from fake_leader import FakeLeader, StallingLeader
from raw_client import RawClient
from routers import start_router, stop_router, wait_for

from nvllm import Client
from nvllm.common.errors import EngineDeadError


@pytest.fixture
def stalling():
    leaders = [StallingLeader(), StallingLeader()]
    yield leaders
    for leader in leaders:
        leader.die()


@pytest.fixture
def answering(tmp_path):
    leaders = [FakeLeader(str(tmp_path)), FakeLeader(str(tmp_path))]
    yield leaders
    for leader in leaders:
        leader.close()


@pytest.fixture
def router():
    started = []

    def start(endpoints, policy="round_robin", **kw):
        started.append(start_router(endpoints, policy, **kw))
        return started[-1]

    yield start
    for r in started:
        stop_router(r)


def test_two_clients_may_use_one_id_and_each_gets_its_own_back(answering, router):
    r = router([leader.endpoint for leader in answering])
    with Client(r.endpoint, timeout_s=10) as a, Client(r.endpoint, timeout_s=10) as b:
        for c in (a, b, a, b):
            out = c.generate([1, 2], {"n": 2, "max_tokens": 1}, request_id="same")
            assert out.request_id == "same" and len(out.outputs) == 2
    sent = [s["id"] for leader in answering for s in leader.submits]
    assert len(sent) == len(set(sent)) == 4 and all(type(i) is int for i in sent)
    assert [len(leader.submits) for leader in answering] == [2, 2]
    wait_for(lambda: all(lk.load == 0 for lk in r.router.links))


def test_abort_and_a_silent_client_reach_the_replica(stalling, router):
    r = router([stalling[0].endpoint], client_timeout_s=1.0)
    with RawClient(r.endpoint, timeout_s=10) as c:
        c.send_map({"op": "submit", "id": "x", "prompt_token_ids": [1]})
        assert c.wait_map("x")["finish_reason"] is None
        c.send_map({"op": "submit", "id": "x", "prompt_token_ids": [1]})
        assert c.wait_map("x")["code"] == "duplicate_id"
        c.abort("x")
        assert c.wait_map("x")["finish_reason"] == "abort"
        assert stalling[0].aborts == [stalling[0].submits[0]["id"]]
        c.send_map({"op": "submit", "id": "y", "prompt_token_ids": [2]})
        assert c.wait_map("y")["finish_reason"] is None
    # The client is gone without a word: after client_timeout_s its request is aborted.
    wait_for(lambda: len(stalling[0].aborts) == 2, timeout_s=10)
    assert r.router.links[0].load == 0


@pytest.mark.parametrize("frame,code,has_id", [
    (b"\xc1", "bad_frame", False),
    (msgpack.packb([1, 2]), "bad_frame", False),
    (msgpack.packb({"op": "fly"}), "bad_op", False),
    (msgpack.packb({"op": "submit", "id": "a", "v": 2}), "bad_version", False),
    (msgpack.packb({"op": "submit", "id": [1], "prompt": "p"}), "invalid_request", False),
    (msgpack.packb({"op": "submit", "id": "a" * 300, "prompt": "p"}), "invalid_request",
     False),
    (msgpack.packb({"op": "submit", "id": "a", "prompt": "p", "routing_key": 5}),
     "invalid_request", True),
])
def test_bad_frames_are_answered_and_reach_no_replica(stalling, router, frame, code, has_id):
    r = router([stalling[0].endpoint])
    with RawClient(r.endpoint, timeout_s=10) as c:
        c._send(frame)
        msg = c.recv_map(time.monotonic() + 10)
        assert msg["op"] == "error" and msg["code"] == code
        assert msg["id"] == ("a" if has_id else None)
    assert stalling[0].submits == []


def test_control_messages_answer_for_the_set(stalling, router):
    r = router([leader.endpoint for leader in stalling])
    with Client(r.endpoint, timeout_s=10) as c:
        info = c.info()
        assert info["ready"] and info["kv_capacity_tokens"] == 2048
        assert c.health() == {"op": "health", "ready": True}
        text = c.metrics()
        assert text.count("# TYPE up gauge") == 1
        assert 'up{replica="0"} 1.0' in text and 'up{replica="1"} 1.0' in text
        assert 'nvllm_router:replica_up{replica="1"} 1.0' in text
        stalling[1].die()
        wait_for(lambda: not r.router.links[1].up)
        assert c.health()["reason"].startswith("1 of 2 replicas up (replica 1: its conn")
        assert '\nup{replica="1"}' not in c.metrics()


def test_no_replica_up_is_one_clear_error(router):
    r = router(["tcp://127.0.0.1:9"], wait_ready=False)  # nothing listens there
    with Client(r.endpoint, timeout_s=10) as c:
        with pytest.raises(EngineDeadError, match="no replica is up .replica 0: "):
            c.generate([1], {"max_tokens": 1})
        assert c.health()["ready"] is False


def test_a_lost_replicas_request_is_replayed_from_what_its_client_saw(stalling, router):
    """Replica 0 streams one token and dies: the request resumes on replica 1 under a new
    id, from its prompt and the token and text the client was shown (prompt logprobs,
    sent once, not asked again); the client's stream goes on, and an abort ends it once."""
    r = router([leader.endpoint for leader in stalling])
    params = {"max_tokens": 8, "temperature": 0.0, "prompt_logprobs": 1}
    with RawClient(r.endpoint, timeout_s=10) as c:
        c.send_map({"op": "submit", "id": "q", "prompt_token_ids": [1, 2], "params": params,
                    "routing_key": "k"})
        assert c.wait_map("q")["token_ids"] == [5]
        first = 0 if stalling[0].submits else 1
        stalling[first].die()
        assert c.wait_map("q") == {"op": "output", "id": "q", "index": 0, "token_ids": [5],
                                   "text": "x", "logprobs": None, "finish_reason": None}
        (resumed,) = stalling[1 - first].submits
        (original,) = stalling[first].submits
        assert resumed["id"] != original["id"]
        assert resumed["output_token_ids"] == [5] and resumed["output_text_offset"] == 1
        assert resumed["params"] == {**params, "prompt_logprobs": None}
        assert resumed["prompt_token_ids"] == [1, 2] and resumed["routing_key"] == "k"
        c.abort("q")
        assert c.wait_map("q")["finish_reason"] == "abort"
    assert (r.router.replayed, r.router.failed_by_replica_loss) == ({first: 1}, {})
    wait_for(lambda: r.router.links[1 - first].load == 0)


def test_an_abort_before_the_loss_is_carried_to_the_replay(stalling, router):
    r = router([leader.endpoint for leader in stalling])
    with RawClient(r.endpoint, timeout_s=10) as c:
        c.send_map({"op": "submit", "id": "q", "prompt_token_ids": [1]})
        assert c.wait_map("q")["finish_reason"] is None
        first = 0 if stalling[0].submits else 1
        stalling[first].muted = True  # it stops answering (the abort goes unanswered)
        c.abort("q")
        wait_for(lambda: stalling[first].aborts)
        stalling[first].die()  # ... and then its connection closes
        # (the replica it resumes on may stream a token before it reads the abort)
        while (msg := c.wait_map("q"))["finish_reason"] is None:
            assert msg["op"] == "output"
        assert msg["finish_reason"] == "abort"
    assert stalling[1 - first].aborts == [stalling[1 - first].submits[0]["id"]]


@pytest.mark.parametrize("n, alive, why", [
    (2, True, "it asked for n=2 completions"),
    (1, False, "no other replica is up"),
])
def test_a_request_that_cannot_be_replayed_ends_with_one_error_saying_why(
        stalling, router, n, alive, why):
    r = router([leader.endpoint for leader in stalling])
    if not alive:
        stalling[1].die()
        wait_for(lambda: not r.router.links[1].up)
    with Client(r.endpoint, timeout_s=10) as c:
        stream = c.stream([1], {"max_tokens": 4, "n": n})
        next(stream)
        first = 0 if stalling[0].submits else 1
        stalling[first].die()
        with pytest.raises(EngineDeadError, match=f"could not be replayed on another: {why}"):
            list(stream)
    assert (r.router.replayed, r.router.failed_by_replica_loss) == ({}, {first: 1})


def test_rl_control_messages_reach_every_replica_and_answer_once(stalling, router):
    """pause, sleep, wake_up, state, an update from a path and one from shared memory, and
    resume: each reaches both replicas, and the client gets one answer for the set."""
    import torch

    r = router([leader.endpoint for leader in stalling])
    with Client(r.endpoint, timeout_s=10) as c:
        c.pause_generation("keep")
        assert c.engine_state()["is_paused"]
        slept = c.sleep(level=1)
        assert (slept.weights_bytes, slept.kv_cache_bytes) == (200, 20)
        assert c.wake_up().asleep == []
        assert c.update_weights_from_path("/ckpt/b", weight_version="b") == "b"
        assert c.update_weights({"w": torch.ones(2, 3)}, weight_version="c") == "c"
        c.resume_generation()
        assert not c.engine_state()["is_paused"]
    for leader in stalling:
        ops = [m["op"] for m in leader.controls]
        assert ops == ["pause", "state", "sleep", "wake_up", "weights_from_path",
                       "weights_chunk", "weights_commit", "resume", "state"], ops
        assert leader.controls[4]["path"] == "/ckpt/b"
    assert all(not lk.pending or set(lk.pending) <= {"health", "info"}
               for lk in r.router.links)


def test_a_replica_refusing_is_named_and_the_others_said(stalling, router):
    from nvllm.common.client import ClientError

    r = router([leader.endpoint for leader in stalling])
    stalling[1].refuse = "the weights are asleep: wake_up first"
    with Client(r.endpoint, timeout_s=10) as c:
        with pytest.raises(ClientError, match=r"bad_state.*replica 1: the weights are "
                                              r"asleep.*replicas \[0\] did weights_from"):
            c.update_weights_from_path("/ckpt/b")
        stalling[1].muted = True  # it stops answering, then its connection closes
        with RawClient(r.endpoint, timeout_s=10) as raw:
            raw.send_map({"op": "resume"})
            wait_for(lambda: stalling[1].controls[-1]["op"] == "resume")
            stalling[1].die()
            msg = raw.recv_map(time.monotonic() + 10)
        assert msg["code"] == "engine_unavailable" and "replica 1: its connection " \
            "closed" in msg["message"], msg


def test_process_group_messages_are_refused_with_where_to_send_them(stalling, router):
    from nvllm.common.client import ClientError

    r = router([leader.endpoint for leader in stalling])
    with Client(r.endpoint, timeout_s=10) as c:
        with pytest.raises(ClientError, match="bad_op.*each replica's leader"):
            c.init_weight_update_group("127.0.0.1", 29500, 1, 2)
        with pytest.raises(ClientError, match="bad_op.*each replica's leader"):
            c.update_weights_from_distributed(["w"], ["float32"], [[2, 3]])
    # (the client's best-effort weights_abort after the refusal is relayed: harmless)
    assert not [m for leader in stalling for m in leader.controls
                if m["op"] in ("init_weight_update_group", "weights_from_distributed")]


def test_with_curve_keys_a_replica_admits_the_router_and_refuses_unkeyed_clients(
        tmp_path, router):
    from nvllm.common.zmq_utils import generate_keys

    keys = str(generate_keys(tmp_path / "keys"))
    leader = FakeLeader(str(tmp_path), curve_key_dir=keys)
    try:
        with Client(leader.endpoint, timeout_s=1) as unkeyed, \
                pytest.raises(TimeoutError, match="no answer"):
            unkeyed.info()  # the handshake is refused: no frame of it reaches the leader
        r = router([leader.endpoint], curve_key_dir=keys)
        with Client(r.endpoint, timeout_s=10, curve_key_dir=keys) as c:
            assert c.generate([1, 2], {"max_tokens": 1}).outputs[0].text == "x"
        assert len(leader.submits) == 1
    finally:
        leader.close()


def test_the_trees_predicted_match_is_counted_against_the_replicas_cached_tokens(tmp_path,
                                                                                 router):
    """Per request: the tree's predicted match on the chosen replica and the replica's
    usage.cached_tokens; a miss by more than one block (16 tokens) counts as over/under."""
    leader = FakeLeader(str(tmp_path))
    try:
        r = router([leader.endpoint], policy="cache_aware")
        a, b = list(range(10, 74)), list(range(100, 164))  # 64 tokens each
        with Client(r.endpoint, timeout_s=10) as c:
            # (prompt, what the replica says it had cached): predicted 0, 64, 64, 0
            for prompt, cached in ((a, 0), (a, 48), (a, 0), (b, 40)):
                leader.cached_tokens = cached
                c.generate(prompt, {"max_tokens": 1})
            text = c.metrics()
        acc = r.router.prefix_accuracy
        assert (acc.requests[0], acc.predicted[0], acc.cached[0]) == (4, 128, 88)
        assert (acc.over[0], acc.under[0]) == (1, 1)  # the third, the fourth
        assert 'nvllm_router:prefix_predicted_tokens_total{replica="0"} 128.0' in text
        assert 'nvllm_router:prefix_cached_tokens_total{replica="0"} 88.0' in text
        assert 'nvllm_router:prefix_overestimated_total{replica="0"} 1.0' in text
    finally:
        leader.close()


def test_tokenize_is_refused_so_a_front_end_uses_its_own_tokenizer(stalling, router):
    from nvllm.common.client import ClientError

    r = router([leader.endpoint for leader in stalling])
    with Client(r.endpoint, timeout_s=10) as c:
        with pytest.raises(ClientError, match="does not answer tokenize") as e:
            c.tokenize("hello")
        assert e.value.code == "bad_op"
        with pytest.raises(ClientError, match="does not answer detokenize"):
            c.detokenize([1, 2])
    assert not [m for leader in stalling for m in leader.controls]
