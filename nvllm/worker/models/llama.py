"""Llama-family decoder (Llama, Llama-3, Mistral, Qwen2, Qwen3) with tensor parallelism.

The members differ only in flags read from the HF config: QKV bias (Qwen2), per-head
q/k RMSNorm (Qwen3), explicit head_dim, rope scaling and tied embeddings; and in each
layer's sliding window (Mistral, Qwen2/Qwen3 with use_sliding_window), which the caller
reads from the config.json (nvllm/common/config.py:layer_windows).
"""

from __future__ import annotations

from collections.abc import Generator

import torch
from torch import nn

from nvllm.kernels import ops
from nvllm.kernels.metadata import AttentionMetadata
from nvllm.worker.layers.activation import SiluAndMul
from nvllm.worker.layers.attention import Attention
from nvllm.worker.layers.embed_head import ParallelLMHead, VocabParallelEmbedding
from nvllm.worker.layers.layernorm import RMSNorm
from nvllm.worker.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    linear,
)
from nvllm.worker.layers.rotary import RotaryEmbedding, compute_inv_freq
from nvllm.worker.models import decode_stack
from nvllm.worker.parallel import TPContext

# Yields partial sums to all-reduce, receives them reduced (see LlamaForCausalLM.stages).
Stages = Generator[torch.Tensor, torch.Tensor, object]


def _hot(m: nn.Module, *names: str) -> tuple:
    """m's submodules `names`, kept as a plain tuple in m.__dict__ from the first call on:
    each nn.Module.__getattr__ of a submodule or parameter costs about 1 µs, some twenty
    of them a layer on the decode path (submodules are not reassigned after the first
    forward)."""
    t = m.__dict__.get("_hot_modules")
    if t is None:
        t = tuple(m._modules[n] for n in names)
        object.__setattr__(m, "_hot_modules", t)
    return t


class DecoderAttention(nn.Module):
    def __init__(self, cfg, tp: TPContext, dtype: torch.dtype, rotary: RotaryEmbedding,
                 backend: str, qkv_bias: bool, o_bias: bool, qk_norm: bool,
                 window: int | None = None) -> None:
        super().__init__()
        heads = cfg.num_attention_heads
        kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, self.head_dim, heads, kv_heads,
                                          qkv_bias, tp, dtype)
        self.num_heads = self.qkv_proj.num_heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        # o_proj reads this rank's query heads' columns: the same uneven cut as qkv_proj.
        q0 = self.qkv_proj.q_head_start * self.head_dim
        self.o_proj = RowParallelLinear(heads * self.head_dim, cfg.hidden_size, o_bias, tp,
                                        dtype, input_span=(q0, q0 + self.num_heads * self.head_dim))
        self.rotary_emb = rotary
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim,
                              self.head_dim ** -0.5, backend, window)
        self.qk_norm = qk_norm
        self.backend = backend
        if qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, dtype, backend)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, dtype, backend)

    def partial(self, positions: torch.Tensor, x: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """Attention up to o_proj's partial sum (all-reduce, then o_proj.finish)."""
        qkv_proj, o_proj, attn, rot = _hot(self, "qkv_proj", "o_proj", "attn", "rotary_emb")
        qkv = linear(x, qkv_proj, qkv_proj.bias)
        if not self.qk_norm:  # decode-only steps on the cpu backend: one native call
            tables = rot._buffers
            o = ops.decode_attention_qkv(qkv, positions, tables["cos"], tables["sin"],
                                         self.num_heads, self.num_kv_heads, attn.k_cache,
                                         attn.v_cache, meta, attn.scale, self.backend,
                                         attn.layer_idx, attn.window)
            if o is not None:
                return linear(o, o_proj)
        d = self.head_dim
        q, k, v = qkv.split([self.num_heads * d, self.num_kv_heads * d,
                             self.num_kv_heads * d], dim=-1)
        q = q.view(-1, self.num_heads, d)
        k = k.view(-1, self.num_kv_heads, d)
        v = v.view(-1, self.num_kv_heads, d)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary_emb(positions, q, k)
        o = self.attn(q, k, v.contiguous(), meta)
        return self.o_proj.partial(o.reshape(-1, self.num_heads * d))


class DecoderMLP(nn.Module):
    def __init__(self, cfg, tp: TPContext, dtype: torch.dtype, backend: str) -> None:
        super().__init__()
        bias = getattr(cfg, "mlp_bias", False)
        self.gate_up_proj = MergedColumnParallelLinear(
            cfg.hidden_size, [cfg.intermediate_size] * 2, bias, tp, dtype)
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, bias, tp,
                                           dtype)
        self.act_fn = SiluAndMul(backend)

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        """The MLP up to down_proj's partial sum (all-reduce, then down_proj.finish)."""
        gate_up, down, act = _hot(self, "gate_up_proj", "down_proj", "act_fn")
        return linear(ops.silu_and_mul(linear(x, gate_up, gate_up.bias), act.backend), down)

    def finish(self, y: torch.Tensor) -> torch.Tensor:
        return _hot(self, "gate_up_proj", "down_proj", "act_fn")[1].finish(y)


class DecoderLayer(nn.Module):
    """Attention (full, or over a sliding window), then a feed-forward with `partial` and
    `finish`: the dense DecoderMLP or a mixture of experts (worker/layers/moe.py), each one
    all-reduce."""

    def __init__(self, cfg, tp, dtype, rotary, backend, qkv_bias, o_bias, qk_norm,
                 mlp: nn.Module, window: int | None = None) -> None:
        super().__init__()
        self.self_attn = DecoderAttention(cfg, tp, dtype, rotary, backend, qkv_bias, o_bias,
                                          qk_norm, window)
        self.mlp = mlp
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, backend)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype,
                                                backend)

    def stages(self, positions, x, residual, meta) -> Stages:
        # Module methods are called directly (no nn.Module.__call__) and the residual adds
        # run in place where the backend can: at one decoding row these hops, not the
        # arithmetic, were most of a layer's time outside its GEMMs.
        attn, mlp, norm1, norm2 = _hot(self, "self_attn", "mlp", "input_layernorm",
                                       "post_attention_layernorm")
        if residual is None:
            residual = x
            x = norm1.forward(x)
        else:
            x, residual = norm1.add_norm_(x, residual)
        x = _hot(attn, "qkv_proj", "o_proj", "attn", "rotary_emb")[1].finish(
            (yield attn.partial(positions, x, meta)))
        x, residual = norm2.add_norm_(x, residual)
        x = mlp.finish((yield mlp.partial(x)))
        return x, residual


class LlamaForCausalLM(nn.Module):
    # HF checkpoint name -> (our fused parameter, shard id)
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }
    qk_norm = False
    # Decode steps may be captured in CUDA graphs (no host syncs, shapes fixed by the batch).
    graph_safe = True

    @staticmethod
    def attention_biases(cfg) -> tuple[bool, bool]:
        """(q/k/v bias, o_proj bias): HF Llama and Qwen3 use attention_bias for both."""
        b = bool(getattr(cfg, "attention_bias", False))
        return b, b

    def __init__(self, cfg, tp: TPContext, dtype: torch.dtype, max_position: int,
                 attention_backend: str = "torch",
                 layer_windows: list[int | None] | None = None,
                 expert_parallel: bool = False) -> None:
        """layer_windows: each layer's sliding window (None: full; default: all full)."""
        super().__init__()
        self.tp = tp
        self.expert_parallel = expert_parallel  # MoE models: whole experts per rank
        heads = cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        inv_freq, scaling = compute_inv_freq(cfg, head_dim)
        rotary = RotaryEmbedding(head_dim, max_position, inv_freq, scaling, attention_backend)
        qkv_bias, o_bias = self.attention_biases(cfg)
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp, dtype)
        windows = layer_windows or [None] * cfg.num_hidden_layers
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, tp, dtype, rotary, attention_backend, qkv_bias, o_bias,
                         self.qk_norm, self.make_mlp(cfg, i, tp, dtype, attention_backend),
                         windows[i])
            for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, attention_backend)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, tp, dtype)
        self.tie_word_embeddings = bool(getattr(cfg, "tie_word_embeddings", False))

    def make_mlp(self, cfg, layer: int, tp: TPContext, dtype: torch.dtype,
                 backend: str) -> nn.Module:
        """Layer `layer`'s feed-forward (MoE models override this)."""
        return DecoderMLP(cfg, tp, dtype, backend)

    def stages(self, input_ids: torch.Tensor, positions: torch.Tensor,
               meta: AttentionMetadata) -> Stages:
        """The forward pass as a generator: it yields every partial sum that needs a
        tensor-parallel all-reduce, is resumed with the reduced tensor, and returns the
        final hidden states. TPContext.run drives one pass, or two micro-batches so that
        one's all-reduce runs while the other computes."""
        x = yield self.embed_tokens.partial(input_ids)
        stacked = decode_stack.run(self, x, positions, meta)  # one rank: no all-reduce
        if stacked is not None:
            x, residual = stacked
        else:
            residual = None
            for layer in self.layers:
                x, residual = yield from layer.stages(positions, x, residual, meta)
        x, _ = self.norm(x, residual)
        return x

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """One synchronous pass (the decode graphs capture this)."""
        return self.tp.run([self.stages(input_ids, positions, meta)])[0]

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        return self.lm_head(hidden_states)

    def param_for(self, hf_name: str) -> list[tuple[str, object]]:
        """Our parameter name(s) and shard id for one checkpoint tensor ([] = skip)."""
        name = hf_name[len("model."):] if hf_name.startswith("model.") else hf_name
        if "rotary_emb.inv_freq" in name:
            return []
        if name == "lm_head.weight" and self.tie_word_embeddings:
            return []  # tied: the head is loaded from embed_tokens
        targets = [(name, None)]
        if name == "embed_tokens.weight" and self.tie_word_embeddings:
            targets.append(("lm_head.weight", None))
        out = []
        for n, _ in targets:
            for hf, (ours, shard) in self.packed_modules_mapping.items():
                if f".{hf}." in n:
                    out.append((n.replace(f".{hf}.", f".{ours}."), shard))
                    break
            else:
                out.append((n, None))
        return out


class Qwen2ForCausalLM(LlamaForCausalLM):
    @staticmethod
    def attention_biases(cfg) -> tuple[bool, bool]:
        return True, False  # Qwen2 always has q/k/v bias and never an o_proj bias


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True

