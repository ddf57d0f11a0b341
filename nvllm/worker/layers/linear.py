"""Column- and row-parallel linear layers that load their own shard of HF weights.

Each parameter carries a ``weight_loader(param, src, shard_id)`` where ``src`` is a lazy
safetensors slice (or a tensor): it is indexed only for this rank's rows/columns, so a
worker reads just the bytes it needs.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from nvllm.worker.parallel import TPContext, shard_range

logger = logging.getLogger(__name__)


def linear(x: torch.Tensor, layer: nn.Module, bias: torch.Tensor | None = None
           ) -> torch.Tensor:
    """x W^T (+ bias), through the layer's oneDNN-packed weight when it has one."""
    packed = layer.packed
    if packed is None:
        return F.linear(x, layer.weight, bias)
    # Dense activations in and out: converting them to and from oneDNN tensors around
    # mkldnn_linear cost 8-25% of a call at decode sizes (512 x 1536 at 27 rows: 358 vs
    # 269 µs), ~4% at prefill sizes.
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def pack_for_cpu(model: nn.Module) -> int:
    """Repack every linear weight of a float32 CPU model in oneDNN's blocked layout and
    drop the dense copy; returns how many were packed.

    At the batch sizes decode runs (tens of rows) a packed weight is read much faster
    (measured: the 16384 x 512 LM head at 48 rows, ~1.6x); results differ from
    F.linear only in the last bits, as F.linear's own do between batch sizes.
    """
    try:  # a private op: make sure this torch build has it before relying on it
        torch.ops.mkldnn._linear_pointwise(torch.ones(1, 1), torch.ones(1, 1).to_mkldnn(),
                                           None, "none", [], "")
    except (AttributeError, RuntimeError) as e:
        logger.info("linear weights stay dense (no oneDNN linear here: %s)", e)
        return 0
    n = 0
    for m in model.modules():
        if getattr(m, "packed", False) is None and m.weight.dtype == torch.float32 \
                and m.weight.device.type == "cpu":
            m.packed = m.weight.detach().to_mkldnn()
            m.weight.data = torch.empty(0, dtype=m.weight.dtype)
            n += 1
    return n


def _load(param: torch.Tensor, src, dim: int, start: int, end: int, dst_off: int = 0) -> None:
    index = [slice(None)] * len(src.get_shape() if hasattr(src, "get_shape") else src.shape)
    index[dim] = slice(start, end)
    t = src[tuple(index)]
    param.data.narrow(dim, dst_off, end - start).copy_(t)


class ColumnParallelLinear(nn.Module):
    """y = x W^T + b with W split by output rows; the output stays sharded."""

    def __init__(self, input_size: int, output_size: int, bias: bool, tp: TPContext,
                 dtype: torch.dtype) -> None:
        super().__init__()
        assert output_size % tp.world_size == 0
        self.tp = tp
        self.output_size_per_partition = output_size // tp.world_size
        self.weight = nn.Parameter(
            torch.empty(self.output_size_per_partition, input_size, dtype=dtype),
            requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        self.packed: torch.Tensor | None = None  # see pack_for_cpu
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.empty(self.output_size_per_partition, dtype=dtype),
                                     requires_grad=False)
            self.bias.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, src, shard_id=None) -> None:
        start, end = shard_range(param.shape[0] * self.tp.world_size, self.tp)
        _load(param, src, 0, start, end)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self, self.bias)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs fused into one matmul (gate_proj + up_proj)."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool, tp: TPContext,
                 dtype: torch.dtype) -> None:
        self.output_sizes = output_sizes
        super().__init__(input_size, sum(output_sizes), bias, tp, dtype)

    def weight_loader(self, param: nn.Parameter, src, shard_id: int) -> None:
        tp = self.tp.world_size
        size = self.output_sizes[shard_id] // tp
        offset = sum(self.output_sizes[:shard_id]) // tp
        start = self.tp.rank * size
        _load(param, src, 0, start, start + size, offset)


class QKVParallelLinear(ColumnParallelLinear):
    """Fused q/k/v projection. With fewer KV heads than ranks, KV heads are replicated:
    rank r serves KV head r // (tp // num_kv_heads)."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int,
                 bias: bool, tp: TPContext, dtype: torch.dtype) -> None:
        self.head_dim = head_dim
        self.num_heads = num_heads // tp.world_size
        self.num_kv_heads = max(1, num_kv_heads // tp.world_size)
        if num_kv_heads >= tp.world_size:
            self.kv_head_start = tp.rank * self.num_kv_heads
        else:
            self.kv_head_start = tp.rank // (tp.world_size // num_kv_heads)
        out = (self.num_heads + 2 * self.num_kv_heads) * head_dim * tp.world_size
        super().__init__(hidden_size, out, bias, tp, dtype)

    def weight_loader(self, param: nn.Parameter, src, shard_id: str) -> None:
        d = self.head_dim
        q_size, kv_size = self.num_heads * d, self.num_kv_heads * d
        if shard_id == "q":
            start, size, off = self.tp.rank * q_size, q_size, 0
        else:
            start, size = self.kv_head_start * d, kv_size
            off = q_size if shard_id == "k" else q_size + kv_size
        _load(param, src, 0, start, start + size, off)


class RowParallelLinear(nn.Module):
    """y = all_reduce(x_shard W_shard^T) + b with W split by input columns."""

    def __init__(self, input_size: int, output_size: int, bias: bool, tp: TPContext,
                 dtype: torch.dtype) -> None:
        super().__init__()
        assert input_size % tp.world_size == 0
        self.tp = tp
        self.input_size_per_partition = input_size // tp.world_size
        self.weight = nn.Parameter(
            torch.empty(output_size, self.input_size_per_partition, dtype=dtype),
            requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        self.packed: torch.Tensor | None = None  # see pack_for_cpu
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size, dtype=dtype), requires_grad=False)
            self.bias.weight_loader = lambda p, src, shard_id=None: p.data.copy_(src[:])

    def weight_loader(self, param: nn.Parameter, src, shard_id=None) -> None:
        size = self.input_size_per_partition
        _load(param, src, 1, self.tp.rank * size, (self.tp.rank + 1) * size)

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's partial sum, before the all-reduce."""
        return linear(x, self)

    def finish(self, y: torch.Tensor) -> torch.Tensor:
        """After the all-reduce: the bias, added once."""
        return y if self.bias is None else y + self.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.finish(self.tp.all_reduce(self.partial(x)))
