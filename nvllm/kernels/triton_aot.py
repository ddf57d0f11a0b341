"""Ahead-of-time compilation of every Triton kernel the engine launches, for a GPU that is
not there (``python -m nvllm.kernels.triton_aot --page-size 16``; run by
tests/kernels/test_triton_compile.py, which passes the engine's default block size).

The launches are not described by hand: ``record_launches`` calls the real launch wrappers of
``triton_attention``, ``triton_layer_ops``, ``triton_moe`` and ``triton_quant``
(``store_kvcache``, ``decode_attention``, ``quant_matmul``, ...) on small CPU tensors of a
model's per-rank shapes, with each ``@triton.jit`` kernel swapped for a
recorder that keeps the arguments, constexprs and launch options instead of launching. Each
recorded launch is then specialized the way the Triton runtime does it (its own binder and
``_pack_args``: the same signature, constexprs, and divisibility-by-16 attributes) and compiled
with ``triton.compile(ASTSource(...), target=GPUTarget("cuda", arch, 32))`` down to a cubin by
the ptxas that Triton ships. Nothing is launched, so no GPU or driver is needed. A change to a
launch site (a new tile size, a new kernel) is picked up without touching this file; a new
*wrapper* must be added to ``record_launches``.

The kernels must be real ``JITFunction`` objects, so this runs with ``TRITON_INTERPRET=0``
(set before triton is imported: the interpreter's ``@triton.jit`` returns functions that
cannot be compiled). Uses triton internals (the binder, ``_pack_args``): tested with 3.9.0.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import sys
import time
from typing import Any

# Shared-memory limit per block (bytes), with the opt-in carve-out that Triton requests when a
# kernel needs more than 48 KB: CUDA C++ Programming Guide, "Technical Specifications per
# Compute Capability" ("Maximum amount of shared memory per thread block": 227 KB for 9.0,
# 163 KB for 8.0), = cudaDevAttrMaxSharedMemoryPerBlockOptin, which Triton's own launch-time
# check (CompiledKernel._init_handles -> OutOfResources) compares metadata.shared against.
TARGETS: dict[str, tuple[int, int]] = {
    "sm_90": (90, 227 * 1024),  # H100 / H200
    "sm_80": (80, 163 * 1024),  # A100
}
DTYPES = ("float32", "bfloat16", "float16")


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """Per-rank shapes of one decoder (what one tensor-parallel worker launches with)."""

    name: str
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    qk_norm: bool = False


# Shapes the engine's model family (Llama / Qwen2 / Qwen3, nvllm/worker/models/llama.py)
# launches with: head_dim 128 and 64, GQA groups 2 / 4 / 7 (7: a tile of 18 query tokens),
# hidden rows up to 4096 wide (8-warp norms), q/k norm; and head_dim 256, which takes the
# kernels' separate tile configuration for BLOCK_D > 128. Kept to the few that give distinct
# tiles (Llama-3.1-8B adds none over these), so the sweep stays under a minute.
MODEL_SHAPES: tuple[ModelShape, ...] = (
    ModelShape("qwen3-0.6b", 1024, 16, 8, 128, 3072, qk_norm=True),
    ModelShape("qwen2.5-7b", 3584, 28, 4, 128, 18944),
    ModelShape("llama-3.2-1b", 2048, 32, 8, 64, 8192),
    ModelShape("hd256", 2048, 8, 4, 256, 8192, qk_norm=True),
)

# Tokens per launch: enough rows that every row-packing tile reaches its largest size
# (_NORM_TILE_ELEMS / head_dim rows per program), which is the steady-state compilation.
_TOKENS = 64
# Decode splits for the split-K path: _MAX_SPLITS, the largest reduce tile (BLOCK_S).


@dataclasses.dataclass
class Launch:
    kernel: Any  # JITFunction
    args: tuple
    kwargs: dict
    label: str = ""
    min_arch: int = 0  # compiled only for targets at or above this (fp8: sm_89)

    @property
    def name(self) -> str:
        return self.kernel.__name__


class _Recorder:
    def __init__(self, kernel, sink: list[Launch]) -> None:
        self.kernel, self.sink = kernel, sink

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.sink.append(Launch(self.kernel, args, dict(kwargs)))
        return launch


def _kernel_modules():
    from nvllm.kernels import triton_attention, triton_layer_ops, triton_moe, triton_quant

    return triton_attention, triton_layer_ops, triton_moe, triton_quant


@contextlib.contextmanager
def _recording(sink: list[Launch]):
    """Swap every @triton.jit kernel (``_*_kernel``) of the kernel modules for a recorder."""
    from triton.runtime.jit import JITFunction

    saved = []
    for mod in _kernel_modules():
        for attr, val in vars(mod).items():
            if isinstance(val, JITFunction) and attr.endswith("_kernel"):
                saved.append((mod, attr, val))
    if not saved:
        raise RuntimeError("no JIT kernels found: is TRITON_INTERPRET set? AOT compilation "
                           "needs TRITON_INTERPRET=0 before triton is imported")
    try:
        for mod, attr, val in saved:
            setattr(mod, attr, _Recorder(val, sink))
        yield
    finally:
        for mod, attr, val in saved:
            setattr(mod, attr, val)


def record_launches(shape: ModelShape, dtype_name: str, page_size: int) -> list[Launch]:
    """Every kernel launch of one model step, recorded through the real launch wrappers."""
    import torch

    from nvllm.kernels.metadata import build_metadata

    attn, layer, moe, quant = _kernel_modules()
    from nvllm.kernels.triton_dot import dot_upcast
    dtype = getattr(torch, dtype_name)
    t, h, kh, d = _TOKENS, shape.heads, shape.kv_heads, shape.head_dim
    out: list[Launch] = []

    def rec(label, fn, *args, **kwargs):
        start = len(out)
        fn(*args, **kwargs)
        for launch in out[start:]:
            launch.label = label

    with _recording(out):
        x = torch.zeros(t, shape.hidden, dtype=dtype)
        w = torch.ones(shape.hidden, dtype=dtype)
        rec("norm", layer.rms_norm, x, w, 1e-6)
        rec("add+norm", layer.fused_add_rms_norm, x, x, w, 1e-6)
        # q / k as views into the fused qkv projection, as the model passes them.
        qkv = torch.zeros(t, (h + 2 * kh) * d, dtype=dtype)
        q, k, v = qkv.split([h * d, kh * d, kh * d], dim=-1)
        q, k, v = q.view(t, h, d), k.view(t, kh, d), v.view(t, kh, d)
        if shape.qk_norm:
            rec("q-norm", layer.rms_norm, q, torch.ones(d, dtype=dtype), 1e-6)
        # cos/sin caches are float32 buffers (nvllm/worker/layers/rotary.py).
        cs = torch.zeros(128, d, dtype=torch.float32)
        rec("rotary", layer.rotary_embedding, torch.zeros(t, dtype=torch.long), q, k, cs, cs)
        rec("silu*mul", layer.silu_and_mul, torch.zeros(t, 2 * shape.intermediate,
                                                         dtype=dtype))

        num_blocks = 2 * ((t + page_size - 1) // page_size) + 1
        kc = torch.zeros(num_blocks, page_size, kh, d, dtype=dtype)
        vc = torch.zeros_like(kc)
        rec("store", attn.store_kvcache, k, v, kc, vc, torch.zeros(t, dtype=torch.long))
        # Decode: 4 sequences, one token each; unsplit (WRITE_OUT) and split-K + reduce.
        n = 4
        meta, _ = build_metadata([1] * n, [t] * n, [list(range(num_blocks))] * n, page_size)
        qd = torch.zeros(n, h, d, dtype=dtype)
        for splits in (1, attn._MAX_SPLITS):
            rec(f"splits={splits}", attn.decode_attention, qd, kc, vc, meta.block_tables,
                meta.seq_lens, d ** -0.5, num_splits=splits)
        # Extend: a mixed batch (a prefill chunk after a prefix, and a decode row).
        meta, _ = build_metadata([t - 1, 1], [t, t], [list(range(num_blocks))] * 2,
                                 page_size)
        rec("extend", attn.extend_attention, q.contiguous(), kc, vc, meta, d ** -0.5)
        _record_moe(rec, moe, shape, dtype)
        _record_quant(rec, quant, shape, dtype, out)

    # DOT_UPCAST widens bf16 dots only under the interpreter (CPU tensors); a CUDA launch
    # passes what dot_upcast says for a CUDA device.
    for launch in out:
        if "DOT_UPCAST" in launch.kwargs:
            launch.kwargs["DOT_UPCAST"] = dot_upcast(dtype, torch.device("cuda"))
    return out


def _record_moe(rec, moe, shape: ModelShape, dtype) -> None:
    """The fused-MoE launches with the tiles a CUDA launch picks (triton_moe._config reads
    the device, and these tensors are on the CPU): a decode batch (4 tokens, top-8: a few
    pairs per expert) and a prefill (256 tokens, top-2: 64 per expert)."""
    import torch

    pick = moe._config
    moe._config = lambda n, e, dt, _device: pick(n, e, dt, torch.device("cuda"))
    try:
        e, i = 8, 256  # experts and their intermediate size only move runtime arguments
        w13 = torch.zeros(e, 2 * i, shape.hidden, dtype=dtype)
        w2 = torch.zeros(e, shape.hidden, i, dtype=dtype)
        for t, k in ((4, 8), (256, 2)):
            ids = (torch.arange(t * k) % e).view(t, k)
            rec(f"moe top-{k}", moe.fused_moe, torch.zeros(t, shape.hidden, dtype=dtype), w13,
                w2, ids, torch.full((t, k), 1.0 / k), 0)
    finally:
        moe._config = pick


def _record_quant(rec, quant, shape: ModelShape, dtype, out: list[Launch]) -> None:
    """The quantized GEMMs (quantization=int8/int4/fp8) with the tiles a CUDA launch picks
    (triton_quant._config reads the device): the MLP's gate/up projection at decode (4
    rows) and prefill (64 rows). bfloat16: every group format (and float32 mins, as AWQ /
    GPTQ load) and fp8 (marked sm_89+) at both. The other dtypes share those tiles
    (float16) or differ only by M (float32), so they take one launch per code path (~2 s
    of ptxas each): int8 and fp8 at decode, int4+min at prefill. The weights are
    torch.empty: only shapes and strides are read."""
    import torch

    pick = quant._config
    quant._config = lambda m, dt, _device: pick(m, dt, torch.device("cuda"))
    try:
        n, k = 2 * shape.intermediate, shape.hidden
        scales = torch.empty(n, k // quant.GROUP, dtype=torch.float16)
        packed = {8: torch.empty(n, k, dtype=torch.int8),
                  4: torch.empty(n, k // 2, dtype=torch.uint8)}
        fp8 = torch.empty(n, k, dtype=torch.float8_e4m3fn)
        every = [(m, f) for m in (4, 64) for f in ("int8", "int8+min", "int4", "int4+min",
                                                   "int4+min32", "fp8")]
        some = [(4, "int8"), (4, "fp8"), (64, "int4+min")]
        for m, fmt in every if dtype == torch.bfloat16 else some:
            x = torch.zeros(m, k, dtype=dtype)
            start = len(out)
            if fmt == "fp8":
                rec(f"fp8 m={m}", quant.fp8_matmul, x, fp8, torch.empty(n))
                for launch in out[start:]:
                    launch.min_arch = quant.FP8_MIN_ARCH
            else:
                bits, has_min = int(fmt[3]), "+min" in fmt
                mins = (scales.float() if fmt.endswith("32") else scales.clone()) \
                    if has_min else None  # float32 mins: AWQ / GPTQ's
                rec(f"{fmt} m={m}", quant.quant_matmul, x, packed[bits], scales, mins, bits)
    finally:
        quant._config = pick


def specialize(launch: Launch, target):
    """(ASTSource, options) of a launch, specialized exactly as JITFunction.run does."""
    from triton import knobs
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    kernel = launch.kernel
    backend = make_backend(target)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    kwargs = dict(launch.kwargs)
    kwargs["debug"] = kwargs.get("debug", kernel.debug) or knobs.runtime.debug
    bound_args, specialization, options = binder(*launch.args, **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound_args,
                                                              specialization, options)
    return ASTSource(kernel, signature, constexprs, attrs), options


def compile_launch(launch: Launch, target):
    import triton

    src, options = specialize(launch, target)
    return triton.compile(src, target=target, options=options.__dict__)


def _config_str(launch: Launch) -> str:
    keep = ("BLOCK", "GROUP", "HEAD_DIM", "WRITE_OUT", "HAS_RESIDUAL", "Q_PER_TILE",
            "num_warps", "num_stages")
    return " ".join(f"{k}={v}" for k, v in launch.kwargs.items()
                    if any(k.startswith(p) for p in keep))


def run_all(page_size: int, targets=tuple(TARGETS), dtypes=DTYPES,
            shapes=MODEL_SHAPES) -> list[dict]:
    """Compile every distinct launch for every target; one row per (launch, target).
    ``page_size`` is the KV block size (tokens per page) the engine runs with: the caller
    passes it (kernels import nothing of the engine's config)."""
    from triton.backends.compiler import GPUTarget

    rows: list[dict] = []
    seen: dict[tuple, dict] = {}
    for tname in targets:
        arch, limit = TARGETS[tname]
        target = GPUTarget("cuda", arch, 32)
        for dtype_name in dtypes:
            for shape in shapes:
                for launch in record_launches(shape, dtype_name, page_size):
                    if launch.min_arch > arch:
                        continue
                    src, options = specialize(launch, target)
                    key = (tname, src.hash(), str(sorted(options.__dict__.items())))
                    row = {"kernel": launch.name, "config": _config_str(launch),
                           "dtype": dtype_name, "target": tname, "limit": limit,
                           "model": shape.name, "call": launch.label}
                    if key in seen:  # same compilation as an earlier shape: reuse it
                        seen[key]["models"].append(shape.name)
                        continue
                    t0 = time.perf_counter()
                    try:
                        import triton

                        compiled = triton.compile(src, target=target,
                                                  options=options.__dict__)
                        row["shared"] = compiled.metadata.shared
                    except Exception as e:  # reported, and failed on, by the caller
                        row["error"] = f"{type(e).__name__}: {e}"[:2000]
                    row["seconds"] = round(time.perf_counter() - t0, 2)
                    row["models"] = [shape.name]
                    seen[key] = row
                    rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", action="store_true", help="print the rows as JSON")
    p.add_argument("--targets", nargs="+", default=list(TARGETS), choices=list(TARGETS))
    p.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    p.add_argument("--page-size", type=int, required=True,
                   help="KV block size in tokens: the engine's block_size (its default: 16)")
    args = p.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("run with TRITON_INTERPRET=0: interpreted kernels cannot be compiled",
              file=sys.stderr)
        return 2
    rows = run_all(args.page_size, tuple(args.targets), tuple(args.dtypes))
    if args.json:
        print(json.dumps(rows))
    else:
        for r in rows:
            print(f"{r['kernel']:24} {r['dtype']:9} {r['target']:6} "
                  f"{r.get('shared', '-'):>7} {r['config']}  [{','.join(r['models'])}]"
                  + (f"  ERROR {r['error']}" if "error" in r else ""))
    bad = [r for r in rows if "error" in r or r["shared"] > r["limit"]]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
