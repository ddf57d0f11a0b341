"""The one dispatch point for every kernel: the worker calls these, passing its backend.

``"torch"`` runs the reference twins (``reference.py``); ``"triton"`` runs the Triton
kernels (on CPU under the Triton interpreter, ``TRITON_INTERPRET=1``). ``"auto"`` is
resolved once at start-up by ``resolve_backend``: Triton on CUDA, torch on CPU.

Attention on the torch backend has a second implementation, the CPU backend
(``cpu_attention.py``: contiguous per-sequence K/V copies). ``uses_cpu_attention`` says
whether a worker runs it; ``attention`` then picks it per step by the metadata carrying
its views (``meta.cpu_kv``), not by another backend name: the views exist exactly when
the runner keeps copies, every other op is the same as torch's (a "cpu" name would only
alias it), and steps built without views (tests, benchmarks, ``cpu_kv_mirror=False``)
read the pages through the reference.
"""

from __future__ import annotations

import importlib.util
import os

import torch

from nvllm.kernels import cpu_attention, reference
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


def uses_cpu_attention(backend: str, device: torch.device, cpu_kv_mirror: bool) -> bool:
    """Whether a worker keeps the CPU backend's K/V copies (and puts their views in each
    step's metadata); backend is the resolved one."""
    return device.type == "cpu" and backend == "torch" and cpu_kv_mirror


def attention(q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float,
              backend: str = "torch", layer: int = 0) -> torch.Tensor:
    """One layer's attention step: store this step's K/V ([T, kv_heads, d]) in the paged
    cache, then attend. layer indexes the CPU backend's copies (which hold every layer)."""
    if meta.cpu_kv is not None and backend == "torch":
        return cpu_attention.attention(q, k, v, k_cache, v_cache, meta, scale, layer)
    store_kvcache(k, v, k_cache, v_cache, meta.slot_mapping, backend)
    return paged_attention(q, k_cache, v_cache, meta, scale, backend)


def store_kvcache(k, v, k_cache, v_cache, slot_mapping, backend: str = "torch") -> None:
    if backend == "triton":
        return _triton_attention().store_kvcache(k, v, k_cache, v_cache, slot_mapping)
    return reference.store_kvcache(k, v, k_cache, v_cache, slot_mapping)


def paged_attention(q, k_cache, v_cache, meta: AttentionMetadata, scale: float,
                    backend: str = "torch") -> torch.Tensor:
    if backend == "triton":
        return _triton_attention().paged_attention(q, k_cache, v_cache, meta, scale)
    return reference.paged_attention(q, k_cache, v_cache, meta, scale)


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
