"""Which layers of a model are held quantized (the ``quantization`` setting), turning them
into quantized layers before the weights load, and loading a shard into one.

The setting: ``none`` keeps every weight in the run dtype (GGUF blocks dequantized);
``auto`` (the default) keeps a GGUF file's own format where a layer's blocks fit one of
nvllm/worker/layers/quant.py's formats exactly (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1; an
embedding and the LM head too, the file's choice), else that layer is dense (F16/F32,
K-quants, mixed formats no engine format holds); ``int8`` / ``int4`` quantize every
linear layer (not the embedding or the LM head) at load, round-to-nearest per group of 32,
symmetric; a GGUF block that already fits (Q8_0/Q5/Q4 in int8, Q4_0/Q4_1 in int4, with
a min where the file has one) is repacked as is instead. ``fp8`` quantizes them to e4m3
with a float32 scale per output channel (nvllm/worker/layers/fp8.py; no groups, so any
shard of columns).

One rule for shards: a quantized layer is cut along whole groups of 32 input columns. A
row-parallel layer whose rank-local input columns do not start and end on a group (an
input split that is not a multiple of 32 per rank) stays dense, logged; output rows split
anywhere.
"""

from __future__ import annotations

import logging
from collections import defaultdict

import torch
from torch import nn

from nvllm.common.config import QUANTIZATIONS as MODES
from nvllm.worker.layers.embed_head import ParallelLMHead, VocabParallelEmbedding
from nvllm.worker.layers.fp8 import FP8, Fp8Weight
from nvllm.worker.layers.linear import ColumnParallelLinear, RowParallelLinear
from nvllm.worker.layers.quant import (
    GROUP,
    INT4,
    INT4_MIN,
    INT8,
    INT8_MIN,
    QuantFormat,
    QuantizedWeight,
    quantize,
)

logger = logging.getLogger(__name__)

# Rows of a shard read, converted and stored at a time by load_quantized.
ROW_CHUNK = 1024



def _gguf_format(qtypes: set[str]) -> QuantFormat | None:
    """The engine format holding every one of a layer's GGUF block types exactly."""
    if not qtypes or not qtypes <= {"Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"}:
        return None
    has_min = bool(qtypes & {"Q4_1", "Q5_1"})
    if qtypes <= {"Q4_0", "Q4_1"}:
        return INT4_MIN if has_min else INT4
    return INT8_MIN if has_min else INT8


def _requested(mode: str, qtypes: set[str]) -> QuantFormat:
    """int8/int4 at load: that width, with a min where the file's blocks carry one (so
    they repack exactly); fp8: e4m3 with per-channel scales (nvllm/worker/layers/fp8.py)."""
    if mode == "fp8":
        return FP8
    has_min = bool(qtypes & {"Q4_1", "Q5_1"})
    if mode == "int8":
        return INT8_MIN if has_min else INT8
    return INT4_MIN if has_min and qtypes <= {"Q4_0", "Q4_1"} else INT4


def _quantizable(model: nn.Module) -> dict[str, nn.Module]:
    return {name: m for name, m in model.named_modules()
            if isinstance(m, (ColumnParallelLinear, RowParallelLinear,
                              VocabParallelEmbedding))}


def _source_qtypes(model: nn.Module, source) -> dict[str, set[str]]:
    """Module name -> the GGUF block types of the tensors that load into its weight."""
    from nvllm.worker.loader import _tensor_sources

    out: dict[str, set[str]] = defaultdict(set)
    for _path, open_file in _tensor_sources(source):
        with open_file() as tensors:
            for hf_name, src in tensors:
                packed = getattr(src, "packed", None)
                for pname, _shard in model.param_for(hf_name):
                    if pname.endswith(".weight"):
                        qtype = packed.qtype.name if packed is not None else "float"
                        out[pname[:-len(".weight")]].add(qtype)
    return out


def plan(model: nn.Module, source, mode: str) -> dict[str, QuantFormat]:
    """Module name -> format, for the modules ``mode`` quantizes in this model."""
    if mode not in MODES:
        raise ValueError(f"quantization={mode!r}; expected one of {', '.join(MODES)}")
    if mode == "none" or (mode == "auto" and source.format != "gguf"):
        return {}
    qtypes = _source_qtypes(model, source) if source.format == "gguf" else {}
    out = {}
    for name, m in _quantizable(model).items():
        types = qtypes.get(name, set())
        if mode == "auto":
            fmt = _gguf_format(types)
        elif isinstance(m, VocabParallelEmbedding):
            fmt = None  # embedding / LM head: quantized only as the file has them
        else:
            fmt = _requested(mode, types)
        if fmt is not None:
            out[name] = fmt
    return out


def quantize_module(m: nn.Module, fmt: QuantFormat) -> bool:
    """Replace m's dense weight by a QuantizedWeight of ``fmt`` (to be loaded); False
    (m unchanged, logged) where its local input columns are not whole groups (fp8 has
    no groups: any columns)."""
    w = m.weight
    n, k = w.shape
    start = getattr(m, "input_start", 0)
    if fmt == FP8:
        qw = Fp8Weight(n, k, device=w.device)
    elif k % GROUP or start % GROUP:
        logger.info("%s stays dense: its input columns [%d, %d) are not whole groups of %d",
                    type(m).__name__, start, start + k, GROUP)
        return False
    else:
        qw = QuantizedWeight(fmt, n, k, device=w.device)
    param = nn.Parameter(qw.qweight, requires_grad=False)
    param.weight_loader = w.weight_loader
    param.quant = qw
    m.weight = param
    m.register_buffer("weight_scales", qw.scales, persistent=False)
    if qw.mins is not None:
        m.register_buffer("weight_mins", qw.mins, persistent=False)
    if isinstance(m, VocabParallelEmbedding) and not isinstance(m, ParallelLMHead):
        m.quant = qw
    else:
        m.packed = qw
    return True


def quantize_model(model: nn.Module, source, mode: str,
                   device: torch.device | str = "cpu") -> dict[str, str]:
    """Make the layers ``mode`` quantizes quantized (before loading); returns module
    name -> format name of those that are. ``auto`` off the CPU loads dense: the Triton
    kernels (nvllm/kernels/triton_quant.py) are checked against the reference and
    compiled ahead of time, but not yet measured against dense weights on a GPU; an
    explicit int8/int4/fp8 is honoured everywhere (on CUDA through those kernels)."""
    if mode == "auto" and torch.device(device).type != "cpu":
        logger.info("quantization=auto on %s: weights load dense (pass int8/int4/fp8 for "
                    "the Triton quantized kernels)", device)
        return {}
    formats = plan(model, source, mode)
    modules = _quantizable(model)
    done = {name: fmt.name for name, fmt in formats.items()
            if quantize_module(modules[name], fmt)}
    if done:
        counts: dict[str, int] = defaultdict(int)
        for f in done.values():
            counts[f] += 1
        logger.info("quantization=%s: %s", mode,
                    ", ".join(f"{n} layers {f}" for f, n in sorted(counts.items())))
    return done


def share_tied_head(model: nn.Module) -> bool:
    """A tied LM head held quantized like its embedding reads the embedding's blocks
    (after loading: both loaded the same tensor), instead of keeping a second copy."""
    embed, head = getattr(model, "embed_tokens", None), getattr(model, "lm_head", None)
    if not getattr(model, "tie_word_embeddings", False) or embed is None or head is None:
        return False
    eq, hq = getattr(embed, "quant", None), getattr(head, "packed", None)
    if not isinstance(eq, QuantizedWeight) or not isinstance(hq, QuantizedWeight) \
            or eq.fmt != hq.fmt or embed.vocab_start != head.vocab_start:
        return False
    head.packed = eq
    head.weight = embed.weight
    head.register_buffer("weight_scales", eq.scales, persistent=False)
    if eq.mins is not None:
        head.register_buffer("weight_mins", eq.mins, persistent=False)
    return True


def load_quantized(qw: QuantizedWeight, src, dim: int, start: int, end: int,
                   dst_off: int) -> None:
    """A shard of a 2-D checkpoint tensor (rows [start, end) when dim is 0, else columns,
    whole groups) into qw at dst_off along dim: a GGUF source's blocks repacked where
    qw's format holds them exactly, else the shard's float values quantized; ROW_CHUNK
    rows at a time, so neither path holds more than that many rows in float."""
    from nvllm.worker.gguf_weights import EXACT_TYPES, repack

    if isinstance(qw, Fp8Weight):  # per-channel scales: whole rows, no groups
        qw.load(src, dim, start, end, dst_off, ROW_CHUNK)
        return
    shape = list(src.get_shape() if hasattr(src, "get_shape") else src.shape)
    if len(shape) != 2:
        raise ValueError(f"a quantized layer loads 2-D tensors, not {shape}")
    n, k = shape
    rows, cols = ((start, end), (0, k)) if dim == 0 else ((0, n), (start, end))
    if dim == 1 and (start % GROUP or end % GROUP):
        raise ValueError(f"columns [{start}, {end}) are not whole groups of {GROUP}")
    if (k != qw.k) if dim == 0 else (n != qw.n or end - start > qw.k):
        raise ValueError(f"a [{n}, {k}] tensor does not fit a [{qw.n}, {qw.k}] quantized "
                         "weight")
    packed = getattr(src, "packed", None)
    exact = packed is not None and getattr(src, "expert", None) is None \
        and packed.qtype in EXACT_TYPES
    for a in range(rows[0], rows[1], ROW_CHUNK):  # bounded temporaries, whatever the shard
        b = min(rows[1], a + ROW_CHUNK)
        got = repack(src.blocks((a, b), cols), packed.qtype, qw.fmt) if exact else None
        if got is None:
            got = quantize(torch.as_tensor(src[a:b, cols[0]:cols[1]]), qw.fmt)
        at = (dst_off + a - rows[0], 0) if dim == 0 else (a - rows[0], dst_off)
        qw.write(*at, *(t if t is None else t.to(qw.qweight.device) for t in got))


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the weights a worker holds: parameters (each once: a tied head shares),
    quantized scales and mins, and oneDNN-packed copies."""
    seen: set[int] = set()
    total = 0
    tensors = [p for p in model.parameters()]
    tensors += [b for name, b in model.named_buffers() if name.endswith(("weight_scales",
                                                                          "weight_mins"))]
    tensors += [m.packed for m in model.modules()
                if isinstance(getattr(m, "packed", None), torch.Tensor)]
    for t in tensors:
        key = t.data_ptr() if not t.is_mkldnn else id(t)
        if key in seen or t.numel() == 0:
            continue
        seen.add(key)
        total += t.numel() * t.element_size()
    return total
