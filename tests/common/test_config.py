"""EngineConfig.finalize: checkpoint facts, defaults, and errors that name the fix."""

from __future__ import annotations

import json
import shutil

import pytest

from nvllm.common.config import EngineConfig


@pytest.fixture()
def qwen3(tiny, tmp_path):
    """A private copy of the tiny qwen3 checkpoint whose config.json a test may edit."""
    dst = tmp_path / "m"
    shutil.copytree(tiny("qwen3"), dst)
    return dst


def edit_config(path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


def test_facts_and_defaults(qwen3):
    c = EngineConfig(str(qwen3), device="cpu").finalize()
    info = c.model_info
    assert info.architecture == "Qwen3ForCausalLM"
    assert (info.num_attention_heads, info.num_key_value_heads, info.head_dim) == (4, 2, 32)
    assert info.eos_token_ids == [0]
    assert c.max_model_len == info.max_position_embeddings
    assert c.dtype == "float32"


def test_missing_checkpoint_says_no_hub(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not download"):
        EngineConfig(str(tmp_path)).finalize()


def test_unsupported_architecture(qwen3):
    edit_config(qwen3, architectures=["GPT2LMHeadModel"])
    with pytest.raises(ValueError, match="not supported"):
        EngineConfig(str(qwen3), device="cpu").finalize()


@pytest.mark.parametrize("tp,match", [(5, "tensor_parallel_size=5 is larger than "
                                          "num_attention_heads=4"),
                                      (0, "tensor_parallel_size must be >= 1")])
def test_tp_needs_a_query_head_per_rank(qwen3, tp, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(str(qwen3), device="cpu", tensor_parallel_size=tp).finalize()


@pytest.mark.parametrize("heads,kv,tp", [(4, 2, 3), (6, 3, 2), (9, 3, 2), (14, 2, 3),
                                         (28, 4, 3), (4, 4, 4)])
def test_any_head_count_at_any_tp_up_to_the_heads(qwen3, heads, kv, tp):
    """tp need divide neither the query nor the KV heads (shards by KV group)."""
    edit_config(qwen3, num_attention_heads=heads, num_key_value_heads=kv)
    EngineConfig(str(qwen3), device="cpu", tensor_parallel_size=tp).finalize()


def test_query_heads_must_be_a_multiple_of_kv_heads(qwen3):
    edit_config(qwen3, num_attention_heads=6, num_key_value_heads=4)
    with pytest.raises(ValueError, match="num_attention_heads=6 is not a multiple of "
                                         "num_key_value_heads=4"):
        EngineConfig(str(qwen3), device="cpu", tensor_parallel_size=2).finalize()


@pytest.mark.parametrize("field,value,match", [
    ("block_size", 12, "power of two"),
    ("dtype", "int8", "dtype must be"),
    ("device", "tpu", "device must be"),
    ("attention_backend", "flash", "attention_backend"),
    ("num_kv_blocks", 0, "num_kv_blocks"),
    ("gpu_memory_utilization", 1.5, "gpu_memory_utilization"),
    ("max_model_len", 1, "max_model_len"),
])
def test_bad_values_name_the_field(qwen3, field, value, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(str(qwen3), **{"device": "cpu", field: value}).finalize()


def test_sliding_window_no_longer_caps_max_model_len(qwen3):
    # layer_types null: derived again from max_window_layers (as HF does).
    edit_config(qwen3, sliding_window=128, use_sliding_window=True, max_window_layers=0,
                layer_types=None)
    c = EngineConfig(str(qwen3), device="cpu", max_model_len=512).finalize()
    assert c.max_model_len == 512 and c.model_info.layer_windows == [128, 128]
    assert c.model_info.kv_window == 128
    edit_config(qwen3, use_sliding_window=False)
    c = EngineConfig(str(qwen3), device="cpu").finalize()
    assert c.max_model_len == 1024 and c.model_info.kv_window is None


HF_CONFIGS = [  # (model_type, config.json fields)
    ("mistral", {"sliding_window": 32}),
    ("mistral", {"sliding_window": None}),
    ("qwen2", {"sliding_window": 32}),  # use_sliding_window defaults to False
    ("qwen2", {"sliding_window": 32, "use_sliding_window": True}),  # max_window_layers 28
    ("qwen2", {"sliding_window": 32, "use_sliding_window": True, "max_window_layers": 1}),
    ("qwen2", {"sliding_window": 32, "use_sliding_window": False, "max_window_layers": 0}),
    ("qwen3", {"sliding_window": 16, "use_sliding_window": True, "max_window_layers": 2}),
    ("qwen3", {"sliding_window": 16, "use_sliding_window": True, "layer_types": [
        "full_attention", "sliding_attention", "full_attention", "sliding_attention"]}),
    ("llama", {"sliding_window": 32}),
]


@pytest.mark.parametrize("model_type,fields", HF_CONFIGS)
def test_layer_windows_follow_transformers(model_type, fields):
    """Each layer's window is what HF's attention layer uses: Mistral's config window on
    every layer; Qwen's on the layers its layer_types slide; Llama's never."""
    from transformers import AutoConfig

    from nvllm.common.config import SUPPORTED_ARCHITECTURES, layer_windows

    raw = {"num_hidden_layers": 4, **fields}
    hf = AutoConfig.for_model(model_type, **raw)
    arch = next(a for a in SUPPORTED_ARCHITECTURES if a.lower().startswith(model_type))
    if model_type == "mistral":
        want = [hf.sliding_window] * 4
    elif model_type == "llama":
        want = [None] * 4
    else:
        want = [hf.sliding_window if t == "sliding_attention" else None
                for t in hf.layer_types]
    assert layer_windows(arch, raw) == want
    # A config.json that transformers wrote itself (layer_types spelled out) reads the same.
    assert layer_windows(arch, {**hf.to_dict(), "num_hidden_layers": 4}) == want


def test_small_token_budget_caps_max_num_seqs(qwen3):
    c = EngineConfig(str(qwen3), device="cpu", max_num_batched_tokens=8).finalize()
    assert c.max_num_seqs == 8


def test_moe_facts_and_any_expert_split(tiny, tmp_path):
    """transformers 5 writes Qwen3-MoE's expert count as num_local_experts; tensor-parallel
    experts split their intermediate size unevenly when tp does not divide it, as expert
    parallelism splits the experts."""
    dst = tmp_path / "moe"
    shutil.copytree(tiny("qwen3-moe"), dst)
    info = EngineConfig(str(dst), device="cpu").finalize().model_info
    assert (info.architecture, info.num_experts, info.expert_intermediate_size) == (
        "Qwen3MoeForCausalLM", 5, 48)
    edit_config(dst, moe_intermediate_size=50)
    EngineConfig(str(dst), device="cpu", tensor_parallel_size=4).finalize()
    EngineConfig(str(dst), device="cpu", tensor_parallel_size=4,
                 enable_expert_parallel=True).finalize()
    assert EngineConfig(str(tiny("qwen3")), device="cpu").finalize().model_info.num_experts == 0


def test_architectures_from_model_type_as_auto_classes_do(qwen3):
    cfg = json.loads((qwen3 / "config.json").read_text())
    cfg.pop("architectures")
    (qwen3 / "config.json").write_text(json.dumps(cfg))
    assert EngineConfig(str(qwen3), device="cpu").finalize().model_info.architecture == \
        "Qwen3ForCausalLM"
    edit_config(qwen3, model_type="bert")
    with pytest.raises(ValueError, match=r"architecture \['BertLMHeadModel'\] is not supported"):
        EngineConfig(str(qwen3), device="cpu").finalize()


def test_source_and_tokenizer_override(qwen3, tmp_path):
    c = EngineConfig(str(qwen3), device="cpu").finalize()
    assert (c.source.format, c.source.config_dir, c.source.tokenizer) == (
        "hf", str(qwen3), str(qwen3))
    assert [p.endswith(".safetensors") for p in c.source.weight_files] == [True]
    c = EngineConfig(str(qwen3), device="cpu", tokenizer=str(tmp_path)).finalize()
    assert c.source.tokenizer == str(tmp_path)
    assert "source" not in c.to_dict() and c.to_dict()["tokenizer"] == str(tmp_path)


def test_gguf_file_config_from_its_metadata_cached_once(smollm2, monkeypatch):
    from nvllm.common import model_source

    c = EngineConfig(smollm2, device="cpu").finalize()
    info = c.model_info
    assert c.source.format == "gguf" and c.source.weight_files == (smollm2,)
    assert (info.architecture, info.num_attention_heads, info.num_key_value_heads,
            info.head_dim, info.vocab_size, info.eos_token_ids) == (
        "LlamaForCausalLM", 9, 3, 64, 49152, [2])
    assert str(model_source.gguf_cache_root()) in c.source.config_dir
    monkeypatch.setattr(model_source, "_convert_in_child", None)  # cached: not called
    assert EngineConfig(smollm2, device="cpu").finalize().source == c.source
