"""Native CPU ops (``csrc/``), compiled once per machine with ``torch.utils.cpp_extension``.

Why native code: decode attention over a batch of sequences of different lengths has no
single torch call on CPU, and a Python loop of per-sequence SDPA calls spends more time
in dispatch than in arithmetic (``csrc/cpu_decode_attention.cpp`` says by how much). The
layer ops (``csrc/cpu_layer_ops.cpp``: RMSNorm with or without the residual add, SiLU-and-
mul, rotary) each replace several torch ops and their temporaries with one pass.
``csrc/cpu_quant_linear.cpp`` multiplies by weights held in groups of 32 int8 / int4
values (nvllm/worker/layers/quant.py) without dequantizing them to memory;
``csrc/cpu_quant_vnni.cpp`` does the same with the activations quantized to int8 per
block of 32 and integer dot products (AVX-512 VNNI, or AVX2's vpmaddubsw), as llama.cpp's
Q8 path does; ``csrc/cpu_quant_amx.cpp`` with Intel AMX's bfloat16 tiles (built only
where the compiler targets AMX). The other ops each hold an AVX-512 path, an AVX2 + FMA
one (AMD Zen 1-3, most client CPUs) and portable loops; ``NVLLM_CPU_ISA`` builds a
narrower one to test it. The
``"cpu"`` backend of ``ops`` runs them; ``ops.resolve_backend`` picks it on CPU when
``load()`` succeeds.

``scripts/install.sh`` builds the library (``python -m nvllm.kernels.cpu_ops``); a worker
that finds it missing builds it on first use (about two minutes on 2 cores, under
torch's file lock, so ranks starting together build it once). It is compiled for this machine's CPU
(``-march=native``), so its folder is keyed by the source, the flags, torch's version and
the CPU's feature flags. Without a compiler, or with ``NVLLM_CPU_OPS=0``, ``load()``
returns False and attention runs the per-sequence SDPA path: same results within float
rounding, slower.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import pathlib
import platform

import torch

logger = logging.getLogger(__name__)

NAME = "nvllm_cpu_ops"
CSRC = pathlib.Path(__file__).parent / "csrc"
SOURCES = [CSRC / "cpu_decode_attention.cpp", CSRC / "cpu_layer_ops.cpp",
           CSRC / "cpu_token_bitmask.cpp", CSRC / "cpu_argmax.cpp",
           CSRC / "cpu_quant_linear.cpp", CSRC / "cpu_quant_vnni.cpp",
           CSRC / "cpu_quant_a16.cpp", CSRC / "cpu_quant_amx.cpp",
           CSRC / "cpu_decode_stack.cpp"]
# What is compiled: SOURCES as one translation unit (it says why).
UNITY = CSRC / "all_ops.cpp"
# part of the build's key, not compiled on their own
HEADERS = [CSRC / "bf16.h", CSRC / "quant_args.h", CSRC / "attend_kernels.h"]
# -ffast-math lets GCC vectorize the dot products and exp (glibc's libmvec): the kernel
# computes no infinities or NaNs on purpose (scores are finite, softmax subtracts the max).
# -mtune=generic: with GCC 12's znver3 tuning (what -march=native picks on AMD EPYC) the
# quantized matmul's buffered kernel folds its loads into the FMAs and ran 1.5x slower
# (3072 x 576 at 16 rows: 870 against 560 us); generic tuning keeps -march's instructions.
CFLAGS = ["-O3", "-march=native", "-mtune=generic", "-ffast-math", "-fopenmp"]
LDFLAGS = ["-lmvec", "-fopenmp"]
# NVLLM_CPU_ISA narrows what the build may use below what this CPU has, so that one
# machine can test each vector path the kernels hold (AVX-512, AVX2, portable loops):
# "native" (the default), "avx2" (no AVX-512), "portable" (no AVX, AVX2, FMA or F16C).
ISA_ENV = "NVLLM_CPU_ISA"
ISA_FLAGS = {"native": [], "avx2": ["-mno-avx512f"],
             "portable": ["-mno-avx512f", "-mno-avx2", "-mno-avx", "-mno-fma", "-mno-f16c"]}


def cflags() -> list[str]:
    isa = os.environ.get(ISA_ENV, "native")
    if isa not in ISA_FLAGS:
        raise ValueError(f"{ISA_ENV}={isa!r}; expected one of {', '.join(ISA_FLAGS)}")
    return CFLAGS + ISA_FLAGS[isa]


def narrower_isa() -> str:
    """The vector path one narrower than this CPU's best that ``NVLLM_CPU_ISA`` can build,
    so that one machine tests two of the three: "avx2" where the CPU has AVX-512, else
    "portable"."""
    flags = _cpu_flags().split()
    return "avx2" if "avx512f" in flags and "avx2" in flags else "portable"


def _cpu_flags() -> str:
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def build_dir() -> pathlib.Path:
    """Where this machine's build lives: ``$NVLLM_EXT_DIR`` or ``~/.cache/nvllm/ext``."""
    h = hashlib.sha256()
    for src in [UNITY, *SOURCES, *HEADERS]:
        h.update(src.read_bytes())
    h.update(" ".join(cflags() + LDFLAGS).encode())
    h.update(torch.__version__.encode())
    h.update(_cpu_flags().encode())
    root = os.environ.get("NVLLM_EXT_DIR") or pathlib.Path.home() / ".cache" / "nvllm" / "ext"
    return pathlib.Path(root) / f"{NAME}-{h.hexdigest()[:16]}"


def library_path() -> pathlib.Path:
    return build_dir() / f"{NAME}.so"


def build(verbose: bool = False) -> pathlib.Path:
    """Compile the library (a no-op when it is already built); returns its path."""
    from torch.utils import cpp_extension

    d = build_dir()
    d.mkdir(parents=True, exist_ok=True)
    # A copy of LDFLAGS (cflags() is a new list): cpp_extension.load appends torch's own
    # -L/-l flags to the lists it is given, which would change the build key (and so
    # library_path) for the rest of the process.
    cpp_extension.load(name=NAME, sources=[str(UNITY)], extra_cflags=cflags(),
                       extra_ldflags=list(LDFLAGS), build_directory=str(d),
                       is_python_module=False, verbose=verbose)
    return d / f"{NAME}.so"


@functools.cache
def load() -> bool:
    """Whether ``torch.ops.nvllm_cpu`` is usable in this process (building it if needed)."""
    if os.environ.get("NVLLM_CPU_OPS", "1") == "0":
        return False
    path = library_path()
    try:
        if not path.exists():
            logger.info("building nvllm's CPU ops in %s (once per machine)", path.parent)
            build()
        torch.ops.load_library(str(path))
        return True
    except Exception as e:  # no compiler, no headers, a foreign .so: run without them
        logger.warning("nvllm's CPU ops are not available, attention runs per sequence "
                       "(slower): %s. Build them with: python -m nvllm.kernels.cpu_ops", e)
        return False


# New tokens per sequence the decode kernel takes (csrc/cpu_decode_attention.cpp's
# kMaxQueries, which says why): every verify row (1 + the largest k) and short prompt
# chunks; longer runs go to SDPA.
MAX_QUERIES = 17


def decode_attention(out: torch.Tensor, q: torch.Tensor, k_new: torch.Tensor,
                     v_new: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     slots: torch.Tensor, rows: torch.Tensor, bases: torch.Tensor,
                     caps: torch.Tensor, lens: torch.Tensor, layer: int, scale: float,
                     window: int = 0, query_lens: torch.Tensor | None = None) -> None:
    """See csrc/cpu_decode_attention.cpp (window > 0: only the last `window` keys of each
    query are visible). query_lens: each sequence's new tokens (1..MAX_QUERIES, at rows[i]
    onwards; slots then has one entry per new token); None: one each. Only after load()
    returned True."""
    torch.ops.nvllm_cpu.decode_attention(out, q, k_new, v_new, k_cache, v_cache, slots, rows,
                                         bases, caps, lens, layer, scale, window, query_lens)


def decode_attention_qkv(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
                         sin: torch.Tensor, heads: int, kv_heads: int, k_cache: torch.Tensor,
                         v_cache: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor,
                         bases: torch.Tensor, caps: torch.Tensor, lens: torch.Tensor,
                         layer: int, scale: float, window: int = 0,
                         query_lens: torch.Tensor | None = None) -> torch.Tensor:
    """decode_attention of the fused q/k/v projection's output ([T, (heads + 2 kv_heads) d]),
    q and k rotated as rotary_embedding rotates them, in one call; returns [T, heads * d]
    (rows not in the sequences' runs left unwritten)."""
    out = torch.empty(qkv.shape[0], heads * (qkv.shape[1] // (heads + 2 * kv_heads)),
                      dtype=qkv.dtype)
    torch.ops.nvllm_cpu.decode_attention_qkv(out, qkv, positions, cos, sin, heads, kv_heads,
                                             k_cache, v_cache, slots, rows, bases, caps,
                                             lens, layer, scale, window, query_lens)
    return out


def paged_decode_attention(out: torch.Tensor, q: torch.Tensor, k_new: torch.Tensor,
                           v_new: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           slots: torch.Tensor, rows: torch.Tensor, block_tables: torch.Tensor,
                           lens: torch.Tensor, scale: float, window: int = 0,
                           query_lens: torch.Tensor | None = None) -> None:
    """decode_attention with every sequence's keys and values read from the paged cache
    through its row of block_tables (int32, the step's metadata's; block_size a power of
    two) instead of a contiguous copy; every new token needs a slot."""
    torch.ops.nvllm_cpu.paged_decode_attention(out, q, k_new, v_new, k_cache, v_cache, slots,
                                               rows, block_tables, lens, scale, window,
                                               query_lens)


def paged_decode_attention_qkv(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
                               sin: torch.Tensor, heads: int, kv_heads: int,
                               k_cache: torch.Tensor, v_cache: torch.Tensor,
                               slots: torch.Tensor, rows: torch.Tensor,
                               block_tables: torch.Tensor, lens: torch.Tensor, scale: float,
                               window: int = 0,
                               query_lens: torch.Tensor | None = None) -> torch.Tensor:
    """decode_attention_qkv in paged mode (as paged_decode_attention)."""
    out = torch.empty(qkv.shape[0], heads * (qkv.shape[1] // (heads + 2 * kv_heads)),
                      dtype=qkv.dtype)
    torch.ops.nvllm_cpu.paged_decode_attention_qkv(out, qkv, positions, cos, sin, heads,
                                                   kv_heads, k_cache, v_cache, slots, rows,
                                                   block_tables, lens, scale, window,
                                                   query_lens)
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """reference.rms_norm over the last dim of a 2-D or 3-D x (rows may be strided)."""
    out = torch.empty(x.shape, dtype=x.dtype)
    torch.ops.nvllm_cpu.rms_norm(out, x, weight, eps, None, None)
    return out


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """reference.fused_add_rms_norm: (rms_norm(x + residual), x + residual)."""
    out = torch.empty(x.shape, dtype=x.dtype)
    res_out = torch.empty(x.shape, dtype=x.dtype)
    torch.ops.nvllm_cpu.rms_norm(out, x, weight, eps, residual, res_out)
    return out, res_out


def fused_add_rms_norm_(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                        eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """fused_add_rms_norm in place, with no allocation: x + residual into residual (which
    must be contiguous), its norm into x; returns (x, residual). The same values."""
    torch.ops.nvllm_cpu.rms_norm(x, x, weight, eps, residual, residual)
    return x, residual


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """reference.silu_and_mul for x = [N, 2D]."""
    out = torch.empty(x.shape[0], x.shape[1] // 2, dtype=x.dtype)
    torch.ops.nvllm_cpu.silu_and_mul(out, x)
    return out


def rotary_embedding(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                     cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """reference.rotary_embedding: q [T, H, d], k [T, KH, d] (rows may be strided)."""
    q_out = torch.empty(q.shape, dtype=q.dtype)
    k_out = torch.empty(k.shape, dtype=k.dtype)
    torch.ops.nvllm_cpu.rotary_embedding(q_out, k_out, positions, q, k, cos, sin)
    return q_out, k_out


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """logits[r, j] = -inf where bit j of bitmask[r] is 0, for r in rows (in place;
    xgrammar's bitmask layout; logits float32 [B, V], bitmask int32 [B, ceil(V / 32)])."""
    torch.ops.nvllm_cpu.apply_token_bitmask(logits, bitmask,
                                            torch.tensor(rows, dtype=torch.long))


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """torch.argmax(x, dim=-1) for float32 logits x [B, V] (rows contiguous), the same
    indices (first maximum, NaN the largest) about 10x faster (csrc/cpu_argmax.cpp)."""
    out = torch.empty(x.shape[0], dtype=torch.long)
    torch.ops.nvllm_cpu.argmax_rows(out, x)
    return out


def quant_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                 mins: torch.Tensor | None, bits: int) -> torch.Tensor:
    """x [M, K] (float32 or bfloat16, contiguous) times the grouped quantized weight's
    transpose (nvllm/worker/layers/quant.py's layout): [M, N] in x's dtype."""
    out = torch.empty(x.shape[0], qweight.shape[0], dtype=x.dtype)
    torch.ops.nvllm_cpu.quant_linear(out, x.contiguous(), qweight, scales, mins, bits)
    return out


def quant_linear_a8(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                    mins: torch.Tensor | None, bits: int) -> torch.Tensor:
    """quant_linear with x's rows quantized to int8 per block of 32 first (scale max|x| /
    127, round to nearest) and integer dot products (csrc/cpu_quant_vnni.cpp): the
    dequantized weights times x's int8-rounded values, up to float32 summation order."""
    out = torch.empty(x.shape[0], qweight.shape[0], dtype=x.dtype)
    torch.ops.nvllm_cpu.quant_linear_a8(out, x.contiguous(), qweight, scales, mins, bits)
    return out


def quant_linear_a16(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                     mins: torch.Tensor | None, bits: int) -> torch.Tensor:
    """quant_linear with x's rows rounded to int16 per group of 32 first (scale max|x| /
    32767, round to nearest even) and integer dot products (csrc/cpu_quant_a16.cpp): the
    dequantized weights times x's int16-rounded values, up to float32 summation order."""
    out = torch.empty(x.shape[0], qweight.shape[0], dtype=x.dtype)
    torch.ops.nvllm_cpu.quant_linear_a16(out, x.contiguous(), qweight, scales, mins, bits)
    return out


def quant_linear_amx(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                     mins: torch.Tensor | None, bits: int) -> torch.Tensor:
    """quant_linear on Intel AMX (csrc/cpu_quant_amx.cpp): float32 x split into two
    bfloat16s (16 of its 24 significant bits kept: at most 2^-17 of each value off),
    bfloat16 x as it is, times the weights' integers exact in bfloat16, each group's scale
    (and min) applied in float32. Only where quant_amx_usable()."""
    out = torch.empty(x.shape[0], qweight.shape[0], dtype=x.dtype)
    torch.ops.nvllm_cpu.quant_linear_amx(out, x.contiguous(), qweight, scales, mins, bits)
    return out


def quant_amx_usable() -> bool:
    """Whether the ops load and quant_linear_amx was built (a compiler targeting AMX-TILE,
    AMX-BF16 and AVX512-BF16 on Linux: -march=native on such a CPU) and the kernel lets
    this process use the tile registers."""
    return load() and bool(torch.ops.nvllm_cpu.quant_amx_usable())


def quant_linear_buffered() -> bool:
    """Whether quant_linear multiplies 5 rows and more against a buffer of dequantized
    columns (its AVX2 build), which is faster than dequantized tiles and torch.mm up to
    64 rows; the other builds loop over the weight once per 8 rows."""
    return bool(torch.ops.nvllm_cpu.quant_linear_buffered())


def quant_a8_vectorized() -> bool:
    """Whether quant_linear_a8 was built with its AVX-512 VNNI loop (else portable scalar
    loops: the same results, slower than quant_linear)."""
    return bool(torch.ops.nvllm_cpu.quant_a8_vectorized())


def quant_a16_vectorized() -> bool:
    """Whether quant_linear_a16 was built with its AVX2 loop (AVX2 without AVX-512, where
    it was measured; else portable loops: the same results, slower than quant_linear)."""
    return bool(torch.ops.nvllm_cpu.quant_a16_vectorized())


def quant_dequantize(qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None,
                     bits: int, dtype: torch.dtype) -> torch.Tensor:
    """The grouped quantized weight's values [N, K] in dtype (float32 or bfloat16), as
    nvllm/worker/layers/quant.py:dequantize computes them, in one native pass."""
    k = qweight.shape[1] * (8 // bits)
    out = torch.empty(qweight.shape[0], k, dtype=dtype)
    torch.ops.nvllm_cpu.quant_dequantize(out, qweight, scales, mins, bits)
    return out


if __name__ == "__main__":
    import sys

    try:
        print(build(verbose="-v" in sys.argv))
    except Exception as e:
        sys.exit(f"could not build nvllm's CPU ops ({e}); nvllm runs without them, slower")
