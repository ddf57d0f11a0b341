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

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from nvllm.kernels import moe as moe_kernels
from nvllm.kernels import ops
from nvllm.worker.parallel import TPContext, shard_range

GROUP = 32  # nvllm/worker/layers/quant.py's group: a quantized weight's input columns


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
        # Experts held quantized (quantize_experts): per local expert, a QuantizedWeight /
        # Fp8Weight view of one stacked weight, else None (dense).
        self.q13: list | None = None
        self.q2: list | None = None

    def load_gate_up(self, param: nn.Parameter, src, shard_id: tuple[int, int] | None) -> None:
        """Per-expert gate (shard (e, 0)) or up (e, 1) [I, H], or the fused [E, 2I, H] or
        [E, H, 2I] (shard None; [E, 2I, H], HF's own layout, when H == 2I); reads only this
        rank's experts and rows."""
        s, inter = self.shard, self.intermediate
        if s.count == 0:
            return
        if self.q13 is not None:
            self._load_quantized(self.q13, src, shard_id, 0, _shape(src)[-2] != 2 * inter)
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
        if self.q2 is not None:
            self._load_quantized(self.q2, src, shard_id, 1,
                                 _shape(src)[-2] != self.hidden_size)
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
        if self.q13 is not None or self.q2 is not None:  # the torch grouping, per expert
            return moe_kernels.fused_moe(
                x, self.q13 if self.q13 is not None else self.experts.gate_up_proj,
                self.q2 if self.q2 is not None else self.experts.down_proj, ids,
                weights.float(), self.shard.start, _expert_linear)
        return ops.fused_moe(x, self.experts.gate_up_proj, self.experts.down_proj, ids,
                             weights.float(), self.shard.start, self.backend)

    def quantize_experts(self, make: Callable[[int, int], object], grouped: bool
                         ) -> list[str]:
        """Hold the experts' weights quantized (before loading): ``make(n, k)`` gives an
        empty QuantizedWeight / Fp8Weight, one per projection stacking every local
        expert's rows, each expert a view of its rows. gate_up's input is the hidden
        size, down's this rank's intermediate columns: each is quantized where its input
        columns are whole groups of 32 (``grouped``; fp8 has none: always), else stays
        dense. Returns the parameter names held quantized."""
        s, h = self.shard, self.hidden_size
        done: list[str] = []
        if s.count == 0:
            return done
        if not grouped or h % GROUP == 0:
            self.q13 = self._hold("gate_up_proj", make(s.count * 2 * s.inter_size, h),
                                  2 * s.inter_size)
            done.append("gate_up_proj")
        if not grouped or (s.inter_size % GROUP == 0 and s.inter_start % GROUP == 0):
            self.q2 = self._hold("down_proj", make(s.count * h, s.inter_size), h)
            done.append("down_proj")
        return done

    def _hold(self, name: str, qw, rows: int) -> list:
        """qw in place of experts.<name> (its values as the parameter, its scales and mins
        as buffers, so .to and weight_bytes see them); per-expert views of ``rows``."""
        param = nn.Parameter(qw.qweight, requires_grad=False)
        param.weight_loader = getattr(self.experts, name).weight_loader
        param.quant = qw
        setattr(self.experts, name, param)
        self.experts.register_buffer(f"{name}_weight_scales", qw.scales, persistent=False)
        if qw.mins is not None:
            self.experts.register_buffer(f"{name}_weight_mins", qw.mins, persistent=False)
        return [_row_view(qw, e * rows, (e + 1) * rows) for e in range(self.shard.count)]

    def _load_quantized(self, views: list, src, shard_id, which: int,
                        transposed: bool) -> None:
        """One checkpoint tensor into the quantized experts (which: 0 gate_up, 1 down):
        a per-expert tensor (shard id (e, half) / e) or the fused [E, ...] one, this
        rank's experts and rows / columns only."""
        from nvllm.worker.quantize import load_quantized

        s, inter = self.shard, self.intermediate
        if shard_id is not None:
            e = shard_id[0] if which == 0 else shard_id
            experts = [(e, src)] if 0 <= e - s.start < s.count else []
        else:
            experts = [(e, _ExpertSlice(src, e, transposed))
                       for e in range(s.start, s.start + s.count)]
        for e, one in experts:
            view = views[e - s.start]
            if which == 1:  # down [H, I]: this rank's intermediate columns
                load_quantized(view, one, 1, s.inter_start, s.inter_start + s.inter_size, 0)
                continue
            halves = [shard_id[1]] if shard_id is not None else [0, 1]
            for half in halves:  # gate / up [I, H]: this rank's intermediate rows
                base = half * inter if shard_id is None else 0
                load_quantized(view, one, 0, base + s.inter_start,
                               base + s.inter_start + s.inter_size, half * s.inter_size)

    def finish(self, y: torch.Tensor) -> torch.Tensor:
        return y  # no bias


def _expert_linear(x: torch.Tensor, w) -> torch.Tensor:
    """One expert's x W^T: a dense weight (a projection left dense) or a quantized one."""
    return F.linear(x, w) if isinstance(w, torch.Tensor) else w.matmul(x)


def _row_view(qw, r0: int, r1: int):
    """Rows [r0, r1) of a QuantizedWeight / Fp8Weight as one of the same type sharing its
    storage (writes to the view land in qw)."""
    view = object.__new__(type(qw))
    view.fmt, view.n, view.k = qw.fmt, r1 - r0, qw.k
    view.qweight, view.scales = qw.qweight[r0:r1], qw.scales[r0:r1]
    view.mins = None if qw.mins is None else qw.mins[r0:r1]
    return view


class _ExpertSlice:
    """Expert e of a fused [E, a, b] checkpoint tensor as a 2-D [rows, cols] source in
    the layer's orientation (transposed: stored [E, cols, rows])."""

    __slots__ = ("src", "e", "transposed")

    def __init__(self, src, e: int, transposed: bool) -> None:
        self.src, self.e, self.transposed = src, e, transposed

    def get_shape(self) -> list[int]:
        _, a, b = _shape(self.src)
        return [b, a] if self.transposed else [a, b]

    def __getitem__(self, index: tuple[slice, slice]) -> torch.Tensor:
        rows, cols = index
        if self.transposed:
            return torch.as_tensor(self.src[self.e, cols, rows]).t()
        return torch.as_tensor(self.src[self.e, rows, cols])
