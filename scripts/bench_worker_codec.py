#!/usr/bin/env python
"""Encode + decode time of a decode step plan (n running sequences, one token each, 1 in
16 with a new block) with whichever nvllm is on PYTHONPATH: main's dataclass codec or the
msgspec one (which also counts reading the columns as numpy arrays, what the worker does
next; main's decode already yields the lists its worker reads).

    PYTHONPATH=/work/main python scripts/bench_worker_codec.py
    PYTHONPATH=$PWD python scripts/bench_worker_codec.py
"""

from __future__ import annotations

import argparse
import timeit

from nvllm.common import worker_protocol as protocol


def decode_plan(n: int):
    run = [protocol.RunningSeq(1000 + i, 1, [60_000 + i] if i % 16 == 0 else [])
           for i in range(n)]
    make = getattr(protocol.StepPlan, "of", protocol.StepPlan)
    return make(123_456, [], run, [])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seqs", nargs="*", type=int, default=[1, 16, 64, 256])
    ap.add_argument("--number", type=int, default=2000)
    args = ap.parse_args()
    try:
        from nvllm.common.plan_arrays import columns
    except ImportError:
        columns = None
    print("| running seqs | bytes | encode µs | decode µs | decode+columns µs | "
          "encode+decode+columns µs |")
    print("|---:|---:|---:|---:|---:|---:|")
    for n in args.seqs:
        plan = decode_plan(n)
        data = protocol.encode(plan)
        def dec(data=data):
            return protocol.decode(data)

        def dec_cols(data=data):
            return columns(protocol.decode(data), None) if columns else protocol.decode(data)

        def t(fn) -> float:
            return min(timeit.repeat(fn, number=args.number, repeat=5)) / args.number * 1e6

        enc, de, de_cols = t(lambda plan=plan: protocol.encode(plan)), t(dec), t(dec_cols)
        print(f"| {n} | {len(data)} | {enc:.1f} | {de:.1f} | {de_cols:.1f} | "
              f"{enc + de_cols:.1f} |")


if __name__ == "__main__":
    main()
