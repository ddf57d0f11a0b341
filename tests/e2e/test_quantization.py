"""quantization=int8 / int4 / fp8 on a float checkpoint: greedy tokens equal, token for
token, those of the same model whose linear weights were replaced by their dequantized
values (a checkpoint written here), at tp 1 and 2. Activations stay float32 in both
(pinned: NVLLM_QUANT_ACTIVATIONS=off, so decode steps do not take the int8-activation
op, whose logits tests/worker/test_quant_vnni.py bounds instead), so the two runs differ
only in float32 summation order. The real model's Q4_1 file kept quantized (the default,
quantization=auto) is tests/e2e/test_real_model.py's HF comparison. An AWQ checkpoint,
an fp8 checkpoint and a GGUF file of K-quants, under quantization=auto, against their
dequantized float models."""

from __future__ import annotations

import shutil
from pathlib import Path

import hf_ref
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from nvllm import LLM, SamplingParams
from nvllm.worker.gguf_weights import hf_name
from nvllm.worker.layers.fp8 import Fp8Weight, quantize_fp8
from nvllm.worker.layers.quant import ACT_ENV, QuantizedWeight, quantize
from nvllm.worker.quantize import AT_LOAD
from tests.support.fp8_checkpoints import write_fp8_checkpoint
from tests.support.gguf_files import KQUANT_MIX, write_kquant_gguf
from tests.support.int4_checkpoints import write_int4_checkpoint

pytestmark = pytest.mark.e2e


@pytest.fixture(autouse=True)
def float_activations(monkeypatch):
    """Token-for-token equality holds with float activations only (workers inherit it)."""
    monkeypatch.setenv(ACT_ENV, "off")

MAX_TOKENS = 16
TEXTS = ["The quick brown fox jumps over the lazy dog. " * 3, "Once upon a time",
         "Quantized weights are read in groups of thirty-two values."]
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def dequantized_checkpoint(model_dir: str, out: Path, mode: str) -> str:
    """model_dir with every linear weight replaced by quantize-then-dequantize of it (the
    values quantization=mode holds)."""
    shutil.copytree(model_dir, out)
    for f in out.glob("*.safetensors"):
        tensors = load_file(f)
        for name, w in tensors.items():
            if name.endswith(".weight") and any(f".{n}." in name for n in LINEARS):
                if mode != "fp8" and w.shape[1] % 32:
                    continue  # held dense: its input columns are not whole groups
                if mode == "fp8":
                    qw = Fp8Weight(*w.shape)
                    qw.write(0, 0, *quantize_fp8(w))
                else:
                    fmt = AT_LOAD[mode]
                    qw = QuantizedWeight(fmt, *w.shape)
                    qw.write(0, 0, *quantize(w, fmt))
                tensors[name] = qw.dequantize(dtype=w.dtype)
        save_file(tensors, f, metadata={"format": "pt"})
    return str(out)


def greedy(model: str, prompts: list[list[int]], tp: int, quantization: str) -> list[list[int]]:
    with LLM(model, device="cpu", dtype="float32", tensor_parallel_size=tp,
             quantization=quantization, max_num_batched_tokens=32, block_size=8) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS,
                                           ignore_eos=True), use_tqdm=False)
    assert all(o.error is None for o in outs)
    return [o.token_ids for o in outs]


# (An engine start costs ~10 s here: each mode runs at one tp; the layer contracts of
# tests/worker/test_quant.py cover both formats at tp 1 and 2.)
# fp8 at tp 2: its row-parallel shards take their full rows' scales, so they hold the
# values the whole tensors quantize to.
@pytest.mark.parametrize("mode,tp", [("int8", 2), ("int4", 1), ("fp8", 2)])
def test_quantized_at_load_equals_dequantized_checkpoint(tiny, tmp_path, mode, tp):
    model = tiny("qwen3")
    tok = hf_ref.hf_tokenizer(model)
    prompts = [tok(t).input_ids for t in TEXTS]
    deq = dequantized_checkpoint(model, tmp_path / "deq", mode)
    # every linear weight changed (else the comparison would prove nothing)
    for f in Path(model).glob("*.safetensors"):
        orig, new = load_file(f), load_file(Path(deq) / f.name)
        changed = [n for n in orig if any(f".{x}." in n for x in LINEARS)
                   and not orig[n].equal(new[n])]
        assert len(changed) == 7 * 2  # 7 linears x 2 layers
    want = greedy(deq, prompts, 1, "none")
    assert greedy(model, prompts, tp, mode) == want, f"{mode} tp={tp}"


def test_moe_experts_quantized_at_load_equal_dequantized_checkpoint(tiny, tmp_path):
    """int8 at load on the tiny MoE preset (experts per expert in the checkpoint): the
    experts' gate/up held int8+min, their down_proj (48 input columns) and the router
    dense, a dense MLP layer quantized too; greedy equals the dequantized checkpoint's."""
    model = tiny("qwen3-moe")
    tok = hf_ref.hf_tokenizer(model)
    prompts = [tok(t).input_ids for t in TEXTS]
    deq = dequantized_checkpoint(model, tmp_path / "deq", "int8")
    for f in Path(model).glob("*.safetensors"):  # the experts' gate / up values changed
        orig, new = load_file(f), load_file(Path(deq) / f.name)
        changed = [n for n in orig if ".experts." in n and not orig[n].equal(new[n])]
        assert len(changed) == 2 * 5 * 2  # 2 MoE layers x 5 experts x (gate, up)
    assert greedy(model, prompts, 1, "int8") == greedy(deq, prompts, 1, "none")


def test_awq_checkpoint_greedy_equals_its_dequantized_float_checkpoint(qwen3_h256, tmp_path):
    """An AWQ checkpoint (tests/support/int4_checkpoints.py's packer, group 128) under
    quantization=auto, its linears held int4+min32: token for token the greedy output of
    the same model with those linears' dequantized values as a float checkpoint."""
    packed, deq = write_int4_checkpoint(qwen3_h256, tmp_path / "awq", "awq")
    tok = hf_ref.hf_tokenizer(str(qwen3_h256))
    prompts = [tok(t).input_ids for t in TEXTS]
    assert greedy(str(packed), prompts, 1, "auto") == greedy(str(deq), prompts, 1, "none")


def test_fp8_checkpoint_greedy_equals_its_dequantized_float_checkpoint(tiny, tmp_path):
    """A vLLM-style fp8 checkpoint (per-tensor weight scales, static input scales) under
    quantization=auto, its e4m3 bytes held as they are: token for token the greedy output
    of the same model with those linears' values scale * q as a float checkpoint."""
    packed, deq = write_fp8_checkpoint(tiny("qwen3"), tmp_path / "fp8")
    tok = hf_ref.hf_tokenizer(str(packed))
    prompts = [tok(t).input_ids for t in TEXTS]
    assert greedy(str(packed), prompts, 1, "auto") == greedy(str(deq), prompts, 1, "none")


def test_kquant_gguf_greedy_matches_its_dequantized_float_model(qwen3_h256, tmp_path):
    """A GGUF file of random K-quant tensors (every type: Q4_K_M's mix plus Q2_K, Q3_K,
    Q5_K) under quantization=auto, held in groups of 32 with the bounded error of
    nvllm/worker/gguf_kquants.py: greedy equals HF's on the dequantized float model
    (gguf.quants.dequantize written as safetensors), up to a near-tie."""
    values = write_kquant_gguf(qwen3_h256, tmp_path / "k.gguf", KQUANT_MIX,
                               np.random.default_rng(0))
    deq = tmp_path / "deq"
    shutil.copytree(qwen3_h256, deq)
    for f in deq.glob("*.safetensors"):
        tensors = load_file(f)
        for g, v in values.items():
            name = hf_name(g)[0]
            if name in tensors:
                tensors[name] = torch.from_numpy(v)
        save_file(tensors, f, metadata={"format": "pt"})
    tok = hf_ref.hf_tokenizer(str(qwen3_h256))
    prompts = [tok(t).input_ids for t in TEXTS]
    got = greedy(str(tmp_path / "k.gguf"), prompts, 1, "auto")
    for p, g in zip(prompts, got):
        ref = hf_ref.greedy(str(deq), p, MAX_TOKENS)
        assert hf_ref.greedy_mismatch(str(deq), p, g, ref) is None
