"""ModelRunner over a real (tiny) model: the plan sequences the leader sends, including a
sequence dropped and resumed in the same plan (preemption), keep every rank's state in
step with the leader's."""

from __future__ import annotations

import torch

from nvllm.common import worker_protocol as protocol
from nvllm.common.config import EngineConfig
from nvllm.worker.model_runner import ModelRunner
from nvllm.worker.parallel import TPContext


def make_runner(model: str) -> ModelRunner:
    cfg = EngineConfig(model, device="cpu", dtype="float32", block_size=4, max_num_seqs=2,
                       max_model_len=48).finalize()
    runner = ModelRunner(cfg, TPContext(), torch.device("cpu"))
    runner.init_kv_cache(40)
    return runner


def run(runner: ModelRunner, plan: protocol.StepPlan) -> protocol.StepResult:
    return runner.execute(protocol.decode(protocol.encode(plan)))


def test_a_sequence_resumed_in_the_plan_that_drops_it_stays_held(tiny):
    runner = make_runner(tiny("qwen3"))
    greedy = protocol.WorkerSampling()
    first = run(runner, protocol.StepPlan.of(1, [protocol.NewSeq(
        7, [11, 12, 13], 3, 0, 3, [0], greedy)], [], []))
    assert first.seq_ids == [7]
    # Preempted and resumed at once: dropped, then sent whole again with its token.
    tokens = [11, 12, 13, *first.token_ids]
    again = run(runner, protocol.StepPlan.of(2, [protocol.NewSeq(
        7, tokens, 3, 0, 4, [5, 6], greedy)], [], [7]))
    assert again.seq_ids == [7]
    # It is held: it decodes as a delta, and so does a third sequence beyond max_num_seqs.
    for step in range(3, 6):
        new = [protocol.NewSeq(8 + step, [20, 21], 2, 0, 2, [10 + step], greedy)]
        res = run(runner, protocol.StepPlan.of(step, new, [protocol.RunningSeq(7, 1, [])],
                                               []))
        assert sorted(res.seq_ids) == [7, 8 + step]
    assert runner.batch.tokens(runner.batch.row_of[7]).tolist()[:4] == tokens
