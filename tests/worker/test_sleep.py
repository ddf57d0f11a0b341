"""nvllm/worker/sleep.py on one rank, with a stand-in runner (no process, no plan): what
each level frees and brings back, counted exactly, and the refusals that free nothing."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from nvllm.common import worker_protocol as wp
from nvllm.worker.cpu_malloc import release_freed_memory, rss_bytes
from nvllm.worker.sleep import SleepRefused, WorkerSleep


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.self_attn = nn.Module()
        self.self_attn.attn = nn.Module()
        self.self_attn.attn.k_cache = self.self_attn.attn.v_cache = torch.empty(0)
        self.proj = nn.Linear(8, 4, bias=False)
        self.proj.packed = None


class Runner:
    """What WorkerSleep reads of a ModelRunner."""

    def __init__(self, packed: bool = False) -> None:
        torch.manual_seed(0)
        self.device = torch.device("cpu")
        self.model = nn.Module()
        self.model.layers = nn.ModuleList([Layer(), Layer()])
        self.model.embed = nn.Embedding(16, 8)
        self.model.head = nn.Linear(8, 16, bias=False)
        self.model.head.weight = self.model.embed.weight  # tied: counted once
        if packed:  # a oneDNN-packed linear drops its dense weight (pack_for_cpu)
            lin = self.model.layers[0].proj
            lin.packed = lin.weight.detach().to_mkldnn()
            lin.weight.data = torch.empty(0)
        self.quantized: dict[str, str] = {}
        self.draft = None
        self.weights = SimpleNamespace(hf_shapes={"embed.weight": (16, 8), "w": (4, 8)})
        self.use_cuda_graphs = False
        self.graphs = self.cpu_kv = None
        self.scoring: set[int] = {3}
        self.init_kv_cache(5)

    def init_kv_cache(self, num_blocks: int) -> None:
        self.kv_cache = torch.ones(2, 2, num_blocks, 4, 1, 2)
        self.batch = object()
        for i, layer in enumerate(self.model.layers):
            layer.self_attn.attn.k_cache = self.kv_cache[0, i]
            layer.self_attn.attn.v_cache = self.kv_cache[1, i]


KV_BYTES = 2 * 2 * 5 * 4 * 1 * 2 * 4
WEIGHT_BYTES = (2 * 4 * 8 + 16 * 8) * 4  # two linears, the embedding (its head is tied)


def test_level_1_on_cpu_frees_the_kv_cache_and_keeps_the_weights():
    r = Runner()
    ptrs = [p.data_ptr() for p in r.model.parameters()]
    s = WorkerSleep(r)
    ack = s.handle(wp.SleepWorker(1), rank=0)
    assert (ack.error, ack.weights_bytes, ack.kv_cache_bytes) == ("", 0, KV_BYTES)
    assert r.kv_cache is None and r.batch is None and not r.scoring
    assert r.model.layers[0].self_attn.attn.k_cache.numel() == 0
    assert [p.data_ptr() for p in r.model.parameters()] == ptrs
    ack = s.handle(wp.WakeWorker(["weights", "kv_cache"]), rank=0)
    assert (ack.weights_bytes, ack.kv_cache_bytes, ack.missing) == (0, KV_BYTES, [])
    assert r.kv_cache.shape[2] == 5 and not s.asleep


@pytest.mark.parametrize("packed", [False, True])
def test_level_2_drops_every_weight_and_wakes_zeroed(packed):
    r = Runner(packed)
    shapes = {n: p.shape for n, p in r.model.named_parameters()}
    lin = r.model.layers[0].proj
    s = WorkerSleep(r)
    ack = s.handle(wp.SleepWorker(2), rank=0)
    assert (ack.weights_bytes, ack.kv_cache_bytes) == (WEIGHT_BYTES, KV_BYTES)
    assert all(p.numel() == 0 for p in r.model.parameters())
    assert lin.packed is None
    assert r.model.head.weight is r.model.embed.weight
    ack = s.handle(wp.WakeWorker(["weights"]), rank=0)  # the KV cache stays asleep
    assert ack.weights_bytes == WEIGHT_BYTES and ack.kv_cache_bytes == 0
    assert ack.missing == ["embed.weight", "w"] and s.asleep == {"kv_cache"}
    for n, p in r.model.named_parameters():
        assert p.shape == shapes[n] and not p.any()
    if packed:
        assert lin.packed.is_mkldnn and lin.packed.shape == (4, 8)
    assert s.handle(wp.WakeWorker(["weights"]), rank=1).weights_bytes == 0  # awake already
    assert s.handle(wp.WakeWorker(["kv_cache"]), rank=1).missing == []


def test_refusals_free_nothing():
    r = Runner()
    r.quantized = {"layers.0.proj": "int8"}
    s = WorkerSleep(r)
    ack = s.handle(wp.SleepWorker(2), rank=0)
    assert "held quantized" in ack.error and r.kv_cache is not None and not s.asleep
    assert s.handle(wp.SleepWorker(1), rank=0).error == ""  # level 1 keeps them whole
    assert "already asleep" in s.handle(wp.SleepWorker(1), rank=0).error
    r2 = Runner()
    r2.draft = object()
    assert "draft model" in WorkerSleep(r2).handle(wp.SleepWorker(1), rank=0).error
    with pytest.raises(SleepRefused):
        WorkerSleep(r2).sleep(1)


def test_heap_release_and_rss():
    assert rss_bytes() > 0
    assert isinstance(release_freed_memory(), bool)
