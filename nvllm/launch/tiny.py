"""Deterministic tiny random HF-format checkpoints for tests, demos and benchmarks.

A tiny checkpoint is a complete Hugging Face model directory (``config.json``,
``generation_config.json``, ``model.safetensors`` or a sharded index, ``tokenizer.json``,
``tokenizer_config.json``) holding a few hundred KB of random weights.  Because HF
``transformers`` can load it, it doubles as the correctness oracle: tests decode greedily
with our engine and with ``AutoModelForCausalLM.generate(do_sample=False)`` and compare
token for token.

Two properties matter for that use and drive most of the choices below:

* Determinism: the same arguments give byte-identical safetensors files, in any process.
* Decisive logits: with HF's default init (std 0.02) the logits of a random model are
  nearly flat, so the top-2 logits are often within float32 rounding of each other and a
  token-for-token comparison becomes flaky.  :func:`_init_weights` uses a larger scale so
  the top-1/top-2 gap is comfortably above kernel-level numeric noise.

Usage::

    nvllm-make-tiny --preset qwen3 --out /tmp/tiny
    nvllm-make-tiny --all
"""

from __future__ import annotations

import contextlib
import math
import os
import pathlib
import shutil
import tempfile
import zlib
from typing import Any

import click
import torch
from click.core import ParameterSource

# The special tokens are re-exported: tests and callers know them from here.
from nvllm.launch.tiny_tokenizer import EOS_TOKEN, IM_END, IM_START, build_tokenizer  # noqa: F401

# --------------------------------------------------------------------------------------------
# Presets
# --------------------------------------------------------------------------------------------

# Llama-3 style frequency-dependent RoPE scaling.  original_max_position_embeddings is kept
# below max_position_embeddings (1024) so the scaling actually changes the low frequencies.
LLAMA3_ROPE_SCALING: dict[str, Any] = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 256,
}

# name -> kwargs for make_tiny_checkpoint.  Each preset exercises one loader / sharding path
# of the engine while staying < ~1 MB so building one takes well under a second.
PRESETS: dict[str, dict[str, Any]] = {
    "llama": {"arch": "llama"},
    "llama3": {
        "arch": "llama",
        "rope_scaling": LLAMA3_ROPE_SCALING,
        "tie_word_embeddings": True,
    },
    "mistral": {"arch": "mistral"},
    # Sliding-window attention on every layer; generations run far past the window.
    "mistral-sw": {"arch": "mistral", "sliding_window": 32},
    # Layers 1 and 2 windowed, layer 0 full (HF: layer i slides iff i >= max_window_layers):
    # mixed layers keep every block.
    "qwen2-sw": {"arch": "qwen2", "num_hidden_layers": 3, "use_sliding_window": True,
                 "sliding_window": 32, "max_window_layers": 1},
    # Qwen2 always has q/k/v bias; the biases are randomised so that dropping them is caught.
    "qwen2": {"arch": "qwen2"},
    # head_dim * num_heads (128) != hidden_size (64): catches code deriving head_dim.
    "qwen3": {"arch": "qwen3", "head_dim": 32},
    # Odd vocab: the vocab-parallel embedding / lm_head must pad or split unevenly.
    "qwen3-odd-vocab": {"arch": "qwen3", "head_dim": 32, "vocab_size": 1031},
    # One KV head: with TP=2 the KV head must be replicated instead of split.
    "llama-1kv": {"arch": "llama", "num_key_value_heads": 1},
    # Head counts tp does not divide (sharded by KV group, nvllm/worker/sharding.py).
    # SmolLM2-135M's 9 query / 3 KV heads: 6 + 3 query heads at tp=2; with an intermediate
    # size (131) and a vocabulary (1025) no tp > 1 divides.
    "llama-9h3kv": {"arch": "llama", "num_attention_heads": 9, "num_key_value_heads": 3,
                    "hidden_size": 72, "intermediate_size": 131, "vocab_size": 1025},
    # 14 / 2: at tp=3 KV head 0 on two ranks (4 + 3 query heads), KV head 1 on one (7).
    "qwen3-14h2kv": {"arch": "qwen3", "num_attention_heads": 14, "num_key_value_heads": 2,
                     "hidden_size": 112, "head_dim": 8},
    # 28 / 4 (Qwen2-7B's ratio) with q/k/v biases: at tp=3, 14 + 7 + 7 query heads.
    "qwen2-28h4kv": {"arch": "qwen2", "num_attention_heads": 28, "num_key_value_heads": 4,
                     "hidden_size": 112},
    "qwen3-bf16": {"arch": "qwen3", "head_dim": 32, "dtype": "bfloat16"},
    # ~100 KB shards -> several model-0000x-of-0000y.safetensors + index.json.
    "qwen3-sharded": {"arch": "qwen3", "head_dim": 32, "shard_size": "100KB"},
    # qwen3's weights with Qwen's tool-calling tokens (<tool_call> ...) and chat template.
    "qwen3-tools": {"arch": "qwen3", "head_dim": 32, "tool_tokenizer": True},
    # Mixture of experts. 5 experts: uneven over 2 ranks with expert parallelism (3 + 2);
    # layer 1 dense (mlp_only_layers) with intermediate_size, the MoE layers with
    # moe_intermediate_size; one KV head, replicated at tp=2. norm_topk_prob is HF's
    # default (False) here; the Qwen3-30B-A3B setting (True) has a preset of its own.
    "qwen3-moe": {
        "arch": "qwen3_moe", "head_dim": 32, "num_hidden_layers": 3, "num_key_value_heads": 1,
        "moe": {"num_experts": 5, "num_experts_per_tok": 3, "moe_intermediate_size": 48,
                "norm_topk_prob": False, "mlp_only_layers": [1]},
    },
    "qwen3-moe-norm": {
        "arch": "qwen3_moe", "head_dim": 32, "num_hidden_layers": 2,
        "moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 48,
                "norm_topk_prob": True, "decoder_sparse_step": 2},
    },
    # Mixtral: 4 experts, top-2 (always renormalised), every layer MoE.
    "mixtral": {"arch": "mixtral", "moe": {"num_local_experts": 4, "num_experts_per_tok": 2}},
}

# Benchmark checkpoints: too big to build inside tests (seconds, tens of MB), same
# generator. qwen3-36m is the Qwen3-shaped model the vLLM comparison runs on
# (scripts/bench_vs_vllm.py, scripts/serve_vs_vllm.sh); its tokenizer names every id of
# the vocabulary, so the text a server streams has one piece per sampled token.
BENCH_PRESETS: dict[str, dict[str, Any]] = {
    "qwen3-36m": {
        "arch": "qwen3", "vocab_size": 16000, "hidden_size": 512, "intermediate_size": 1408,
        "num_hidden_layers": 10, "num_attention_heads": 8, "num_key_value_heads": 2,
        "head_dim": 64, "tie_word_embeddings": True, "max_position_embeddings": 2048,
        "full_vocab_tokenizer": True,
    },
    # The expert-parallel vs tensor-parallel-experts benchmark (docs/benchmarks.md): 16
    # experts top-4 with intermediate 256 per expert in each of 6 layers (50M parameters,
    # 38M of them experts), qwen3-36m's attention and vocabulary.
    "qwen3-moe-50m": {
        "arch": "qwen3_moe", "vocab_size": 16000, "hidden_size": 512, "num_hidden_layers": 6,
        "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 64,
        "tie_word_embeddings": True, "max_position_embeddings": 2048,
        "full_vocab_tokenizer": True,
        "moe": {"num_experts": 16, "num_experts_per_tok": 4, "moe_intermediate_size": 256,
                "norm_topk_prob": True},
    },
}
# SmolLM2-135M's shapes (random weights): 9 query / 3 KV heads, which tp=2 shards by KV
# group (docs/benchmarks.md: against zero-padded heads, scripts/pad_heads.py).
BENCH_PRESETS["smollm2-135m"] = {
    "arch": "llama", "vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536,
    "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
    "tie_word_embeddings": True, "max_position_embeddings": 2048, "dtype": "bfloat16",
}
ALL_PRESETS: dict[str, dict[str, Any]] = {**PRESETS, **BENCH_PRESETS}

_ARCHS = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "mixtral")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# --------------------------------------------------------------------------------------------
# Model
# --------------------------------------------------------------------------------------------


def _config_class(arch: str):
    from transformers import (
        LlamaConfig,
        MistralConfig,
        MixtralConfig,
        Qwen2Config,
        Qwen3Config,
        Qwen3MoeConfig,
    )

    return {
        "llama": LlamaConfig,
        "mistral": MistralConfig,
        "qwen2": Qwen2Config,
        "qwen3": Qwen3Config,
        "qwen3_moe": Qwen3MoeConfig,
        "mixtral": MixtralConfig,
    }[arch]


def _param_generator(seed: int, arch: str, name: str) -> torch.Generator:
    # One generator per parameter, keyed by (seed, arch, name), so a parameter's values depend
    # only on those and its shape: changing tie_word_embeddings, the dtype or the sharding
    # does not reshuffle the other tensors (a larger vocab even keeps the first rows with
    # torch's CPU generator), while llama and qwen2, which share parameter names, still get
    # independent weights.  crc32 is stable across processes (unlike hash()).
    g = torch.Generator()
    g.manual_seed((seed * 0x9E3779B1 + zlib.crc32(f"{arch}/{name}".encode())) % (2**63))
    return g


# Initialization scales, see _init_weights.  Changing any of them changes every checkpoint.
_EMBED_STD = 1.0  # embed_tokens and lm_head
_BIAS_STD = 0.2  # q/k/v biases (qwen2)
_QK_GAIN = 2.0  # on q_proj / k_proj, or on Qwen3's q_norm / k_norm: sharper attention
_RESIDUAL_GAIN = 10.0  # on o_proj / down_proj, the writes into the residual stream
_ROUTER_GAIN = 4.0  # on MoE routers (mlp.gate): decisive routing, see _init_weights


@torch.no_grad()
def _init_weights(model: torch.nn.Module, arch: str, seed: int) -> None:
    """Overwrite every parameter with a deterministic, deliberately "loud" initialization.

    Why not HF's default (all matrices N(0, 0.02), norms 1, biases 0):

    * Flat logits.  With std 0.02 the logits have std ~0.15, so the gap between the best and
      second-best token is often < 1e-4, close to the noise between different kernels.
      Here embeddings and lm_head are N(0, 1), so after the final RMSNorm the logits have
      std ~sqrt(hidden).  Measured over 20 prompts x 32 greedy steps per preset, the
      float32 top-1/top-2 gap has a median ~1.5-1.9, a 1st percentile of 1e-2-4e-2 and a
      minimum of 3e-4-4e-3.  (bfloat16 logits are quantised and do tie exactly; compare
      bf16 runs against a float32 oracle or with a tolerance.)
    * Degenerate text.  If the residual stream is dominated by the current token's
      embedding, a tied-embedding model's argmax is the input token itself and greedy
      decoding repeats it forever (the llama3 preset did so with a residual gain below ~8).
      Matrices are N(0, 1/fan_in) times a gain: _RESIDUAL_GAIN on o_proj / down_proj so
      attention and MLP outputs dominate the residual stream, and _QK_GAIN on the queries
      and keys so attention is selective rather than a near-uniform average (with gain 1,
      several presets fell into one-token loops for some prompts; with 2, none did).
    * Untestable weights.  Norm weights of exactly 1 and biases of exactly 0 would let an
      engine that ignores them pass.  Norm weights are U(0.5, 1.5) and biases
      N(0, _BIAS_STD); the bias is kept small because a large v bias adds the same vector at
      every position and pulls all outputs into short cycles.
    * Near-tie routing.  With gain 1 a router's logits have std ~1 and the k-th and
      (k+1)-th experts are often close, so kernel noise could flip an expert choice; with
      _ROUTER_GAIN the softmax is sharp and choices are clear. Experts (3-D, [E, out, in])
      get the same rule as the 2-D matrices, per expert.
    """
    for name, param in model.named_parameters():
        g = _param_generator(seed, arch, name)
        is_qk = any(k in name for k in ("q_proj", "k_proj", "q_norm", "k_norm"))
        if name.endswith("norm.weight"):
            # input_layernorm, post_attention_layernorm, q_norm, k_norm, final norm.  Qwen3
            # normalises q and k after the projection, so their gain must go on the norm.
            gain = _QK_GAIN if is_qk else 1.0
            param.copy_((torch.rand(param.shape, generator=g) + 0.5) * gain)
        elif name.endswith(".bias"):
            param.copy_(torch.randn(param.shape, generator=g) * _BIAS_STD)
        elif "embed_tokens" in name or "lm_head" in name:
            param.copy_(torch.randn(param.shape, generator=g) * _EMBED_STD)
        elif name.endswith("mlp.gate.weight"):
            param.copy_(torch.randn(param.shape, generator=g)
                        * (_ROUTER_GAIN / math.sqrt(param.shape[1])))
        elif param.ndim == 3 and "experts" in name:
            gain = _RESIDUAL_GAIN if "down_proj" in name else 1.0
            param.copy_(torch.randn(param.shape, generator=g) * (gain / math.sqrt(param.shape[2])))
        elif param.ndim == 2:
            if is_qk:
                gain = _QK_GAIN
            elif "o_proj" in name or "down_proj" in name:
                gain = _RESIDUAL_GAIN
            else:
                gain = 1.0
            param.copy_(torch.randn(param.shape, generator=g) * (gain / math.sqrt(param.shape[1])))
        else:
            # A new architecture with a parameter kind we have not thought about: fail loudly
            # rather than silently leaving HF's init in place.
            raise ValueError(f"no init rule for parameter {name} {tuple(param.shape)}")


def _rope_kwargs(rope_scaling: dict | None) -> dict[str, Any]:
    # transformers 5 stores RoPE settings as config.rope_parameters (one dict that also holds
    # rope_theta) and writes that to config.json; transformers 4 uses rope_scaling + a
    # top-level rope_theta.  Both versions accept the 4.x keyword spelling (5 converts it), so
    # pass that and let the installed version write its native format.  rope_theta is pinned
    # so the checkpoint does not depend on a library default.
    kwargs: dict[str, Any] = {"rope_theta": 10000.0}
    if rope_scaling is not None:
        params = dict(rope_scaling)
        if "type" in params and "rope_type" not in params:  # legacy spelling of the key
            params["rope_type"] = params.pop("type")
        kwargs["rope_scaling"] = params
    return kwargs


def make_tiny_checkpoint(
    path: str | os.PathLike,
    arch: str = "qwen3",
    *,
    vocab_size: int = 1024,
    hidden_size: int = 64,
    intermediate_size: int = 128,
    num_hidden_layers: int = 2,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    head_dim: int | None = None,
    tie_word_embeddings: bool = False,
    rope_scaling: dict | None = None,
    max_position_embeddings: int = 1024,
    seed: int = 0,
    dtype: str = "float32",
    shard_size: str | None = None,
    full_vocab_tokenizer: bool = False,
    tool_tokenizer: bool = False,
    moe: dict[str, Any] | None = None,
    fused_experts: bool = False,
    sliding_window: int | None = None,
    use_sliding_window: bool = False,
    max_window_layers: int | None = None,
) -> pathlib.Path:
    """Write a random HF checkpoint plus tokenizer to ``path`` and return it.

    Deterministic: the same arguments produce byte-identical safetensors.  ``path`` is
    created if needed; existing files with the same names are overwritten.
    full_vocab_tokenizer: the tokenizer names every model id (see build_tokenizer).
    tool_tokenizer: Qwen's tool-calling tokens and chat template (see build_tokenizer).
    moe: the MoE config fields of qwen3_moe / mixtral (num_experts, num_experts_per_tok, ...).
    fused_experts: write the experts as transformers 5 holds them (``experts.gate_up_proj``
    [E, 2I, H], ``experts.down_proj`` [E, H, I]) instead of save_pretrained's per-expert
    tensors; the values are the same.
    sliding_window: Mistral's window (every layer); with use_sliding_window, Qwen's (the
    layers from max_window_layers on).
    """
    from transformers import AutoModelForCausalLM, GenerationConfig

    if arch not in _ARCHS:
        raise ValueError(f"arch must be one of {_ARCHS}, got {arch!r}")
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {tuple(_DTYPES)}, got {dtype!r}")
    path = pathlib.Path(path)
    path.mkdir(parents=True, exist_ok=True)

    tokenizer = build_tokenizer(vocab_size, max_position_embeddings, full_vocab_tokenizer,
                                tool_tokenizer)
    eos_id = tokenizer.convert_tokens_to_ids(EOS_TOKEN)

    kwargs: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        tie_word_embeddings=tie_word_embeddings,
        max_position_embeddings=max_position_embeddings,
        # Qwen-style: <|endoftext|> is bos, eos and pad; the tokenizer adds no bos by itself.
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
        rms_norm_eps=1e-6,
        **_rope_kwargs(rope_scaling),
        **(moe or {}),
    )
    if arch in ("qwen3", "qwen3_moe") and head_dim is None:
        # Qwen3Config defaults head_dim to 128 rather than hidden // heads.
        head_dim = hidden_size // num_attention_heads
    if head_dim is not None:
        kwargs["head_dim"] = head_dim
    if arch in ("mistral", "mixtral"):
        # By default no sliding window (as in Mistral v0.2+).
        kwargs["sliding_window"] = sliding_window
    if arch in ("qwen2", "qwen3") and use_sliding_window:
        kwargs.update(use_sliding_window=True, sliding_window=sliding_window,
                      max_window_layers=max_window_layers)
    config = _config_class(arch)(**kwargs)
    # A tiny model's own hint for readers; weights are not drawn from it (see _init_weights).
    config.initializer_range = _EMBED_STD / math.sqrt(hidden_size)

    torch.manual_seed(seed)
    # Build and initialise in float32 whatever the target dtype, so a bf16 checkpoint is
    # exactly the rounded float32 one for the same seed.
    model = AutoModelForCausalLM.from_config(config).to(torch.float32)
    _init_weights(model, arch, seed)
    if tie_word_embeddings:
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    model.eval()
    if dtype != "float32":
        model = model.to(_DTYPES[dtype])

    gen = GenerationConfig(bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=eos_id)
    model.generation_config = gen

    save_kwargs: dict[str, Any] = {"safe_serialization": True}
    if shard_size is not None:
        save_kwargs["max_shard_size"] = shard_size
    with _quiet_transformers():
        model.save_pretrained(path, **save_kwargs)
        if fused_experts:
            _write_fused(model, path, shard_size)
        # save_jinja_files=False keeps the chat template inside tokenizer_config.json, which
        # is where our engine (and older transformers) look for it.
        tokenizer.save_pretrained(path, save_jinja_files=False)
    return path


def _write_fused(model: torch.nn.Module, path: pathlib.Path, shard_size: str | None) -> None:
    """Replace save_pretrained's weights with the model's own state dict (fused experts)."""
    from safetensors.torch import save_file

    if shard_size is not None:
        raise ValueError("fused_experts writes one model.safetensors: no shard_size")
    state = {n: t.contiguous() for n, t in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    assert any(n.endswith("experts.gate_up_proj") for n in state), "no fused experts"
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})


@contextlib.contextmanager
def _quiet_transformers():
    # save_pretrained draws a "Writing model shards" progress bar and may warn about things
    # that are intentional here; callers (tests, the CLI) should only see the paths.
    from transformers.utils import logging as hf_logging

    old_level = hf_logging.get_verbosity()
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(old_level)
        if bars:
            hf_logging.enable_progress_bar()


# --------------------------------------------------------------------------------------------
# Cache
# --------------------------------------------------------------------------------------------


def _default_root() -> pathlib.Path:
    env = os.environ.get("NVLLM_TINY_DIR")
    if env:
        return pathlib.Path(env)
    return pathlib.Path.home() / ".cache" / "nvllm" / "tiny"


def ensure_tiny_checkpoint(
    name: str = "qwen3", root: str | os.PathLike | None = None
) -> pathlib.Path:
    """Return ``root/name``, building the preset ``name`` there first if it is missing.

    ``root`` defaults to ``$NVLLM_TINY_DIR`` or ``~/.cache/nvllm/tiny``.  The checkpoint is
    written to a temporary sibling directory and renamed into place, so concurrent callers
    (pytest-xdist workers, several ranks) either see a complete checkpoint or none.
    """
    if name not in ALL_PRESETS:
        raise KeyError(f"unknown tiny preset {name!r}; choose from {sorted(ALL_PRESETS)}")
    root = pathlib.Path(root) if root is not None else _default_root()
    target = root / name
    if (target / "config.json").exists():
        return target
    root.mkdir(parents=True, exist_ok=True)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=root))
    try:
        make_tiny_checkpoint(tmp, **ALL_PRESETS[name])
        try:
            # rename of a directory is atomic on POSIX and fails if target exists non-empty.
            os.rename(tmp, target)
        except OSError:
            # Lost the race to another process (or a stale empty dir); use theirs if complete.
            if not (target / "config.json").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


# --------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------


@click.command(context_settings={"show_default": True, "help_option_names": ["-h", "--help"]})
@click.option("--preset", type=click.Choice(sorted(ALL_PRESETS)), default="qwen3",
              help="The preset to build (qwen3-36m: the benchmarks' 36M-parameter model).")
@click.option("--all", "all_presets", is_flag=True,
              help="Build every preset the tests use (not the benchmark ones).")
@click.option("--out", default=None,
              help="Root directory (default: $NVLLM_TINY_DIR or ~/.cache/nvllm/tiny); each "
                   "preset goes to OUT/NAME and is reused if it already exists.")
@click.pass_context
def main(ctx: click.Context, preset: str, all_presets: bool, out: str | None) -> None:
    """Write deterministic tiny random HF checkpoints and print their paths."""
    if all_presets and ctx.get_parameter_source("preset") is not ParameterSource.DEFAULT:
        raise click.UsageError("--preset and --all are mutually exclusive")
    for name in sorted(PRESETS) if all_presets else [preset]:
        click.echo(ensure_tiny_checkpoint(name, out))


if __name__ == "__main__":
    main()
