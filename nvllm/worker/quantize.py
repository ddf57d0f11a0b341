"""Which layers of a model are held quantized (the ``quantization`` setting), turning them
into quantized layers before the weights load, and loading a shard into one.

The setting: ``none`` keeps every weight in the run dtype (GGUF blocks, AWQ / GPTQ words
dequantized); ``auto`` (the default) keeps a packed checkpoint's own format where a
layer's tensors repack into one of nvllm/worker/layers/quant.py's formats: GGUF's Q8_0,
Q4_0, Q4_1, Q5_0, Q5_1 exactly, its K-quants nearly (nvllm/worker/gguf_kquants.py), AWQ /
GPTQ exactly in ``int4+min32`` (an embedding and the LM head too where a GGUF file has
them quantized), else that layer is dense (F16/F32, a float safetensors checkpoint);
``int8`` / ``int4`` quantize every linear layer (not the embedding or the LM head) at
load, round-to-nearest per group of 32, asymmetric (a scale and a min per group:
``AT_LOAD``; MoE experts too: ``quantize_experts``); a packed tensor that fits the width
(GGUF blocks with a min where the file has one, AWQ / GPTQ in int8 or int4+min32) is
repacked instead. ``fp8`` quantizes them to e4m3 with a float32 scale per
output channel (nvllm/worker/layers/fp8.py; no groups, so any shard of columns).

One rule for shards: a quantized layer is cut along whole groups of 32 input columns. A
row-parallel layer whose rank-local input columns do not start and end on a group (an
input split that is not a multiple of 32 per rank) stays dense, logged; output rows split
anywhere. (An AWQ / GPTQ group of 128 or a K-quant super-block of 256 may be cut: each
group of 32 inside it keeps its scale.)
"""

from __future__ import annotations

import logging
from collections import defaultdict

import torch
from torch import nn

from nvllm.common.config import QUANTIZATIONS as MODES
from nvllm.worker.fp8_checkpoint import QTYPE as FP8_QTYPE
from nvllm.worker.layers.embed_head import ParallelLMHead, VocabParallelEmbedding
from nvllm.worker.layers.fp8 import FP8, Fp8Weight
from nvllm.worker.layers.linear import ColumnParallelLinear, RowParallelLinear
from nvllm.worker.layers.quant import (
    GROUP,
    INT4,
    INT4_MIN,
    INT4_MIN32,
    INT8,
    INT8_MIN,
    QuantFormat,
    QuantizedWeight,
    quantize,
)

logger = logging.getLogger(__name__)

# Rows of a shard read, converted and stored at a time by load_quantized.
ROW_CHUNK = 1024



# The engine format each source type repacks into by itself: GGUF's exact types
# (bytes rearranged), K-quants (nvllm/worker/gguf_kquants.py: scales rounded to fp16,
# Q6_K / Q3_K / Q2_K re-quantized per 32) and AWQ / GPTQ (nvllm/worker/awq_gptq.py).
HOME_FORMATS = {"Q8_0": INT8, "Q5_0": INT8, "Q4_0": INT4, "Q4_1": INT4_MIN, "Q5_1": INT8_MIN,
                "Q4_K": INT4_MIN, "Q5_K": INT8_MIN, "Q6_K": INT8, "Q3_K": INT8,
                "Q2_K": INT8_MIN}
PACKED_CHECKPOINTS = {"AWQ", "GPTQ"}


def _auto_format(qtypes: set[str]) -> QuantFormat | None:
    """The narrowest engine format every one of a layer's source types repacks into
    (GGUF: int4 fits in int8 and in int4+min, each in int8+min: the join of their home
    formats), or None (a float tensor, or AWQ mixed with anything)."""
    if qtypes and qtypes <= PACKED_CHECKPOINTS:
        return INT4_MIN32 if len(qtypes) == 1 else None
    if qtypes == {FP8_QTYPE}:  # an fp8 checkpoint's linear: its e4m3 values as they are
        return FP8
    if not qtypes or not qtypes <= set(HOME_FORMATS):
        return None
    homes = [HOME_FORMATS[t] for t in qtypes]
    return QuantFormat(max(f.bits for f in homes), any(f.has_min for f in homes))


# What int8 / int4 at load quantize a float tensor into: asymmetric per 32 (a scale and a
# min per group, GGUF Q4_1's rule; int8 likewise over 255 steps). Measured on the real
# model (docs/quantization.md, "Quality"): int8 symmetric per 32 agreed on 97.65% of the
# argmaxes, int4 symmetric on 63.8%; these two on 99.41% / 100% (int4 flattered there:
# the model's weights are Q4_1's, which int4+min finds again; see the doc's proxy).
AT_LOAD = {"int8": INT8_MIN, "int4": INT4_MIN}
# Packed types a symmetric format holds exactly (or nearly: Q6_K / Q3_K) at that width,
# so int8 / int4 keep their blocks without the 2 bytes of mins per group.
_SYMMETRIC_AT = {"int8": {"Q8_0", "Q5_0", "Q4_0", "Q6_K", "Q3_K"}, "int4": {"Q4_0"}}


def _requested(mode: str, qtypes: set[str]) -> QuantFormat:
    """int8/int4 at load: AT_LOAD's asymmetric format, or the symmetric one where every
    source tensor is a block type that holds as it is; AWQ / GPTQ in int4+min32 or int8
    (both exact); fp8: e4m3 with per-channel scales (nvllm/worker/layers/fp8.py)."""
    if mode == "fp8":
        return FP8
    if qtypes and qtypes <= PACKED_CHECKPOINTS:
        return INT8 if mode == "int8" else INT4_MIN32
    if qtypes and qtypes <= _SYMMETRIC_AT[mode]:
        return INT8 if mode == "int8" else INT4
    return AT_LOAD[mode]


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
                qtype = getattr(src, "qtype_name", None) or \
                    (packed.qtype.name if packed is not None else "float")
                for pname, _shard in model.param_for(hf_name):
                    if pname.endswith(".weight"):
                        out[pname[:-len(".weight")]].add(qtype)
    return out


def _packed_checkpoint(source) -> bool:
    """Whether an HF checkpoint is AWQ / GPTQ or fp8 (its config says)."""
    from nvllm.worker.awq_gptq import checkpoint_quant_config
    from nvllm.worker.fp8_checkpoint import fp8_checkpoint_config

    folder = source.config_dir or source.path
    return source.format == "hf" and (checkpoint_quant_config(folder) is not None
                                      or fp8_checkpoint_config(folder) is not None)


def plan(model: nn.Module, source, mode: str) -> dict[str, QuantFormat]:
    """Module name -> format, for the modules ``mode`` quantizes in this model."""
    if mode not in MODES:
        raise ValueError(f"quantization={mode!r}; expected one of {', '.join(MODES)}")
    packed = source.format == "gguf" or _packed_checkpoint(source)
    if mode == "none" or (mode == "auto" and not packed):
        return {}
    qtypes = _source_qtypes(model, source) if packed else {}
    out = {}
    for name, m in _quantizable(model).items():
        types = qtypes.get(name, set())
        if mode == "auto":
            fmt = _auto_format(types)
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
    if mode in AT_LOAD or mode == "fp8":
        done.update(quantize_experts(model, mode, device))
    if done:
        counts: dict[str, int] = defaultdict(int)
        for f in done.values():
            counts[f] += 1
        logger.info("quantization=%s: %s", mode,
                    ", ".join(f"{n} layers {f}" for f, n in sorted(counts.items())))
    return done


def quantize_experts(model: nn.Module, mode: str, device: torch.device | str
                     ) -> dict[str, str]:
    """int8 / int4 / fp8 at load: every SparseMoE's experts too (AT_LOAD's format, or fp8),
    whatever the checkpoint holds them in (a GGUF file's expert blocks are read as float
    values and quantized); returns ``<module>.experts`` -> format name for those held
    (a projection whose rank-local input columns are not whole groups stays dense)."""
    from nvllm.worker.layers.moe import SparseMoE

    fmt = FP8 if mode == "fp8" else AT_LOAD[mode]

    def make(n: int, k: int):
        return Fp8Weight(n, k, device=device) if fmt == FP8 else \
            QuantizedWeight(fmt, n, k, device=device)

    done = {}
    for name, m in model.named_modules():
        if isinstance(m, SparseMoE):
            held = m.quantize_experts(make, grouped=fmt != FP8)
            if held:
                done[f"{name}.experts"] = fmt.name
            if len(held) < 2 and m.shard.count:
                logger.info("%s.experts: %s stay dense (input columns not whole groups of "
                            "%d)", name, ", ".join({"gate_up_proj", "down_proj"} - set(held)),
                            GROUP)
    return done


def share_tied_head(model: nn.Module) -> bool:
    """A tied LM head reads its embedding's weight (after loading: both loaded the same
    tensor) instead of keeping a second copy: the embedding's blocks where both are held
    quantized alike, or its dense parameter where both are dense (int8 / int4 / fp8 at
    load keep the embedding and the head in the run dtype). The shared dense head is not
    repacked for oneDNN (``shares_embedding``: linear.pack_for_cpu would drop the dense
    copy the embedding reads); it multiplies with F.linear."""
    embed, head = getattr(model, "embed_tokens", None), getattr(model, "lm_head", None)
    if not getattr(model, "tie_word_embeddings", False) or embed is None or head is None \
            or embed.vocab_start != head.vocab_start:
        return False
    eq, hq = getattr(embed, "quant", None), getattr(head, "packed", None)
    if eq is None and hq is None:
        if embed.weight.shape != head.weight.shape or embed.weight.dtype != head.weight.dtype:
            return False
        head.weight = embed.weight
        head.shares_embedding = True
        return True
    if not isinstance(eq, QuantizedWeight) or not isinstance(hq, QuantizedWeight) \
            or eq.fmt != hq.fmt:
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
    whole groups) into qw at dst_off along dim: a packed source's own form (GGUF blocks,
    AWQ / GPTQ words) repacked where qw's format holds it, else the shard's float values
    quantized; ROW_CHUNK rows at a time, so neither path holds more than that many rows
    in float."""
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
    for a in range(rows[0], rows[1], ROW_CHUNK):  # bounded temporaries, whatever the shard
        b = min(rows[1], a + ROW_CHUNK)
        got = _repacked(src, (a, b), cols, qw.fmt)
        if got is None:
            got = quantize(torch.as_tensor(src[a:b, cols[0]:cols[1]]), qw.fmt)
        at = (dst_off + a - rows[0], 0) if dim == 0 else (a - rows[0], dst_off)
        qw.write(*at, *(t if t is None else t.to(qw.qweight.device) for t in got))


def _repacked(src, rows: tuple[int, int], cols: tuple[int, int], fmt: QuantFormat
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None:
    """src[rows, cols] in ``fmt`` from its own packed form (AWQ / GPTQ words, GGUF
    blocks: the blocks covering cols, repacked, cut to cols), or None where it has none
    that ``fmt`` holds."""
    from nvllm.worker.gguf_weights import REPACKED_TYPES, repack

    own = getattr(src, "repack", None)
    if own is not None:
        return own(rows, cols, fmt)
    packed = getattr(src, "packed", None)
    if packed is None or getattr(src, "expert", None) is not None \
            or packed.qtype not in REPACKED_TYPES:
        return None
    b = packed.block
    c0, c1 = cols[0] // b * b, -(-cols[1] // b) * b
    got = repack(src.blocks(rows, (c0, c1)), packed.qtype, fmt)
    if got is None or (c0, c1) == cols:
        return got
    g0, g1 = (cols[0] - c0) // GROUP, (cols[1] - c0) // GROUP
    q, scales, mins = got
    pc = fmt.packed_cols(GROUP)
    return (q[:, g0 * pc:g1 * pc].contiguous(), scales[:, g0:g1].contiguous(),
            None if mins is None else mins[:, g0:g1].contiguous())


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
