"""A sparse mixture-of-experts feed-forward, sharded one of two ways over the TP ranks.

* Tensor-parallel experts (the default): every rank holds every expert, its share of
  the intermediate dim (shard_range: uneven when tp does not divide it), exactly as the
  dense MLP is split.
* Expert parallelism (``expert_parallel``): every rank holds whole experts, a contiguous
  range (uneven when tp does not divide the count).

Either way there is no dispatch: after attention's all-reduce every rank holds every
token, the router (replicated) runs on every rank, each rank computes the (token, expert)
pairs it holds the weights for and the layer's partial sum goes through the one
all-reduce per layer the dense path has.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from nvllm.kernels import ops
from nvllm.worker.parallel import TPContext, shard_range


def route(logits: torch.Tensor, top_k: int, renormalize: bool
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """HF's top-k router: softmax over all experts in float32, top-k, renormalised to sum
    to 1 when asked (Mixtral always; Qwen3-MoE when norm_topk_prob), then cast to the
    logits' dtype. The order matters below float32: renormalising after the cast gives
    other weights. Returns (weights [T, K] in logits.dtype, expert ids [T, K] int64)."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(logits.dtype), ids


def expert_range(num_experts: int, tp: TPContext) -> tuple[int, int]:
    """(first expert, count) of this rank's contiguous share (shard_range's rule: the first
    num_experts % tp ranks take one more; 5 experts on 2 ranks: 3 and 2), ranks past the
    count none."""
    start, end = shard_range(num_experts, tp)
    return start, end - start


@dataclass(slots=True)
class ExpertShard:
    """What of the experts one rank holds: experts [start, start + count), and of each the
    intermediate rows [inter_start, inter_start + inter_size)."""

    start: int
    count: int
    inter_start: int
    inter_size: int

    @classmethod
    def of(cls, num_experts: int, intermediate: int, tp: TPContext,
           expert_parallel: bool) -> ExpertShard:
        if expert_parallel:
            return cls(*expert_range(num_experts, tp), 0, intermediate)
        start, end = shard_range(intermediate, tp)  # uneven when tp does not divide it
        return cls(0, num_experts, start, end - start)


def _shape(src) -> tuple[int, ...]:
    return tuple(src.get_shape() if hasattr(src, "get_shape") else src.shape)


class SparseMoE(nn.Module):
    """Router + experts, named as HF's fused modules: ``gate.weight`` [E, H] (replicated),
    ``experts.gate_up_proj`` [E_local, 2 * I_local, H] (gate rows, then up rows) and
    ``experts.down_proj`` [E_local, H, I_local]."""

    def __init__(self, hidden_size: int, num_experts: int, intermediate: int, top_k: int,
                 renormalize: bool, tp: TPContext, expert_parallel: bool, dtype: torch.dtype,
                 backend: str) -> None:
        super().__init__()
        self.top_k, self.renormalize, self.backend = top_k, renormalize, backend
        self.hidden_size, self.intermediate = hidden_size, intermediate
        self.shard = s = ExpertShard.of(num_experts, intermediate, tp, expert_parallel)
        self.gate = nn.Linear(hidden_size, num_experts, bias=False, dtype=dtype)
        self.experts = nn.Module()
        self.experts.gate_up_proj = nn.Parameter(
            torch.empty(s.count, 2 * s.inter_size, hidden_size, dtype=dtype),
            requires_grad=False)
        self.experts.down_proj = nn.Parameter(
            torch.empty(s.count, hidden_size, s.inter_size, dtype=dtype), requires_grad=False)
        self.experts.gate_up_proj.weight_loader = self.load_gate_up
        self.experts.down_proj.weight_loader = self.load_down

    def load_gate_up(self, param: nn.Parameter, src, shard_id: tuple[int, int] | None) -> None:
        """Per-expert gate (shard (e, 0)) or up (e, 1) [I, H], or the fused [E, 2I, H] or
        [E, H, 2I] (shard None; [E, 2I, H], HF's own layout, when H == 2I); reads only this
        rank's experts and rows."""
        s, inter = self.shard, self.intermediate
        if s.count == 0:
            return
        if shard_id is not None:
            local = shard_id[0] - s.start
            if 0 <= local < s.count:
                half = shard_id[1] * s.inter_size
                param.data[local, half:half + s.inter_size].copy_(
                    src[s.inter_start:s.inter_start + s.inter_size, :])
            return
        experts = slice(s.start, s.start + s.count)
        transposed = _shape(src)[1] != 2 * inter
        for h in (0, 1):
            rows = slice(h * inter + s.inter_start, h * inter + s.inter_start + s.inter_size)
            t = src[experts, :, rows].transpose(1, 2) if transposed else src[experts, rows, :]
            param.data[:, h * s.inter_size:(h + 1) * s.inter_size].copy_(t)

    def load_down(self, param: nn.Parameter, src, shard_id: int | None) -> None:
        """Per-expert down [H, I] (shard e), or the fused [E, H, I] or [E, I, H] (shard None;
        [E, H, I] when H == I)."""
        s = self.shard
        if s.count == 0:
            return
        cols = slice(s.inter_start, s.inter_start + s.inter_size)
        if shard_id is not None:
            local = shard_id - s.start
            if 0 <= local < s.count:
                param.data[local].copy_(src[:, cols])
            return
        experts = slice(s.start, s.start + s.count)
        if _shape(src)[1] != self.hidden_size:
            param.data.copy_(src[experts, cols, :].transpose(1, 2))
        else:
            param.data.copy_(src[experts, :, cols])

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's experts' weighted outputs, before the all-reduce."""
        weights, ids = route(F.linear(x, self.gate.weight), self.top_k, self.renormalize)
        return ops.fused_moe(x, self.experts.gate_up_proj, self.experts.down_proj, ids,
                             weights.float(), self.shard.start, self.backend)

    def finish(self, y: torch.Tensor) -> torch.Tensor:
        return y  # no bias
