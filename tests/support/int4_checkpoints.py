"""AWQ / GPTQ checkpoints written from float weights by a reference packer of this test
suite's own (AutoAWQ's GEMM layout, AutoGPTQ's v1 layout), and their dequantized values.

Round-to-nearest, asymmetric per group of input columns (the packing, not AWQ's scale
search or GPTQ's error feedback, is what a loader must get right): scale = (max - min) /
15 in fp16, z = round(-min / scale) in 0..15, q = clamp(round(w / scale) + z, 0, 15);
value = scale * (q - z)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # nibble i of an int32 holds column AWQ_ORDER[i]
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def quantize_rtn(w: torch.Tensor, group: int, zmin: int = 0
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """W [N, K] -> (q [N, K], z [N, K / group], scale fp16 [N, K / group]); zero points
    from ``zmin`` (GPTQ v1 stores z - 1 in 4 bits: a zero of 0 would read back as 16)."""
    n, k = w.shape
    g = w.float().reshape(n, k // group, group)
    lo, hi = g.amin(-1).clamp(max=0), g.amax(-1).clamp(min=0)
    s = ((hi - lo) / 15).clamp(min=1e-4).half()
    z = torch.round(-lo / s.float()).clamp(zmin, 15)
    q = torch.clamp(torch.round(g / s.float().unsqueeze(-1)) + z.unsqueeze(-1), 0, 15)
    return q.reshape(n, k).int().numpy(), z.int().numpy(), s.numpy()


def dequantize_ref(q: np.ndarray, z: np.ndarray, s: np.ndarray, group: int) -> torch.Tensor:
    """scale * (q - z), float32 [N, K]."""
    zz, ss = np.repeat(z, group, axis=1), np.repeat(s.astype(np.float32), group, axis=1)
    return torch.from_numpy(ss * (q - zz).astype(np.float32))


def _pack_cols(v: np.ndarray, order: list[int]) -> np.ndarray:
    """[R, C] nibbles -> int32 [R, C / 8], column 8c + order[i] at nibble i."""
    r, c = v.shape
    out = np.zeros((r, c // 8), np.uint32)
    for i, j in enumerate(order):
        out |= (v[:, j::8].astype(np.uint32) & 0xF) << np.uint32(4 * i)
    return out.view(np.int32)


def pack_awq(q: np.ndarray, z: np.ndarray, s: np.ndarray) -> dict[str, torch.Tensor]:
    return {"qweight": torch.from_numpy(_pack_cols(q.T.copy(), AWQ_ORDER)),
            "qzeros": torch.from_numpy(_pack_cols(z.T.copy(), AWQ_ORDER)),
            "scales": torch.from_numpy(s.T.copy())}


def pack_gptq(q: np.ndarray, z: np.ndarray, s: np.ndarray, group: int
              ) -> dict[str, torch.Tensor]:
    """GPTQ v1: qweight packed along the input, zeros stored minus one."""
    qt = q.T  # [K, N]
    words = np.zeros((qt.shape[0] // 8, qt.shape[1]), np.uint32)
    for j in range(8):
        words |= qt[j::8].astype(np.uint32) << np.uint32(4 * j)
    k = qt.shape[0]
    return {"qweight": torch.from_numpy(words.view(np.int32)),
            "qzeros": torch.from_numpy(_pack_cols((z.T - 1).copy(), list(range(8)))),
            "scales": torch.from_numpy(s.T.copy()),
            "g_idx": torch.arange(k, dtype=torch.int32) // group}


def write_int4_checkpoint(model_dir: str | Path, out: Path, method: str, group: int = 128
                          ) -> tuple[Path, Path]:
    """model_dir's linears packed as ``method`` into ``out``, and the same model with
    those linears' dequantized values as a float checkpoint (``out``-deq)."""
    deq = out.with_name(out.name + "-deq")
    for d in (out, deq):
        shutil.copytree(model_dir, d)
    for f in Path(model_dir).glob("*.safetensors"):
        tensors = load_file(f)
        packed, dense = {}, {}
        for name, w in tensors.items():
            base = name[:-len(".weight")]
            if name.endswith(".weight") and base.rsplit(".", 1)[-1] in LINEARS:
                q, z, s = quantize_rtn(w, group, zmin=0 if method == "awq" else 1)
                parts = pack_awq(q, z, s) if method == "awq" else pack_gptq(q, z, s, group)
                packed.update({f"{base}.{k}": v for k, v in parts.items()})
                dense[name] = dequantize_ref(q, z, s, group).to(w.dtype)
            else:
                packed[name] = dense[name] = w
        save_file(packed, out / f.name, metadata={"format": "pt"})
        save_file(dense, deq / f.name, metadata={"format": "pt"})
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"] = (
        {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True,
         "version": "gemm"} if method == "awq" else
        {"quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": False,
         "sym": False, "checkpoint_format": "gptq"})
    (out / "config.json").write_text(json.dumps(cfg))
    return out, deq
