"""Decode steps through the CUDA-graph runner, checked on CPU: a stand-in graph re-runs
the captured callable on replay (what a real graph does, minus the launch savings), so
the static buffers, the padding to the next captured size (slot -1: no KV written) and
the hand-off to the sampler are all exercised. Real capture runs in tests/e2e/test_cuda.py
on a GPU (scripts/device_check.sh). The model runs the Triton kernels (interpreted on
CPU), the only backend graphs are used with."""

from __future__ import annotations

import pytest
import torch

from nvllm.common import worker_protocol as protocol
from nvllm.common.config import EngineConfig
from nvllm.worker.cuda_graph import capture_sizes
from nvllm.worker.model_runner import ModelRunner
from nvllm.worker.parallel import TPContext

pytest.importorskip("triton")


class ReplayingGraph:
    """A graph stand-in: capture runs fn once and keeps its output tensor; replay runs
    fn again and writes into that same tensor, as a replayed graph would."""

    replays = 0

    def capture(self, fn):
        self.fn = fn
        self.out = fn()
        return self.out

    def replay(self) -> None:
        ReplayingGraph.replays += 1
        self.out.copy_(self.fn())


def test_capture_sizes():
    assert capture_sizes(1) == [1]
    assert capture_sizes(6) == [1, 2, 4, 6]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert capture_sizes(512)[-3:] == [496, 504, 512] and len(capture_sizes(512)) == 67


def make_runner(model: str) -> ModelRunner:
    cfg = EngineConfig(model, device="cpu", dtype="float32", attention_backend="triton",
                       block_size=4, max_num_seqs=6, max_model_len=48).finalize()
    runner = ModelRunner(cfg, TPContext(), torch.device("cpu"))
    runner.init_kv_cache(40)
    return runner


def test_graph_decode_equals_eager(tiny):
    model = tiny("qwen3")
    eager, graphed = make_runner(model), make_runner(model)
    assert eager.graphs is None  # CPU: never by default
    graphed.capture_graphs(ReplayingGraph)
    assert sorted(graphed.graphs.graphs) == [1, 2, 4, 6]
    greedy = protocol.WorkerSampling()
    lens = [3, 7, 5, 9, 2]
    new = [protocol.NewSeq(i, [10 + i + j for j in range(n)], n, 0, n,
                           list(range(3 * i, 3 * i + 3)), greedy)
           for i, n in enumerate(lens)]
    plans = [protocol.StepPlan.of(1, new, [], [])]
    # Decodes of 5 sequences (padded to 6), then 3 (padded to 4), with new blocks.
    for step in range(2, 8):
        ids = range(5) if step < 5 else (0, 2, 4)
        drops = [1, 3] if step == 5 else []
        plans.append(protocol.StepPlan.of(step, [], [protocol.RunningSeq(i, 1, [])
                                                  for i in ids], drops))
    replays_before = ReplayingGraph.replays
    for plan in plans:
        # Each rank decodes its own copy of a plan (runners keep the lists they get).
        wire = protocol.encode(plan)
        a, b = eager.execute(protocol.decode(wire)), graphed.execute(protocol.decode(wire))
        assert (a.seq_ids, a.token_ids) == (b.seq_ids, b.token_ids), plan.step_id
    assert ReplayingGraph.replays - replays_before == len(plans) - 1  # every decode
    # Padded rows wrote nothing: the same slots hold K/V, with the same values (up to
    # the last bits: matmuls of a padded batch may sum in another order).
    written = eager.kv_cache.abs().sum((0, 1, 4, 5)) != 0  # [block, slot]
    assert torch.equal(written, graphed.kv_cache.abs().sum((0, 1, 4, 5)) != 0)
    torch.testing.assert_close(eager.kv_cache, graphed.kv_cache, rtol=1e-5, atol=1e-5)


def test_prefill_and_oversized_batches_run_eagerly(tiny):
    runner = make_runner(tiny("qwen3"))
    runner.capture_graphs(ReplayingGraph)
    g = runner.graphs
    assert g.can_run(6, 6, 12) and g.can_run(1, 1, 1)
    assert not g.can_run(7, 7, 1)  # beyond the largest graph
    assert not g.can_run(3, 5, 1)  # a prefill chunk among the decodes
    assert not g.can_run(2, 2, 13)  # block tables wider than the buffers
