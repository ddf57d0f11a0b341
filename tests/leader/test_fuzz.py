"""Property-based fuzzing of the client protocol: the decoder on its own, and a live
EngineServer (fake workers, loop driven by hand as in test_server.py) fed batches of
arbitrary msgpack maps, mutated submits and raw bytes over a ZMQ DEALER.

After each batch: every frame got at most one immediate reply (an abort: its request's
final messages), and no reply is ``internal_error`` or echoes what was sent; every
accepted request got exactly one terminal message per completion; the client received
exactly what the server sent; the server still answers a ping and serves a normal request
to completion; no request is left and every KV block is free. Fixed seed
(``derandomize``): a failure reproduces."""

from __future__ import annotations

import logging
import math
import time

import msgpack
import pytest
import zmq
from fake_workers import prompt_ids
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nvllm.common import client_protocol as cp
from nvllm.common.client_decode import decode_client_frame
from nvllm.common.client_limits import default_limits
from nvllm.leader.server import EngineServer

WAIT_MS = 5000
MAX_STEPS = 40  # then every live request is aborted by its client
INT64 = (-(2**63), 2**63 - 1)
OPS = ["submit", "abort", "info", "health", "metrics", "ping"]
PARAM_FIELDS = ["n", "temperature", "top_p", "top_k", "min_p", "seed", "max_tokens",
                "min_tokens", "stop_token_ids", "ignore_eos", "repetition_penalty",
                "presence_penalty", "frequency_penalty", "logprobs", "stop",
                "include_stop_str_in_output", "skip_special_tokens", "eos_token_ids"]
# What a hostile frame may be answered with; never internal_error.
ERROR_CODES = cp.HOSTILE_CODES | {"rejected", "duplicate_id", "overloaded"}

# ---- strategies ------------------------------------------------------------------------

ints = st.one_of(st.integers(-3, 300), st.integers(*INT64),
                 st.integers(2**63, 2**64 - 1),  # uint64: msgpack's widest
                 st.sampled_from([0, -1, 2**31, 2**32, 2**53 + 1, INT64[0], INT64[1]]))
floats = st.one_of(st.floats(allow_nan=True, allow_infinity=True),
                   st.sampled_from([math.nan, math.inf, -math.inf, -0.0, 1e308, 5e-324]))
leaves = st.one_of(st.none(), st.booleans(), ints, floats, st.text(max_size=40),
                   st.binary(max_size=40))
keys = st.one_of(st.sampled_from(["op", "id", "v", "prompt", "prompt_token_ids", "params",
                                  "priority", "ttl_ms", "stream", *PARAM_FIELDS]),
                 st.text(max_size=10), ints, st.binary(max_size=8), st.booleans())
values = st.recursive(leaves, lambda kids: st.one_of(
    st.lists(kids, max_size=6), st.dictionaries(keys, kids, max_size=6)), max_leaves=30)
# Nested lists deep enough to pass MAX_DEPTH.
deep = st.integers(1, 40).map(lambda d: [[]] if d == 1 else _nest(d))
ops = st.one_of(st.sampled_from(OPS), st.sampled_from(["", "Submit", "submit\x00", "pong",
                                                       "output", "error"]),
                values)


def _nest(depth: int) -> list:
    v: list = []
    for _ in range(depth):
        v = [v]
    return v


request_ids = st.one_of(st.integers(0, 5), st.integers(0, 5), st.text(max_size=6),  # collide
                        ints, st.integers(250, 300).map(lambda k: "i" * k),  # around the id limit
                        st.binary(max_size=20), floats, st.booleans(), st.none(),
                        st.lists(ints, max_size=3))
token_ids = st.one_of(st.integers(0, 1000), ints, floats, st.text(max_size=3))
param_values = {
    "n": st.one_of(st.integers(1, 3), st.integers(100, 200), ints, floats),
    "max_tokens": st.one_of(st.integers(1, 8), ints),
    "top_k": st.one_of(st.integers(-2, 5), ints),
    "stop_token_ids": st.one_of(st.lists(st.integers(0, 1000), max_size=5),
                                st.lists(token_ids, max_size=300)),
    "stop": st.one_of(st.lists(st.text(max_size=5), max_size=20), st.text(max_size=300),
                      values),
    "logprobs": st.one_of(st.integers(0, 25), ints, st.none()),
}
valid_params = st.fixed_dictionaries(
    {"max_tokens": st.one_of(st.integers(1, 6), st.just(100))},
    optional={"n": st.integers(1, 3), "ignore_eos": st.booleans(),
              "temperature": st.sampled_from([0.0, 0.7]), "seed": st.integers(0, 9),
              "stop": st.lists(st.text(max_size=3), max_size=2),
              "stop_token_ids": st.lists(st.integers(0, 1000), max_size=3),
              "logprobs": st.integers(0, 3)})
mutated_params = st.dictionaries(st.one_of(st.sampled_from(PARAM_FIELDS), keys),
                                 st.one_of(leaves, values), max_size=4).flatmap(
    lambda junk: st.fixed_dictionaries({}, optional={
        k: param_values.get(k, st.one_of(leaves, values)) for k in PARAM_FIELDS}).map(
        lambda real: {"max_tokens": 4, **junk, **real}))
params = st.one_of(valid_params, valid_params, mutated_params, values)
long_prompts = st.builds(lambda c, k: c * k, st.sampled_from(["x", "é", "東", "\U0001f600"]),
                         st.integers(1000, 5000))  # around max_prompt_bytes and max_model_len
prompts = st.one_of(st.text(max_size=60), st.text(max_size=60), long_prompts, values)
prompt_token_lists = st.one_of(st.lists(st.integers(0, 1000), min_size=1, max_size=40),
                               st.lists(st.integers(0, 1000), min_size=1, max_size=40),
                               st.lists(st.integers(0, 2**63 - 1), min_size=1, max_size=3),
                               st.lists(token_ids, max_size=40),
                               st.integers(1000, 1100).map(lambda k: [5] * k),
                               values)


@st.composite
def submits(draw) -> dict:
    """A valid submit, then none, one or a few of its fields mutated (or dropped)."""
    msg = {"op": "submit", "v": 1, "id": draw(st.one_of(st.integers(0, 5), st.text(max_size=4))),
           "params": draw(valid_params)}
    if draw(st.booleans()):
        msg["prompt_token_ids"] = draw(st.lists(st.integers(0, 1000), min_size=1, max_size=40))
    else:
        msg["prompt"] = draw(st.text(max_size=60))
    mutations = {"id": request_ids, "params": params, "prompt": prompts,
                 "prompt_token_ids": prompt_token_lists,
                 "priority": st.one_of(st.integers(-5, 5), ints, floats, values),
                 "ttl_ms": st.one_of(st.integers(1, 10**6), ints, floats, values),
                 "stream": st.one_of(st.booleans(), values),
                 "v": st.one_of(st.just(1), ints, values), "op": ops}
    for k in draw(st.lists(st.sampled_from(sorted(mutations)), max_size=3, unique=True)):
        if k == "params" and draw(st.booleans()):  # one parameter mutated, the rest valid
            name = draw(st.sampled_from(PARAM_FIELDS))
            msg["params"] = {**msg["params"], name: draw(st.one_of(
                param_values.get(name, leaves), ints, floats, leaves))}
        elif draw(st.integers(0, 5)) == 0:
            msg.pop(k, None)
        else:
            msg[k] = draw(mutations[k])
    return msg


@st.composite
def one_param_submits(draw) -> dict:
    """A valid submit but for one sampling parameter: each limit and check in reach."""
    name = draw(st.sampled_from(PARAM_FIELDS))
    specific = param_values.get(name, leaves)
    value = draw(st.one_of(specific, specific, st.one_of(ints, floats, leaves)))
    return {"op": "submit", "v": 1, "id": draw(st.integers(0, 5)),
            "prompt_token_ids": [5, 6, 7], "params": {"max_tokens": 3, name: value}}


maps = st.builds(lambda op, rest, v: {"op": op, **rest, **v}, ops,
                 st.dictionaries(keys, values, max_size=8),
                 st.one_of(st.just({}), st.fixed_dictionaries({"v": values})))
aborts = st.builds(lambda rid: {"op": "abort", "id": rid},
                   st.one_of(st.integers(0, 5), st.text(max_size=1), request_ids))


def pack(msg) -> bytes:
    return msgpack.packb(msg, use_bin_type=True)


@st.composite
def raw_frames(draw) -> bytes:
    kind = draw(st.integers(0, 3))
    if kind == 0:
        return draw(st.binary(max_size=200))
    if kind == 1:  # a valid frame cut short, or with junk appended
        frame = pack(draw(submits()))
        cut = draw(st.integers(0, len(frame)))
        return frame[:cut] + draw(st.binary(max_size=8))
    if kind == 2:
        return pack(draw(values))  # not necessarily a map
    return pack({"op": "ping", "v": 1, "x": draw(deep)})


# ("abort-live", i): the harness aborts its i-th live request (modulo), if any.
frames = st.one_of(submits().map(pack), submits().map(pack), one_param_submits().map(pack),
                   maps.map(pack), aborts.map(pack), raw_frames(),
                   st.tuples(st.just("abort-live"), st.integers(0, 15)))


# ---- the decoder on its own ------------------------------------------------------------


@settings(derandomize=True, deadline=None, max_examples=1500)
@given(frame=st.one_of(frames.filter(lambda f: isinstance(f, bytes)),
                      one_param_submits().map(pack)))
def test_the_decoder_returns_a_message_or_a_protocol_error(frame):
    try:
        msg = decode_client_frame(frame)
    except cp.ClientProtocolError as e:
        assert e.code in ERROR_CODES, e.code
        assert isinstance(e.message, str) and 0 < len(e.message) < 400
        assert e.request_id is None or type(e.request_id) in (str, int)
        return
    assert type(msg) in cp.CLIENT_MESSAGES
    if isinstance(msg, cp.Submit):  # what the decoder lets through fits every limit
        lim = default_limits()
        assert type(msg.id) in (str, int) and INT64[0] <= msg.priority <= INT64[1]
        assert (msg.prompt is None) != (msg.prompt_token_ids is None)
        assert 1 <= msg.params.n <= lim.max_n
        assert len(msg.params.stop_token_ids or []) <= lim.max_stop_token_ids
        decode_client_frame(cp.encode(msg))  # and it round-trips


# ---- a live server ---------------------------------------------------------------------


class Harness:
    """A server, one DEALER, a record of everything the server sent to it (in order), and
    the model of what must happen: each accepted request's completions end exactly once."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.server = EngineServer(engine, host="127.0.0.1", port=0)
        self.ctx = zmq.Context()
        self.dealer = self.ctx.socket(zmq.DEALER)
        self.dealer.setsockopt(zmq.LINGER, 0)
        self.dealer.connect(self.server.endpoint)
        self.sent: list[bytes] = []  # frames the server sent to the dealer
        self.log: list = []  # messages sent while handling the current frame or step
        real_send = self.server._send

        def spy(client, msg):
            self.log.append(msg)
            self.sent.append(cp.encode(msg))
            real_send(client, msg)

        self.server._send = spy
        self.live: dict = {}  # client request id -> [n, set of finished indices]
        self.accepted = 0
        self.normal = 0

    def close(self) -> None:
        self.dealer.close(0)
        self.ctx.term()
        self.server.close()

    def _output(self, m: cp.Output) -> None:
        gen = self.live.get(m.id)
        assert gen is not None, f"an output for no live request: {m}"
        n, done = gen
        assert 0 <= m.index < n and m.index not in done, f"after its final message: {m}"
        if m.finish_reason is not None:
            assert m.usage is not None
            done.add(m.index)
            if len(done) == n:
                del self.live[m.id]

    def send(self, frame: bytes | tuple) -> None:
        """One frame in, handled; checks what it was answered."""
        if isinstance(frame, tuple):
            live = sorted(self.live, key=repr)
            rid = live[frame[1] % len(live)] if live else "nothing-live"
            frame = pack({"op": "abort", "id": rid})
        owners = set(self.server._owners)
        self.log.clear()
        self.dealer.send(frame)
        self.server._drain(WAIT_MS)
        new = set(self.server._owners) - owners
        assert len(new) <= 1
        if new:
            owner = self.server._owners[new.pop()]
            assert not self.log, f"an accepted submit was answered at once: {self.log}"
            assert owner.client_rid not in self.live, "a live id accepted twice"
            self.live[owner.client_rid] = [owner.remaining, set()]
            self.accepted += 1
            return
        errors = [m for m in self.log if isinstance(m, cp.Error)]
        outputs = [m for m in self.log if isinstance(m, cp.Output)]
        if errors:
            assert len(self.log) == 1, f"an error and more for one frame: {self.log}"
            e = errors[0]
            assert e.code in ERROR_CODES, e
            assert 0 < len(e.message) < 400
        elif outputs:  # an abort of a live request: its final messages, nothing else
            assert len(outputs) == len(self.log) and len({m.id for m in outputs}) == 1
            for m in outputs:
                self._output(m)
            assert outputs[0].id not in self.live, "an abort left completions open"
        else:
            assert len(self.log) <= 1, self.log

    def settle(self) -> None:
        """Step until every accepted request has ended (aborting, as its client, what is
        still running after MAX_STEPS), checking every message."""
        deadline = time.monotonic() + WAIT_MS / 1000
        while time.monotonic() < deadline and not all(
                (t is None or t.done()) and (g is None or g.done())
                for _, t, g in self.server._tokenizing.values()):
            time.sleep(0.01)  # prompts being tokenized (or grammars compiled) off the loop
        for _ in range(MAX_STEPS):
            if not self.engine.has_unfinished_requests() and not self.server._tokenizing:
                break
            self.log.clear()
            # As the serve loop: a long text prompt is tokenized off the loop and admitted
            # here (or refused: then its error is its one terminal message).
            self.server._admit_tokenized()
            self.server._step()
            for m in self.log:
                if isinstance(m, cp.Error) and m.id in self.live:
                    assert m.code in ERROR_CODES, m
                    del self.live[m.id]
                    continue
                assert isinstance(m, cp.Output), m
                self._output(m)
        for rid in list(self.live):
            self.send(pack({"op": "abort", "id": rid}))
        assert not self.live, f"requests with completions that never ended: {self.live}"
        for _ in range(3):  # the workers hear of aborted sequences on the next step
            if not self.engine.has_unfinished_requests():
                break
            self.log.clear()
            self.server._step()
            assert not self.log, self.log
        assert not self.engine.has_unfinished_requests() and not self.engine.requests
        assert not self.server._owners
        kv = self.engine.kv
        assert kv.num_free_blocks == kv.num_blocks, "KV blocks held after every request ended"

    def still_serves(self) -> None:
        self.send(pack({"op": "ping"}))
        assert [type(m) for m in self.log] == [cp.Pong]
        self.normal += 1
        rid = f"normal-{self.normal}"
        self.send(pack({"op": "submit", "v": 1, "id": rid, "prompt_token_ids":
                        prompt_ids(7, 5), "params": {"max_tokens": 3, "ignore_eos": True}}))
        assert rid in self.live
        finals = []
        for _ in range(MAX_STEPS):
            self.log.clear()
            self.server._step()
            for m in self.log:
                self._output(m)
                finals += [m.finish_reason] if m.finish_reason else []
            if rid not in self.live:
                break
        assert finals == ["length"]

    def received_all(self) -> None:
        """The dealer got exactly the frames the server sent it, in order."""
        self.send(pack({"op": "ping"}))  # a barrier: answered after everything before it
        got = []
        while len(got) < len(self.sent):
            assert self.dealer.poll(WAIT_MS), f"{len(got)} of {len(self.sent)} frames arrived"
            got.append(self.dealer.recv())
        assert got == self.sent and not self.dealer.poll(50)
        self.sent.clear()


@pytest.fixture
def harness(make_engine):
    engine, _ = make_engine(num_kv_blocks=256, max_num_seqs=64, max_queued_requests=40)
    h = Harness(engine)
    yield h
    h.close()


@settings(derandomize=True, deadline=None, max_examples=100,
          suppress_health_check=[HealthCheck.function_scoped_fixture,
                                 HealthCheck.too_slow, HealthCheck.data_too_large])
@given(batch=st.lists(frames, min_size=2, max_size=16))
def test_a_live_server_survives_fuzzed_frames(harness, batch, caplog):
    caplog.set_level(logging.ERROR, logger="nvllm")
    for frame in batch:
        harness.send(frame)
    harness.settle()
    harness.still_serves()
    harness.settle()
    harness.received_all()
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], \
        "the server logged an error (an exception in its loop?)"
