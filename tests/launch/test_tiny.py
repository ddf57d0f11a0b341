"""Tests for the tiny random checkpoints that the rest of the test suite uses as an oracle."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import hf_ref
import pytest
import torch
from click.testing import CliRunner
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from nvllm.launch.tiny import (
    EOS_TOKEN,
    IM_END,
    IM_START,
    PRESETS,
    ensure_tiny_checkpoint,
    main,
    make_tiny_checkpoint,
)

REPO = pathlib.Path(__file__).resolve().parents[2]

ENGLISH = "The quick brown fox jumps over the lazy dog.  Tabs\tand\nnewlines, too!"
MULTIBYTE = "Grüße aus Köln — naïve café, 東京タワー, Привет, 🙂🚀 and é (combining)"


@pytest.fixture(scope="module")
def presets_root(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    # Build every preset once for the module; each is well under a second.
    root = tmp_path_factory.mktemp("tiny")
    for name in PRESETS:
        ensure_tiny_checkpoint(name, root)
    return root


def _config(root: pathlib.Path, name: str) -> dict:
    return json.loads((root / name / "config.json").read_text())


def _tensor_files(path: pathlib.Path) -> list[pathlib.Path]:
    return sorted(path.glob("*.safetensors"))


def _state_dict(path: pathlib.Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in _tensor_files(path):
        with safe_open(f, "pt") as st:
            for k in st.keys():
                out[k] = st.get_tensor(k)
    return out


# ---------------------------------------------------------------------------------------------
# Determinism
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["qwen2", "qwen3-sharded"])
def test_same_args_give_byte_identical_files(tmp_path: pathlib.Path, name: str) -> None:
    a = make_tiny_checkpoint(tmp_path / "a", **PRESETS[name])
    b = make_tiny_checkpoint(tmp_path / "b", **PRESETS[name])
    files = sorted(p.name for p in a.iterdir())
    assert files == sorted(p.name for p in b.iterdir())
    assert any(f.endswith(".safetensors") for f in files)
    for f in files:
        assert (a / f).read_bytes() == (b / f).read_bytes(), f


def test_deterministic_across_processes(tmp_path: pathlib.Path, presets_root: pathlib.Path) -> None:
    # A different PYTHONHASHSEED catches any dependence on hash() or set/dict-of-str ordering
    # (e.g. in tokenizer training).
    code = (
        "import sys; from nvllm.launch.tiny import make_tiny_checkpoint, PRESETS; "
        "make_tiny_checkpoint(sys.argv[1], **PRESETS['llama3'])"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345", "PYTHONPATH": str(REPO)}
    subprocess.run([sys.executable, "-c", code, str(tmp_path / "x")], check=True, env=env)
    for f in sorted((presets_root / "llama3").iterdir()):
        assert (tmp_path / "x" / f.name).read_bytes() == f.read_bytes(), f.name


def test_seed_changes_weights(tmp_path: pathlib.Path) -> None:
    a = _state_dict(make_tiny_checkpoint(tmp_path / "a", "llama", seed=0))
    b = _state_dict(make_tiny_checkpoint(tmp_path / "b", "llama", seed=1))
    assert a.keys() == b.keys()
    assert not torch.equal(a["model.embed_tokens.weight"], b["model.embed_tokens.weight"])


# ---------------------------------------------------------------------------------------------
# Loading with HF
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_loads_with_transformers(presets_root: pathlib.Path, name: str) -> None:
    path = presets_root / name
    # Keep checkpoints tiny: they are built on the fly by many tests.
    assert sum(f.stat().st_size for f in path.iterdir()) < 2_000_000
    config = AutoConfig.from_pretrained(path)
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    assert len(tok) <= config.vocab_size
    assert config.eos_token_id == tok.eos_token_id == tok.convert_tokens_to_ids(EOS_TOKEN)
    assert config.pad_token_id == tok.pad_token_id
    assert config.bos_token_id == tok.bos_token_id
    assert model.generation_config.eos_token_id == tok.eos_token_id
    ids = torch.tensor([tok.encode(ENGLISH)])
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], config.vocab_size)
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize("name", ["llama", "llama3", "qwen2", "qwen3"])
def test_greedy_decoding_is_decisive_and_not_degenerate(
    presets_root: pathlib.Path, name: str
) -> None:
    # Guards the init in _init_weights: tests compare our engine's greedy tokens with HF's, so
    # top-1/top-2 near-ties would make them flaky, and a model stuck on one token would make
    # them toothless.
    path = presets_root / name
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    margins, relative, distinct = [], [], set()
    for prompt in ["Once upon a time", ENGLISH, "What is two plus three? Answer:"]:
        ids = torch.tensor([tok.encode(prompt)])
        with torch.no_grad():
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=16,
                output_logits=True,
                return_dict_in_generate=True,
            )
        new = out.sequences[0, ids.shape[1] :].tolist()
        assert new[0] != tok.eos_token_id
        distinct.update(new)
        for step in out.logits:
            top2 = step[0].topk(2).values
            margins.append((top2[0] - top2[1]).item())
            relative.append(margins[-1] / step[0].abs().max().item())
    # A random model may fall into a short loop for some prompt, but not for all of them.
    assert len(distinct) > 16, distinct
    # No near-tie in the sense the exactness checks use (hf_ref.NEAR_TIE: a share of the
    # row's largest |logit|, which rounding on another CPU cannot cross; an absolute margin
    # would not scale with the logits). Smallest here: 1.3e-4 (qwen3).
    assert min(relative) > hf_ref.NEAR_TIE, min(relative)
    assert sorted(margins)[len(margins) // 2] > 0.1


def test_bf16_preset_stores_bf16(presets_root: pathlib.Path) -> None:
    assert _config(presets_root, "qwen3-bf16")["dtype"] == "bfloat16"
    sd = _state_dict(presets_root / "qwen3-bf16")
    assert {t.dtype for t in sd.values()} == {torch.bfloat16}
    # Same seed and shape as "qwen3": the bf16 checkpoint is the rounded float32 one.
    ref = _state_dict(presets_root / "qwen3")
    assert torch.equal(sd["lm_head.weight"], ref["lm_head.weight"].to(torch.bfloat16))


def test_sharded_preset_has_index_and_same_weights(presets_root: pathlib.Path) -> None:
    path = presets_root / "qwen3-sharded"
    index = json.loads((path / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) >= 2
    assert all((path / s).is_file() for s in shards)
    assert not (path / "model.safetensors").exists()
    sharded, ref = _state_dict(path), _state_dict(presets_root / "qwen3")
    assert sharded.keys() == ref.keys() == index["weight_map"].keys()
    for k in ref:
        assert torch.equal(sharded[k], ref[k]), k


# ---------------------------------------------------------------------------------------------
# Config fields
# ---------------------------------------------------------------------------------------------


def test_qwen2_has_random_qkv_bias(presets_root: pathlib.Path) -> None:
    sd = _state_dict(presets_root / "qwen2")
    for proj in ("q_proj", "k_proj", "v_proj"):
        bias = sd[f"model.layers.0.self_attn.{proj}.bias"]
        # Non-zero so that an engine dropping the bias diverges from HF.
        assert bias.abs().min() > 0
    assert "model.layers.0.self_attn.o_proj.bias" not in sd
    # Norm weights are randomised too, for the same reason.
    assert not torch.all(sd["model.layers.0.input_layernorm.weight"] == 1)


def test_qwen3_head_dim_and_qk_norm(presets_root: pathlib.Path) -> None:
    cfg = _config(presets_root, "qwen3")
    assert cfg["model_type"] == "qwen3"
    assert cfg["head_dim"] == 32
    assert cfg["head_dim"] * cfg["num_attention_heads"] != cfg["hidden_size"]
    sd = _state_dict(presets_root / "qwen3")
    assert sd["model.layers.0.self_attn.q_proj.weight"].shape == (4 * 32, 64)
    assert sd["model.layers.0.self_attn.k_proj.weight"].shape == (2 * 32, 64)
    assert sd["model.layers.0.self_attn.q_norm.weight"].shape == (32,)
    assert sd["model.layers.0.self_attn.k_norm.weight"].shape == (32,)


def test_explicit_head_dim_for_other_archs(tmp_path: pathlib.Path) -> None:
    for arch in ("llama", "mistral", "qwen2"):
        path = make_tiny_checkpoint(tmp_path / arch, arch, head_dim=32)
        cfg = AutoConfig.from_pretrained(path)
        assert cfg.head_dim == 32
        sd = _state_dict(path)
        assert sd["model.layers.0.self_attn.q_proj.weight"].shape == (128, 64)
        AutoModelForCausalLM.from_pretrained(path)


def test_tied_and_untied(presets_root: pathlib.Path) -> None:
    assert _config(presets_root, "llama3")["tie_word_embeddings"] is True
    assert "lm_head.weight" not in _state_dict(presets_root / "llama3")
    for name in ("llama", "mistral", "qwen2", "qwen3"):
        assert _config(presets_root, name)["tie_word_embeddings"] is False
        assert "lm_head.weight" in _state_dict(presets_root / name)


def test_llama3_rope_scaling(presets_root: pathlib.Path) -> None:
    cfg = AutoConfig.from_pretrained(presets_root / "llama3")
    rope = cfg.rope_parameters
    assert rope["rope_type"] == "llama3"
    assert rope["factor"] == 8.0
    assert rope["low_freq_factor"] == 1.0
    assert rope["high_freq_factor"] == 4.0
    assert rope["original_max_position_embeddings"] == 256
    assert rope["rope_theta"] == 10000.0
    plain = AutoConfig.from_pretrained(presets_root / "llama").rope_parameters
    assert plain["rope_type"] == "default" and plain["rope_theta"] == 10000.0


def test_odd_vocab_and_single_kv_head(presets_root: pathlib.Path) -> None:
    assert _config(presets_root, "qwen3-odd-vocab")["vocab_size"] == 1031
    sd = _state_dict(presets_root / "qwen3-odd-vocab")
    assert sd["model.embed_tokens.weight"].shape == (1031, 64)
    assert sd["lm_head.weight"].shape == (1031, 64)
    assert _config(presets_root, "llama-1kv")["num_key_value_heads"] == 1
    sd = _state_dict(presets_root / "llama-1kv")
    assert sd["model.layers.0.self_attn.k_proj.weight"].shape == (16, 64)
    assert _config(presets_root, "mistral")["model_type"] == "mistral"


# ---------------------------------------------------------------------------------------------
# Tokenizer
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("text", [ENGLISH, MULTIBYTE, " leading space", "", "a  b   c ."])
def test_tokenizer_round_trip(presets_root: pathlib.Path, text: str) -> None:
    tok = AutoTokenizer.from_pretrained(presets_root / "qwen3")
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    # Ordinary English should mostly use merged tokens, not single bytes.
    if text == ENGLISH:
        assert len(ids) < len(text.encode()) / 2


def test_tokenizer_special_tokens(presets_root: pathlib.Path) -> None:
    tok = AutoTokenizer.from_pretrained(presets_root / "qwen3")
    assert tok.convert_tokens_to_ids([EOS_TOKEN, IM_START, IM_END]) == [0, 1, 2]
    assert tok.eos_token == tok.pad_token == EOS_TOKEN
    # No automatic bos: prompts tokenize to exactly their text.
    assert tok.decode(tok.encode("hello")) == "hello"
    ids = tok.encode(f"{IM_START}user{IM_END}")
    assert ids[0] == 1 and ids[-1] == 2
    assert tok.decode(ids, skip_special_tokens=True) == "user"
    assert 500 <= len(tok) <= 1000


def test_decode_ids_beyond_tokenizer(presets_root: pathlib.Path) -> None:
    # The model's vocab (1031) is larger than the tokenizer's; such ids must not crash decode
    # and contribute no text.
    tok = AutoTokenizer.from_pretrained(presets_root / "qwen3-odd-vocab")
    hello = tok.encode("hello")
    beyond = [len(tok), 1024, 1030]
    assert tok.decode(beyond) == ""
    assert tok.decode(hello + beyond + hello) == "hellohello"
    assert tok.convert_ids_to_tokens(beyond) == [None, None, None]


def test_chat_template(presets_root: pathlib.Path) -> None:
    path = presets_root / "qwen3"
    assert "chat_template" in json.loads((path / "tokenizer_config.json").read_text())
    tok = AutoTokenizer.from_pretrained(path)
    messages = [
        {"role": "system", "content": "You are helpful."},
        {"role": "user", "content": "Hi!"},
    ]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nYou are helpful.<|im_end|>\n"
        "<|im_start|>user\nHi!<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    ids = tok.encode(text)
    assert ids.count(tok.convert_tokens_to_ids(IM_START)) == 3
    assert tok.decode(ids) == text


def test_tool_preset_tokenizer_and_template(presets_root: pathlib.Path) -> None:
    """qwen3-tools: qwen3's ids plus Qwen's tool markers as added, non-special tokens (they
    survive skip_special_tokens, as in Qwen), and a template that renders tools, calls and
    results the way Qwen2.5's does."""
    from nvllm.launch.tiny_tokenizer import TOOL_TOKENS

    tok = AutoTokenizer.from_pretrained(presets_root / "qwen3-tools")
    plain = AutoTokenizer.from_pretrained(presets_root / "qwen3")
    assert tok.convert_tokens_to_ids(TOOL_TOKENS) == list(range(len(plain), len(plain) + 4))
    assert tok.encode(ENGLISH) == plain.encode(ENGLISH)
    text = '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>'
    ids = tok.encode(text)
    assert ids[0] == len(plain) and ids[-1] == len(plain) + 1
    assert tok.decode(ids, skip_special_tokens=True) == text
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    messages = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "",
         "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": {"a": 1}}}]},
        {"role": "tool", "content": "r1"}, {"role": "tool", "content": "r2"},
    ]
    rendered = tok.apply_chat_template(messages, tools=tools, tokenize=False,
                                       add_generation_prompt=True)
    assert rendered.startswith("<|im_start|>system\n# Tools\n")
    assert '<tools>\n{"type": "function", "function": {"name": "f", ' in rendered
    assert rendered.endswith(
        "<|im_start|>user\nHi<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n'
        "</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\nr1\n</tool_response>\n"
        "<tool_response>\nr2\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
    # Without tools it is plain ChatML.
    assert tok.apply_chat_template(messages[:1], tokenize=False) == \
        plain.apply_chat_template(messages[:1], tokenize=False)


def test_generation_config(presets_root: pathlib.Path) -> None:
    gen = json.loads((presets_root / "qwen2" / "generation_config.json").read_text())
    assert gen["eos_token_id"] == gen["pad_token_id"] == gen["bos_token_id"] == 0


# ---------------------------------------------------------------------------------------------
# Cache and CLI
# ---------------------------------------------------------------------------------------------


def test_ensure_builds_once(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NVLLM_TINY_DIR", str(tmp_path / "cache"))
    path = ensure_tiny_checkpoint("llama-1kv")
    assert path == tmp_path / "cache" / "llama-1kv"
    assert (path / "config.json").is_file()
    stamp = (path / "model.safetensors").stat().st_mtime_ns
    assert ensure_tiny_checkpoint("llama-1kv") == path
    assert (path / "model.safetensors").stat().st_mtime_ns == stamp
    # No temporary build directories are left behind.
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == ["llama-1kv"]
    with pytest.raises(KeyError):
        ensure_tiny_checkpoint("no-such-preset")


def test_cli(tmp_path: pathlib.Path) -> None:
    res = CliRunner().invoke(main, ["--preset", "llama", "--out", str(tmp_path)])
    assert res.exit_code == 0, res.output
    assert res.output.split() == [str(tmp_path / "llama")]
    assert (tmp_path / "llama" / "tokenizer.json").is_file()
    res = CliRunner().invoke(main, ["--all", "--preset", "llama", "--out", str(tmp_path)])
    assert res.exit_code == 2 and "mutually exclusive" in res.output


def test_full_vocab_tokenizer_names_every_id(tmp_path: pathlib.Path) -> None:
    """The benchmark preset's tokenizer: ids past the trained ones decode to a word each
    (so a server streams one text piece per token), and the trained ids keep their
    meaning (the same as without the option)."""
    full = make_tiny_checkpoint(tmp_path / "full", "qwen3", vocab_size=1500, head_dim=32,
                                full_vocab_tokenizer=True)
    plain = make_tiny_checkpoint(tmp_path / "plain", "qwen3", vocab_size=1500, head_dim=32)
    tf, tp = AutoTokenizer.from_pretrained(full), AutoTokenizer.from_pretrained(plain)
    assert len(tf) == 1500 and len(tp) < 1500
    assert [tf.decode([i]) for i in range(len(tp), 1500)] == [
        f" w{i}" for i in range(len(tp), 1500)]
    assert tf.decode(list(range(len(tp)))) == tp.decode(list(range(len(tp))))
    assert tf.encode(ENGLISH) == tp.encode(ENGLISH)


def test_bench_preset_is_offered_but_not_built_with_all() -> None:
    from nvllm.launch.tiny import ALL_PRESETS, BENCH_PRESETS

    assert "qwen3-36m" in BENCH_PRESETS and set(ALL_PRESETS) == set(PRESETS) | set(BENCH_PRESETS)
    assert BENCH_PRESETS["qwen3-36m"]["full_vocab_tokenizer"]
    result = CliRunner().invoke(main, ["--help"])
    assert "qwen3-36m" in result.output
