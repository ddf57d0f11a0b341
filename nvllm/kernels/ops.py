"""The one dispatch point for every kernel: the worker calls these, passing its backend.

``"torch"`` runs the reference twins (``reference.py``); ``"triton"`` runs the Triton
kernels (on CPU under the Triton interpreter, ``TRITON_INTERPRET=1``). ``"auto"`` is
resolved once at start-up by ``resolve_backend``: Triton on CUDA, torch on CPU.
"""

from __future__ import annotations

import importlib.util
import os

import torch

from nvllm.kernels import reference
from nvllm.kernels.metadata import AttentionMetadata

BACKENDS = ("auto", "torch", "triton")


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def resolve_backend(backend: str, device: torch.device) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"attention backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        return "triton" if device.type == "cuda" and triton_available() else "torch"
    if backend == "triton":
        if not triton_available():
            raise RuntimeError("attention_backend='triton' needs the triton package "
                               "(pip install triton)")
        if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
            raise RuntimeError("Triton kernels on CPU run only under the Triton interpreter: "
                               "set TRITON_INTERPRET=1 before starting the process")
    return backend


def _triton_attention():
    from nvllm.kernels import triton_attention

    return triton_attention


def _triton_layer_ops():
    from nvllm.kernels import triton_layer_ops

    return triton_layer_ops


def store_kvcache(k, v, k_cache, v_cache, slot_mapping, backend: str = "torch") -> None:
    if backend == "triton":
        return _triton_attention().store_kvcache(k, v, k_cache, v_cache, slot_mapping)
    return reference.store_kvcache(k, v, k_cache, v_cache, slot_mapping)


def paged_attention(q, k_cache, v_cache, meta: AttentionMetadata, scale: float,
                    backend: str = "torch", k_new=None, v_new=None,
                    layer: int = 0) -> torch.Tensor:
    """k_new/v_new/layer feed the torch backend's contiguous per-sequence copies
    (meta.seq_kv, CPU); the Triton kernels read the paged cache directly."""
    if backend == "triton":
        return _triton_attention().paged_attention(q, k_cache, v_cache, meta, scale)
    return reference.paged_attention(q, k_cache, v_cache, meta, scale, k_new, v_new, layer)


def rms_norm(x, weight, eps: float, backend: str = "torch") -> torch.Tensor:
    if backend == "triton":
        return _triton_layer_ops().rms_norm(x, weight, eps)
    return reference.rms_norm(x, weight, eps)


def fused_add_rms_norm(x, residual, weight, eps: float, backend: str = "torch"):
    if backend == "triton":
        return _triton_layer_ops().fused_add_rms_norm(x, residual, weight, eps)
    return reference.fused_add_rms_norm(x, residual, weight, eps)


def rotary_embedding(positions, q, k, cos, sin, backend: str = "torch"):
    if backend == "triton":
        return _triton_layer_ops().rotary_embedding(positions, q, k, cos, sin)
    return reference.rotary_embedding(positions, q, k, cos, sin)


def silu_and_mul(x, backend: str = "torch") -> torch.Tensor:
    if backend == "triton":
        return _triton_layer_ops().silu_and_mul(x)
    return reference.silu_and_mul(x)
