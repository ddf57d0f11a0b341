"""Neox-style rotary embedding with a precomputed cos/sin cache.

Frequencies come from transformers' own rope initializers (llama3, linear, yarn, ...),
so scaled variants match HF exactly; position-dependent (dynamic) types are refused.
"""

from __future__ import annotations

import torch
from torch import nn

from nvllm.kernels import ops


def compute_inv_freq(hf_config, head_dim: int) -> tuple[torch.Tensor, float]:
    rope = (getattr(hf_config, "rope_parameters", None)
            or getattr(hf_config, "rope_scaling", None) or {})
    rope_type = rope.get("rope_type", rope.get("type", "default")) or "default"
    theta = rope.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    if rope_type == "default":
        inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float()
                               / head_dim))
        return inv, 1.0
    if rope_type in ("dynamic", "longrope"):
        raise ValueError(f"rope_type {rope_type!r} is not supported (position-dependent)")
    from transformers import PretrainedConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    # transformers' initializers call config methods: a worker's resolved config
    # (nvllm/common/hf_config.py, plain attributes) becomes the base config class again,
    # which imports no model's configuration module.
    if not isinstance(hf_config, PretrainedConfig):
        hf_config = PretrainedConfig(**vars(hf_config))
    inv, scale = ROPE_INIT_FUNCTIONS[rope_type](hf_config, "cpu")
    return inv.float(), float(scale)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_position: int, inv_freq: torch.Tensor,
                 attention_scaling: float = 1.0, backend: str = "torch") -> None:
        super().__init__()
        self.head_dim = head_dim
        self.backend = backend
        t = torch.arange(max_position, dtype=torch.float32)
        freqs = t[:, None] * inv_freq.to(t.device)[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos() * attention_scaling, persistent=False)
        self.register_buffer("sin", emb.sin() * attention_scaling, persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """q: [T, heads, d], k: [T, kv_heads, d]."""
        return ops.rotary_embedding(positions, q, k, self.cos, self.sin, self.backend)
