"""RMSNorm, optionally fused with the residual add (float32 math, like HF)."""

from __future__ import annotations

import torch
from torch import nn

from nvllm.kernels import ops


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype,
                 backend: str = "torch") -> None:
        super().__init__()
        self.eps = eps
        self.backend = backend
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """Without residual: norm(x). With it: (norm(x + residual), x + residual)."""
        if residual is None:
            return ops.rms_norm(x, self.weight, self.eps, self.backend)
        return ops.fused_add_rms_norm(x, residual, self.weight, self.eps, self.backend)

    def add_norm_(self, x: torch.Tensor, residual: torch.Tensor):
        """forward(x, residual), in place where the backend can (the decoder layers own
        both tensors): (norm(x + residual), x + residual)."""
        # (_parameters: a plain dict read, where self.weight costs a Module.__getattr__)
        return ops.fused_add_rms_norm_(x, residual, self._parameters["weight"], self.eps,
                                       self.backend)
