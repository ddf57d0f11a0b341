"""DraftRunner (rank 0's draft model): its drafts are the draft model's greedy
continuation (checked against HF transformers), and its decode steps write KV only at the
lookahead slots inside the sequence's own blocks, never past them or max_model_len."""

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
def prefill_and_draft(r, blocks: list[int], k: int = 4) -> tuple[list[int], torch.Tensor]:
    """The draft's forward over PROMPT (as after the target's prefill step), NEWEST
    appended, then k drafts; returns them and which [block, offset] slots changed."""
    b = InputBatch(4, 64, 16, BS, 1024, 16)
    step = b.apply(protocol.StepPlan.of(
        1, [protocol.NewSeq(1, PROMPT, len(PROMPT), 0, len(PROMPT), blocks)], [], []))
    r.forward(step)
    rows = step.rows[step.sample_idx]
    b.append_sampled(rows, np.array([NEWEST]))
    before = r.kv_cache.clone()
    drafts = r.propose(b, rows, k)[0]
    changed = (r.kv_cache != before).any(-1).any(-1).any(0).any(0)  # [blocks, BS]
    return drafts, changed


def hf_greedy(model: str, n: int) -> list[int]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    ids = torch.tensor([PROMPT + [NEWEST]])
    with torch.no_grad():
        out = hf.generate(ids, max_new_tokens=n, do_sample=False,
                          attention_mask=torch.ones_like(ids))
    return out[0, ids.shape[1]:].tolist()


def test_drafts_are_the_greedy_continuation(tiny):
    r = runner(tiny)
    drafts, changed = prefill_and_draft(r, [5, 2, 9, 11])  # room for positions 10..15
    assert drafts == hf_greedy(tiny("qwen3"), 4)
    # positions 10..13: block 9 offsets 2, 3, then block 11 offsets 0, 1
    want = torch.zeros_like(changed)
    want[9, 2:] = want[11, :2] = True
    assert changed.equal(want)


@pytest.mark.parametrize("blocks,max_len,n", [
    ([5, 2, 9], 64, 2),  # the row's blocks end at position 11: two drafts
    ([5, 2, 9, 11], 11, 1),  # max_model_len 11: position 10 only
    ([5, 2, 9, 11], 12, 2),  # max_model_len 12: positions 10 and 11 only
])
def test_drafts_stop_where_the_blocks_or_the_length_end(tiny, blocks, max_len, n):
    r = runner(tiny, max_len)
    drafts, changed = prefill_and_draft(r, blocks)
    assert len(drafts) == n
    assert int(changed.sum()) == n  # one slot per draft step, inside the row's blocks
    if n:
        assert changed[9, 2:2 + n].all()
