"""Pre-quantized fp8 checkpoints (nvllm/worker/fp8_checkpoint.py), written by the test's
own quantizer (tests/support/fp8_checkpoints.py) in vLLM's layout:

- under ``auto`` (and ``fp8``) each rank's linears are fp8 layers holding the checkpoint's
  e4m3 bytes and scales as stored (a per-tensor scale as every row's), so they equal the
  dequantized checkpoint's shards exactly; nothing is re-quantized;
- under ``none`` the same checkpoint loads dense to those values; ``int8`` quantizes them;
- input scales are skipped with a log line; block-wise scales are refused, saying so.
"""

from __future__ import annotations

import json
import logging

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig

from nvllm.common.model_source import resolve_model_source
from nvllm.worker.fp8_checkpoint import fp8_checkpoint_config
from nvllm.worker.layers.fp8 import Fp8Weight
from nvllm.worker.loader import load_weights
from nvllm.worker.quantize import AT_LOAD, quantize_model
from tests.support.fp8_checkpoints import write_fp8_checkpoint
from tests.worker.test_quant import _model


@pytest.mark.parametrize("per_channel,tp", [(False, 2), (True, 1)])
def test_layers_hold_the_checkpoint_bytes(tiny, tmp_path, caplog, per_channel, tp):
    model_dir = tiny("qwen3")
    packed, deq = write_fp8_checkpoint(model_dir, tmp_path / "fp8", per_channel)
    source, deq_source = resolve_model_source(str(packed)), resolve_model_source(str(deq))
    cfg = AutoConfig.from_pretrained(packed)
    stored = load_file(next(packed.glob("*.safetensors")))
    for rank in range(tp):
        ours, dense = _model(cfg, rank, tp), _model(cfg, rank, tp)
        done = quantize_model(ours, source, "auto")
        assert len(done) == 8 and set(done.values()) == {"fp8"}, done  # 2 x (qkv, o, gu, d)
        with caplog.at_level(logging.INFO, logger="nvllm.worker.fp8_checkpoint"):
            load_weights(ours, source, show_progress=False)
        assert "activation / KV scales skipped" in caplog.text
        load_weights(dense, deq_source, show_progress=False)
        for name in done:
            q, d = dict(ours.named_modules())[name], dict(dense.named_modules())[name]
            assert isinstance(q.packed, Fp8Weight)
            assert torch.equal(q.packed.dequantize(), d.weight), f"{name} rank {rank}"
        down = ours.layers[0].mlp.down_proj.packed  # row-parallel: a column shard
        w = stored["model.layers.0.mlp.down_proj.weight"]
        k = down.k
        assert torch.equal(down.qweight.view(torch.uint8),
                           w[:, rank * k:(rank + 1) * k].view(torch.uint8))
        s = stored["model.layers.0.mlp.down_proj.weight_scale"].reshape(-1)
        assert torch.equal(down.scales, s.expand(down.n))
        plain = _model(cfg, rank, tp)  # quantization=none: the values, dense
        load_weights(plain, source, show_progress=False)
        for name in done:
            assert torch.equal(dict(plain.named_modules())[name].weight,
                               dict(dense.named_modules())[name].weight), name
    assert set(quantize_model(_model(cfg, 0, 1), source, "int8").values()) == \
        {AT_LOAD["int8"].name}


def test_unreadable_fp8_checkpoints_say_why(tmp_path):
    for qcfg, match in [({"quant_method": "fp8", "weight_block_size": [128, 128]},
                         "block-wise"),
                        ({"quant_method": "fp8", "fmt": "e5m2"}, "e4m3")]:
        (tmp_path / "config.json").write_text(json.dumps({"quantization_config": qcfg}))
        with pytest.raises(ValueError, match=match):
            fp8_checkpoint_config(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({}))
    assert fp8_checkpoint_config(tmp_path) is None
