"""Weight updates from a trainer's process group (gloo), from a checkpoint path, and by
CUDA IPC handle (a stand-in CuPy whose "device memory" is shared memory), end to end: an
engine on checkpoint A updated to B generates what HF generates on B, token for token,
at tp 1 and 2; a trainer that dies mid-broadcast, a wrong path and a wrong architecture
leave the old weights in force. Checkpoints and HF references are test_weight_update's."""

from __future__ import annotations

import asyncio
import os
import pathlib
import sys

import pytest
import torch
from served import serve, teardown
from weight_ckpts import PROMPTS, _run, ckpts, hf_refs  # noqa: F401 (a fixture)
from weight_ckpts import finish_trainer as _finish
from weight_ckpts import free_port as _port
from weight_ckpts import group_specs as _specs
from weight_ckpts import start_trainer as _trainer

from nvllm import LLM, AsyncClient, Client
from nvllm.common.weight_transfer import WeightUpdateError

pytestmark = pytest.mark.e2e

SUPPORT = pathlib.Path(__file__).parents[1] / "support"
FAKE_CUPY = SUPPORT / "fake_cupy"


def test_group_and_path_updates_at_tp1(ckpts, tiny):  # noqa: F811
    """tp=1, offline: a trainer process pushes B over the group, then dies in the middle
    of pushing A (B stays, the group is closed); from a path: a missing one and another
    architecture are refused, A's folder brings A back."""
    folder, a, b, b_dir = ckpts
    with LLM(folder, device="cpu", dtype="float32", block_size=8) as llm:
        assert [o.token_ids for o in _run(llm)] == hf_refs(folder, "A", a)
        port = _port()
        trainer = _trainer(port, 2, b_dir, folder)
        llm.init_weight_update_group("127.0.0.1", port, 1, 2, timeout_s=30)
        assert llm.update_weights_from_distributed(*_specs(b), weight_version="B") == "B"
        outs = _run(llm)
        assert [o.token_ids for o in outs] == hf_refs(folder, "B", b)
        assert all(o.weight_version == "B" for o in outs)
        with pytest.raises(WeightUpdateError, match="broadcast of .* failed"):
            llm.update_weights_from_distributed(*_specs(a), weight_version="never")
        _finish(trainer, 3)
        assert [o.token_ids for o in _run(llm)] == hf_refs(folder, "B", b)
        assert llm.weight_version == "B"
        with pytest.raises(WeightUpdateError, match="init_weight_update_group first"):
            llm.update_weights_from_distributed(*_specs(a))  # the failure closed it

        with pytest.raises(WeightUpdateError, match="no config.json"):
            llm.update_weights_from_path(str(b_dir) + "-missing")
        with pytest.raises(WeightUpdateError, match="Qwen3ForCausalLM.*LlamaForCausalLM"):
            llm.update_weights_from_path(tiny("qwen3"))
        assert llm.weight_version == "B"
        assert llm.update_weights_from_path(folder, weight_version="A") == "A"
        assert [o.token_ids for o in _run(llm)] == hf_refs(folder, "A", a)


def test_served_group_path_and_cuda_ipc_at_tp2(ckpts, monkeypatch, procs):  # noqa: F811
    """tp=2, served, through nvllm.Client: B over the group, A from its folder (through
    AsyncClient, after a refused missing one), then B by
    CUDA IPC handles (the stand-in CuPy: tensors at offsets inside shared allocations,
    one with transposed strides); every worker closed every handle it opened."""
    folder, a, b, b_dir = ckpts
    sys.path.insert(0, str(FAKE_CUPY))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(FAKE_CUPY)] + sys.path))
    monkeypatch.delitem(sys.modules, "cupy", raising=False)
    import cupy as fake

    from nvllm.common import cuda_ipc

    assert fake.__file__.startswith(str(FAKE_CUPY))
    monkeypatch.setattr(cuda_ipc, "allocation_base", fake.allocation_base)
    s = serve(LLM(folder, tensor_parallel_size=2, device="cpu", dtype="float32",
                  block_size=8))
    try:
        with Client(s.endpoint, timeout_s=90) as client:
            def run() -> list:
                return [client.generate(p, {"temperature": 0.0, "max_tokens": 12,
                                            "ignore_eos": True}) for p in PROMPTS]

            port = _port()
            trainer = _trainer(port, 3, b_dir)
            client.init_weight_update_group("127.0.0.1", port, 1, 3, timeout_s=30)
            assert client.update_weights_from_distributed(*_specs(b), weight_version=1) == 1
            _finish(trainer, 0)
            assert [o.token_ids for o in run()] == hf_refs(folder, "B", b)

            assert asyncio.run(_async_path(s.endpoint, folder)) == "A"
            after = run()
            assert [o.token_ids for o in after] == hf_refs(folder, "A", a)
            assert all(o.weight_version == "A" for o in after)

            shared, names = _in_fake_device_memory(fake, b)
            assert client.update_weights(shared, weight_version="ipc", cuda_ipc=True,
                                         chunk_bytes=64 << 10) == "ipc"
            assert [o.token_ids for o in run()] == hf_refs(folder, "B", b)
            for pid in procs.worker_pids_of(os.getpid()):
                maps = pathlib.Path(f"/proc/{pid}/maps").read_text()
                assert not any(n in maps for n in names), "a handle was left open"
    finally:
        teardown(s)
        fake.free_all()
        sys.path.remove(str(FAKE_CUPY))
        sys.modules.pop("cupy", None)


async def _async_path(endpoint: str, folder: str) -> int | str:
    """Through AsyncClient: a missing folder refused over the wire, then A's folder."""
    client = AsyncClient(endpoint, timeout_s=90)
    try:
        with pytest.raises(WeightUpdateError, match="no config.json"):
            await client.update_weights_from_path(folder + "-missing")
        return await client.update_weights_from_path(folder, weight_version="A")
    finally:
        client.close()


def _in_fake_device_memory(fake, state: dict[str, torch.Tensor]
                           ) -> tuple[dict[str, torch.Tensor], list[str]]:
    """`state` copied into two fake allocations, tensors at 256-byte-aligned offsets (as
    a caching allocator places them); 2-D ones alternate row- and column-major."""
    out: dict[str, torch.Tensor] = {}
    segments = []
    items = sorted(state.items())
    for half in (items[::2], items[1::2]):
        sizes = [-(-t.numel() * t.element_size() // 256) * 256 for _, t in half]
        _base, seg = fake.alloc(sum(sizes) + 256)
        segments.append(seg.name.lstrip("/"))
        at = 256  # nothing at the base: offsets are never 0
        for k, ((name, t), size) in enumerate(zip(half, sizes)):
            flat = torch.frombuffer(seg.buf, dtype=t.dtype, count=t.numel(), offset=at)
            if t.dim() == 2 and k % 2:
                view = flat.view(t.shape[1], t.shape[0]).t()  # strides (1, rows)
            else:
                view = flat.view(t.shape)
            view.copy_(t)
            out[name] = view
            at += size
    return out, segments
