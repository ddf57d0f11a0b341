"""DecodeStack (csrc/cpu_decode_stack.cpp, worker/models/decode_stack.py): every decoder
layer of a decode step in one native call computes bit for bit what the per-layer path
computes, serves the steps it should, and steps aside for the rest."""

from __future__ import annotations

import pytest
import torch

from nvllm.common import worker_protocol as P
from nvllm.common.config import EngineConfig
from nvllm.kernels import cpu_ops
from nvllm.worker.layers import quant
from nvllm.worker.model_runner import ModelRunner
from nvllm.worker.models import decode_stack
from nvllm.worker.parallel import TPContext

pytestmark = pytest.mark.skipif(not cpu_ops.load(), reason="nvllm's CPU ops are not built")

GREEDY = P.WorkerSampling()
# Checkpoints whose linears' inputs are whole groups of 32 (so they load quantized):
# SmolLM2's grouping (3 query heads per KV head), and a sliding window over 2 layers.
SHAPES = {
    "llama-g3": {"arch": "llama", "hidden_size": 96, "intermediate_size": 160,
                 "num_attention_heads": 6, "num_key_value_heads": 2, "head_dim": 16},
    "mistral-sw": {"arch": "mistral", "sliding_window": 16},
    "llama": {"arch": "llama"},
    "qwen3": {"arch": "qwen3", "head_dim": 32},
}


@pytest.fixture(scope="module")
def model(tiny_root):
    from nvllm.launch.tiny import make_tiny_checkpoint

    def get(name: str) -> str:
        path = tiny_root / f"stack-{name}"
        if not (path / "config.json").exists():
            kw = dict(SHAPES[name])
            make_tiny_checkpoint(path, kw.pop("arch"), **kw)
        return str(path)

    return get


def make_runner(model: str, quantization: str, dtype: str = "float32", kv: str = "auto",
                mirror: bool = False) -> ModelRunner:
    cfg = EngineConfig(model, device="cpu", dtype=dtype, block_size=8, max_num_seqs=4,
                       max_model_len=96, quantization=quantization, kv_cache_dtype=kv,
                       cpu_kv_mirror=mirror, attention_backend="cpu").finalize()
    runner = ModelRunner(cfg, TPContext(), torch.device("cpu"))
    runner.init_kv_cache(48)
    return runner


def plans() -> list[P.StepPlan]:
    """Two prompts (their prefill takes the per-layer path), one joining later as a
    short chunk of 3 (a 3-row run the paged kernel serves), then decode steps."""
    out = [P.StepPlan.of(1, [P.NewSeq(1, list(range(3, 23)), 20, 0, 20, [0, 1, 2], GREEDY),
                             P.NewSeq(2, list(range(40, 51)), 11, 0, 11, [3, 4], GREEDY)],
                         [], [])]
    lens = {1: 20, 2: 11}
    blocks = {1: 3, 2: 2}
    nxt = 5
    for step in range(2, 14):
        new = []
        if step == 4:
            new = [P.NewSeq(3, [7, 8, 9], 3, 0, 3, [nxt], GREEDY)]
            lens[3], blocks[3], nxt = 3, 1, nxt + 1
        running = []
        for sid in (1, 2, 3):
            if sid not in lens or (sid == 3 and step == 4):
                continue
            grow = []
            if lens[sid] % 8 == 0:
                grow, blocks[sid], nxt = [nxt], blocks[sid] + 1, nxt + 1
            lens[sid] += 1
            running.append(P.RunningSeq(sid, 1, grow))
        out.append(P.StepPlan.of(step, new, running, []))
    return out


def trace(runner: ModelRunner, stacked: bool, monkeypatch) -> tuple[list, int]:
    """The hidden states every step of plans() samples from, and how many steps the
    stack served."""
    monkeypatch.setattr(decode_stack, "_ENABLED", [stacked])
    hiddens, served = [], [0]
    sample, real_run = runner._sample, decode_stack.run

    def keep(plan, step, hidden, *a):
        hiddens.append(hidden.clone())
        return sample(plan, step, hidden, *a)

    def counted(*a):
        out = real_run(*a)
        served[0] += out is not None
        return out

    monkeypatch.setattr(runner, "_sample", keep)
    monkeypatch.setattr(decode_stack, "run", counted)
    for plan in plans():
        runner.execute(P.decode(P.encode(plan)))
    monkeypatch.undo()
    return hiddens, served[0]


# (the pages read in place unless `mirror`: each sequence's contiguous copy; acts: the
# activation mode, so each linear op serves decode rows somewhere: auto = int16)
@pytest.mark.parametrize("preset,quantization,dtype,kv,acts,mirror", [
    ("llama-g3", "int4", "float32", "auto", "off", False),
    ("llama-g3", "int4", "float32", "bfloat16", "int8", False),
    ("llama-g3", "int4", "float32", "bfloat16", "auto", True),
    ("mistral-sw", "int8", "float32", "auto", "int8", False),
    ("mistral-sw", "int8", "float32", "auto", "auto", False),
    ("mistral-sw", "int8", "float32", "auto", "off", True),
    ("llama", "int4", "bfloat16", "auto", "auto", False),
])
def test_the_stack_computes_what_the_layers_compute(model, monkeypatch, preset, quantization,
                                                    dtype, kv, acts, mirror):
    monkeypatch.setattr(quant, "_ACT", [acts])
    path = model(preset)
    ref, served_ref = trace(make_runner(path, quantization, dtype, kv, mirror), False,
                            monkeypatch)
    monkeypatch.setattr(quant, "_ACT", [acts])
    got, served = trace(make_runner(path, quantization, dtype, kv, mirror), True, monkeypatch)
    assert served_ref == 0
    assert served == len(plans()) - 1  # every step after the prefill
    assert len(got) == len(ref)
    for i, (a, b) in enumerate(zip(got, ref)):
        assert torch.equal(a, b), f"step {i + 1}: hidden states differ"


def test_models_it_does_not_fit_take_the_layers(model, monkeypatch):
    # Dense weights (quantization off) and q/k norms (Qwen3) are not the stack's.
    for preset, quantization in (("llama", "none"), ("qwen3", "int4")):
        runner = make_runner(model(preset), quantization)
        _, served = trace(runner, True, monkeypatch)
        assert served == 0
        assert decode_stack.build(runner.model) is None
    # Activations the native ops do not take (float16) never reach the model's stack.
    x = torch.zeros(1, 64, dtype=torch.float16)
    assert decode_stack.run(None, x, torch.zeros(1, dtype=torch.long), None) is None


def test_a_new_kv_cache_rebuilds_the_stack(model, monkeypatch):
    runner = make_runner(model("llama"), "int4")
    trace(runner, True, monkeypatch)
    first = runner.model.__dict__[decode_stack._ATTR]
    assert first and first[0].num_layers() == len(runner.model.layers)
    runner.init_kv_cache(48)  # the stack's caches are gone: it is dropped
    assert decode_stack._ATTR not in runner.model.__dict__
    _, served = trace(runner, True, monkeypatch)
    assert served == len(plans()) - 1
    held = runner.model.__dict__[decode_stack._ATTR]
    assert held[1] is runner.model.layers[0].self_attn.attn.k_cache


def test_off_by_environment(monkeypatch):
    monkeypatch.setattr(decode_stack, "_ENABLED", [])
    monkeypatch.setenv(decode_stack.ENV, "0")
    assert not decode_stack.enabled()
