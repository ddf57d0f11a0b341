"""LLMEngine through its public surface (submit, step, abort_request, abort_all, outputs,
metrics) against the fake worker group: what reaches the workers, and what the workers'
results become. A safety net for refactors of the engine; every test runs with
synchronous and with async scheduling (the `scheduling` fixture in conftest.py).
"""

from __future__ import annotations

import msgspec
import pytest
import xxhash
from fake_workers import (
    deltas_of,
    fake_logprobs,
    finished_of,
    metric,
    prompt_ids,
    run,
    submit,
)

from nvllm.common import worker_protocol as protocol
from nvllm.common.sampling_params import SamplingParams

# ---- what the workers are told --------------------------------------------------------------


def new_seqs_of(workers, seq_id: int) -> list[protocol.NewSeq]:
    return [ns for p in workers.plans for ns in p.new_seqs if ns.seq_id == seq_id]


def test_every_sampling_field_reaches_the_workers(make_engine):
    """Each field of WorkerSampling, set away from its default, arrives as given in the
    plan's NewSeq.sampling (stop_token_ids: the request's plus the model's EOS ids;
    prompt_logprobs: only to the request's first sequence, which scores the prompt)."""
    engine, workers = make_engine()
    params = SamplingParams(temperature=0.75, top_p=0.875, top_k=7, min_p=0.125, seed=1234,
                            max_tokens=6, min_tokens=2, stop_token_ids=[41, 17],
                            repetition_penalty=1.25, presence_penalty=0.5,
                            frequency_penalty=-0.25, logprobs=3, prompt_logprobs=2,
                            structured_outputs={"regex": "[a-z ]+"},
                            logit_bias={"9": -100, 130: 2.5})
    no_eos = params.clone(ignore_eos=True, n=2, seed=77, structured_outputs=None)
    req = submit(engine, prompt_token_ids=prompt_ids(0, 5), params=params)
    req2 = submit(engine, prompt_token_ids=prompt_ids(10, 5), params=no_eos)
    eos = engine.config.model_info.eos_token_ids  # the checkpoint's
    assert eos, "the tiny model has an EOS token"
    want = protocol.WorkerSampling(
        temperature=0.75, top_p=0.875, top_k=7, min_p=0.125, seed=1234, min_tokens=2,
        stop_token_ids=sorted({41, 17, *eos}), repetition_penalty=1.25,
        presence_penalty=0.5, frequency_penalty=-0.25, logprobs=3, prompt_logprobs=2,
        grammar_key=engine.grammars.key(params.structured_outputs),
        logit_bias_ids=[9, 130], logit_bias_values=[-100.0, 2.5])
    # The test covers every field: none of them may be left at its default.
    for f in msgspec.structs.fields(protocol.WorkerSampling):
        default = f.default_factory() if f.default is msgspec.NODEFAULT else f.default
        assert getattr(want, f.name) != default, f"{f.name} is not exercised"
    run(engine)
    (ns,) = new_seqs_of(workers, req.seqs[0].seq_id)
    assert ns.sampling == want
    # ignore_eos leaves only the request's stop ids; the n completions of a seeded request
    # get consecutive seeds.
    for i, seq in enumerate(req2.seqs):
        (ns,) = new_seqs_of(workers, seq.seq_id)
        assert ns.sampling == msgspec.structs.replace(want, stop_token_ids=[17, 41],
                                                      seed=77 + i, grammar_key=None,
                                                      prompt_logprobs=2 if i == 0 else None)
    # The compiled grammar went to rank 0 once, before the plan that needs it.
    (load,) = [m for m in workers.other if isinstance(m, protocol.LoadGrammars)]
    assert load.keys == [want.grammar_key] and load.tokenizer_info and not load.drop


@pytest.mark.parametrize("field", ["stop_token_ids", "logit_bias"])
def test_token_ids_outside_the_vocabulary_are_rejected_and_not_echoed(make_engine, field):
    from nvllm.common.errors import RequestRejected

    engine, workers = make_engine()
    vocab = engine.vocab_size
    ids = [5, vocab, vocab + 12345]
    value = ids if field == "stop_token_ids" else {t: 1.0 for t in ids}
    with pytest.raises(RequestRejected) as e:
        submit(engine, prompt_token_ids=prompt_ids(0, 3),
               params=SamplingParams(max_tokens=2, **{field: value}))
    msg = str(e.value)
    assert msg.startswith(f"{field} holds 2 id(s) outside the vocabulary"), msg
    assert str(vocab + 12345) not in msg
    assert not workers.plans


# ---- submit and abort_all ------------------------------------------------------------------


def test_submit_admits_and_abort_all_ends_every_request(make_engine):
    """submit processes and admits (a used id is refused, nothing changes); requests is a
    read-only view; abort_all ends every live request, in admission order, with one final
    delta per completion and a RequestOutput each, and frees every block."""
    from nvllm.common.errors import RequestRejected

    engine, workers = make_engine()
    a = submit(engine, prompt_token_ids=prompt_ids(0, 5), request_id="a",
               params=SamplingParams(max_tokens=50, n=2, ignore_eos=True))
    b = submit(engine, prompt_ids(10, 6), SamplingParams(max_tokens=50, ignore_eos=True),
               request_id="b", priority=1, ttl_ms=60_000)
    assert b.priority == 1 and b.deadline is not None and b.prompt_token_ids == prompt_ids(10, 6)
    with pytest.raises(RequestRejected, match="already in use"):
        submit(engine, prompt_token_ids=prompt_ids(20, 3), request_id="a")
    assert list(engine.requests) == ["a", "b"] and engine.requests["a"] is a
    with pytest.raises(TypeError):
        engine.requests["c"] = a  # only the engine changes its requests
    engine.step()
    out = engine.abort_all("abort")
    assert [(d.request_id, d.index, d.finish_reason) for d in out.deltas] == [
        ("a", 0, "abort"), ("a", 1, "abort"), ("b", 0, "abort")]
    assert [r.request_id for r in out.finished] == ["a", "b"]
    assert not engine.requests and not engine.abort_all().deltas
    run(engine)  # the workers let go of the aborted sequences
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


@pytest.mark.parametrize("prompt_len", [1, 13, 31])
def test_prompt_plus_max_tokens_filling_max_model_len_is_served_to_length(make_engine,
                                                                         prompt_len):
    """prompt + max_tokens == max_model_len is the longest request there is: accepted, and
    it ends with 'length' after every one of its max_tokens, the last sampled at position
    max_model_len - 1. One token more is rejected."""
    from nvllm.common.errors import RequestRejected

    limit = 32
    positions = []  # the position each sampled token takes

    def choose(sid, fs):
        positions.append(len(fs.token_ids))
        return 200

    engine, _ = make_engine(choose, max_model_len=limit)
    fits = SamplingParams(max_tokens=limit - prompt_len, ignore_eos=True)
    submit(engine, prompt_token_ids=prompt_ids(0, prompt_len), params=fits, request_id="full")
    outs = run(engine)
    final = deltas_of(outs, "full")[-1]
    assert final.finish_reason == "length"
    assert final.usage["completion_tokens"] == limit - prompt_len
    assert max(positions) == limit - 1
    with pytest.raises(RequestRejected, match=f"exceeds max_model_len {limit}"):
        submit(engine, prompt_token_ids=prompt_ids(0, prompt_len),
               params=fits.clone(max_tokens=limit - prompt_len + 1))


# ---- prefix caching -------------------------------------------------------------------------


def test_shared_prefix_is_reported_as_cached(make_engine):
    """A second request sharing two full blocks (block size 4) of the first's prompt
    computes only the rest: its usage, its RequestOutput and the hit metric say so."""
    engine, workers = make_engine()
    shared = prompt_ids(0, 8)
    submit(engine, prompt_token_ids=shared + prompt_ids(50, 3), request_id="first",
                       params=SamplingParams(max_tokens=3))
    outs = run(engine)
    assert finished_of(outs, "first").num_cached_tokens == 0
    assert deltas_of(outs, "first")[-1].usage["cached_tokens"] == 0
    assert metric(engine, "nvllm:prefix_cache_hits_total") == 0
    submit(engine, prompt_token_ids=shared + prompt_ids(60, 2), request_id="second",
                       params=SamplingParams(max_tokens=3))
    outs = run(engine)
    res = finished_of(outs, "second")
    final = deltas_of(outs, "second")[-1]
    assert final.finish_reason == "length"
    assert final.usage == {"prompt_tokens": 10, "completion_tokens": 3, "cached_tokens": 8}
    assert res.num_cached_tokens == 8
    assert metric(engine, "nvllm:prefix_cache_hits_total") == 8
    assert metric(engine, "nvllm:prefix_cache_queries_total") == 11 + 10
    # The workers were told so: the second prompt arrived with 8 tokens already computed.
    (ns,) = [ns for p in workers.plans for ns in p.new_seqs if ns.token_ids[8:10]
             == prompt_ids(60, 2)]
    assert ns.num_computed_tokens == 8 and ns.num_new_tokens == 2


# ---- min_tokens -----------------------------------------------------------------------------


@pytest.mark.parametrize("stop_with", ["eos", "stop_token_id"])
def test_no_stop_before_min_tokens(make_engine, tokenizer, stop_with):
    """The workers may sample EOS (or a stop token id) from the very first token; the
    leader must not stop before min_tokens, and must stop at the first one after."""
    stop = tokenizer.eos_token_id if stop_with == "eos" else 77
    extra = {} if stop_with == "eos" else {"stop_token_ids": [77], "ignore_eos": True}
    # Always the stop token: the completion ends exactly at min_tokens.
    engine, _ = make_engine(lambda sid, fs: stop)
    submit(engine, prompt_token_ids=prompt_ids(0, 5), request_id="always",
                       params=SamplingParams(max_tokens=10, min_tokens=3, **extra))
    outs = run(engine)
    res = finished_of(outs, "always")
    assert res.token_ids == [stop] * 3 and res.finish_reason == "stop"
    assert [d.finish_reason for d in deltas_of(outs, "always")] == [None, None, "stop"]

    # Stop tokens around min_tokens: only the first one at or past it stops.
    script = [stop, stop, 300, 301, stop, 302]
    engine, _ = make_engine(
        lambda sid, fs: script[min(len(fs.token_ids) - fs.num_prompt_tokens, 5)])
    submit(engine, prompt_token_ids=prompt_ids(0, 5), request_id="later",
                       params=SamplingParams(max_tokens=10, min_tokens=3, **extra))
    res = finished_of(run(engine), "later")
    assert res.token_ids == script[:5] and res.finish_reason == "stop"


# ---- logprobs -------------------------------------------------------------------------------


@pytest.mark.parametrize("k", [0, 1, 3])
def test_logprobs_map_the_sampled_token_and_the_top_k(make_engine, k):
    tokens = [300, 901, 302, 900, 304, 305, 306]  # 900/901: ids the fake top-k uses too
    engine, workers = make_engine(
        lambda sid, fs: tokens[len(fs.token_ids) - fs.num_prompt_tokens])
    submit(engine, prompt_token_ids=prompt_ids(0, 5), request_id="lp",
                       params=SamplingParams(max_tokens=7, ignore_eos=True, logprobs=k))
    submit(engine, prompt_token_ids=prompt_ids(10, 6), request_id="plain",
                       params=SamplingParams(max_tokens=4, ignore_eos=True))
    outs = run(engine)
    deltas = deltas_of(outs, "lp")
    assert [t for d in deltas for t in d.token_ids] == tokens
    not_in_top = 0
    for n, (d, token) in enumerate(zip(deltas, tokens)):
        lp, top = fake_logprobs(n, token, k)
        assert len(top) == k
        (entry,) = d.logprobs
        assert entry[token] == lp  # the sampled token's own logprob
        for t, v in top:
            assert entry[t] == v
        assert set(entry) == {token, *(t for t, _ in top)}
        not_in_top += token not in {t for t, _ in top}
    assert not_in_top >= 3, "some steps must sample a token outside the top k"
    res = finished_of(outs, "lp")
    assert res.outputs[0].logprobs == [d.logprobs[0] for d in deltas]
    # A request that did not ask gets none, even when it shares a step with one that did.
    assert all(d.logprobs is None for d in deltas_of(outs, "plain"))
    assert finished_of(outs, "plain").outputs[0].logprobs is None
    assert any(p.new_seqs and len(p.new_seqs) == 2 for p in workers.plans)


# ---- results that do not answer the plan ----------------------------------------------------


def hashed_choice(eos: int):
    """A model whose next token depends on the whole sequence (EOS now and then)."""

    def choose(sid, fs) -> int:
        h = xxhash.xxh64_intdigest(str(fs.token_ids).encode())
        return eos if h % 11 == 0 else 200 + h % 400

    return choose


def other_token(t: int) -> int:
    return 200 + (t + 7) % 400  # a valid token that differs from t


def corrupted(kind: str, vocab_size: int):
    """corrupt(plan, good) for FakeWorkers: one bad result of `kind` before every result
    that samples anything. Each would change the outputs if the engine applied it."""

    def corrupt(plan: protocol.StepPlan, good: protocol.StepResult) -> list:
        if not good.seq_ids:
            return []
        ids, toks = list(good.seq_ids), [other_token(t) for t in good.token_ids]
        lps = None if good.logprobs is None else list(good.logprobs)
        step = good.step_id
        if kind == "wrong_step":  # a stale result, e.g. of the previous step
            step = step - 1
        elif kind == "missing_seq":
            ids, toks = ids[:-1], toks[:-1]
            lps = None if lps is None else lps[:-1]
        elif kind == "extra_seq":
            ids, toks = ids + [10**6], toks + [300]
            lps = None if lps is None else lps + [None]
        elif kind == "wrong_seq":
            ids = ids[:-1] + [10**6]
        elif kind == "duplicate_seq":
            ids, toks = ids + ids[-1:], toks + toks[-1:]
            lps = None if lps is None else lps + lps[-1:]
        elif kind == "tokens_mismatch":  # one token more than sequences
            toks = toks + [300]
        elif kind == "out_of_vocab":
            toks = toks[:-1] + [vocab_size]
        elif kind == "logprobs_length":
            if lps is None:
                return []
            toks, lps = list(good.token_ids), lps[:-1]
        else:
            raise AssertionError(kind)
        return [protocol.StepResult(step, ids, toks, lps, good.worker_time_s)]

    return corrupt


def bad_result_workload(engine) -> None:
    p = SamplingParams
    submit(engine, prompt_token_ids=prompt_ids(0, 6), request_id="a",
                       params=p(max_tokens=9, logprobs=2))
    submit(engine, prompt_token_ids=prompt_ids(20, 9), request_id="b",
                       params=p(max_tokens=7, n=2, seed=5, logprobs=1))
    submit(engine, prompt_token_ids=prompt_ids(40, 3), request_id="c",
                       params=p(max_tokens=12))


def observed(outs) -> dict:
    seen = {}
    for rid in sorted({r.request_id for o in outs for r in o.finished}):
        res = finished_of(outs, rid)
        for comp in res.outputs:
            deltas = [(d.token_ids, d.text, d.logprobs, d.finish_reason, d.usage)
                      for d in deltas_of(outs, rid, comp.index)]
            seen[rid, comp.index] = (comp.token_ids, comp.text, comp.finish_reason,
                                     comp.logprobs, deltas)
    return seen


BAD_KINDS = ["wrong_step", "missing_seq", "extra_seq", "wrong_seq", "duplicate_seq",
             "tokens_mismatch", "out_of_vocab", "logprobs_length"]


@pytest.mark.parametrize("kind", BAD_KINDS)
def test_results_that_do_not_answer_the_plan_are_dropped(make_engine, tokenizer, kind):
    """A result with the wrong step id, the wrong sequences, a token outside the
    vocabulary or malformed logprobs is dropped; the good one that follows is applied, and
    everything users see equals a clean run."""
    eos = tokenizer.eos_token_id
    engine, _ = make_engine(hashed_choice(eos))
    bad_result_workload(engine)
    want = observed(run(engine))
    assert set(want) == {("a", 0), ("b", 0), ("b", 1), ("c", 0)}

    engine, workers = make_engine(hashed_choice(eos))
    workers.corrupt = corrupted(kind, engine.vocab_size)
    bad_result_workload(engine)
    got = observed(run(engine))
    assert len(workers.injected) >= 5
    assert got == want
    assert metric(engine, "nvllm:generation_tokens_total") == sum(
        len(v[0]) for v in want.values())
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
