"""Every decoder layer of a decode step in one native call, where the model allows it.

At one decoding row the Python between a layer's native calls (module methods, the
quantized matmul's dispatch, the attention's wrappers) cost SmolLM2-135M about 2.5 ms of a
10.5 ms step on 2 cores: some ten calls a layer, 30 layers. ``csrc/cpu_decode_stack.cpp``'s
``DecodeStack`` holds the layers' tensors and runs the same kernels in the same order with
the same arguments, so a step's hidden states are bit for bit the per-layer path's.

It serves a step when all of these hold, else the model's per-layer path runs as before:
- the model: one tensor-parallel rank; the cpu backend with its ops built; every layer a
  Llama-family decoder (no q/k norm, no biases, a dense MLP, not experts) whose four
  linears are held quantized (``QuantizedWeight``: GGUF files, ``--quantization``);
- the step: float32 or bfloat16, the native decode attention serving every row
  (decodes, verify rows, short prompt chunks; the pages read in place or each sequence's
  contiguous copy), and no more rows than the native quantized op takes
  (``quant.native_max_rows``).

The stack refers to the modules' tensors (not copies). It is rebuilt when the KV cache is
(``init_kv_cache``), and dropped (``forget``) when sleep or a weight update may have
replaced tensors. ``NVLLM_DECODE_STACK=0`` turns it off (read once per process).
"""

from __future__ import annotations

import os

import torch

from nvllm.kernels import cpu_attention, cpu_ops
from nvllm.kernels.metadata import AttentionMetadata
from nvllm.worker.layers.quant import (
    QuantFormat,
    QuantizedWeight,
    act_rows,
    amx_min_rows,
    native_max_rows,
)

ENV = "NVLLM_DECODE_STACK"
_ATTR = "_decode_stack"  # on the model: (stack, the first layer's k_cache) or False
_INT4, _INT8 = QuantFormat(4, False), QuantFormat(8, False)
_ENABLED: list[bool] = []


def enabled() -> bool:
    if not _ENABLED:
        _ENABLED.append(os.environ.get(ENV, "1") != "0")
    return _ENABLED[0]


def forget(model: torch.nn.Module) -> None:
    """Drop the model's stack (rebuilt, if it still applies, on the next step)."""
    model.__dict__.pop(_ATTR, None)


def _linear_args(m: torch.nn.Module) -> list | None:
    qw = getattr(m, "packed", None)
    if not isinstance(qw, QuantizedWeight) or getattr(m, "bias", None) is not None \
            or qw.qweight.device.type != "cpu":
        return None
    return [qw.qweight, qw.scales, qw.mins, qw.fmt.bits]


def build(model: torch.nn.Module):
    """The model's DecodeStack, or None where it does not apply (the module docstring's
    model conditions)."""
    from nvllm.worker.models.llama import DecoderAttention, DecoderMLP

    if getattr(model, "tp", None) is None or model.tp.world_size != 1 or not cpu_ops.load():
        return None
    layers = getattr(model, "layers", None)
    if not layers:
        return None
    first = layers[0].self_attn
    if type(first) is not DecoderAttention:
        return None
    stack = torch.classes.nvllm_cpu.DecodeStack(first.num_heads, first.num_kv_heads,
                                                float(layers[0].input_layernorm.eps),
                                                float(first.attn.scale))
    for i, layer in enumerate(layers):
        attn, mlp = layer.self_attn, layer.mlp
        if (type(attn) is not DecoderAttention or type(mlp) is not DecoderMLP
                or attn.qk_norm or attn.backend != "cpu" or mlp.act_fn.backend != "cpu"
                or attn.attn.k_cache.numel() == 0 or attn.attn.layer_idx != i
                or (attn.num_heads, attn.num_kv_heads) != (first.num_heads, first.num_kv_heads)
                or attn.attn.scale != first.attn.scale
                or rope_tables(layer) is not rope_tables(layers[0])):
            return None
        norms = (layer.input_layernorm, layer.post_attention_layernorm)
        if any(n.backend != "cpu" or n.eps != layers[0].input_layernorm.eps for n in norms):
            return None
        lins = [_linear_args(m) for m in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj,
                                          mlp.down_proj)]
        if any(a is None for a in lins):
            return None
        stack.add_layer(norms[0].weight, norms[1].weight, *lins[0], *lins[1], *lins[2],
                        *lins[3], attn.attn.k_cache, attn.attn.v_cache,
                        attn.attn.window or 0)
    return stack


def rope_tables(layer: torch.nn.Module) -> dict:
    """The layer's rotary buffers (cos, sin), shared by every layer of a model."""
    return layer.self_attn.rotary_emb._buffers


def run(model: torch.nn.Module, x: torch.Tensor, positions: torch.Tensor,
        meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(the last layer's output, the residual stream) for the embeddings x, as the
    per-layer path computes them; None where the stack does not serve this step."""
    if not enabled() or x.dim() != 2 or x.device.type != "cpu" \
            or x.dtype not in (torch.float32, torch.bfloat16) \
            or not 0 < x.shape[0] <= native_max_rows(x.dtype):  # the native ops' dtypes
        return None
    layers = model.layers
    k0 = layers[0].self_attn.attn.k_cache
    held = model.__dict__.get(_ATTR)
    if held is None or (held and held[1] is not k0):
        stack = build(model)
        held = (stack, k0) if stack is not None else False
        object.__setattr__(model, _ATTR, held)
    if not held:
        return None
    tables = rope_tables(layers[0])
    act = [act_rows(op, fmt) for op in ("a8", "a16") for fmt in (_INT4, _INT8)]
    act.append(amx_min_rows())
    if meta.cpu_kv is not None:  # the contiguous copies (cpu_kv_mirror)
        dec = meta.cpu_kv.decode
        if dec is None or not cpu_attention.serves_all_rows(dec, meta, x.shape[0]):
            return None
        return held[0].run(x, positions, tables["cos"], tables["sin"], dec.slots, dec.rows,
                           dec.lens, dec.query_lens, None, dec.bases, dec.caps, *act)
    first = layers[0].self_attn
    pr = cpu_attention.paged_rows(meta, k0, first.num_heads, first.num_kv_heads)
    if pr is None or not pr.all_rows:
        return None
    return held[0].run(x, positions, tables["cos"], tables["sin"], pr.slots, pr.rows, pr.lens,
                       pr.query_lens, pr.block_tables, None, None, *act)
