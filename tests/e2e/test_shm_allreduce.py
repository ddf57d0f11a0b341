"""An engine at tp=2 on CPU takes its collectives through shared memory by default
(nvllm/worker/shm_allreduce.py), and that changes nothing: two ranks' sums are the same
whichever adds them, so tokens and logprobs equal gloo's bit for bit (micro-batch overlap
forced on, prompt logprobs through the gathered logits); the segment is already unlinked
while the engine runs, and the workers map it only with the setting on."""

from __future__ import annotations

import os

import pytest

from nvllm import LLM, SamplingParams
from nvllm.worker.shm_allreduce import supported_here

pytestmark = [pytest.mark.e2e,
              pytest.mark.skipif(not supported_here(), reason="x86 with POSIX shm only")]

TEXTS = ["Hi", "Once upon a time", "The quick brown fox jumps over the lazy dog. " * 6,
         "Tensor parallel layers split the weights of every matrix across ranks."]


def test_shared_memory_collectives_change_no_token(tiny, procs):
    model = tiny("qwen3")
    params = SamplingParams(temperature=0.0, max_tokens=16, logprobs=3, prompt_logprobs=2)
    got = {}
    for on in (True, False):
        with LLM(model, device="cpu", dtype="float32", block_size=8, tensor_parallel_size=2,
                 micro_batch_min_tokens=8, cpu_shm_allreduce=on) as llm:
            workers = procs.worker_pids_of(os.getpid())
            assert len(workers) == 2
            for pid in workers:
                with open(f"/proc/{pid}/maps") as f:
                    mapped = "/dev/shm/nvllm-ar-" in f.read()
                assert mapped == on, f"worker {pid}: shared-memory segment mapped {mapped}"
            assert not [n for n in os.listdir("/dev/shm") if n.startswith(
                f"nvllm-ar-{os.getpid()}-")], "the segment must be unlinked once mapped"
            outs = llm.generate(TEXTS, params, use_tqdm=False)
        assert all(o.error is None for o in outs)
        got[on] = [(o.token_ids, o.outputs[0].logprobs, o.prompt_logprobs) for o in outs]
    assert got[True] == got[False]
