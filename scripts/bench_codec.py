#!/usr/bin/env python
"""Client-wire codec cost per frame: the msgspec Structs against the previous hand-rolled
map codec (``git show <ref>:nvllm/common/client_protocol.py``, loaded as a module).

Each frame goes through the codec as it travels, in one process (no sockets): a submit is
encoded by the client and decoded, with every limit checked, by the leader; an output
delta is encoded by the leader and decoded by the client. Reported: the frame's size and
the median over repeats of the time per encode and per decode.

Frames:
  submit        a generate request: a 300-character text prompt, sampling parameters
                (temperature, top_p, seed, max_tokens, a stop string, logprobs)
  submit-ids    the same with a 512-token prompt as token ids
  delta         a stream delta: one token, its text, no logprobs
  delta-lp5     the same with the sampled token's and the top-5 logprobs

    python scripts/bench_codec.py [--ref main] [--number 20000] [--markdown]
"""

from __future__ import annotations

import argparse
import importlib.util
import platform
import statistics
import subprocess
import sys
import time
import types
from pathlib import Path

from nvllm.common import client_protocol as new
from nvllm.common.client_decode import decode_client_frame
from nvllm.common.client_limits import default_limits
from nvllm.common.outputs import CompletionDelta
from nvllm.common.sampling_params import SamplingParams

ROOT = Path(__file__).resolve().parents[1]


def load_old(ref: str) -> types.ModuleType:
    src = subprocess.run(["git", "-C", str(ROOT), "show",
                          f"{ref}:nvllm/common/client_protocol.py"],
                         check=True, capture_output=True, text=True).stdout
    spec = importlib.util.spec_from_loader("old_client_protocol", loader=None)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[mod.__name__] = mod  # dataclasses look their module up
    exec(compile(src, f"{ref}:client_protocol.py", "exec"), mod.__dict__)  # noqa: S102
    return mod


def frames(cp: types.ModuleType) -> dict[str, tuple]:
    """name -> (message, encode, decode) for one codec module."""
    params = SamplingParams(temperature=0.7, top_p=0.9, seed=1234, max_tokens=256,
                            stop=["\n\n"], logprobs=1)
    text = ("Write a short story about a lighthouse keeper who finds a message in a "
            "bottle. " * 4)[:300]
    if hasattr(cp, "ClientLimits"):  # the previous codec: its limits object
        limits = cp.ClientLimits()
        decode = lambda b: cp.decode_client_frame(b, limits)  # noqa: E731
    else:
        limits = default_limits()
        decode = lambda b: decode_client_frame(b, limits)  # noqa: E731
    lp = [{1234: -0.11, 99: -2.5, 7: -3.0, 15: -3.2, 8000: -4.0, 42: -4.4}]
    return {
        "submit": (cp.Submit("req-1", text, None, params), cp.encode, decode),
        "submit-ids": (cp.Submit("req-1", None, list(range(1000, 1512)), params),
                       cp.encode, decode),
        "delta": (cp.Output.of(CompletionDelta("r", 0, [1234], " the"), "req-1"),
                  cp.encode, cp.decode_server_frame),
        "delta-lp5": (cp.Output.of(CompletionDelta("r", 0, [1234], " the", lp), "req-1"),
                      cp.encode, cp.decode_server_frame),
    }


def time_per_call(fn, arg, number: int, repeats: int) -> float:
    """Median seconds per call of fn(arg)."""
    runs = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(number):
            fn(arg)
        runs.append((time.perf_counter() - t0) / number)
    return statistics.median(runs)


def measure(msg, encode, decode, number: int, repeats: int) -> tuple[int, float, float]:
    """(frame bytes, µs to encode, µs to decode)."""
    frame = encode(msg)
    assert decode(frame) is not None
    return (len(frame), time_per_call(encode, msg, number, repeats) * 1e6,
            time_per_call(decode, frame, number, repeats) * 1e6)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ref", default="main", help="git ref of the previous codec")
    ap.add_argument("--number", type=int, default=20000, help="round trips per repeat")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--markdown", action="store_true")
    args = ap.parse_args()
    old = load_old(args.ref)
    old_frames, new_frames = frames(old), frames(new)
    print(f"# {platform.processor() or platform.machine()}, Python "
          f"{platform.python_version()}, median of {args.repeats} x {args.number} calls")
    head = ("| frame | bytes old / new | encode µs old / new | decode µs old / new "
            "| encode + decode µs old / new | speedup |")
    if args.markdown:
        print(head)
        print("|---|---:|---:|---:|---:|---:|")
    for name in new_frames:
        b_o, e_o, d_o = measure(*old_frames[name], args.number, args.repeats)
        b_n, e_n, d_n = measure(*new_frames[name], args.number, args.repeats)
        cells = [name, f"{b_o} / {b_n}", f"{e_o:.2f} / {e_n:.2f}", f"{d_o:.2f} / {d_n:.2f}",
                 f"{e_o + d_o:.2f} / {e_n + d_n:.2f}", f"{(e_o + d_o) / (e_n + d_n):.1f}x"]
        print("| " + " | ".join(cells) + " |" if args.markdown else "  ".join(cells))


if __name__ == "__main__":
    main()
