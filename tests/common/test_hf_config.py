"""The resolved transformers config a worker reads (nvllm/common/hf_config.py): what
transformers itself computes, cached, and read back without importing transformers."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from nvllm.common import hf_config
from nvllm.common.hf_config import cache_path, load_hf_config, resolved_dict


def _transformers_dict(d) -> dict:
    from transformers import AutoConfig

    return json.loads(json.dumps(AutoConfig.from_pretrained(str(d)).to_dict(), default=str))


def test_resolved_config_is_transformers_own_then_read_from_the_cache(tiny, tmp_path,
                                                                      monkeypatch):
    monkeypatch.setenv(hf_config.CACHE_ENV, str(tmp_path / "cache"))
    d = tiny("qwen3")
    want = _transformers_dict(d)
    assert not cache_path(d).exists()
    assert resolved_dict(d) == want
    assert cache_path(d).is_file()

    def boom(*a, **k):
        raise AssertionError("resolved again instead of read from the cache")

    monkeypatch.setattr("transformers.AutoConfig.from_pretrained", boom)
    assert resolved_dict(d) == want
    cfg = load_hf_config(d)
    assert cfg.hidden_size == want["hidden_size"] and cfg.rms_norm_eps == want["rms_norm_eps"]
    assert getattr(cfg, "no_such_field", 7) == 7  # the models' getattr defaults still apply


def test_an_older_config_json_gets_the_fields_transformers_standardizes(tmp_path,
                                                                        monkeypatch):
    """A config.json as an older transformers saved it (rope_theta and rope_scaling at the
    top, no head_dim): the worker sees transformers 5's rope_parameters and defaults, which
    config.json alone does not hold."""
    monkeypatch.setenv(hf_config.CACHE_ENV, str(tmp_path / "cache"))
    d = tmp_path / "old"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
        "intermediate_size": 128, "num_attention_heads": 4, "num_hidden_layers": 2,
        "vocab_size": 100, "rope_theta": 500000.0,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}))
    cfg = load_hf_config(d)
    assert cfg.rope_parameters["rope_theta"] == 500000.0
    assert cfg.rope_parameters["rope_type"] == "llama3"
    assert cfg.num_key_value_heads == 4 and cfg.rms_norm_eps == _transformers_dict(d)[
        "rms_norm_eps"]
    assert vars(cfg) == _transformers_dict(d)
    # Scaled rope types go through transformers' initializers, which call config methods:
    # the plain attributes give the frequencies the config class gives.
    import torch
    from transformers import AutoConfig

    from nvllm.worker.layers.rotary import compute_inv_freq

    got, want = compute_inv_freq(cfg, 16), compute_inv_freq(AutoConfig.from_pretrained(d), 16)
    assert torch.equal(got[0], want[0]) and got[1] == want[1]


def test_the_cache_key_follows_config_json(tiny, tmp_path):
    d = tmp_path / "m"
    d.mkdir()
    src = json.loads((__import__("pathlib").Path(tiny("llama")) / "config.json").read_text())
    (d / "config.json").write_text(json.dumps(src))
    first = cache_path(d)
    src["rms_norm_eps"] = 1e-3
    (d / "config.json").write_text(json.dumps(src))
    assert cache_path(d) != first


@pytest.mark.timeout(120)
def test_a_worker_builds_its_model_from_a_cached_config_without_transformers(tiny):
    """The point of the cache: a worker whose config was resolved before imports no
    transformers module (its config classes cost ~70 MiB per worker)."""
    d = tiny("llama")
    resolved_dict(d)  # warm (this process may import transformers; the child must not)
    code = (
        "import sys, torch\n"
        "import nvllm.worker.main\n"
        "from nvllm.common.hf_config import load_hf_config\n"
        "from nvllm.common.config import ModelInfo\n"
        "from nvllm.worker.models import MODEL_REGISTRY\n"
        "from nvllm.worker.parallel import TPContext\n"
        f"d = {str(d)!r}\n"
        "cfg = load_hf_config(d)\n"
        "MODEL_REGISTRY[ModelInfo.from_pretrained(d).architecture](cfg, TPContext(), "
        "torch.float32, 64, 'torch')\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'transformers'))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=100, check=True)
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout


def test_gguf_conversion_caches_the_resolved_config(smollm2):
    from nvllm.common.model_source import resolve_model_source

    src = resolve_model_source(smollm2)
    assert cache_path(src.config_dir).is_file()
    assert load_hf_config(src.config_dir).num_hidden_layers == 30
