"""DraftRunner (rank 0's draft model): its drafts are the draft model's greedy
continuation (checked against HF transformers), and its decode steps write KV only at the
lookahead slots inside the sequence's own blocks, never past them or max_model_len. Steps
in which nobody drafts run no draft forward; a sequence that drafts again is caught up
first (within the step budget), and a prefix hit on blocks the draft filled needs none."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from nvllm.common import worker_protocol as protocol
from nvllm.worker.input_batch import InputBatch

BS = 4
PROMPT = list(range(100, 110))  # 10 tokens
NEWEST = 7  # the token the target sampled after them (position 10)


def runner(tiny, max_model_len: int = 64):
    from nvllm.common.config import EngineConfig
    from nvllm.worker.draft_runner import DraftRunner

    model = tiny("qwen3")
    cfg = EngineConfig(model, device="cpu", dtype="float32", block_size=BS,
                       max_model_len=max_model_len,
                       speculative_config={"model": model, "num_speculative_tokens": 4}
                       ).finalize()
    r = DraftRunner(cfg, torch.device("cpu"), torch.float32, "torch")
    r.init_kv_cache(16, BS)
    return r


@torch.inference_mode()
def prefill_and_draft(r, blocks: list[int], k: int = 4, merge: bool = True
                      ) -> tuple[list[int], set[tuple[int, int]]]:
    """The prefill step of PROMPT with the target's token NEWEST appended (as the model
    runner has it after sampling), then DraftRunner.run; returns the drafts and the
    (block, offset) slots whose draft KV changed."""
    b = InputBatch(4, 64, 16, BS, 1024, 16)
    step = b.apply(protocol.StepPlan.of(
        1, [protocol.NewSeq(1, PROMPT, len(PROMPT), 0, len(PROMPT), blocks)], [], []))
    b.append_sampled(step.rows[step.sample_idx], np.array([NEWEST]))
    before = r.kv_cache.clone()
    drafts = r.run(step, b, [1], k, merge)[0]
    changed = (r.kv_cache != before).any(-1).any(-1).any(0).any(0)  # [blocks, BS]
    return drafts, {tuple(x) for x in changed.nonzero().tolist()}


def slots(blocks: list[int], n: int) -> set[tuple[int, int]]:
    """The (block, offset) slots of positions 0..n-1."""
    return {(blocks[p // BS], p % BS) for p in range(n)}


def hf_greedy(model: str, n: int, tail: tuple[int, ...] = ()) -> list[int]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    ids = torch.tensor([PROMPT + [NEWEST, *tail]])
    with torch.no_grad():
        out = hf.generate(ids, max_new_tokens=n, do_sample=False,
                          attention_mask=torch.ones_like(ids))
    return out[0, ids.shape[1]:].tolist()


@pytest.mark.parametrize("merge", [True, False])
def test_drafts_are_the_greedy_continuation(tiny, merge):
    """`merge`: the newest token joins the step's draft pass (a decode row) or gets a
    decode step of its own (as a verify row whose drafts were rejected): same drafts."""
    r = runner(tiny)
    blocks = [5, 2, 9, 11]  # room for positions 0..15
    drafts, changed = prefill_and_draft(r, blocks, merge=merge)
    assert drafts == hf_greedy(tiny("qwen3"), 4)
    assert changed == slots(blocks, len(PROMPT) + 4)  # the prompt's, then 10..13


def test_no_drafts_for_sequences_not_asked(tiny):
    r = runner(tiny)
    b = InputBatch(4, 64, 16, BS, 1024, 16)
    step = b.apply(protocol.StepPlan.of(
        1, [protocol.NewSeq(1, PROMPT, len(PROMPT), 0, len(PROMPT), [5, 2, 9])], [], []))
    b.append_sampled(step.rows[step.sample_idx], np.array([NEWEST]))
    with torch.inference_mode():
        assert r.run(step, b, [2], 4) == [[]]
        assert r.run(step, b, [1], 0) is None


@pytest.mark.parametrize("blocks,max_len,n", [
    ([5, 2, 9], 64, 2),  # the row's blocks end at position 11: two drafts
    ([5, 2, 9, 11], 11, 1),  # max_model_len 11: position 10 only
    ([5, 2, 9, 11], 12, 2),  # max_model_len 12: positions 10 and 11 only
])
def test_drafts_stop_where_the_blocks_or_the_length_end(tiny, blocks, max_len, n):
    r = runner(tiny, max_len)
    drafts, changed = prefill_and_draft(r, blocks)
    assert len(drafts) == n
    assert changed == slots(blocks, len(PROMPT) + n)  # nothing outside the row's blocks


def decode_step(b: InputBatch, step_id: int, seq_id: int, token: int):
    """A decode step of a held sequence (no new blocks), its sampled `token` appended."""
    step = b.apply(protocol.StepPlan.of(step_id, [], [protocol.RunningSeq(seq_id, 1, [])], []))
    b.append_sampled(step.rows[step.sample_idx], np.array([token]))
    return step


@torch.inference_mode()
def test_no_draft_pass_while_nobody_drafts_then_a_catch_up(tiny):
    """Prefill and a decode with no sequence asked: the draft's cache is untouched. Then a
    decode that asks, with a step budget of 5 catch-up tokens: two steps catch up
    (drafting nothing), the third drafts the greedy continuation of every token so far,
    and only then is the whole sequence's draft KV written."""
    r = runner(tiny)
    r.catch_up_budget = 5
    blocks = [5, 2, 9, 11, 14]
    b = InputBatch(4, 64, 16, BS, 1024, 16)
    step = b.apply(protocol.StepPlan.of(
        1, [protocol.NewSeq(1, PROMPT, len(PROMPT), 0, len(PROMPT), blocks)], [], []))
    b.append_sampled(step.rows[step.sample_idx], np.array([NEWEST]))
    before = r.kv_cache.clone()
    assert r.run(step, b, [], 4) == [[]] and r.run(step, b, [1], 0) is None
    assert r.run(decode_step(b, 2, 1, 3), b, [], 4) == [[]]
    assert torch.equal(r.kv_cache, before)
    drafted = [r.run(decode_step(b, s, 1, t), b, [1], 4) for s, t in ((3, 8), (4, 6))]
    assert drafted == [[[]], [[]]]  # positions 0..4, then 5..9, caught up
    assert r.draft_computed[0] == 10
    drafts = r.run(decode_step(b, 5, 1, 1), b, [1], 3)[0]
    assert drafts == hf_greedy(tiny("qwen3"), 3, (3, 8, 6, 1))
    changed = (r.kv_cache != before).any(-1).any(-1).any(0).any(0)
    # 0..13, then the drafts at 14..16
    assert {tuple(x) for x in changed.nonzero().tolist()} == slots(blocks, 17)


@pytest.mark.parametrize("filled", [True, False])
@torch.inference_mode()
def test_a_prefix_hit_is_caught_up_unless_the_draft_filled_its_blocks(tiny, filled):
    """Sequence 2 is admitted with a two-block prefix hit on sequence 1's blocks. Where
    sequence 1 drafted (the draft filled those blocks) its draft KV starts at the hit;
    where sequence 1's steps ran without the draft (or its blocks were written by the
    target since), the draft catches up from position 0. Either way: the greedy
    continuation."""
    r = runner(tiny)
    b = InputBatch(4, 64, 16, BS, 1024, 16)
    step = b.apply(protocol.StepPlan.of(
        1, [protocol.NewSeq(1, PROMPT, len(PROMPT), 0, len(PROMPT), [5, 2, 9])], [], []))
    b.append_sampled(step.rows[step.sample_idx], np.array([NEWEST]))
    r.run(step, b, [1] if filled else [], 2)
    seq2 = protocol.NewSeq(2, PROMPT, len(PROMPT), 8, 2, [5, 2, 12, 13])
    step = b.apply(protocol.StepPlan.of(2, [seq2], [], [1]))
    b.append_sampled(step.rows[step.sample_idx], np.array([NEWEST]))
    row = int(step.rows[0])
    r._admit(step, b)
    assert r.draft_computed[row] == (8 if filled else 0)
    assert r.run(step, b, [2], 4)[0] == hf_greedy(tiny("qwen3"), 4)
    assert r.draft_computed[row] == len(PROMPT)
