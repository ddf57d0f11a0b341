"""One rank's weight updates (nvllm/worker/weight_update.py), without an engine: staging a
checkpoint's tensors and committing them leaves exactly what loading that checkpoint
would (experts, fused q/k/v and gate/up, oneDNN-packed float32 weights repacked); a
refusal leaves everything as it was; quantized layers refuse by rule."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from nvllm.common.config import EngineConfig
from nvllm.common.model_source import safetensors_files
from nvllm.common.transport import inline_ref
from nvllm.common.weight_transfer import WeightUpdateError, chunks
from nvllm.common.worker_protocol import WeightChunk
from nvllm.worker.model_runner import ModelRunner
from nvllm.worker.parallel import TPContext
from tests.support.weight_ckpts import held_params

PRESET = "qwen3-moe"  # per-expert tensors, a dense layer, one KV head


@pytest.fixture(scope="module")
def folders(tiny, tmp_path_factory):
    from nvllm.launch.tiny import PRESETS, make_tiny_checkpoint

    b = make_tiny_checkpoint(tmp_path_factory.mktemp("moe-b"), **PRESETS[PRESET], seed=1)
    return tiny(PRESET), str(b)


def _runner(folder: str, **kw) -> ModelRunner:
    cfg = EngineConfig(folder, device="cpu", dtype="float32", max_model_len=64,
                       **kw).finalize()
    return ModelRunner(cfg, TPContext(), torch.device("cpu"))


def _tensors(folder: str) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in safetensors_files(folder):
        out.update(load_file(str(f)))
    return out


def _messages(update_id: int, tensors, chunk_bytes: int = 8 << 10) -> list[WeightChunk]:
    return [WeightChunk(update_id, k, [n for n, _, _ in c], [d for _, d, _ in c],
                        [inline_ref(a).encode() for _, _, a in c])
            for k, c in enumerate(chunks(tensors, chunk_bytes))]


def test_a_committed_update_holds_what_loading_holds(folders):
    a_dir, b_dir = folders
    runner, want = _runner(a_dir), held_params(_runner(b_dir))
    assert any(getattr(m, "packed", None) is not None for m in runner.model.modules())
    before = held_params(runner)
    assert sum(not torch.equal(before[k], want[k]) for k in want) > len(want) // 2
    msgs = _messages(1, _tensors(b_dir))
    assert len(msgs) > 3
    for m in msgs:
        runner.weights.stage(m)
    assert held_params(runner).keys() == before.keys()
    assert all(torch.equal(before[k], v) for k, v in held_params(runner).items())  # staged only
    assert runner.weights.staged_bytes > 0
    runner.weights.commit(1)
    got = held_params(runner)
    assert [k for k in want if not torch.equal(got[k], want[k])] == []


def test_a_refused_chunk_changes_nothing(folders):
    a_dir, b_dir = folders
    runner = _runner(a_dir)
    before = held_params(runner)
    b = _tensors(b_dir)
    first, *_ = _messages(5, b)
    runner.weights.stage(first)
    expert = "model.layers.0.mlp.experts.3.down_proj.weight"
    with pytest.raises(WeightUpdateError, match=f"{expert}: shape \\[48, 64\\]"):
        runner.weights.stage(WeightChunk(5, 1, *_one(expert, b[expert].T)))
    assert runner.weights.staged == {} and runner.weights.update_id is None
    with pytest.raises(WeightUpdateError, match="commit of update 5"):
        runner.weights.commit(5)
    assert all(torch.equal(before[k], v) for k, v in held_params(runner).items())
    # Out of order: chunk 1 of an update whose chunk 0 never came.
    with pytest.raises(WeightUpdateError, match="out of order"):
        runner.weights.stage(WeightChunk(6, 1, *_one(expert, b[expert])))


def _one(name: str, t: torch.Tensor) -> tuple[list, list, list]:
    (chunk,) = list(chunks({name: t.contiguous()}, 1 << 20))
    return [chunk[0][0]], [chunk[0][1]], [inline_ref(chunk[0][2]).encode()]


def test_quantized_layers_refuse_updates(tiny):
    runner = _runner(tiny("qwen3"), quantization="int8")
    name = "model.layers.0.self_attn.q_proj.weight"
    t = _tensors(tiny("qwen3"))[name]
    with pytest.raises(WeightUpdateError, match="held quantized.*never updated in place"):
        runner.weights.stage(WeightChunk(1, 0, *_one(name, t)))
    # A layer held dense (the norms) still updates.
    norm = "model.norm.weight"
    runner.weights.stage(WeightChunk(2, 0, *_one(norm, torch.full((64,), 0.5))))
    runner.weights.commit(2)
    assert torch.equal(runner.model.norm.weight, torch.full((64,), 0.5))
    # The tied embedding and head, dense and one parameter (quantize.share_tied_head):
    # an update of the embedding is the head's too.
    runner = _runner(tiny("llama3"), quantization="int8")  # tie_word_embeddings
    model = runner.model
    assert model.lm_head.weight is model.embed_tokens.weight
    emb = "model.embed_tokens.weight"
    new = torch.randn(model.embed_tokens.weight.shape)
    runner.weights.stage(WeightChunk(3, 0, *_one(emb, new)))
    runner.weights.commit(3)
    assert torch.equal(model.embed_tokens.weight, new)
    assert model.lm_head.weight is model.embed_tokens.weight
