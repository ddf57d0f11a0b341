"""Sleep and wake on one rank: vLLM's levels (nvllm/common/sleep_mode.py), for an RL
loop that hands the device to its trainer between rollouts.

What each level frees, and what "offload" means where:

- The KV cache, at both levels: the paged cache, the CPU backend's contiguous K/V copies
  and the batch state are dropped (the leader ended or requeued every sequence first), and
  so are the CUDA graphs, which address the cache and the weights. ``wake_up`` allocates
  the same number of blocks again, zeroed, and captures the graphs again once both the
  weights and the cache are back.
- The weights, level 1: on CUDA every tensor the model holds on the device (parameters,
  buffers, quantized layers' packed tensors) is copied to pinned host memory and its
  device memory freed; ``wake_up`` copies it back (new addresses: hence the graphs). On
  CPU the weights already are host memory: they stay in place, and level 1 frees the KV
  cache only.
- The weights, level 2: every parameter's storage (and a oneDNN-packed weight) is freed
  and nothing kept. ``wake_up`` allocates zeroed parameters of the same shapes, and the
  leader holds generation until ``update_weights`` has written every checkpoint tensor
  again. Layers held quantized cannot be updated (weight_update.py), so an engine with
  any refuses level 2; so does one with a draft model, whose weights no update reaches.

Bytes freed and allocated again are counted from the tensors themselves. On CPU the heap
is trimmed after a sleep (cpu_malloc.release_freed_memory): freed memory otherwise stays
in the resident set.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from nvllm.common import worker_protocol as wp
from nvllm.worker.cpu_malloc import release_freed_memory, rss_bytes
from nvllm.worker.model_runner import ModelRunner
from nvllm.worker.models import decode_stack

logger = logging.getLogger(__name__)

KV_ATTRS = ("k_cache", "v_cache")


class SleepRefused(Exception):
    """This rank cannot sleep (or wake) as asked; nothing was freed or allocated."""


class WorkerSleep:
    """One rank's sleep state: what was freed, and how to bring it back."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.level = 0
        self.asleep: set[str] = set()
        self.num_blocks = 0
        self.params: list[tuple[nn.Parameter, torch.Size]] = []  # moved (1) or dropped (2)
        self.slots: list[tuple[dict, str]] = []  # level 1: buffers and tensor attributes
        self.packed: list[tuple[nn.Module, torch.Size]] = []  # level 2: oneDNN weights

    def handle(self, msg: wp.SleepWorker | wp.WakeWorker, rank: int) -> wp.SleepAck:
        op = "sleep" if isinstance(msg, wp.SleepWorker) else "wake"
        decode_stack.forget(self.runner.model)  # it may hold tensors this moves or frees
        try:
            if op == "sleep":
                weights, kv = self.sleep(msg.level)
            else:
                weights, kv = self.wake(set(msg.tags))
        except SleepRefused as e:
            logger.error("rank %d: %s refused: %s", rank, op, e)
            return wp.SleepAck(rank, op, str(e) or "refused")
        missing = sorted(self.runner.weights.hf_shapes) if (
            op == "wake" and self.level == 2 and "weights" in msg.tags and rank == 0) else []
        ack = wp.SleepAck(rank, op, "", weights, kv, self._device_bytes(), rss_bytes(),
                          missing)
        logger.info("rank %d: %s: weights %.1f MiB, KV cache %.1f MiB; device now holds "
                    "%.1f MiB, RSS %.1f MiB", rank, op, weights / 2**20, kv / 2**20,
                    ack.device_bytes / 2**20, ack.rss_bytes / 2**20)
        return ack

    # ---- sleep ----------------------------------------------------------------------

    def sleep(self, level: int) -> tuple[int, int]:
        """Free the KV cache and the weights' device memory (level 1) or contents
        (level 2); returns the bytes of each freed."""
        r = self.runner
        if self.asleep:
            raise SleepRefused(f"already asleep ({sorted(self.asleep)} at level "
                               f"{self.level}): wake_up first")
        if r.draft is not None:
            raise SleepRefused("a draft model (speculative decoding) cannot sleep: its "
                               "weights and KV cache are not managed by sleep")
        if level == 2 and r.quantized:
            raise SleepRefused(f"{len(r.quantized)} layers are held quantized: level 2 "
                               "would drop weights that update_weights cannot write again "
                               "(use level 1, or serve with quantization off)")
        kv = self._free_kv()
        weights = self._offload() if level == 1 else self._drop()
        self.level = level
        self.asleep = {"weights", "kv_cache"}
        self._release()
        return weights, kv

    def _free_kv(self) -> int:
        r = self.runner
        if r.kv_cache is None:
            return 0
        freed = r.kv_cache.nbytes + (r.cpu_kv.nbytes if r.cpu_kv is not None else 0)
        self.num_blocks = r.kv_cache.shape[2]
        for layer in r.model.layers:
            for name in KV_ATTRS:
                setattr(layer.self_attn.attn, name, torch.empty(0))
        r.kv_cache = r.cpu_kv = r.graphs = r.batch = None
        r.scoring.clear()
        return freed

    def _offload(self) -> int:
        """Level 1: the model's device tensors to pinned host memory (CUDA only)."""
        if self.runner.device.type != "cuda":
            return 0
        moved = 0
        seen: dict[int, torch.Tensor] = {}
        for p in _unique_params(self.runner.model):
            if p.is_cuda:
                moved += p.nbytes
                self.params.append((p, p.shape))
                p.data = _pinned_copy(p.data)
        for d, key, t in _device_slots(self.runner.model):
            if id(t) not in seen:
                moved += t.nbytes
                seen[id(t)] = _pinned_copy(t)
            d[key] = seen[id(t)]
            self.slots.append((d, key))
        return moved

    def _drop(self) -> int:
        """Level 2: every parameter's storage, and every oneDNN-packed weight."""
        dropped = 0
        for p in _unique_params(self.runner.model):
            if p.numel():
                dropped += p.nbytes
                self.params.append((p, p.shape))
                p.data = torch.empty(0, dtype=p.dtype, device=p.device)
        for m in self.runner.model.modules():
            packed = getattr(m, "packed", None)
            if isinstance(packed, torch.Tensor):
                dropped += packed.numel() * packed.element_size()
                self.packed.append((m, packed.shape))
                m.packed = None
        return dropped

    def _release(self) -> None:
        if self.runner.device.type == "cuda":
            torch.cuda.empty_cache()
        else:
            release_freed_memory()

    # ---- wake -----------------------------------------------------------------------

    def wake(self, tags: set[str]) -> tuple[int, int]:
        """Allocate again what sleep freed, of `tags` ("weights", "kv_cache"; what is
        awake already is left alone); returns the bytes of each allocated."""
        r = self.runner
        weights = kv = 0
        if "weights" in tags and "weights" in self.asleep:
            weights = self._restore() if self.level == 1 else self._zeros()
            self.asleep.discard("weights")
            if r.kv_cache is not None and r.use_cuda_graphs:
                r.capture_graphs()  # the weights moved
        if "kv_cache" in tags and "kv_cache" in self.asleep:
            graphs = r.use_cuda_graphs
            r.use_cuda_graphs = graphs and "weights" not in self.asleep
            try:
                r.init_kv_cache(self.num_blocks)
            finally:
                r.use_cuda_graphs = graphs
            kv = r.kv_cache.nbytes
            self.asleep.discard("kv_cache")
        return weights, kv

    def _restore(self) -> int:
        """Level 1: the host copies back to the device."""
        device = self.runner.device
        back = 0
        for p, _ in self.params:
            back += p.nbytes
            p.data = p.data.to(device)
        seen: dict[int, torch.Tensor] = {}
        for d, key in self.slots:
            t = d[key]
            if id(t) not in seen:
                back += t.nbytes
                seen[id(t)] = t.to(device)
            d[key] = seen[id(t)]
        self.params, self.slots = [], []
        return back

    def _zeros(self) -> int:
        """Level 2: zeroed storage of every shape dropped, for update_weights to fill."""
        made = 0
        for p, shape in self.params:
            p.data = torch.zeros(shape, dtype=p.dtype, device=p.device)
            made += p.nbytes
        for m, shape in self.packed:
            dense = torch.zeros(shape, dtype=torch.float32)
            made += dense.nbytes
            m.packed = dense.to_mkldnn()
        self.params, self.packed = [], []
        return made

    def _device_bytes(self) -> int:
        if self.runner.device.type != "cuda":
            return 0
        return torch.cuda.memory_allocated(self.runner.device)


def _unique_params(model: nn.Module) -> list[nn.Parameter]:
    """Every parameter once (a tied head shares the embedding's)."""
    seen: set[int] = set()
    out = []
    for m in model.modules():
        for p in m._parameters.values():
            if p is not None and id(p) not in seen:
                seen.add(id(p))
                out.append(p)
    return out


def _device_slots(model: nn.Module) -> list[tuple[dict, str, torch.Tensor]]:
    """Buffers and plain tensor attributes (quantized layers' packed weights and scales)
    on the device, as (the dict holding it, its key, the tensor); not the KV cache."""
    out = []
    for m in model.modules():
        for key, b in m._buffers.items():
            if b is not None and b.is_cuda:
                out.append((m._buffers, key, b))
        for key, v in vars(m).items():
            if isinstance(v, torch.Tensor) and not isinstance(v, nn.Parameter) \
                    and v.is_cuda and key not in KV_ATTRS:
                out.append((m.__dict__, key, v))
    return out


def _pinned_copy(t: torch.Tensor) -> torch.Tensor:
    host = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=True)
    host.copy_(t)
    return host
