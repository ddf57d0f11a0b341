"""Speculative decoding on the leader, with fake workers that verify drafts greedily
against their scripted model (tests/support/fake_workers.py): outputs equal speculation
off token for token and text for text (stop strings, stop tokens, max_tokens inside an
accepted run, n > 1, logprobs, preemption), drafts are proposed and (partly) accepted, and
the KV accounting holds after every step (tests/support/kv_check.py)."""

from __future__ import annotations

import pytest
from fake_workers import metric
from kv_check import check_kv

from nvllm.common.sampling_params import SamplingParams

# Both modes: with async_scheduling the engine runs synchronously only while a sequence
# may propose (Scheduler.speculating), else async.
pytestmark = pytest.mark.parametrize("scheduling", ["sync", "async"])

# measure_throughput off: these tests check what speculating does, so it must not turn
# itself off on timings (the gate has tests of its own: test_spec_gate.py).
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
        "prompt_lookup_max": 3, "min_acceptance_rate": 0.0, "measure_throughput": False}
PASSAGE = ("The quick brown fox jumps over the lazy dog near the river bank while the "
           "old farmer watches from his porch")
TWIST = 7  # a prompt starting with this id gets a model that strays every 5th token


def copy_model(sid, fs) -> int:
    """Copies its prompt cyclically (from its 4th token), so n-gram drafts match; a
    prompt marked TWIST strays every 5th token (drafts partly rejected)."""
    prompt = fs.token_ids[:fs.num_prompt_tokens]
    n_out = len(fs.token_ids) - fs.num_prompt_tokens
    if prompt[0] == TWIST and n_out % 5 == 4:
        return 300 + n_out
    return prompt[(n_out + 3) % len(prompt)]


def requests(tokenizer):
    ids = tokenizer(PASSAGE, add_special_tokens=False).input_ids
    stop_tok = ids[12]
    return [
        (ids, SamplingParams(max_tokens=40)),
        ([TWIST] + ids, SamplingParams(max_tokens=30)),
        (ids[2:], SamplingParams(max_tokens=40, stop=["river"])),
        (ids[1:], SamplingParams(max_tokens=40, stop_token_ids=[stop_tok])),
        (ids[3:], SamplingParams(max_tokens=13, n=2, logprobs=2)),
        (ids[:-2], SamplingParams(max_tokens=40, stop=["farmer"],
                                  include_stop_str_in_output=True, min_tokens=25)),
    ]


def run(make_engine, tokenizer, after_step=None, **kw):
    engine, workers = make_engine(copy_model, **kw)
    for i, (prompt, params) in enumerate(requests(tokenizer)):
        engine.submit(prompt_token_ids=prompt, params=params, request_id=f"r{i}")
    finished = []
    steps = 0
    while engine.has_unfinished_requests():
        out = engine.step()
        finished += out.finished
        check_kv(engine, workers.slot_tokens)
        if after_step is not None:
            after_step(engine, workers)
        steps += 1
        assert steps < 1000
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
    got = {r.request_id: [(c.token_ids, c.text, c.finish_reason, c.logprobs)
                          for c in r.outputs] for r in finished}
    return got, engine, workers, steps


@pytest.mark.parametrize("blocks", [64, 30])  # 30 blocks of 4: preemption
def test_outputs_equal_speculation_off(make_engine, tokenizer, blocks):
    kw = dict(num_kv_blocks=blocks, max_num_batched_tokens=64)
    base, e0, _, steps0 = run(make_engine, tokenizer, **kw)
    got, e1, workers, steps1 = run(make_engine, tokenizer, speculative_config=SPEC, **kw)
    assert got == base
    st = e1.scheduler.spec_stats
    assert st.num_drafts > 0 and 0 < st.num_accepted_tokens < st.num_draft_tokens
    assert sum(a for _, _, a in workers.accepted) == st.num_accepted_tokens
    # vLLM's counters under nvllm:
    assert metric(e1, "nvllm:spec_decode_num_drafts_total") == st.num_drafts
    assert metric(e1, "nvllm:spec_decode_num_draft_tokens_total") == st.num_draft_tokens
    assert metric(e1, "nvllm:spec_decode_num_accepted_tokens_total") == st.num_accepted_tokens
    per_pos = [metric(e1, "nvllm:spec_decode_num_accepted_tokens_per_pos_total",
                      position=str(j)) for j in range(4)]
    assert per_pos == st.accepted_per_pos and sum(per_pos) == st.num_accepted_tokens
    assert per_pos[0] >= per_pos[1] >= per_pos[2] >= per_pos[3] > 0
    assert steps1 < steps0, "accepted drafts should save steps"
    if blocks == 30:
        assert e1.scheduler.num_preemptions > 0
    # finish reasons exercised: stop string, stop token, length
    reasons = {c[2] for outs in got.values() for c in outs}
    assert reasons == {"stop", "length"}


def run_checked(engine, workers, tokenizer, max_tokens: int) -> list[int]:
    """Run PASSAGE as one request to the end, checking the KV accounting after every
    step; returns its prompt's ids."""
    ids = tokenizer(PASSAGE, add_special_tokens=False).input_ids
    engine.submit(prompt_token_ids=ids, params=SamplingParams(max_tokens=max_tokens),
                  request_id="a")
    while engine.has_unfinished_requests():
        engine.step()
        check_kv(engine, workers.slot_tokens)
    return ids


def test_drafts_never_pass_max_tokens_or_the_budget(make_engine, tokenizer):
    engine, workers = make_engine(copy_model, speculative_config=SPEC,
                                  max_num_batched_tokens=3, max_model_len=64)
    ids = run_checked(engine, workers, tokenizer, max_tokens=9)
    for plan in workers.plans:
        for r in plan.running:
            assert len(r.spec_token_ids) <= 2  # budget 3: 1 + 2 drafts
            if r.spec_token_ids:  # (prefill chunks are running rows too)
                assert r.num_new_tokens == 1 + len(r.spec_token_ids)
    # no position at or past the final token's is ever computed: the last one computed
    # is the 9th output token's predecessor
    assert len(workers.slot_tokens) == len(ids) + 8
    assert engine.scheduler.spec_stats.num_drafts > 0


def test_low_acceptance_stops_proposing(make_engine, tokenizer):
    """A model that never follows its prompt: drafts get rejected, and after a few
    verify steps the sequence stops proposing (retry_after_tokens later it tries again)."""
    def stray(sid, fs):  # prompt tokens, but never in the prompt's order
        prompt = fs.token_ids[:fs.num_prompt_tokens]
        return prompt[3 * (len(fs.token_ids) - fs.num_prompt_tokens) % len(prompt)]

    spec = dict(SPEC, min_acceptance_rate=0.5, retry_after_tokens=1000)
    engine, workers = make_engine(stray, speculative_config=spec)
    run_checked(engine, workers, tokenizer, max_tokens=60)
    st = engine.scheduler.spec_stats
    assert 0 < st.num_drafts < 10 and st.num_accepted_tokens < st.num_draft_tokens / 2
    assert not engine.scheduler.speculating()
    # Paused, the engine goes back to async scheduling where the config allows it: some
    # plan then went out before the previous plan's result was received.
    sent = [n for n in workers.recvs_before_plan]
    overlapped = any(b == a for a, b in zip(sent, sent[1:]))
    assert overlapped == engine.config.async_scheduling
    # and no plan was sent while one with drafts was in flight
    for i, plan in enumerate(workers.plans[:-1]):
        if any(r.spec_token_ids for r in plan.running):
            assert workers.recvs_before_plan[i + 1] > workers.recvs_before_plan[i]


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_restart_and_replay_with_speculation(tiny, tokenizer, scheduling, method):
    """A worker group dies on a plan that verifies drafts: the restarted group recomputes
    every sequence, and the outputs equal those of an uninterrupted run."""
    from fake_workers import FakeWorkers

    from nvllm.common.config import EngineConfig
    from nvllm.leader.engine import LLMEngine
    from nvllm.leader.executor import Executor

    spec = SPEC if method == "ngram" else draft_spec(tiny)

    def make(die: bool):
        groups = []

        def start():
            w = FakeWorkers(copy_model)
            if die and not groups:  # the first group dies on its 3rd verify plan
                n = [0]

                def die_on(plan):
                    n[0] += any(r.spec_token_ids for r in plan.running)
                    return n[0] >= 3
                w.die_on = die_on
            groups.append(w)
            return w

        config = EngineConfig(tiny("qwen3"), device="cpu", block_size=4, num_kv_blocks=64,
                              log_stats_interval_s=3600.0, restart_workers=True,
                              speculative_config=spec).finalize()
        return LLMEngine(config, Executor(config, start), tokenizer), groups

    got = []
    for die in (False, True):
        engine, groups = make(die)
        for i, (prompt, params) in enumerate(requests(tokenizer)):
            engine.submit(prompt_token_ids=prompt, params=params, request_id=f"r{i}")
        finished = []
        while engine.has_unfinished_requests():
            finished += engine.step().finished
            check_kv(engine, groups[-1].slot_tokens)
        assert len(groups) == (2 if die else 1)
        got.append(sorted((r.request_id, [(c.token_ids, c.text, c.finish_reason)
                                          for c in r.outputs]) for r in finished))
        engine.shutdown()
    assert got[0] == got[1]


def test_the_log_line_gives_the_mean_accepted_length(make_engine, tokenizer, caplog):
    import logging

    engine, _ = make_engine(copy_model, speculative_config=SPEC, log_stats_interval_s=0.0)
    ids = tokenizer(PASSAGE, add_special_tokens=False).input_ids
    engine.submit(prompt_token_ids=ids, params=SamplingParams(max_tokens=30), request_id="a")
    with caplog.at_level(logging.INFO, logger="nvllm.leader.stats"):
        while engine.has_unfinished_requests():
            engine.step()
    assert any("Speculative decoding: mean accepted length" in r.getMessage()
               for r in caplog.records)


def test_the_measured_gate_decides_each_step_and_sees_its_tokens(make_engine, tokenizer,
                                                                  scheduling):
    """With measure_throughput on, the gate is asked once per step and a step speculates
    only where it allows (and a sequence may propose); once it says no, plans carry no
    drafts; the gate is told every step's output tokens (accepted drafts included) and
    whether it speculated."""
    engine, workers = make_engine(copy_model, speculative_config=dict(
        SPEC, measure_throughput=True))
    gate = engine.spec_gate
    assert gate is not None
    seen: list[tuple[int, bool, int]] = []
    answers: list[bool] = []

    def allow(num_running: int) -> bool:
        answers.append(len(answers) < 7)  # yes for seven steps (the first prefills), then no
        return answers[-1]

    gate.allow = allow
    gate.record = lambda n, allowed, tokens, s, speculated: seen.append(
        (n, allowed and speculated, tokens))
    run_checked(engine, workers, tokenizer, max_tokens=40)
    st = engine.scheduler.spec_stats
    assert len(answers) == len(seen)  # asked once per step, told once per step
    assert all(a for a, (_, spec, _) in zip(answers, seen) if spec)
    assert 0 < st.num_drafts <= 6 and sum(s for _, s, _ in seen) >= 5
    assert sum(t for _, _, t in seen) == 40
    # No plan after the gate closed carries drafts (a plan or two may be built while
    # the last speculating step's result is taken).
    drafted = [i for i, p in enumerate(workers.plans) if any(r.spec_token_ids
                                                             for r in p.running)]
    assert drafted and max(drafted) < 9


# ---- the draft-model proposer's leader side (nvllm/leader/draft_proposer.py) ----------
# The fake workers draft as DraftRunner does (tests/support/fake_workers.py): the script's
# continuation, one draft in three wrong, within the row's blocks.


def draft_spec(tiny) -> dict:
    """A draft model with the target's vocabulary (the tiny target itself: the fake
    workers never load it)."""
    return {"model": tiny("qwen3"), "num_speculative_tokens": 4, "min_acceptance_rate": 0.0,
            "measure_throughput": False}


class DraftWrites:
    """After every step: each draft KV write since the last check went to a block of its
    own sequence (while that sequence runs), and, when no plan is in flight, to a slot
    past its computed tokens in a block the prefix cache does not hold (a slot the next
    steps recompute)."""

    def __init__(self) -> None:
        self.seen = 0
        self.checked = 0

    def __call__(self, engine, workers) -> None:
        running = {s.seq_id: s for s in engine.scheduler.running}
        bs = engine.kv.block_size
        for writes in workers.draft_writes[self.seen:]:
            for sid, pos, slot in writes:
                seq = running.get(sid)
                if seq is None:
                    continue  # finished or preempted since: its blocks went back
                assert slot // bs in seq.block_table, "a draft wrote outside its blocks"
                if not engine._inflight:
                    assert pos >= seq.num_computed_tokens
                    assert engine.kv.pool.blocks[slot // bs].block_hash is None
                    self.checked += 1
        self.seen = len(workers.draft_writes)


@pytest.mark.parametrize("blocks", [64, 30])  # 30 blocks of 4: preemption
def test_draft_model_outputs_equal_speculation_off(make_engine, tokenizer, tiny, blocks):
    kw = dict(num_kv_blocks=blocks, max_num_batched_tokens=64)
    base, _, _, steps0 = run(make_engine, tokenizer, **kw)
    writes = DraftWrites()
    got, e1, workers, steps1 = run(make_engine, tokenizer, after_step=writes,
                                   speculative_config=draft_spec(tiny), **kw)
    assert got == base
    st = e1.scheduler.spec_stats
    assert st.num_drafts > 0 and 0 < st.num_accepted_tokens < st.num_draft_tokens
    assert sum(a for _, _, a in workers.accepted) == st.num_accepted_tokens
    assert steps1 < steps0, "accepted drafts should save steps"
    assert writes.checked > 0 or e1.config.async_scheduling
    # The scheduler reserved lookahead slots: drafts are cut short by a row's blocks
    # only near its max_tokens (or, when blocks run out, where reserving them failed).
    runs = sum(len(d) for d in workers.drafts)
    assert workers.short_drafts < runs / 4
    if blocks == 30:
        assert e1.scheduler.num_preemptions > 0


def test_draft_model_drafts_come_from_the_previous_result(make_engine, tokenizer, tiny):
    """Each plan asks for k drafts (none where the sequence cannot use them), and every
    draft run a plan verifies is the one the workers drafted for that sequence in the plan
    before (cut to what fits max_tokens)."""
    engine, workers = make_engine(copy_model, speculative_config=draft_spec(tiny))
    run_checked(engine, workers, tokenizer, max_tokens=30)
    plans = workers.plans
    asked = [p.num_draft_tokens for p in plans if p.new_seqs or p.running]
    # k, until the step that computes the last position a token can follow
    assert asked[:-1] == [4] * (len(asked) - 1) and asked[-1] in (0, 4)
    verified = 0
    for i, plan in enumerate(plans):
        for r in plan.running:
            if r.spec_token_ids:
                d = list(r.spec_token_ids)
                assert d == workers.drafts[i - 1][r.seq_id][:len(d)]
                verified += 1
    assert verified > 3


def test_draft_model_paused_sequences_draft_nothing(make_engine, tokenizer, tiny):
    """A sequence paused for low acceptance is not drafted for (its plans leave it out of
    draft_seq_ids, and rank 0 drafts only for those listed), so pausing saves the draft
    model's work too; the engine then goes back to async scheduling where allowed."""
    def stray(sid, fs):  # prompt tokens, but never in the prompt's order
        prompt = fs.token_ids[:fs.num_prompt_tokens]
        return prompt[3 * (len(fs.token_ids) - fs.num_prompt_tokens) % len(prompt)]

    spec = dict(draft_spec(tiny), min_acceptance_rate=0.5, retry_after_tokens=1000)
    engine, workers = make_engine(stray, speculative_config=spec)
    workers.draft_wrong = 1  # every draft wrong
    run_checked(engine, workers, tokenizer, max_tokens=60)
    st = engine.scheduler.spec_stats
    assert 0 < st.num_drafts < 10 and st.num_accepted_tokens == 0
    asked = [bool(p.draft_seq_ids) for p in workers.plans if p.new_seqs or p.running]
    first_off = asked.index(False)
    assert first_off < 12 and not any(asked[first_off:])
    assert workers.num_drafted == sum(len(d) for ds in workers.drafts for d in ds.values())
    assert not any(workers.drafts[first_off + 1:])


def test_draft_model_drafts_nothing_while_the_gate_is_closed(make_engine, tokenizer, tiny):
    """Where the measured gate has speculation off, plans ask rank 0 for no drafts (they
    would be drafted and dropped unused) and reserve no lookahead slots; outputs are
    those of speculation off."""
    engine, workers = make_engine(copy_model, speculative_config=dict(
        draft_spec(tiny), measure_throughput=True))
    engine.spec_gate.allow = lambda n: False
    run_checked(engine, workers, tokenizer, max_tokens=30)
    assert not any(p.draft_seq_ids or p.num_draft_tokens for p in workers.plans)
    assert workers.num_drafted == 0 and engine.scheduler.spec_stats.num_drafts == 0
