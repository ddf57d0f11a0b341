"""GGUF files written from tiny HF checkpoints, as llama.cpp's convert_hf_to_gguf.py lays
them out: tensor names from gguf's TensorNameMap, experts stacked per layer, Llama's Q/K
rows permuted per head; optionally with the model and tokenizer metadata transformers
reads (so the file alone is a checkpoint), optionally cut into split files."""

from __future__ import annotations

import json
import pathlib
import re

import gguf
import numpy as np
from gguf import GGMLQuantizationType as Q
from safetensors.numpy import load_file
from transformers import AutoConfig

# Qwen3-MoE as llama.cpp's qwen3moe can hold it: every layer sparse (the tiny presets
# keep a dense one), routing weights renormalised (what its GGUF reading assumes).
QWEN3_MOE_ALL_SPARSE = {"arch": "qwen3_moe", "head_dim": 32, "num_key_value_heads": 1,
                        "moe": {"num_experts": 4, "num_experts_per_tok": 2,
                                "moe_intermediate_size": 48, "norm_topk_prob": True}}


def tiny_for_gguf(tiny, root: pathlib.Path, preset: str) -> pathlib.Path:
    """The tiny checkpoint ``preset``, or "qwen3-moe-all-sparse" (built under root)."""
    if preset != "qwen3-moe-all-sparse":
        return pathlib.Path(tiny(preset))
    from nvllm.launch.tiny import make_tiny_checkpoint

    return pathlib.Path(make_tiny_checkpoint(root / preset, **QWEN3_MOE_ALL_SPARSE))


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute (Q and K rows, per head)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]) \
        .swapaxes(1, 2).reshape(w.shape)


def gguf_tensors_of(model_dir: pathlib.Path, arch: str) -> dict[str, np.ndarray]:
    cfg = AutoConfig.from_pretrained(model_dir)
    tmap = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], cfg.num_hidden_layers)
    dense_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, cfg.num_hidden_layers)
    hf = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        hf.update(load_file(f))
    tensors, experts = {}, {}
    for name, w in sorted(hf.items()):
        w = w.astype(np.float32)
        m = re.match(r"(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(\w+)\.weight$", name)
        if m:
            experts.setdefault(f"{m[1]}.{m[3]}", {})[int(m[2])] = w
            continue
        base, kind = name.rsplit(".", 1)
        # (llama.cpp's qwen3moe has no dense layers; the preset's mlp_only_layers one is
        # named as Llama's dense MLP.)
        g = tmap.get_name(base) or dense_map.get_name(base)
        assert g is not None, name
        if arch == "llama" and g.endswith((".attn_q", ".attn_k")):
            w = llama_cpp_permute(w, cfg.num_attention_heads if g.endswith("q")
                                  else cfg.num_key_value_heads)
        tensors[f"{g}.{kind}"] = w
    for base, per in experts.items():
        tensors[f"{tmap.get_name(base)}.weight"] = np.stack([per[e] for e in sorted(per)])
    return tensors


def add_metadata(w: gguf.GGUFWriter, model_dir: pathlib.Path, arch: str) -> None:
    """The model and tokenizer keys transformers' GGUF reader turns into a config and a
    tokenizer (the tiny tokenizer is byte-level BPE: GGUF's "gpt2" model)."""
    cfg = AutoConfig.from_pretrained(model_dir)
    w.add_name(f"tiny {arch}")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    w.add_key_length(hd)
    w.add_value_length(hd)
    w.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    if arch == "qwen3moe":
        w.add_expert_count(cfg.num_experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    tok = json.loads((model_dir / "tokenizer.json").read_text())
    added = {a["content"]: a["id"] for a in tok["added_tokens"]}
    tokens = [f"[PAD{i}]" for i in range(cfg.vocab_size)]  # the model's rows past the
    types = [gguf.TokenType.UNUSED] * cfg.vocab_size  # tokenizer's: unused tokens
    for t, i in {**tok["model"]["vocab"], **added}.items():
        tokens[i] = t
        types[i] = gguf.TokenType.CONTROL if t in added else gguf.TokenType.NORMAL
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges([m if isinstance(m, str) else " ".join(m)
                        for m in tok["model"]["merges"]])
    gen = json.loads((model_dir / "generation_config.json").read_text())
    eos = gen.get("eos_token_id", 0)
    w.add_eos_token_id(eos[0] if isinstance(eos, list) else eos)
    template = json.loads((model_dir / "tokenizer_config.json").read_text()).get(
        "chat_template")
    if template:
        w.add_chat_template(template)


def write_split_gguf(model_dir, arch: str, out_dir, parts: int = 2,
                     metadata: bool = False, quant: Q | None = None) -> list[pathlib.Path]:
    """The tiny checkpoint in ``parts`` split files (one: ``model.gguf``), float32 or,
    with ``quant``, every 2-D tensor in that block type (gguf.quants.quantize); only the
    first carries the metadata (head counts, and with ``metadata`` all of it)."""
    model_dir = pathlib.Path(model_dir)
    cfg = AutoConfig.from_pretrained(model_dir)
    tensors = gguf_tensors_of(model_dir, arch)
    names = list(tensors)
    paths = []
    for i in range(parts):
        name = "model.gguf" if parts == 1 else f"m-{i + 1:05d}-of-{parts:05d}.gguf"
        path = pathlib.Path(out_dir) / name
        w = gguf.GGUFWriter(str(path), arch)
        if i == 0:
            w.add_head_count(cfg.num_attention_heads)
            w.add_head_count_kv(cfg.num_key_value_heads)
            if metadata:
                add_metadata(w, model_dir, arch)
        if parts > 1:
            w.add_uint16("split.no", i)
            w.add_uint16("split.count", parts)
        for n in names[i::parts]:
            t = tensors[n]
            if quant is not None and t.ndim == 2:
                w.add_tensor(n, gguf.quants.quantize(t, quant), raw_dtype=quant)
            else:
                w.add_tensor(n, t, raw_dtype=Q.F32)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        paths.append(path)
    return paths


# A Q4_K_M-like mix (Q6_K for V, down and the head), and every other K-quant, by GGUF
# tensor-name suffix.
KQUANT_MIX = {"attn_q": Q.Q4_K, "attn_k": Q.Q4_K, "attn_v": Q.Q6_K, "attn_output": Q.Q3_K,
              "ffn_gate": Q.Q2_K, "ffn_up": Q.Q5_K, "ffn_down": Q.Q6_K, "output": Q.Q6_K,
              "token_embd": Q.Q4_K}
# Where each K-quant keeps its fp16 d (and dmin) fields in a 256-value super-block.
KQUANT_F16_FIELDS = {Q.Q2_K: [80, 82], Q.Q3_K: [108], Q.Q4_K: [0, 2], Q.Q5_K: [0, 2],
                     Q.Q6_K: [208]}


def random_kquant_blocks(qtype: Q, rows: int, cols: int, rng, scale: float = 1e-3
                         ) -> np.ndarray:
    """Random valid blocks [rows, bytes] of a K-quant: random integers and sub-scales,
    d (and dmin) finite fp16 of about ``scale`` (dmin about 7 d: values near zero mean)."""
    n = rows * cols // 256
    blocks = rng.integers(0, 256, (n, gguf.GGML_QUANT_SIZES[qtype][1]), dtype=np.uint8)
    d = (np.abs(rng.standard_normal(n)) + 0.5) * scale
    for i, off in enumerate(KQUANT_F16_FIELDS[qtype]):
        f = (d * (7 if i else 1)).astype(np.float16)
        blocks[:, off:off + 2] = f.view(np.uint8).reshape(n, 2)
    return blocks.reshape(rows, -1)


def write_kquant_gguf(model_dir, out: pathlib.Path, types: dict[str, Q], rng
                      ) -> dict[str, np.ndarray]:
    """The tiny checkpoint as a GGUF file (with its metadata) whose 2-D tensors are random
    K-quant blocks, the type per GGUF tensor-name suffix in ``types`` (e.g. "attn_v");
    returns each such tensor's dequantized values (gguf.quants.dequantize) by GGUF name."""
    model_dir = pathlib.Path(model_dir)
    cfg = AutoConfig.from_pretrained(model_dir)
    tensors = gguf_tensors_of(model_dir, "qwen3")
    w = gguf.GGUFWriter(str(out), "qwen3")
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    add_metadata(w, model_dir, "qwen3")
    values = {}
    for name, t in tensors.items():
        kind = name.split(".")[-2]
        if t.ndim == 2 and kind in types:
            raw = random_kquant_blocks(types[kind], *t.shape, rng)
            w.add_tensor(name, raw, raw_dtype=types[kind])
            values[name] = gguf.quants.dequantize(raw, types[kind])
        else:
            w.add_tensor(name, t, raw_dtype=Q.F32)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return values
