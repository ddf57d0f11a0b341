"""Pre-quantized fp8 checkpoints (vLLM's / llm-compressor's ``quant_method: fp8``
safetensors) as HF ``.weight`` sources.

Such a checkpoint stores each quantized linear's W [N, K] as ``<module>.weight`` in
``float8_e4m3fn`` with ``<module>.weight_scale`` (float32, or bf16 / fp16): one value
for the tensor (shape [] or [1], vLLM's ``Fp8LinearMethod``) or one per output channel
([N] or [N, 1]); value = scale * q. ``<module>.input_scale`` (a static activation scale,
``activation_scheme: static``) is for W8A8 kernels: nvllm's fp8 layers are weight-only
(activations stay in the run dtype), so it is skipped, logged once. Unquantized tensors
(embedding, LM head, norms: ``ignored_layers``) pass through as they are.

``fp8_tensors`` groups a module's weight and weight_scale into one ``Fp8Slice`` named
``<module>.weight`` that reads like safetensors' ``get_slice`` of W (float32 values of
any [rows, cols] range), so a dense parameter (``quantization=none``, a layer left dense,
``int8`` / ``int4`` quantizing the values) loads it as any float tensor; an fp8 layer
(nvllm/worker/layers/fp8.py:Fp8Weight, under ``auto`` or ``fp8``) takes its shard's e4m3
bytes and per-row scales as they are (``fp8_rows``): nothing dequantized, every value the
checkpoint's scale * q exactly (a per-tensor scale becomes each row's).

Not read (an error that says so): block-wise scales (``weight_block_size``, DeepSeek-V3's
``weight_scale_inv`` per 128 x 128), e5m2 weights, other ``quant_method``s.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from nvllm.worker.sharding import window_2d

logger = logging.getLogger(__name__)

QTYPE = "FP8"  # the source type quantize.plan sees (``qtype_name``)


@dataclass(frozen=True, slots=True)
class Fp8CheckpointConfig:
    """activation_scheme: "static" (input scales stored, skipped) or "dynamic";
    ignored_layers: modules the checkpoint left unquantized (informational: their
    tensors are float and load as such)."""

    activation_scheme: str
    ignored_layers: tuple[str, ...]


def fp8_checkpoint_config(model_dir: str | Path) -> Fp8CheckpointConfig | None:
    """The fp8 ``quantization_config`` of an HF checkpoint folder's config.json, None
    where it has none or another method; a ValueError naming the fix for a variant
    nvllm cannot read."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        return None
    cfg = json.loads(path.read_text()).get("quantization_config")
    if not cfg or str(cfg.get("quant_method", "")).lower() != "fp8":
        return None
    if cfg.get("weight_block_size"):
        raise ValueError(f"{model_dir}: block-wise fp8 (weight_block_size="
                         f"{cfg['weight_block_size']}) is not read; nvllm reads fp8 "
                         "checkpoints with per-tensor or per-channel weight scales")
    fmt = str(cfg.get("fmt", "e4m3")).lower()
    if fmt != "e4m3":
        raise ValueError(f"{model_dir}: fp8 fmt={fmt!r}; nvllm reads e4m3 weights")
    return Fp8CheckpointConfig(str(cfg.get("activation_scheme", "dynamic")),
                               tuple(cfg.get("ignored_layers") or ()))


class Fp8Slice:
    """One fp8 linear weight as HF's W [N, K]: ``get_shape()``, ``[rows, cols]`` (float32
    values scale * q) and ``fp8_rows`` (e4m3 values and per-row float32 scales)."""

    __slots__ = ("name", "weight", "scale", "shape", "qtype_name")

    def __init__(self, name: str, weight, scale) -> None:
        self.name, self.weight, self.qtype_name = name, weight, QTYPE
        self.shape = tuple(weight.get_shape())
        dtype = weight.get_dtype()
        if dtype != "F8_E4M3":
            raise ValueError(f"{name}.weight is {dtype}; an fp8 checkpoint's quantized "
                             "weights are float8_e4m3fn (F8_E4M3)")
        s = scale[:].float().reshape(-1)
        n = self.shape[0]
        if s.numel() not in (1, n):
            raise ValueError(f"{name}.weight_scale has {s.numel()} values for {n} rows; "
                             "nvllm reads one per tensor or one per output channel "
                             "(block-wise scales are not read)")
        self.scale = s.expand(n).contiguous() if s.numel() == 1 else s

    def get_shape(self) -> list[int]:
        return list(self.shape)

    def fp8_rows(self, rows: tuple[int, int], cols: tuple[int, int]
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """(q float8_e4m3fn [R, C], scales float32 [R]) of W[rows, cols], as stored."""
        (r0, r1), (c0, c1) = rows, cols
        return self.weight[r0:r1, c0:c1], self.scale[r0:r1]

    def __getitem__(self, index) -> torch.Tensor:
        (r0, r1), (c0, c1) = window_2d(index, self.shape, self.name)
        q, s = self.fp8_rows((r0, r1), (c0, c1))
        return q.float() * s.unsqueeze(1)  # exact: e4m3 has 4 significant bits


@contextmanager
def fp8_tensors(files: list[str], cfg: Fp8CheckpointConfig
                ) -> Iterator[Iterator[tuple[str, object]]]:
    """All files of an fp8 checkpoint at once (a weight and its scale may sit in
    different shards): (HF name, lazy source) pairs, each quantized module's weight and
    weight_scale as one ``<module>.weight`` Fp8Slice, input scales skipped."""
    with ExitStack() as stack:
        handles = [stack.enter_context(safe_open(f, framework="pt", device="cpu"))
                   for f in files]
        where = {name: h for h in handles for name in h.keys()}
        yield _grouped(where, cfg)


def _grouped(where: dict, cfg: Fp8CheckpointConfig) -> Iterator[tuple[str, object]]:
    skipped = 0
    for name in where:
        base, _, kind = name.rpartition(".")
        if kind in ("input_scale", "k_scale", "v_scale", "kv_scale"):
            skipped += 1  # static activation / KV scales: for W8A8 / fp8-KV kernels
            continue
        if kind == "weight_scale" and f"{base}.weight" in where:
            continue  # read with its weight
        src = where[name].get_slice(name)
        if kind == "weight" and f"{base}.weight_scale" in where:
            scale = where[f"{base}.weight_scale"].get_slice(f"{base}.weight_scale")
            yield name, Fp8Slice(base, src, scale)
        else:
            yield name, src
    if skipped:
        logger.info("fp8 checkpoint (activation_scheme=%s): %d activation / KV scales "
                    "skipped; nvllm's fp8 layers are weight-only (activations stay in "
                    "the run dtype)", cfg.activation_scheme, skipped)
