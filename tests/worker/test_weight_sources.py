"""One rank's updates from a checkpoint path and by CUDA IPC handle
(nvllm/worker/weight_sources.py, nvllm/worker/ipc_weights.py), without an engine, on the
MoE preset (per-expert tensors, fused q/k/v and gate/up, oneDNN-packed float32 weights):
committed, they hold exactly what loading checkpoint B holds; a refused tensor opens no
handle and changes nothing; a quantized layer refuses a path update by the same rule."""

from __future__ import annotations

import pathlib
import sys

import pytest
import torch
from weight_ckpts import held_params as _held
from weight_ckpts import runner_on as _runner
from weight_ckpts import tensors_of

from nvllm.common import cuda_ipc
from nvllm.common.weight_transfer import WeightUpdateError, push_weights
from nvllm.common.worker_protocol import WeightChunk, WeightsFromPath
from nvllm.worker.weight_sources import WeightSources

PRESET = "qwen3-moe"  # per-expert tensors, a dense layer, one KV head
FAKE_CUPY = pathlib.Path(__file__).parents[1] / "support" / "fake_cupy"


@pytest.fixture(scope="module")
def folders(tiny, tmp_path_factory):
    from nvllm.launch.tiny import PRESETS, make_tiny_checkpoint

    b = make_tiny_checkpoint(tmp_path_factory.mktemp("moe-b"), **PRESETS[PRESET], seed=1)
    return tiny(PRESET), str(b)


@pytest.fixture
def fake_cupy(monkeypatch):
    monkeypatch.syspath_prepend(str(FAKE_CUPY))
    monkeypatch.delitem(sys.modules, "cupy", raising=False)
    import cupy

    monkeypatch.setattr(cuda_ipc, "allocation_base", cupy.allocation_base)
    yield cupy
    cupy.free_all()
    sys.modules.pop("cupy", None)


def test_an_update_from_a_path_holds_what_loading_holds(folders, tiny):
    a_dir, b_dir = folders
    runner, want = _runner(a_dir), _held(_runner(b_dir))
    sources = WeightSources(runner.weights, torch.device("cpu"), 0)
    before = _held(runner)
    ack = sources.handle(WeightsFromPath(1, 0, b_dir))
    assert ack.error == "" and ack.staged_bytes > 0
    assert all(torch.equal(before[k], v) for k, v in _held(runner).items())  # staged only
    runner.weights.commit(1)
    got = _held(runner)
    assert [k for k in want if not torch.equal(got[k], want[k])] == []

    ack = sources.handle(WeightsFromPath(2, 0, tiny("qwen3")))  # other shapes
    assert "not a tensor of this model's checkpoint" in ack.error
    assert runner.weights.staged == {} and runner.weights.update_id is None

    quantized = _runner(tiny("qwen3"), quantization="int8")
    ack = WeightSources(quantized.weights, torch.device("cpu"), 0).handle(
        WeightsFromPath(3, 0, tiny("qwen3")))
    assert "held quantized" in ack.error


def test_an_update_by_cuda_ipc_handle(folders, fake_cupy):
    a_dir, b_dir = folders
    runner, want = _runner(a_dir), _held(_runner(b_dir))
    b = tensors_of(b_dir)
    total = sum(-(-t.numel() * 4 // 256) * 256 for t in b.values()) + 256
    _base, seg = fake_cupy.alloc(total)
    at, shared = 256, {}
    for k, (name, t) in enumerate(sorted(b.items())):
        flat = torch.frombuffer(seg.buf, dtype=t.dtype, count=t.numel(), offset=at)
        view = flat.view(t.shape[1], t.shape[0]).t() if t.dim() == 2 and k % 2 else \
            flat.view(t.shape)
        view.copy_(t)
        shared[name] = view
        at += -(-t.numel() * 4 // 256) * 256
    chunks = list(cuda_ipc.ipc_chunks(shared, 16 << 10))
    assert len(chunks) > 3
    refs = [cuda_ipc.IpcRef.decode(r) for _, _, rs, _ in chunks for r in rs]
    assert all(r.offset >= 256 for r in refs)
    assert any(r.strides[0] == 1 and len(r.shape) == 2 for r in refs)  # column-major
    for k, (names, dtypes, rs, _) in enumerate(chunks):
        runner.weights.stage(WeightChunk(1, k, names, dtypes, rs))
    assert fake_cupy.OPEN == {}  # every handle closed after its copy
    runner.weights.commit(1)
    got = _held(runner)
    assert [k for k in want if not torch.equal(got[k], want[k])] == []

    # A wrong shape is refused before its handle is opened.
    name = "model.layers.0.mlp.experts.3.down_proj.weight"
    _, ref = cuda_ipc.export_tensor(name, shared[name].t())
    with pytest.raises(WeightUpdateError, match="does not match"):
        runner.weights.stage(WeightChunk(2, 0, [name], ["float32"], [ref.encode()]))
    assert fake_cupy.OPEN == {} and runner.weights.staged == {}


def test_tensors_over_chunk_bytes_travel_in_row_ranges(folders):
    """A tensor larger than chunk_bytes is cut into row ranges of at most chunk_bytes
    (the in-flight bound), reassembled on the rank; a tensor left incomplete is refused
    at commit and nothing changes."""
    a_dir, b_dir = folders
    runner, want = _runner(a_dir), _held(_runner(b_dir))
    b = tensors_of(b_dir)
    chunk_bytes = 4 << 10
    assert max(t.numel() * 4 for t in b.values()) > 4 * chunk_bytes
    sent: list[tuple[int, list | None]] = []

    def send(k, names, dtypes, refs, rows):
        sent.append((sum(inline_nbytes(r) for r in refs), rows))
        runner.weights.stage(WeightChunk(1, k, names, dtypes, refs, rows))

    push_weights(b, send, chunk_bytes, shared_memory=False)
    assert max(n for n, _ in sent) <= chunk_bytes
    assert sum(rows is not None for _, rows in sent) > 10
    runner.weights.commit(1)
    got = _held(runner)
    assert [k for k in want if not torch.equal(got[k], want[k])] == []

    big = "model.embed_tokens.weight"
    pieces = []
    push_weights({big: b[big]}, lambda *c: pieces.append(c), chunk_bytes,
                 shared_memory=False)
    for k, (_, names, dtypes, refs, rows) in enumerate(pieces[:2]):
        runner.weights.stage(WeightChunk(2, k, names, dtypes, refs, rows))
    with pytest.raises(WeightUpdateError, match=f"{big} arrived only in part"):
        runner.weights.commit(2)
    assert [k for k, v in _held(runner).items() if not torch.equal(v, got[k])] == []


def inline_nbytes(ref: list) -> int:
    from nvllm.common.transport import ArrayRef

    return ArrayRef.decode(ref).nbytes
