"""The one dispatch point for every kernel: the worker calls these, passing its backend.

``"torch"`` runs the reference twins (``reference.py``); ``"triton"`` runs the Triton
kernels (on CPU under the Triton interpreter, ``TRITON_INTERPRET=1``); ``"cpu"`` runs
nvllm's native CPU ops (``cpu_ops.py``: the layer ops and batched decode attention),
which are built per machine, and the reference for the rest. ``"auto"`` is resolved
once at start-up by ``resolve_backend``: Triton on CUDA; on CPU, cpu where the native
ops load, else torch.

Attention on the torch and cpu backends has a second implementation
(``cpu_attention.py``: contiguous per-sequence K/V copies; on the cpu backend its decoding
sequences go to the native kernel). ``uses_cpu_attention`` says
whether a worker runs it; ``attention`` then picks it per step by the metadata carrying
its views (``meta.cpu_kv``), not by another backend name: the views exist exactly when
the runner keeps copies, every other op is the same as torch's (a "cpu" name would only
alias it). Steps built without views (``cpu_kv_mirror=False``, tests, benchmarks) read
the pages: on the cpu backend a decode step (every sequence 1..MAX_QUERIES new tokens)
goes to the same native kernel in paged mode (``cpu_attention.paged_rows``), any other
step to the reference.
"""

from __future__ import annotations

import importlib.util
import os

import torch

from nvllm.kernels import cpu_attention, cpu_ops, moe, reference
from nvllm.kernels.metadata import AttentionMetadata

BACKENDS = ("auto", "torch", "triton", "cpu")


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def resolve_backend(backend: str, device: torch.device) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"attention backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        if device.type == "cuda":
            return "triton" if triton_available() else "torch"
        return "cpu" if cpu_ops.load() else "torch"
    if backend == "cpu":
        if device.type != "cpu":
            raise RuntimeError("attention_backend='cpu' runs on CPU only")
        if not cpu_ops.load():
            raise RuntimeError("attention_backend='cpu' needs nvllm's native CPU ops, which "
                               "did not build here: run python -m nvllm.kernels.cpu_ops to "
                               "see why, or use 'torch'")
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
    return device.type == "cpu" and backend in ("torch", "cpu") and cpu_kv_mirror


def attention(q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float,
              backend: str = "torch", layer: int = 0,
              window: int | None = None) -> torch.Tensor:
    """One layer's attention step: store this step's K/V ([T, kv_heads, d]) in the paged
    cache, then attend (query i sees key j iff j <= i and i - j < window; None: full).
    layer indexes the CPU backend's copies (which hold every layer)."""
    if meta.cpu_kv is not None and backend in ("torch", "cpu"):
        return cpu_attention.attention(q, k, v, k_cache, v_cache, meta, scale, layer, window)
    if backend == "cpu":  # no copies: the native kernel reads the pages of decode steps
        out = cpu_attention.paged_attention(q, k, v, k_cache, v_cache, meta, scale, window)
        if out is not None:
            return out
    store_kvcache(k, v, k_cache, v_cache, meta.slot_mapping, backend)
    return paged_attention(q, k_cache, v_cache, meta, scale, backend, window)


def decode_attention_qkv(qkv, positions, cos, sin, num_heads: int, num_kv_heads: int,
                         k_cache, v_cache, meta: AttentionMetadata, scale: float,
                         backend: str = "torch", layer: int = 0,
                         window: int | None = None) -> torch.Tensor | None:
    """Neox rotary + ``attention`` of a decode-only step in one native call, from the fused
    q/k/v projection's output ``qkv`` ([T, (heads + 2 kv_heads) d]; cos/sin: the rotary
    tables); [T, heads * d], the values split + ``rotary_embedding`` + ``attention`` give.
    None (take that path instead) off the cpu backend or when some row of the step is not
    the native decode kernel's."""
    if backend != "cpu":
        return None
    if meta.cpu_kv is None:
        return cpu_attention.paged_decode_qkv(qkv, positions, cos, sin, num_heads, num_kv_heads,
                                              k_cache, v_cache, meta, scale, window)
    return cpu_attention.decode_qkv(qkv, positions, cos, sin, num_heads, num_kv_heads,
                                    k_cache, v_cache, meta, scale, layer, window)


def store_kvcache(k, v, k_cache, v_cache, slot_mapping, backend: str = "torch") -> None:
    if backend == "triton":
        return _triton_attention().store_kvcache(k, v, k_cache, v_cache, slot_mapping)
    return reference.store_kvcache(k, v, k_cache, v_cache, slot_mapping)


def paged_attention(q, k_cache, v_cache, meta: AttentionMetadata, scale: float,
                    backend: str = "torch", window: int | None = None) -> torch.Tensor:
    if backend == "triton":
        return _triton_attention().paged_attention(q, k_cache, v_cache, meta, scale, window)
    return reference.paged_attention(q, k_cache, v_cache, meta, scale, window)


def rms_norm(x, weight, eps: float, backend: str = "torch") -> torch.Tensor:
    if backend == "cpu":
        return cpu_ops.rms_norm(x, weight, eps)
    if backend == "triton":
        return _triton_layer_ops().rms_norm(x, weight, eps)
    return reference.rms_norm(x, weight, eps)


def fused_add_rms_norm(x, residual, weight, eps: float, backend: str = "torch"):
    if backend == "cpu":
        return cpu_ops.fused_add_rms_norm(x, residual, weight, eps)
    if backend == "triton":
        return _triton_layer_ops().fused_add_rms_norm(x, residual, weight, eps)
    return reference.fused_add_rms_norm(x, residual, weight, eps)


def fused_add_rms_norm_(x, residual, weight, eps: float, backend: str = "torch"):
    """fused_add_rms_norm, in place on the cpu backend (x + residual into residual, which
    must be contiguous, and its norm into x; no allocation); elsewhere new tensors."""
    if backend == "cpu":
        return cpu_ops.fused_add_rms_norm_(x, residual, weight, eps)
    return fused_add_rms_norm(x, residual, weight, eps, backend)


def rotary_embedding(positions, q, k, cos, sin, backend: str = "torch"):
    if backend == "cpu":
        return cpu_ops.rotary_embedding(positions, q, k, cos, sin)
    if backend == "triton":
        return _triton_layer_ops().rotary_embedding(positions, q, k, cos, sin)
    return reference.rotary_embedding(positions, q, k, cos, sin)


def silu_and_mul(x, backend: str = "torch") -> torch.Tensor:
    if backend == "cpu":
        return cpu_ops.silu_and_mul(x)
    if backend == "triton":
        return _triton_layer_ops().silu_and_mul(x)
    return reference.silu_and_mul(x)


def fused_moe(x, w13, w2, topk_ids, topk_weights, expert_start: int,
              backend: str = "torch") -> torch.Tensor:
    """The MoE feed-forward: on the triton backend the fused grouped-GEMM kernel
    (``triton_moe.py``), elsewhere the torch path that groups tokens by expert
    (``moe.py``); both take the same arguments and sum in float32."""
    if backend == "triton":
        from nvllm.kernels import triton_moe

        return triton_moe.fused_moe(x, w13, w2, topk_ids, topk_weights, expert_start)
    return moe.fused_moe(x, w13, w2, topk_ids, topk_weights, expert_start)
