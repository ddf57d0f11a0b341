"""nvllm.launch.truncate: a checkpoint cut to its first N layers (the tests' draft model)."""

from __future__ import annotations

import json
import pathlib

import pytest


def test_keeps_the_first_layers_and_everything_else(tiny, tmp_path):
    from safetensors import safe_open

    from nvllm.common.config import ModelInfo
    from nvllm.launch.truncate import truncate_checkpoint

    src = pathlib.Path(tiny("qwen2-sw"))  # 3 layers, layer_types per layer
    out = truncate_checkpoint(src, tmp_path / "d", 2)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 2
    if "layer_types" in json.loads((src / "config.json").read_text()):
        assert len(cfg["layer_types"]) == 2
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
    with safe_open(str(src / "model.safetensors"), framework="pt") as f:
        full = set(f.keys())
        want = {n for n in full if ".layers.2." not in n}
        assert names == want and len(full) > len(names)
        emb = "model.embed_tokens.weight"
        with safe_open(str(out / "model.safetensors"), framework="pt") as g:
            assert g.get_tensor(emb).equal(f.get_tensor(emb))
    info, full_info = ModelInfo.from_pretrained(out), ModelInfo.from_pretrained(src)
    assert info.vocab_size == full_info.vocab_size
    assert info.layer_windows == full_info.layer_windows[:2]
    assert (out / "tokenizer.json").is_file()
    with pytest.raises(ValueError, match=r"num_layers must be in 1\.\.3"):
        truncate_checkpoint(src, tmp_path / "e", 4)
