"""sleep / wake_up on CUDA (skipped without a GPU; run by scripts/device_check.sh): level
1 moves the weights to pinned host memory and frees the device's copy, the KV cache and
the CUDA graphs, and the wake gives the same greedy tokens (graphs captured again on the
moved weights); level 2 frees the weights too, and an update brings them back."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from nvllm import LLM, SamplingParams
from nvllm.common.model_source import safetensors_files

pytestmark = [pytest.mark.e2e,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

PROMPTS = [[1, 5, 9, 200, 17, 33, 4, 81, 99], [400, 12, 7]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def test_cuda_sleep_both_levels(tiny):
    folder = tiny("qwen3")
    tensors: dict[str, torch.Tensor] = {}
    for f in safetensors_files(folder):
        tensors.update(load_file(str(f)))
    params = sum(t.numel() * 4 for t in tensors.values())
    with LLM(folder, device="cuda", dtype="float32", block_size=16, num_kv_blocks=64) as llm:
        def run() -> list[list[int]]:
            outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY,
                                use_tqdm=False)
            return [o.token_ids for o in outs]

        before = run()
        slept = llm.sleep(level=1)
        assert slept.weights_bytes >= params and slept.kv_cache_bytes > 0
        woke = llm.wake_up()
        assert woke.weights_bytes == slept.weights_bytes
        assert woke.device_bytes >= slept.device_bytes + woke.weights_bytes
        assert run() == before

        slept = llm.sleep(level=2)
        assert slept.weights_bytes >= params
        woke = llm.wake_up()
        assert woke.weights_missing == len(tensors)
        llm.update_weights(tensors, weight_version="back")
        assert run() == before
