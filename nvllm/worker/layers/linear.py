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
from nvllm.worker.sharding import head_partition

logger = logging.getLogger(__name__)


def linear(x: torch.Tensor, layer: nn.Module, bias: torch.Tensor | None = None
           ) -> torch.Tensor:
    """x W^T (+ bias), through the layer's oneDNN-packed weight when it has one."""
    packed = layer.packed
    if packed is None:  # (_parameters: a plain dict read, cheaper than layer.weight)
        return F.linear(x, layer._parameters["weight"], bias)
    if packed.__class__ is not torch.Tensor:  # a QuantizedWeight (worker/quantize.py)
        return packed.matmul(x, bias)
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
                and m.weight.device.type == "cpu" \
                and not getattr(m, "shares_embedding", False):  # quantize.share_tied_head
            m.packed = m.weight.detach().to_mkldnn()
            m.weight.data = torch.empty(0, dtype=m.weight.dtype)
            n += 1
    return n


def load_slice(param: torch.Tensor, src, dim: int, start: int, end: int, dst_off: int = 0
               ) -> None:
    """Copy src[..., start:end (along dim), ...] into param at dst_off along dim, indexing
    the lazy source by a tuple of slices (only those bytes are read). A quantized
    param (nvllm/worker/quantize.py) takes the shard in its own format."""
    quant = getattr(param, "quant", None)
    if quant is not None:
        from nvllm.worker.quantize import load_quantized

        load_quantized(quant, src, dim, start, end, dst_off)
        return
    index = [slice(None)] * len(src.get_shape() if hasattr(src, "get_shape") else src.shape)
    index[dim] = slice(start, end)
    t = src[tuple(index)]
    param.data.narrow(dim, dst_off, end - start).copy_(t)


class ColumnParallelLinear(nn.Module):
    """y = x W^T + b with W split by output rows; the output stays sharded.

    The rows are cut by nvllm/worker/sharding.py:shard_sizes (in units of `granule`), so
    tp need not divide output_size."""

    def __init__(self, input_size: int, output_size: int, bias: bool, tp: TPContext,
                 dtype: torch.dtype, granule: int = 1) -> None:
        super().__init__()
        self.tp = tp
        self.output_start, end = shard_range(output_size, tp, granule)
        self._make_params(input_size, end - self.output_start, bias, dtype)

    def _make_params(self, input_size: int, local_out: int, bias: bool,
                     dtype: torch.dtype) -> None:
        self.output_size_per_partition = local_out
        self.weight = nn.Parameter(torch.empty(local_out, input_size, dtype=dtype),
                                   requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        self.packed: torch.Tensor | None = None  # see pack_for_cpu
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.empty(local_out, dtype=dtype), requires_grad=False)
            self.bias.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, src, shard_id=None) -> None:
        start = self.output_start
        load_slice(param, src, 0, start, start + self.output_size_per_partition)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self, self.bias)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs fused into one matmul (gate_proj + up_proj), each
    cut by the same rule as a RowParallelLinear of its size (so down_proj's input slice
    matches)."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool, tp: TPContext,
                 dtype: torch.dtype, granule: int = 1) -> None:
        nn.Module.__init__(self)
        self.tp = tp
        self.output_sizes = output_sizes
        self.spans = [shard_range(n, tp, granule) for n in output_sizes]
        self._make_params(input_size, sum(e - s for s, e in self.spans), bias, dtype)

    def weight_loader(self, param: nn.Parameter, src, shard_id: int) -> None:
        start, end = self.spans[shard_id]
        offset = sum(e - s for s, e in self.spans[:shard_id])
        load_slice(param, src, 0, start, end, offset)


class QKVParallelLinear(ColumnParallelLinear):
    """Fused q/k/v projection of this rank's heads, cut by KV group
    (nvllm/worker/sharding.py:head_partition): whole KV heads and the query heads that
    read them, or with fewer KV heads than ranks a replica of one KV head and a share of
    its query heads."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int,
                 bias: bool, tp: TPContext, dtype: torch.dtype) -> None:
        nn.Module.__init__(self)
        self.tp = tp
        self.head_dim = head_dim
        self.heads = h = head_partition(num_heads, num_kv_heads, tp.world_size)[tp.rank]
        self.num_heads, self.num_kv_heads = h.num_q_heads, h.num_kv_heads
        self.q_head_start, self.kv_head_start = h.q_head_start, h.kv_head_start
        self._make_params(hidden_size, (self.num_heads + 2 * self.num_kv_heads) * head_dim,
                          bias, dtype)

    def weight_loader(self, param: nn.Parameter, src, shard_id: str) -> None:
        d = self.head_dim
        q_size, kv_size = self.num_heads * d, self.num_kv_heads * d
        if shard_id == "q":
            start, size, off = self.q_head_start * d, q_size, 0
        else:
            start, size = self.kv_head_start * d, kv_size
            off = q_size if shard_id == "k" else q_size + kv_size
        load_slice(param, src, 0, start, start + size, off)


class RowParallelLinear(nn.Module):
    """y = all_reduce(x_shard W_shard^T) + b with W split by input columns: by default
    cut by shard_sizes (granule), or the given [start, end) (o_proj: this rank's query
    heads)."""

    def __init__(self, input_size: int, output_size: int, bias: bool, tp: TPContext,
                 dtype: torch.dtype, granule: int = 1,
                 input_span: tuple[int, int] | None = None) -> None:
        super().__init__()
        self.tp = tp
        self.input_start, end = input_span or shard_range(input_size, tp, granule)
        self.input_size_per_partition = end - self.input_start
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
        start = self.input_start
        load_slice(param, src, 1, start, start + self.input_size_per_partition)

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's partial sum, before the all-reduce."""
        return linear(x, self)

    def finish(self, y: torch.Tensor) -> torch.Tensor:
        """After the all-reduce: the bias, added once."""
        return y if self.bias is None else y + self.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.finish(self.tp.all_reduce(self.partial(x)))
