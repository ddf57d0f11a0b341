"""Time x W^T on SmolLM2-135M's linear shapes, per row count: nvllm's quantized weights
(the native op, csrc/cpu_quant_linear.cpp; the int16- and int8-activation ops,
csrc/cpu_quant_a16.cpp "a16" and csrc/cpu_quant_vnni.cpp "a8"; and the
dequantize-a-tile-then-torch.mm path),
dense float32 / bfloat16 F.linear, oneDNN-packed float32, and torch's own weight-only ops
(``_weight_int8pack_mm``: one scale per output channel; ``_weight_int4pack_mm_for_cpu``:
groups of 32 with a scale and a zero point). Prints one row per (shape, rows): microseconds,
the minimum of --repeat timings (on a shared machine the minimum is what compares).
``--decode`` compares only what decode picks between (rows 1..8, the native, a16 and a8
ops in each format against dense F.linear) and prints their speed-ups over the native op.
Those shapes stay in cache between calls; a decode step reads every weight from memory:
``--step N`` times all of a SmolLM2 decode step's linears (30 layers of Q4_1, the Q8_0 LM
head: 93 MiB, more than any cache) per op, the ops in turn N times (medians and 10th
percentiles, layers and head apart; the AMX op too where it is usable).

    PYTHONPATH=$PWD python scripts/bench_quant_linear.py [--threads 2] [--rows 1,2,4,8,16,32,64]
    PYTHONPATH=$PWD python scripts/bench_quant_linear.py --decode --threads 1
    PYTHONPATH=$PWD python scripts/bench_quant_linear.py --paired 400 --threads 2
    PYTHONPATH=$PWD python scripts/bench_quant_linear.py --step 40 --threads 2 [--rows 1]

``--paired N``: one decoder layer's linears (qkv, o, gate_up, down) at one row in int4+min,
the a8 op and the native op called alternately N times each, so both see the same load
(what a shared machine needs): medians, minimums and how often a8 was the faster.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from nvllm.kernels import cpu_ops
from nvllm.worker.layers.quant import INT4, INT4_MIN, INT8, QuantizedWeight, quantize

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536),
          "lm_head": (49152, 576)}


def timeit(fn, repeat: int) -> float:
    fn()
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < 0.05:  # calls per timing: about 50 ms worth
        fn()
        n += 1
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        times.append((time.perf_counter() - t0) / n)
    return min(times) * 1e6


def decode_candidates(n: int, k: int, m: int):
    """Dense float32 / bfloat16 and, per format, the native and the a8 op (float32 x)."""
    w = torch.randn(n, k) * 0.05
    x32 = torch.randn(m, k)
    wb, x16 = w.bfloat16(), x32.bfloat16()
    out = {"dense f32": lambda: F.linear(x32, w), "dense bf16": lambda: F.linear(x16, wb)}
    for fmt in (INT4_MIN, INT4, INT8):
        qw = QuantizedWeight(fmt, n, k)
        qw.write(0, 0, *quantize(w, fmt))
        out[f"{fmt.name} native"] = \
            lambda qw=qw: cpu_ops.quant_linear(x32, qw.qweight, qw.scales, qw.mins, qw.fmt.bits)
        for op in ("a16", "a8"):
            fn = getattr(cpu_ops, f"quant_linear_{op}")
            out[f"{fmt.name} {op}"] = \
                lambda qw=qw, fn=fn: fn(x32, qw.qweight, qw.scales, qw.mins, qw.fmt.bits)
    return out


def candidates(n: int, k: int, m: int):
    w = torch.randn(n, k) * 0.05
    x32 = torch.randn(m, k)
    x16 = x32.bfloat16()
    out = {}
    out["dense f32"] = lambda: F.linear(x32, w)
    wb = w.bfloat16()
    out["dense bf16"] = lambda: F.linear(x16, wb)
    packed = w.to_mkldnn()
    out["onednn f32"] = lambda: torch.ops.mkldnn._linear_pointwise(x32, packed, None, "none",
                                                                    [], "")
    for fmt in (INT4_MIN, INT8):
        qw = QuantizedWeight(fmt, n, k)
        qw.write(0, 0, *quantize(w, fmt))
        if cpu_ops.load():
            out[f"nvllm {fmt.name} native f32"] = \
                lambda qw=qw: cpu_ops.quant_linear(x32, qw.qweight, qw.scales, qw.mins, qw.fmt.bits)
            out[f"nvllm {fmt.name} native bf16"] = \
                lambda qw=qw: cpu_ops.quant_linear(x16, qw.qweight, qw.scales, qw.mins, qw.fmt.bits)
        out[f"nvllm {fmt.name} tile f32"] = lambda qw=qw: qw.matmul_tiles(x32, cpu_ops.load())
        out[f"nvllm {fmt.name} tile bf16"] = lambda qw=qw: qw.matmul_tiles(x16, cpu_ops.load())
    try:
        q4 = torch.randint(0, 16, (n, k), dtype=torch.int32)
        w4 = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q4, 1)
        sz32 = torch.rand(k // 32, n, 2)
        sz16 = sz32.bfloat16()
        out["torch int4pack f32"] = lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(
            x32, w4, 32, sz32)
        out["torch int4pack bf16"] = lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(
            x16, w4, 32, sz16)
    except (RuntimeError, AttributeError) as e:
        print("no int4pack:", e)
    w8 = torch.randint(-127, 128, (n, k), dtype=torch.int8)
    s8 = torch.rand(n)
    out["torch int8pack f32"] = lambda: torch.ops.aten._weight_int8pack_mm(x32, w8, s8)
    out["torch int8pack bf16"] = lambda: torch.ops.aten._weight_int8pack_mm(
        x16, w8, s8.bfloat16())
    return out


def paired(calls: int) -> None:
    import statistics

    layers = []
    for name in ("qkv", "o", "gate_up", "down"):
        n, k = SHAPES[name]
        qw = QuantizedWeight(INT4_MIN, n, k)
        qw.write(0, 0, *quantize(torch.randn(n, k) * 0.05, INT4_MIN))
        layers.append((torch.randn(1, k), qw))

    def layer(op) -> float:
        t0 = time.perf_counter()
        for x, qw in layers:
            op(x, qw.qweight, qw.scales, qw.mins, qw.fmt.bits)
        return time.perf_counter() - t0

    a8, native = [], []
    for _ in range(calls):
        a8.append(layer(cpu_ops.quant_linear_a8))
        native.append(layer(cpu_ops.quant_linear))
    wins = sum(a < b for a, b in zip(a8, native))
    print(f"one layer's linears, int4+min, 1 row, {torch.get_num_threads()} threads: a8 median "
          f"{statistics.median(a8) * 1e6:.0f} us (min {min(a8) * 1e6:.0f}), native "
          f"{statistics.median(native) * 1e6:.0f} us (min {min(native) * 1e6:.0f}); "
          f"a8 faster in {wins}/{calls} pairs")


def step(rounds: int, rows: int) -> None:
    """All linears of a SmolLM2 decode step (``--step``), each op in turn per round."""
    import statistics

    def weight(fmt, n, k):
        qw = QuantizedWeight(fmt, n, k)
        qw.write(0, 0, *quantize(torch.randn(n, k) * 0.05, fmt))
        return qw

    layers = [weight(INT4_MIN, *SHAPES[name]) for _ in range(30)
              for name in ("qkv", "o", "gate_up", "down")]
    head = weight(INT8, *SHAPES["lm_head"])
    xs = {k: torch.randn(rows, k) for k in (576, 1536)}
    ops = {"native": cpu_ops.quant_linear, "a16": cpu_ops.quant_linear_a16,
           "a8": cpu_ops.quant_linear_a8}
    if cpu_ops.quant_amx_usable():
        ops["amx"] = cpu_ops.quant_linear_amx
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in ops}
    for r in range(rounds + 2):
        for name, op in ops.items():
            t0 = time.perf_counter()
            for qw in layers:
                op(xs[qw.k], qw.qweight, qw.scales, qw.mins, qw.fmt.bits)
            t1 = time.perf_counter()
            op(xs[576], head.qweight, head.scales, head.mins, head.fmt.bits)
            if r >= 2:  # warm-up
                times[name].append((t1 - t0, time.perf_counter() - t1))
    for name, ts in times.items():
        lay, hd = sorted(t[0] for t in ts), sorted(t[1] for t in ts)
        print(f"{name:>6}: 120 layer linears median {statistics.median(lay) * 1e3:.2f} ms "
              f"(p10 {lay[len(lay) // 10] * 1e3:.2f}), LM head median "
              f"{statistics.median(hd) * 1e3:.2f} ms (p10 {hd[len(hd) // 10] * 1e3:.2f})")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rows", default="1,2,4,8,16,32,64")
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--paired", type=int, default=0, metavar="N",
                   help="a8 vs native on one layer's linears, N alternating calls each")
    p.add_argument("--decode", action="store_true",
                   help="rows 1..8 (unless --rows), native vs a16 vs a8 vs dense only")
    p.add_argument("--step", type=int, default=0, metavar="N",
                   help="a decode step's linears from memory, N rounds of each op")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    if args.decode and args.rows == p.get_default("rows"):
        args.rows = "1,2,3,4,6,8"
    if (args.decode or args.paired or args.step) and not cpu_ops.load():
        raise SystemExit("--decode / --paired / --step compare nvllm's CPU ops: build them "
                         "with python -m nvllm.kernels.cpu_ops")
    if args.paired:
        paired(args.paired)
        return
    if args.step:
        step(args.step, int(args.rows.split(",")[0]) if args.rows != p.get_default("rows")
             else 1)
        return
    make = decode_candidates if args.decode else candidates
    for name in args.shapes.split(","):
        n, k = SHAPES[name]
        for m in map(int, args.rows.split(",")):
            res = {c: timeit(fn, args.repeat) for c, fn in make(n, k, m).items()}
            cols = "  ".join(f"{c}={t:.0f}" for c, t in res.items())
            if args.decode:
                cols += "  | speed-up a16, a8: " + " ".join(
                    f"{f}={res[f + ' native'] / res[f + ' a16']:.2f}x,"
                    f"{res[f + ' native'] / res[f + ' a8']:.2f}x"
                    for f in ("int4+min", "int4", "int8"))
            print(f"{name} {n}x{k} rows={m}: {cols}", flush=True)


if __name__ == "__main__":
    main()
