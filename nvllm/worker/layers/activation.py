from __future__ import annotations

import torch
from torch import nn

from nvllm.kernels import ops


class SiluAndMul(nn.Module):
    """silu(gate) * up for the fused gate_up projection output [.., 2 * d]."""

    def __init__(self, backend: str = "torch") -> None:
        super().__init__()
        self.backend = backend

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.silu_and_mul(x, self.backend)
