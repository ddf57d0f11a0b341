"""A completion resumed from its tokens already produced (Submit.output_token_ids, what the
data-parallel router replays a lost replica's requests with) continues exactly where the
uninterrupted one was: the same later tokens and text, no character twice, max_tokens and
min_tokens counting what was produced, stop strings found across the resume point, and
the workers given the produced tokens as outputs (penalties, seeds and grammars read
them there). Against the fake worker group, whose model is a script of output positions.
"""

from __future__ import annotations

import msgspec
import pytest
from fake_workers import deltas_of, finished_of, prompt_ids, run, scripted, submit

from nvllm.common import client_protocol as cp
from nvllm.common.client_decode import decode_client_frame
from nvllm.common.client_limits import default_limits
from nvllm.common.errors import RequestRejected
from nvllm.common.sampling_params import SamplingParams

# Multi-byte characters (several tokens each) and spaces: a resume point can fall inside
# a character, where the stream had shown nothing of it yet.
TEXT = " naïve café — 東京 ok done well"


def stream(engine, rid: str, params: SamplingParams, **resume) -> tuple[list, object]:
    submit(engine, prompt_token_ids=prompt_ids(0, 6), params=params, request_id=rid,
           **resume)
    outs = run(engine)
    return deltas_of(outs, rid), finished_of(outs, rid)


@pytest.mark.parametrize("stop", [None, ["東京 ok"]])
def test_a_resumed_completion_continues_the_stream_exactly(make_engine, tokenizer, stop):
    """Cut the uninterrupted stream after every token: what was shown plus what the
    resumed request streams is the whole stream, token for token and character for
    character, ending at the same place for the same reason."""
    choose, script = scripted(tokenizer, TEXT)
    params = SamplingParams(max_tokens=len(script) + 2, ignore_eos=True, stop=stop)
    engine, _ = make_engine(choose)
    full, whole = stream(engine, "full", params)
    tokens = [t for d in full for t in d.token_ids]
    text = "".join(d.text for d in full)
    assert text == whole.text and (stop is None or text == TEXT[:TEXT.index(stop[0])])
    for k in range(1, len(full) - 1):
        shown = "".join(d.text for d in full[:k])
        rest, res = stream(engine, f"r{k}", params, output_token_ids=tokens[:k],
                           output_text_offset=len(shown))
        assert [t for d in rest for t in d.token_ids] == tokens[k:], k
        assert shown + "".join(d.text for d in rest) == text, k
        assert rest[-1].finish_reason == full[-1].finish_reason
        assert rest[-1].usage["completion_tokens"] == full[-1].usage["completion_tokens"]
        assert res.token_ids == whole.token_ids and res.text == whole.text


def test_the_workers_see_the_produced_tokens_as_outputs(make_engine, tokenizer):
    """Penalties, min_tokens, a seed's output position and a grammar's replay all read a
    sequence's outputs from its row: prompt length and tokens as the leader sends them."""
    seen = []

    def choose(sid, fs):
        seen.append((list(fs.token_ids), fs.num_prompt_tokens))
        return 300

    engine, _ = make_engine(choose)
    params = SamplingParams(max_tokens=5, ignore_eos=True, repetition_penalty=1.3, seed=7)
    rest, res = stream(engine, "r", params, output_token_ids=[401, 402])
    assert seen[0] == (prompt_ids(0, 6) + [401, 402], 6)
    # max_tokens counts the two produced: three more, then "length".
    assert [t for d in rest for t in d.token_ids] == [300] * 3
    assert rest[-1].finish_reason == "length" and res.token_ids == [401, 402, 300, 300, 300]
    assert rest[-1].usage["completion_tokens"] == 5


def test_min_tokens_counts_the_produced_tokens(make_engine, tokenizer):
    eos = tokenizer.eos_token_id
    engine, _ = make_engine(lambda sid, fs: eos)
    rest, _ = stream(engine, "r", SamplingParams(max_tokens=9, min_tokens=3),
                     output_token_ids=[401, 402])
    assert [d.token_ids for d in rest] == [[eos]] and rest[0].finish_reason == "stop"


@pytest.mark.parametrize("kwargs, resume, match", [
    ({"n": 2}, {"output_token_ids": [401]}, "n=2"),
    ({"max_tokens": 2}, {"output_token_ids": [401, 402]}, "fewer than max_tokens"),
    ({}, {"output_token_ids": [10**9]}, r"output_token_ids\[0\] is outside the vocab"),
    ({}, {"output_token_ids": [401], "output_text_offset": 10**6}, "past the"),
    ({"stop": ["東"]}, {"output_token_ids": "東京"}, "already holds a stop string"),
])
def test_a_resume_that_cannot_continue_is_rejected_and_changes_nothing(
        make_engine, tokenizer, kwargs, resume, match):
    engine, _ = make_engine()
    if isinstance(resume["output_token_ids"], str):
        resume["output_token_ids"] = tokenizer(resume["output_token_ids"],
                                               add_special_tokens=False).input_ids
    with pytest.raises(RequestRejected, match=match):
        submit(engine, prompt_token_ids=prompt_ids(0, 4),
               params=SamplingParams(**{"max_tokens": 8, **kwargs}), request_id="x",
               **resume)
    assert not engine.requests and engine.kv.num_free_blocks == engine.kv.num_blocks


def test_the_wire_bounds_output_token_ids_by_max_model_len():
    lim = default_limits()
    frame = {"op": "submit", "id": 1, "prompt_token_ids": [1],
             "output_token_ids": [5] * (lim.max_model_len + 1)}
    with pytest.raises(cp.ClientProtocolError) as e:
        decode_client_frame(msgspec.msgpack.encode(frame), lim)
    assert "output_token_ids" in e.value.message and "max_model_len" in e.value.message
    ok = decode_client_frame(msgspec.msgpack.encode(
        {**frame, "output_token_ids": [5, 6], "output_text_offset": 3}), lim)
    assert ok.output_token_ids == [5, 6] and ok.output_text_offset == 3
    with pytest.raises(cp.ClientProtocolError, match="output_text_offset"):
        decode_client_frame(msgspec.msgpack.encode({**frame, "output_token_ids": [5],
                                                    "output_text_offset": -1}), lim)


def test_a_served_engine_resumes_from_the_wire(serve_engine, tokenizer):
    """The fields travel from the frame to the engine: two tokens produced elsewhere,
    two more here, max_tokens 4 in all; a resume the engine refuses is `rejected`."""
    import msgpack

    engine, server, dealer = serve_engine()
    the = tokenizer(" the", add_special_tokens=False).input_ids[0]
    base = {"op": "submit", "prompt_token_ids": prompt_ids(0, 5),
            "params": {"max_tokens": 4, "ignore_eos": True},
            "output_token_ids": [the, the], "output_text_offset": 4}
    dealer.send(msgpack.packb({**base, "id": "bad", "output_token_ids": [the] * 4}))
    dealer.send(msgpack.packb({**base, "id": "r"}))
    server._drain(5000)
    msgs = []
    for _ in range(50):
        if not engine.has_unfinished_requests():
            break
        server._step()
    while dealer.poll(5000 if not msgs or msgs[-1].get("finish_reason") is None else 0):
        msgs.append(msgpack.unpackb(dealer.recv(), raw=False))
    err, *outs = msgs
    assert err["id"] == "bad" and err["code"] == "rejected"
    assert "fewer than max_tokens" in err["message"]
    assert [m["token_ids"] for m in outs] == [[the], [the]]
    # The client had 4 of the 8 characters " the the": the other 4 come first.
    assert "".join(m["text"] for m in outs) == " the the the"
    assert outs[-1]["finish_reason"] == "length"
    assert outs[-1]["usage"]["completion_tokens"] == 4
