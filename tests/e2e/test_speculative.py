"""Speculative decoding end to end on a tiny random-weight model: greedy output with
speculation on equals output with it off, token for token, at tp 1 and 2, with chunked
prefill, preemption, prefix hits, stop strings, n > 1, logprobs and a structured-output
request in the batch; the KV accounting holds after every step; seeded sampling is
reproducible.

A random model does not copy its prompt, so the n-gram proposer's drafts are mostly
rejected here (that path is run too). To exercise acceptance (accepted drafts' KV reused
by later steps, runs cut at stop strings), an oracle proposer drafts from the reference
output, with a wrong token planted now and then (partial acceptance)."""

from __future__ import annotations

import copy
import itertools
import os
import signal

import numpy as np
import pytest

from nvllm import LLM, SamplingParams
from nvllm.common.speculative import SpeculativeConfig

pytestmark = pytest.mark.e2e

PASSAGE = ("The quick brown fox jumps over the lazy dog near the river bank while the old "
           "farmer watches. ")
SCHEMA_CHOICES = ["yes", "no", "maybe so"]
STRESS = dict(enable_prefix_caching=True, max_num_batched_tokens=32, num_kv_blocks=18)


def requests(tok):
    texts = [PASSAGE * 2 + "Again: " + PASSAGE[:20 + 9 * i] for i in range(3)]
    prompts = [tok(t).input_ids for t in texts] + [tok("Hi").input_ids] * 2
    params = [SamplingParams(temperature=0.0, max_tokens=32, prompt_logprobs=1)] + [
        SamplingParams(temperature=0.0, max_tokens=32) for _ in range(2)] + [
        SamplingParams(temperature=0.0, max_tokens=20, n=2, logprobs=2),
        SamplingParams(temperature=0.0, max_tokens=30,
                       structured_outputs={"choice": SCHEMA_CHOICES})]
    return prompts, params


class OracleProposer:
    """Drafts the reference greedy continuation (by prompt), planting a wrong token at
    some positions: the leader's proposer interface (nvllm/leader/ngram_proposer.py)."""

    def __init__(self, refs: dict[tuple, list[list[int]]], k: int = 4) -> None:
        self.refs, self.k = refs, k
        self.calls = 0
        self.config = SpeculativeConfig(num_speculative_tokens=k)

    def eligible(self, seq) -> bool:
        return True

    def propose(self, seqs, k):
        out = {}
        for s in seqs:
            self.calls += 1
            ref = self.refs[tuple(s.token_ids[:s.num_prompt_tokens])][s.index]
            n = s.num_output_tokens
            d = list(ref[n:n + k])
            if len(d) > 2 and self.calls % 3 == 0:
                d[2] = (d[2] + 1) % 1000  # a wrong draft: the rest of the run is rejected
            if d:
                out[s.seq_id] = np.asarray(d, np.int64)
        return out

    def observe(self, seq_id, num_drafted, num_accepted, num_tokens=0) -> None:
        pass

    def drop(self, seq_id) -> None:
        pass


def same(got, base) -> None:
    """Tokens, text and finish reasons exactly; logprobs within float noise (verify rows
    run the multi-query attention path, plain decodes the native one-query kernel)."""
    assert [[c[:3] for c in r] for r in got] == [[c[:3] for c in r] for r in base]
    for r, b in zip(got, base):
        for c, d in zip(r, b):
            for i in (3, 4):  # logprobs, then the request's prompt logprobs
                if d[i] is None:
                    assert c[i] is None
                    continue
                assert len(c[i]) == len(d[i])
                for x, y in zip(c[i], d[i]):
                    assert (x is None) == (y is None)
                    if x is not None:
                        assert x.keys() == y.keys()
                        assert all(abs(x[t] - y[t]) < 1e-4 for t in x)


def generate(llm, prompts, params):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert all(o.error is None for o in outs)
    return [[(c.token_ids, c.text, c.finish_reason, c.logprobs, o.prompt_logprobs)
             for c in o.outputs] for o in outs]


def kv_ok(llm) -> None:
    """Ref counts match the running tables; free blocks are the rest; cached blocks lie
    within verified tokens (the leader's view; the fake-worker test checks slot content)."""
    eng = llm.engine
    kv, bs = eng.kv, eng.kv.block_size
    users = [0] * kv.num_blocks
    for seq in eng.scheduler.running:
        held = [b for b in seq.block_table if b >= 0]
        assert len(set(held)) == len(held)
        for b in held:
            users[b] += 1
        assert seq.blocks.num_cached * bs <= min(seq.num_computed_tokens, seq.num_tokens)
    assert [b.ref_cnt for b in kv.pool.blocks] == users
    assert kv.num_free_blocks == users.count(0)


def run_steps(llm, prompts, params, kill_at: int | None = None):
    """Generate step by step (engine API), checking KV accounting after every step;
    `kill_at`: SIGKILL rank 0 before that step (the engine must restart its workers)."""
    eng = llm.engine
    for i, (p, sp) in enumerate(zip(prompts, params)):
        eng.submit(prompt_token_ids=p, params=sp, request_id=f"q{i}")
    done = {}
    steps = 0
    while eng.has_unfinished_requests():
        if steps == kill_at:
            os.kill(llm.worker_pids[0], signal.SIGKILL)
        steps += 1
        out = eng.step()
        kv_ok(llm)
        for r in out.finished:
            done[r.request_id] = [(c.token_ids, c.text, c.finish_reason, c.logprobs,
                                   r.prompt_logprobs) for c in r.outputs]
    assert eng.kv.num_free_blocks == eng.kv.num_blocks
    return [done[f"q{i}"] for i in range(len(prompts))]


_REFERENCES: dict[tuple, tuple] = {}


def reference(model: str, kw: dict):
    """The batch and its outputs with speculation off, computed once per model and engine
    settings (both tests at a tp compare against the same run); each caller gets its own
    copy."""
    key = (model, tuple(sorted(kw.items())))
    if key not in _REFERENCES:
        _REFERENCES[key] = _reference(model, kw)
    return copy.deepcopy(_REFERENCES[key])


def _reference(model: str, kw: dict):
    """Requests 1 and 2 stop at a stop string / stop token their first reference output
    produced mid-way (so a speculative run meets them inside accepted runs)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    prompts, params = requests(tok)
    with LLM(model, **kw) as llm:
        base = generate(llm, prompts, params)
        text = base[1][0][1]
        stop = text[len(text) // 2:][:3]
        params[1] = SamplingParams(temperature=0.0, max_tokens=32, stop=[stop])
        params[2] = SamplingParams(temperature=0.0, max_tokens=32,
                                   stop_token_ids=[base[2][0][0][17]])
        base = generate(llm, prompts, params)
    assert base[1][0][2] == "stop" and base[2][0][2] == "stop"
    assert len(base[0][0][4]) == len(prompts[0])  # scored over chunked prefill steps
    assert base[4][0][1] in SCHEMA_CHOICES
    return prompts, params, base


@pytest.mark.parametrize("tp", [1, 2])
def test_greedy_equal_with_speculation(tiny, tp):
    model = tiny("qwen3")
    kw = dict(device="cpu", dtype="float32", block_size=8, tensor_parallel_size=tp, **STRESS)
    prompts, params, base = reference(model, kw)
    refs = {}
    for p, outs in zip(prompts, base):
        refs.setdefault(tuple(p), [o[0] for o in outs])
    spec = {"num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
            "measure_throughput": False}  # speculating throughout, whatever the timings
    with LLM(model, speculative_config=spec, **kw) as llm:
        assert llm.engine._depth == 1  # async where nothing may propose
        ngram = 0
        if tp == 1:  # the n-gram proposer (a random model: its drafts mostly rejected)
            got = generate(llm, prompts, params)
            same(got, base)
            ngram = llm.engine.scheduler.spec_stats.num_draft_tokens
            assert ngram > 0
        llm.engine.scheduler.proposer = OracleProposer(refs)
        got = run_steps(llm, prompts, params)
        same(got, base)
        st = llm.engine.scheduler.spec_stats
        assert st.num_accepted_tokens > 40 and st.accepted_per_pos[3] > 0
        assert st.num_accepted_tokens < st.num_draft_tokens - ngram
        assert llm.engine.scheduler.num_preemptions > 0
        assert llm.engine.kv.stats.hits > 0


@pytest.mark.parametrize("tp", [1, 2])
def test_greedy_equal_with_a_draft_model(tiny, tmp_path, tp):
    """Draft-model speculative decoding (rank 0 runs the draft, nvllm/worker/draft_runner.py)
    under the same stress: outputs equal speculation off token for token, the KV
    accounting holds after every step. Drafts come from the target cut to its first layer
    (some accepted: a random model's layers agree now and then) and, at tp 1, from the
    target itself: its drafts are the target's own greedy tokens, so nearly all are
    accepted, which holds only if the draft's KV (written beside the target's, in the same
    blocks, through prefix hits, chunked prefill, recompute after preemption, replay
    after rank 0, which holds the draft, is killed mid-run, and catch-ups after steps
    with speculation off, in which the draft does not run) is right."""
    from nvllm.launch.truncate import truncate_checkpoint

    model = tiny("qwen3")
    kw = dict(device="cpu", dtype="float32", block_size=8, tensor_parallel_size=tp, **STRESS)
    prompts, params, base = reference(model, kw)
    drafts = [str(truncate_checkpoint(model, tmp_path / "draft", 1))]
    if tp == 1:
        drafts.append(model)
    for draft in drafts:
        spec = {"model": draft, "num_speculative_tokens": 3}
        restart = draft == model
        with LLM(model, speculative_config=spec, restart_workers=restart, **kw) as llm:
            # The gate, scripted: speculation on for 5 steps, off for 5, and so on, so
            # rank 0 skips the draft's forward and catches its KV up again, many times.
            llm.engine.spec_gate.allow = lambda n, c=itertools.count(): next(c) // 5 % 2 == 0
            llm.engine.spec_gate.record = lambda *a, **k: None
            got = run_steps(llm, prompts, params, kill_at=12 if restart else None)
            same(got, base)
            st = llm.engine.scheduler.spec_stats
            eng = llm.engine
            assert eng.scheduler.num_preemptions > 0 and eng.kv.stats.hits > 0
            if restart:  # the kill did happen, and the group was replaced once
                assert eng.executor.restarts_left == eng.config.max_worker_restarts - 1
        rate = st.num_accepted_tokens / st.num_draft_tokens
        if draft == model:  # (float rounding flips a near tie now and then)
            assert rate > 0.8, (st.num_accepted_tokens, st.num_draft_tokens)
        else:
            assert st.num_accepted_tokens > 0 and rate < 0.9


def test_seeded_sampling_reproducible_with_speculation(tiny):
    """Seeded sampled requests verify drafts by rejection sampling with generators keyed
    by (seed, position): the same request gives the same tokens again, alone or in a
    different batch."""
    model = tiny("llama")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    prompts = [tok(PASSAGE * 2).input_ids] * 3
    params = [SamplingParams(temperature=0.8, top_k=50, seed=7 + i, max_tokens=24)
              for i in range(3)]
    spec = {"num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2,
            "measure_throughput": False}
    with LLM(model, device="cpu", dtype="float32", block_size=8,
             speculative_config=spec) as llm:
        first = generate(llm, prompts, params)
        again = generate(llm, prompts[1:2], params[1:2])
        assert llm.engine.scheduler.spec_stats.num_draft_tokens > 0
    assert again[0] == first[1]
    assert first[0][0][0] != first[1][0][0]


class ForcedDraft:
    """Proposes one fixed draft token for every decoding sequence (or nothing when off)."""

    def __init__(self, token: int | None) -> None:
        self.token = token
        self.config = SpeculativeConfig(num_speculative_tokens=1)
        self.k = 1

    def eligible(self, seq) -> bool:
        return True

    def propose(self, seqs, k):
        if self.token is None:
            return {}
        return {s.seq_id: np.asarray([self.token], np.int64) for s in seqs}

    def observe(self, seq_id, num_drafted, num_accepted, num_tokens=0) -> None:
        pass

    def drop(self, seq_id) -> None:
        pass


# Two-sample chi-square (homogeneity of a 2 x 4 table, 3 degrees of freedom) at
# significance 1e-4. Seeds are fixed (each request's draws come from generators keyed by
# (seed, position)), so the statistic is the same every run: derandomised. That a wrong
# acceptance rule fails the same kind of test is shown on the sampler's own draws
# (tests/worker/test_rejection_sampler.py::test_draws_under_a_wrong_rule_fail_the_chi_square).
CHI2_CRIT_3 = 21.11
N_SEEDS = 800


def test_sampled_tokens_keep_their_distribution_under_speculation(tiny):
    """The second output token (the first position a draft is verified at; the first
    comes from the prefill) over N_SEEDS seeded requests, with a draft forced at it, has
    the same distribution as without speculation. logit_bias confines each position to
    four tokens, so the draft is accepted often and rejected often."""
    toks = [11, 12, 13, 14]
    params = [SamplingParams(temperature=4.0, seed=s, max_tokens=3,
                             logit_bias={t: 100.0 for t in toks}) for s in range(N_SEEDS)]
    prompts = [{"prompt_token_ids": [100, 200, 300]}] * N_SEEDS
    counts = []
    with LLM(tiny("qwen3"), device="cpu", dtype="float32", block_size=8,
             speculative_config={"num_speculative_tokens": 1, "measure_throughput": False},
             max_num_seqs=512) as llm:
        for draft in (None, toks[1]):
            llm.engine.scheduler.proposer = ForcedDraft(draft)
            outs = llm.generate(prompts, params, use_tqdm=False)
            c = np.zeros(4)
            for o in outs:
                c[toks.index(o.outputs[0].token_ids[1])] += 1
            counts.append(c)
        st = llm.engine.scheduler.spec_stats
    assert st.num_draft_tokens == N_SEEDS
    assert 0.2 < st.num_accepted_tokens / N_SEEDS < 0.95  # accepted and rejected, often
    table = np.array(counts)
    expected = table.sum(1, keepdims=True) * table.sum(0, keepdims=True) / table.sum()
    keep = expected > 0
    chi2 = float(((table - expected)[keep] ** 2 / expected[keep]).sum())
    assert chi2 < CHI2_CRIT_3, (table, chi2)
    assert (table[1] != table[0]).any()  # the draws did change: the draft path ran
