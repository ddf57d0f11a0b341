"""fp8 checkpoints as vLLM / llm-compressor write them (``quant_method: fp8``), written
from a float checkpoint by this test suite's own quantizer, and their dequantized values.

Each linear weight W [N, K] becomes ``float8_e4m3fn`` q = W / scale rounded to nearest
(clamped to +-448) with ``weight_scale`` = absmax / 448 over the tensor (vLLM's
per-tensor scheme, shape [1]) or over each row ([N, 1]: per channel), plus an
``input_scale`` (static activations) that a weight-only loader must skip; value =
scale * q. The embedding, the head and the norms stay float (``ignored_layers``)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def quantize_fp8_ref(w: torch.Tensor, per_channel: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(q float8_e4m3fn [N, K], weight_scale float32 [N, 1] or [1])."""
    wf = w.float()
    amax = wf.abs().amax(1, keepdim=True) if per_channel else wf.abs().amax().reshape(1)
    s = (amax / 448).clamp(min=1e-12)
    q = (wf / (s if per_channel else s[0])).clamp(-448, 448).to(torch.float8_e4m3fn)
    return q, s


def write_fp8_checkpoint(model_dir: str | Path, out: Path, per_channel: bool = False
                         ) -> tuple[Path, Path]:
    """model_dir's linears as an fp8 checkpoint in ``out``, and the same model with those
    linears' dequantized values (scale * q) as a float checkpoint (``out``-deq)."""
    deq = out.with_name(out.name + "-deq")
    for d in (out, deq):
        shutil.copytree(model_dir, d)
    for f in Path(model_dir).glob("*.safetensors"):
        packed, dense = {}, {}
        for name, w in load_file(f).items():
            base = name[:-len(".weight")]
            if name.endswith(".weight") and base.rsplit(".", 1)[-1] in LINEARS:
                q, s = quantize_fp8_ref(w, per_channel)
                packed.update({name: q, f"{base}.weight_scale": s,
                               f"{base}.input_scale": torch.tensor([0.02])})
                dense[name] = (q.float() * s).to(w.dtype)
            else:
                packed[name] = dense[name] = w
        save_file(packed, out / f.name, metadata={"format": "pt"})
        save_file(dense, deq / f.name, metadata={"format": "pt"})
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "static",
                                  "ignored_layers": ["lm_head"]}
    (out / "config.json").write_text(json.dumps(cfg))
    return out, deq
