"""Vocab-parallel embedding and LM head. The vocabulary is cut by
nvllm/worker/sharding.py:shard_sizes (1031 rows on 2 ranks: 516 + 515); the LM head's
gather pads the smaller shards' logits to the largest and cuts them off again."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from nvllm.worker.layers.linear import linear, load_slice
from nvllm.worker.parallel import TPContext, shard_range
from nvllm.worker.sharding import shard_sizes


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, tp: TPContext,
                 dtype: torch.dtype) -> None:
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        self.shard_sizes = shard_sizes(vocab_size, tp.world_size)
        self.vocab_start, self.vocab_end = shard_range(vocab_size, tp)
        self.shard_size = self.vocab_end - self.vocab_start
        self.dtype = dtype
        self.embedding_dim = hidden_size
        # A quantized embedding's blocks (nvllm/worker/quantize.py), else None.
        self.quant = None
        self.weight = nn.Parameter(torch.zeros(self.shard_size, hidden_size, dtype=dtype),
                                   requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, src, shard_id=None) -> None:
        if self.shard_size > 0:
            load_slice(param, src, 0, self.vocab_start, self.vocab_end)

    def partial(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Rows of this rank's vocabulary shard (zeros elsewhere): all-reduce to finish."""
        if self.tp.world_size == 1:
            return self._rows(input_ids)
        mask = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        local = torch.where(mask, input_ids - self.vocab_start, 0)
        return self._rows(local) * mask.unsqueeze(-1).to(self.dtype)

    def _rows(self, ids: torch.Tensor) -> torch.Tensor:
        if self.quant is None:
            return F.embedding(ids, self.weight)
        return self.quant.embedding(ids, self.dtype)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(self.partial(input_ids))


class ParallelLMHead(VocabParallelEmbedding):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.packed: torch.Tensor | None = None  # see linear.pack_for_cpu

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        """Full-vocabulary float32 logits on rank 0, None on the other ranks."""
        logits = self.tp.gather_to_first(linear(hidden_states, self), self.shard_sizes)
        return None if logits is None else logits[:, :self.vocab_size].float()
