"""MoE experts quantized at load (quantize.quantize_experts, layers/moe.py): every rank's
experts hold exactly what quantizing each expert's full weight gives, for per-expert and
fused checkpoint layouts, tensor- and expert-parallel; a projection whose rank-local
input is not whole groups of 32 stays dense; the layer's output equals the dense layer's
on the dequantized weights within float32 summation's bound."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig

from nvllm.common.model_source import resolve_model_source
from nvllm.launch.tiny import PRESETS, make_tiny_checkpoint
from nvllm.worker.layers import quant
from nvllm.worker.layers.moe import SparseMoE
from nvllm.worker.layers.quant import QuantizedWeight, quantize
from nvllm.worker.loader import load_weights
from nvllm.worker.models import MODEL_REGISTRY
from nvllm.worker.parallel import TPContext
from nvllm.worker.quantize import AT_LOAD, quantize_model


def _model(cfg, rank: int, tp: int, ep: bool):
    return MODEL_REGISTRY[cfg.architectures[0]](cfg, TPContext(rank, tp), torch.float32, 64,
                                                "torch", expert_parallel=ep)


def _deq(w: torch.Tensor, mode: str) -> torch.Tensor:
    qw = QuantizedWeight(AT_LOAD[mode], *w.shape)
    qw.write(0, 0, *quantize(w, AT_LOAD[mode]))
    return qw.dequantize()


# mixtral: hidden 64, intermediate 128 (both projections quantize at tp 2); qwen3-moe:
# intermediate 48, so down_proj's input (48, or 24 a rank) stays dense.
@pytest.mark.parametrize("preset,fused,tp,ep,mode", [
    ("mixtral", False, 2, False, "int8"), ("mixtral", True, 2, True, "int4"),
    ("qwen3-moe", True, 1, False, "int4")])
def test_experts_hold_each_expert_quantized(tmp_path, monkeypatch, preset, fused, tp, ep,
                                            mode):
    monkeypatch.setattr(quant, "_ACT", ["off"])  # float activations: equal to dense
    path = make_tiny_checkpoint(tmp_path / preset, **PRESETS[preset], fused_experts=fused)
    source = resolve_model_source(str(path))
    cfg = AutoConfig.from_pretrained(path)
    tensors = load_file(next(path.glob("*.safetensors")))
    moe_names = [n for n in tensors if ".experts." in n]
    assert moe_names and any(n.endswith("experts.gate_up_proj") for n in moe_names) == fused
    torch.manual_seed(0)
    for rank in range(tp):
        ours, dense = _model(cfg, rank, tp, ep), _model(cfg, rank, tp, ep)
        done = quantize_model(ours, source, mode)
        experts = {n for n in done if n.endswith(".experts")}
        assert experts and {done[n] for n in experts} == {AT_LOAD[mode].name}
        load_weights(ours, source, show_progress=False)
        load_weights(dense, source, show_progress=False)
        pairs = [(m, dict(dense.named_modules())[n]) for n, m in ours.named_modules()
                 if isinstance(m, SparseMoE)]
        for q, d in pairs:
            assert q.q13 is not None and (q.q2 is not None) == (preset == "mixtral")
            w13 = d.experts.gate_up_proj.data.clone()  # the dense values, this rank's
            for e, view in enumerate(q.q13):
                # each expert's gate and up rows quantized as wholes (rows are independent)
                assert torch.equal(view.dequantize(), _deq(w13[e], mode)), (rank, e)
                d.experts.gate_up_proj.data[e] = view.dequantize()
            for e, view in enumerate(q.q2 or []):
                assert torch.equal(view.dequantize(), _deq(d.experts.down_proj[e], mode))
                d.experts.down_proj.data[e] = view.dequantize()
            x = torch.randn(7, cfg.hidden_size)
            torch.testing.assert_close(q.partial(x), d.partial(x), rtol=1e-5, atol=1e-5)


def test_gguf_experts_quantize_from_their_values(tiny, tmp_path):
    """A GGUF file's stacked expert tensors (read per expert, as float values) quantize at
    load to what the HF checkpoint's experts quantize to, at tp 2."""
    from pathlib import Path

    from nvllm.common.model_source import ModelSource
    from tests.support.gguf_files import write_split_gguf

    model_dir = Path(tiny("qwen3-moe"))
    [path] = write_split_gguf(model_dir, "qwen3moe", tmp_path, parts=1)
    source = ModelSource(str(path), "gguf", str(model_dir), str(model_dir), (str(path),))
    cfg = AutoConfig.from_pretrained(model_dir)
    for rank in range(2):
        ours, ref = _model(cfg, rank, 2, False), _model(cfg, rank, 2, False)
        assert "layers.0.mlp.experts" in quantize_model(ours, source, "int8")
        quantize_model(ref, resolve_model_source(str(model_dir)), "int8")
        load_weights(ours, source, show_progress=False)
        load_weights(ref, model_dir, show_progress=False)
        for e, view in enumerate(ours.layers[0].mlp.q13):
            assert torch.equal(view.dequantize(), ref.layers[0].mlp.q13[e].dequantize())
