#!/usr/bin/env python
"""Per-step cost of a step plan as the engine sends it: msgpack lists vs by reference.

Two processes, a real ZMQ PUSH/PULL pair over TCP loopback each way (as the engine's
plan and result sockets). Per step the leader builds the plan (protocol records, as
``LLMEngine._build_plan`` makes them), packs it when by reference
(``plan_arrays.pack``: ids into the shared-memory ring, running sequences as columns),
encodes and sends it; the worker decodes it with the protocol's type checks, reads it
(``plan_arrays.columns``: the arrays the batch state reads; ``unpack`` on older trees) and
answers with a tiny ack, on which the leader acknowledges the ring region as the engine does on
rank 0's result. A step's time runs from the start of building to the ack's arrival
(median over the steps; the two transports alternate within each step).

Payloads (--seqs sequences, default 256, 16-token blocks):
  prefill   new sequences, 1,024-token prompts, 64-block tables
  decode    running sequences, one token each, 1 in 16 gets a new block

    python scripts/bench_plan_transport.py [--steps 200] [--seqs 256] [--markdown]
        [--payloads prefill decode]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import time

import msgpack
import numpy as np
import zmq

from nvllm.common import plan_arrays
from nvllm.common import worker_protocol as protocol
from nvllm.common.transport import ArrayReader, ArrayWriter

NUM_SEQS, PROMPT, BLOCKS, VOCAB = 256, 1024, 64, 151_936
TRANSPORTS = ["lists", "shm"]
PAYLOADS = ["prefill", "decode"]


def make_state(num_seqs: int, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    sampling = protocol.WorkerSampling(temperature=0.7, top_p=0.9, stop_token_ids=[151645])
    return [{"seq_id": i, "tokens": rng.integers(0, VOCAB, PROMPT).tolist(),
             "table": rng.integers(0, 40_000, BLOCKS).tolist(), "sampling": sampling,
             "new_block": [int(rng.integers(0, 40_000))] if i % 16 == 0 else []}
            for i in range(num_seqs)]


# Columns (this branch) or records (older nvllm): the script times either.
MAKE_PLAN = getattr(protocol.StepPlan, "of", protocol.StepPlan)


def build(payload: str, step: int, state: list[dict]) -> protocol.StepPlan:
    if payload == "prefill":
        new = [protocol.NewSeq(s["seq_id"], list(s["tokens"]), PROMPT, 0, PROMPT,
                               list(s["table"]), s["sampling"]) for s in state]
        return MAKE_PLAN(step, new, [], [])
    return MAKE_PLAN(step, [], [protocol.RunningSeq(s["seq_id"], 1, s["new_block"])
                                for s in state], [])


def read_plan(plan: protocol.StepPlan, reader: ArrayReader) -> int:
    """What a worker reads before it applies the plan; returns its sequence count."""
    if hasattr(plan_arrays, "columns"):
        cols = plan_arrays.columns(plan, reader)
        return len(cols.new_ids) + len(cols.run_ids)
    plan_arrays.unpack(plan, reader)
    return len(plan.new_seqs) + len(plan.running)


def worker(plan_ep: str, ack_ep: str) -> None:
    ctx = zmq.Context()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    pull.connect(plan_ep)
    push.connect(ack_ep)
    reader = ArrayReader()
    while (data := pull.recv()) != b"quit":
        t0 = time.perf_counter()
        plan = protocol.decode(data)
        assert read_plan(plan, reader) == int(os.environ["BENCH_SEQS"])
        dt = time.perf_counter() - t0
        push.send(msgpack.packb([plan.step_id, dt]))
        plan = None  # freed here, not inside the next step's timing
    reader.close()
    ctx.destroy(linger=0)


def step_once(payload: str, w: ArrayWriter | None, step: int, sock: zmq.Socket,
              acks: zmq.Socket, state: list[dict]) -> tuple[float, float, float, int]:
    t0 = time.perf_counter()
    plan = build(payload, step, state)
    gen = plan_arrays.pack(plan, w) if w is not None else 0
    data = protocol.encode(plan)
    t1 = time.perf_counter()
    sock.send(data, copy=False)
    step_id, worker_s = msgpack.unpackb(acks.recv())
    assert step_id == step
    if gen:
        w.acked_all(gen)
    return time.perf_counter() - t0, t1 - t0, worker_s, len(data)


def run(payload: str, steps: int, sock: zmq.Socket, acks: zmq.Socket, state: list[dict],
        w: ArrayWriter) -> list[dict]:
    samples: dict[str, list] = {t: [] for t in TRANSPORTS}
    for step in range(steps + 5):  # 5 warm-up rounds
        order = TRANSPORTS if step % 2 else TRANSPORTS[::-1]
        for t in order:
            s = step_once(payload, w if t == "shm" else None, step, sock, acks, state)
            if step >= 5:
                samples[t].append(s)
    med = lambda xs: statistics.median(xs) * 1e6  # noqa: E731
    return [{"payload": payload, "transport": t, "step_us": med([x[0] for x in xs]),
             "encode_us": med([x[1] for x in xs]), "decode_us": med([x[2] for x in xs]),
             "wire": xs[-1][3]} for t, xs in samples.items()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--seqs", type=int, default=NUM_SEQS, help="sequences per plan")
    ap.add_argument("--payloads", nargs="*", default=PAYLOADS, choices=PAYLOADS)
    ap.add_argument("--markdown", action="store_true", help="print a markdown table")
    ap.add_argument("--worker", nargs=2, metavar=("PLAN_EP", "ACK_EP"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(*args.worker)
    # By reference whatever the size, so the small decode plan is measured that way too
    # (the engine sends plans under 16 KiB of ids as lists).
    plan_arrays.MIN_BULK_BYTES = 0
    ctx = zmq.Context()
    sock, acks = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    plan_ep = f"tcp://127.0.0.1:{sock.bind_to_random_port('tcp://127.0.0.1')}"
    ack_ep = f"tcp://127.0.0.1:{acks.bind_to_random_port('tcp://127.0.0.1')}"
    child = subprocess.Popen([sys.executable, __file__, "--worker", plan_ep, ack_ep],
                             env={**os.environ, "BENCH_SEQS": str(args.seqs)})
    state = make_state(args.seqs)
    rows = []
    w = ArrayWriter(capacity_bytes=16 << 20, timeout_s=0.0)
    try:
        for payload in args.payloads:
            n = max(20, args.steps // 4) if payload == "prefill" else args.steps
            rows += run(payload, n, sock, acks, state, w)
            print(f"{payload} done", file=sys.stderr, flush=True)
    finally:
        sock.send(b"quit")
        child.wait(timeout=30)
        ctx.destroy(linger=0)
        w.close()
    base = {r["payload"]: r["step_us"] for r in rows if r["transport"] == "lists"}
    head = ("| payload | transport | bytes on the wire | leader build+pack+encode µs | "
            "worker decode+unpack µs | step µs (send to ack) | vs lists |")
    lines = [head, "|" + "---|" * 7]
    for r in rows:
        lines.append(f"| {r['payload']} | {r['transport']} | {r['wire']:,} | "
                     f"{r['encode_us']:,.0f} | {r['decode_us']:,.0f} | {r['step_us']:,.0f} | "
                     f"{base[r['payload']] / r['step_us']:.2f}x |")
    print(f"# {platform.python_version()}, numpy {np.__version__}, pyzmq {zmq.__version__}, "
          f"{os.cpu_count()} CPUs; medians over {args.steps} steps ({max(20, args.steps // 4)}"
          " for prefill)")
    print("\n".join(lines) if args.markdown else "\n".join(
        f"{r['payload']:8s} {r['transport']:6s} {r['wire']:>10,} B  enc {r['encode_us']:8,.0f}"
        f"  dec {r['decode_us']:8,.0f}  step {r['step_us']:8,.0f} us" for r in rows))


if __name__ == "__main__":
    main()
