"""Decode steps replayed from CUDA graphs.

A decode step launches a few hundred small kernels whose launch cost, not their work,
bounds small batches. The runner captures the whole forward pass of a pure-decode batch
(one token per sequence) once per size of a ladder (1, 2, 4, 8, then steps of 8 up to
the largest size), on static input buffers. A step of n sequences copies its inputs into
the buffers, pads them to the next captured size (padded rows write no KV: slot -1; and
attend to one key of block 0 so they stay finite), replays the graph, and keeps the
first n rows of the output.

Capture runs after the KV cache is allocated, so the graphs' memory comes out of what
is left (the worker reserves it when it sizes the cache). The Triton attention kernels
take their launch grids from shapes alone, never from tensor values, which is what lets
one graph serve every context length up to max_model_len. ``enforce_eager`` turns all
of this off.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from nvllm.kernels.metadata import AttentionMetadata

logger = logging.getLogger(__name__)


def capture_sizes(max_batch: int) -> list[int]:
    """The ladder: 1, 2, 4, 8, 16, 24, ... up to and including max_batch."""
    sizes = [s for s in (1, 2, 4) if s < max_batch]
    sizes += list(range(8, max_batch, 8))
    return sorted({*sizes, max_batch})


class TorchCUDAGraph:
    """What the runner needs of a graph: capture a callable once, replay it."""

    def __init__(self, pool) -> None:
        self.graph = torch.cuda.CUDAGraph()
        self.pool = pool

    def capture(self, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
        torch.cuda.synchronize()
        with torch.cuda.graph(self.graph, pool=self.pool):
            out = fn()
        torch.cuda.synchronize()
        return out

    def replay(self) -> None:
        self.graph.replay()


class CUDAGraphRunner:
    def __init__(self, forward: Callable[[torch.Tensor, torch.Tensor, AttentionMetadata],
                                         torch.Tensor],
                 max_batch: int, max_blocks_per_seq: int, block_size: int,
                 device: torch.device, graph_factory: Callable | None = None) -> None:
        """forward(input_ids, positions, meta) -> hidden states [n, hidden]. The graph
        factory is replaceable so the padding and buffer logic can be tested on CPU
        (with a stand-in that re-runs the callable on replay)."""
        self.forward = forward
        self.sizes = capture_sizes(max_batch)
        self.max_batch = self.sizes[-1]
        self.block_size = block_size
        self.device = device
        if graph_factory is None:
            pool = torch.cuda.graph_pool_handle()
            graph_factory = lambda: TorchCUDAGraph(pool)  # noqa: E731
        self.graph_factory = graph_factory
        n, w = self.max_batch, max_blocks_per_seq
        kw = dict(device=device)
        self.input_ids = torch.zeros(n, dtype=torch.long, **kw)
        self.positions = torch.zeros(n, dtype=torch.long, **kw)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.long, **kw)
        self.seq_lens = torch.ones(n, dtype=torch.int32, **kw)
        self.block_tables = torch.zeros(n, w, dtype=torch.int32, **kw)
        self.cu_seqlens_q = torch.arange(n + 1, dtype=torch.int32, **kw)
        self.max_seqlen_k = w * block_size
        self.graphs: dict[int, tuple[object, torch.Tensor]] = {}

    def _meta(self, bs: int) -> AttentionMetadata:
        # Host lists are sized for the batch; their values are never read on the decode
        # path (a graph could not follow them anyway).
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:bs], cu_seqlens_q=self.cu_seqlens_q[:bs + 1],
            seq_lens=self.seq_lens[:bs], block_tables=self.block_tables[:bs],
            max_seqlen_q=1, max_seqlen_k=self.max_seqlen_k,
            cu_seqlens_q_host=list(range(bs + 1)), seq_lens_host=[1] * bs)

    @torch.inference_mode()
    def capture(self) -> None:
        t0 = time.perf_counter()
        before = torch.cuda.memory_allocated(self.device) if self.device.type == "cuda" else 0
        for bs in reversed(self.sizes):  # largest first: smaller graphs reuse its pool
            meta = self._meta(bs)
            run = lambda bs=bs, meta=meta: self.forward(  # noqa: E731
                self.input_ids[:bs], self.positions[:bs], meta)
            run()  # warm-up outside the graph: Triton compiles, allocators settle
            graph = self.graph_factory()
            self.graphs[bs] = (graph, graph.capture(run))
        used = (torch.cuda.memory_allocated(self.device) - before
                if self.device.type == "cuda" else 0)
        logger.info("captured %d decode graphs (batch sizes %d..%d) in %.1f s, %.0f MiB",
                    len(self.graphs), self.sizes[0], self.max_batch,
                    time.perf_counter() - t0, used / 2**20)

    def can_run(self, num_seqs: int, num_tokens: int, width: int) -> bool:
        """A pure-decode batch that fits the largest graph and its block tables."""
        return (bool(self.graphs) and num_tokens == num_seqs <= self.max_batch
                and width <= self.block_tables.shape[1])

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor,
            meta: AttentionMetadata) -> torch.Tensor:
        n = input_ids.shape[0]
        bs = next(s for s in self.sizes if s >= n)
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(meta.slot_mapping)
        self.seq_lens[:n].copy_(meta.seq_lens)
        width = meta.block_tables.shape[1]
        self.block_tables[:n, :width].copy_(meta.block_tables)
        # Padding rows: no KV write, one key of block 0, token 0 at position 0. The rows
        # after n were left that way by the last replay only up to its own n: reset them.
        self.input_ids[n:bs].zero_()
        self.positions[n:bs].zero_()
        self.slot_mapping[n:bs].fill_(-1)
        self.seq_lens[n:bs].fill_(1)
        self.block_tables[n:bs].zero_()
        graph, out = self.graphs[bs]
        graph.replay()
        return out[:n]
