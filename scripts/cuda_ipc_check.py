"""Device check (scripts/device_check.sh): weight updates into a CUDA engine by CUDA IPC
handle (the trainer's GPU tensors, each worker opening the handle) and over a gloo
weight-update group, each then generating exactly what HF generates on the new weights.
Uses CuPy when installed, else scripts/cudart_cupy (the same calls over libcudart). One
GPU cannot check an NCCL group (NCCL refuses two ranks on one device)."""

from __future__ import annotations

import os
import pathlib
import socket
import sys
import tempfile
import threading

import torch
from safetensors.torch import load_file

HERE = pathlib.Path(__file__).parent
try:
    import cupy  # noqa: F401
except ImportError:
    sys.path.insert(0, str(HERE / "cudart_cupy"))
    os.environ["PYTHONPATH"] = os.pathsep.join([str(HERE / "cudart_cupy")] + sys.path)

from nvllm import LLM, SamplingParams  # noqa: E402
from nvllm.common.model_source import safetensors_files  # noqa: E402
from nvllm.launch.tiny import PRESETS, ensure_tiny_checkpoint, make_tiny_checkpoint  # noqa: E402
from nvllm.worker.weight_group import TrainerWeightGroup, describe  # noqa: E402

PROMPTS = [[1, 5, 9, 200, 17, 33, 4, 81, 99, 120, 7, 8], [400, 12, 7]]


def tensors(folder) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in safetensors_files(folder):
        out.update(load_file(str(f)))
    return out


def hf_greedy(folder: str) -> list[list[int]]:
    """HF's greedy tokens on the checkpoint in `folder` (loaded from it, never by
    load_state_dict: that would skip the names HF fuses on load without a word)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).cuda().eval()
    with torch.no_grad():
        return [model.generate(torch.tensor([p]).cuda(), do_sample=False, max_new_tokens=12,
                               min_new_tokens=12, pad_token_id=0)[0, len(p):].tolist()
                for p in PROMPTS]


def main() -> None:
    a = str(ensure_tiny_checkpoint("llama-9h3kv"))
    with tempfile.TemporaryDirectory() as tmp:
        b = make_tiny_checkpoint(tmp, **PRESETS["llama-9h3kv"], seed=1)
        ta, tb = tensors(a), tensors(b)
        want_a, want_b = hf_greedy(a), hf_greedy(str(b))
        params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        with LLM(a, device="cuda", dtype="float32", block_size=16, num_kv_blocks=24) as llm:
            def run() -> list[list[int]]:
                return [o.token_ids for o in llm.generate(
                    [{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)]

            assert run() == want_a, "engine on A differs from HF"
            on_gpu = {n: t.cuda() for n, t in tb.items()}
            col = next(n for n, t in on_gpu.items() if t.dim() == 2)
            on_gpu[col] = on_gpu[col].t().contiguous().t()  # column-major strides
            assert llm.update_weights(on_gpu, weight_version="ipc") == "ipc"
            assert run() == want_b, "after the CUDA IPC update: differs from HF on B"
            print("cuda ipc: update to B equals HF on B")

            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            group = TrainerWeightGroup("127.0.0.1", port, 2, backend="gloo", timeout_s=60)
            join = threading.Thread(target=llm.init_weight_update_group,
                                    args=("127.0.0.1", port, 1, 2),
                                    kwargs={"backend": "gloo", "timeout_s": 60})
            join.start()
            group.connect()
            join.join()
            names, dtypes, shapes = describe(sorted(ta.items()))
            push = threading.Thread(target=llm.update_weights_from_distributed,
                                    args=(names, dtypes, shapes))
            push.start()
            group.broadcast(ta[n] for n in names)
            push.join()
            assert run() == want_a, "after the gloo group update: differs from HF on A"
            print("gloo group into a CUDA engine: update to A equals HF on A")
    print("cuda ipc check: PASSED")


if __name__ == "__main__":
    main()
