"""Mixture-of-experts decoders (Qwen3-MoE, Mixtral): Llama-family attention, and a sparse
MoE feed-forward (worker/layers/moe.py) in place of the dense MLP where the config says.

Checkpoints name experts per expert (``experts.{e}.gate_proj.weight``, Mixtral's
``block_sparse_moe.experts.{e}.w1/w3/w2.weight``: what transformers' save_pretrained
writes) or fused (``experts.gate_up_proj`` / ``experts.down_proj``: transformers 5's
in-memory layout); both load, each rank reading only what it holds.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from nvllm.worker.layers.moe import SparseMoE
from nvllm.worker.models.llama import LlamaForCausalLM, Qwen3ForCausalLM
from nvllm.worker.parallel import TPContext

_PER_EXPERT = re.compile(r"\.experts\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight$")
_GATE_UP_HALF = {"gate_proj": 0, "w1": 0, "up_proj": 1, "w3": 1}


def num_experts(cfg) -> int:
    # Qwen3MoeConfig calls it num_experts (config.json: num_local_experts in transformers 5).
    return int(getattr(cfg, "num_experts", None) or getattr(cfg, "num_local_experts", 0) or 0)


def is_moe_layer(cfg, layer: int) -> bool:
    """HF Qwen3-MoE's rule (Mixtral has neither field: every layer): sparse unless listed
    in mlp_only_layers, and only every decoder_sparse_step-th layer (1-based)."""
    step = getattr(cfg, "decoder_sparse_step", None) or 1
    return (layer not in (getattr(cfg, "mlp_only_layers", None) or [])
            and num_experts(cfg) > 0 and (layer + 1) % step == 0)


def expert_target(name: str) -> list[tuple[str, object]] | None:
    """A per-expert checkpoint name's (fused parameter, shard id), or None if it is none."""
    m = _PER_EXPERT.search(name)
    if m is None:
        return None
    base, e, kind = name[:m.start()] + ".experts.", int(m[1]), m[2]
    if kind in _GATE_UP_HALF:
        return [(base + "gate_up_proj", (e, _GATE_UP_HALF[kind]))]
    return [(base + "down_proj", e)]


class MoEMixin:
    """make_mlp and param_for shared by the MoE models."""

    graph_safe = False  # the grouped experts size their matmuls on the host every step
    renormalize_always = False

    def moe_intermediate(self, cfg) -> int:
        return cfg.intermediate_size

    def make_mlp(self, cfg, layer: int, tp: TPContext, dtype: torch.dtype,
                 backend: str) -> nn.Module:
        if not is_moe_layer(cfg, layer):
            return super().make_mlp(cfg, layer, tp, dtype, backend)
        renorm = self.renormalize_always or bool(getattr(cfg, "norm_topk_prob", False))
        return SparseMoE(cfg.hidden_size, num_experts(cfg), self.moe_intermediate(cfg),
                         cfg.num_experts_per_tok, renorm, tp, self.expert_parallel, dtype,
                         backend)

    def param_for(self, hf_name: str) -> list[tuple[str, object]]:
        name = hf_name.replace(".block_sparse_moe.", ".mlp.")
        name = name[len("model."):] if name.startswith("model.") else name
        return expert_target(name) or super().param_for(name)


class Qwen3MoeForCausalLM(MoEMixin, Qwen3ForCausalLM):
    def moe_intermediate(self, cfg) -> int:
        return cfg.moe_intermediate_size


class MixtralForCausalLM(MoEMixin, LlamaForCausalLM):
    renormalize_always = True
