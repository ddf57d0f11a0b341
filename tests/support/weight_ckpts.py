"""Checkpoints A and B of one tiny preset (same shapes, other seeds) and HF's greedy
tokens on either, for the weight-update tests (tests/e2e/test_weight_update.py,
tests/e2e/test_weight_sources.py)."""

from __future__ import annotations

import functools
import os
import pathlib
import socket
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from nvllm import LLM, SamplingParams
from nvllm.common.model_source import safetensors_files

# KV-group heads and intermediate/vocabulary sizes tp=2 does not divide: the update goes
# through the loader's uneven sharding (fused q/k/v and gate/up included).
PRESET = "llama-9h3kv"
MAX_TOKENS = 12
PROMPTS = [[1, 5, 9, 200, 17, 33, 4, 81, 99, 120, 7, 8, 300, 12, 11, 64, 2, 3],
           [400, 12, 7], [1, 5, 9, 200, 17, 33, 4, 81, 99, 120, 7, 8, 300, 12, 11, 64, 5]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def ckpts(tiny, tmp_path_factory):
    """(A's folder, A's tensors, B's tensors, B's folder): B is A's preset with another
    seed."""
    from nvllm.launch.tiny import PRESETS, make_tiny_checkpoint

    a = tiny(PRESET)
    b = make_tiny_checkpoint(tmp_path_factory.mktemp("ckpt-b"), **PRESETS[PRESET], seed=1)
    return a, _tensors(a), _tensors(b), b


def _tensors(folder) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in safetensors_files(folder):
        out.update(load_file(str(f)))
    return out


@functools.cache
def _hf(folder: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


@torch.no_grad()
def hf_greedy(folder: str, state: dict[str, torch.Tensor], prompt: list[int],
              max_tokens: int = MAX_TOKENS) -> list[int]:
    """HF greedy tokens on `folder`'s architecture holding `state`. Every name of `state`
    must land in the model, and every model tensor but a tied lm_head must come from it:
    HF fuses some checkpoint tensors on load (transformers 5's per-expert MoE weights),
    and load_state_dict(strict=False) would skip those names silently, leaving the
    folder's weights in place; such a reference must load B's folder instead."""
    model = _hf(folder)
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = {"lm_head.weight"} if model.config.get_text_config().tie_word_embeddings \
        else set()
    if unexpected or set(missing) - tied:
        raise AssertionError(
            f"HF's {type(model).__name__} does not take these tensors by name (missing "
            f"{sorted(set(missing) - tied)[:4]}, unexpected {sorted(unexpected)[:4]}): "
            "build the reference with from_pretrained on a folder holding them")
    gen = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=max_tokens,
                         min_new_tokens=max_tokens, pad_token_id=0)
    return gen[0, len(prompt):].tolist()


def _run(llm: LLM) -> list:
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    assert all(o.error is None for o in outs)
    return outs


_REFS: dict[str, list[list[int]]] = {}


def hf_refs(folder: str, label: str, state: dict[str, torch.Tensor]) -> list[list[int]]:
    """HF greedy tokens of every prompt on `state`, once per label in the session."""
    if label not in _REFS:
        _REFS[label] = [hf_greedy(folder, state, p) for p in PROMPTS]
    return _REFS[label]


def tensors_of(folder) -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors checkpoint folder, by HF name."""
    return _tensors(folder)


def runner_on(folder: str, **kw):
    """A tp=1 CPU ModelRunner on `folder`, without an engine."""
    from nvllm.common.config import EngineConfig
    from nvllm.worker.model_runner import ModelRunner
    from nvllm.worker.parallel import TPContext

    cfg = EngineConfig(folder, device="cpu", dtype="float32", max_model_len=64,
                       **kw).finalize()
    return ModelRunner(cfg, TPContext(), torch.device("cpu"))


def held_params(runner) -> dict[str, torch.Tensor]:
    """Every parameter as the layers hold it (a oneDNN-packed weight unpacked)."""
    out = {}
    for name, p in runner.model.named_parameters():
        module = runner.model.get_submodule(name.rsplit(".", 1)[0])
        packed = getattr(module, "packed", None)
        if p.numel() == 0 and isinstance(packed, torch.Tensor):
            out[name] = packed.to_dense().clone()
        else:
            out[name] = p.detach().clone()
    return out


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_trainer(port: int, world: int, *folders) -> subprocess.Popen:
    """The trainer, rank 0 of a weight-update group, in a process of its own
    (group_trainer.py: it broadcasts the first folder's tensors in sorted name order)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    script = pathlib.Path(__file__).parent / "group_trainer.py"
    return subprocess.Popen([sys.executable, str(script), str(port), str(world),
                             *map(str, folders)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def group_specs(state: dict[str, torch.Tensor]) -> tuple[list, list, list]:
    """update_weights_from_distributed's names, dtypes and shapes, in the trainer's
    broadcast order."""
    names = sorted(state)
    return names, [str(state[n].dtype).removeprefix("torch.") for n in names], \
        [list(state[n].shape) for n in names]


def finish_trainer(proc: subprocess.Popen, code: int) -> None:
    """Wait for the trainer (60 s at most) and check its exit status."""
    try:
        _out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == code, err[-2000:]
