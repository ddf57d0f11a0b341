#!/usr/bin/env python
"""Per-step cost of sending a step plan, today's msgpack lists vs ArrayRefs.

Two processes, a real ZMQ PUSH/PULL pair over TCP loopback each way (as the engine's
plan and result sockets). Per step the leader builds the plan from Python lists (as
_build_plan does), encodes and sends it; the worker receives, decodes with the
protocol's type checks, materializes the arrays (numpy views, one slice per sequence)
and answers with a tiny ack; the leader applies the ack. A step's time is from the
start of building to the ack's arrival (median over the steps).

Transports:
  lists        protocol.encode(StepPlan) with token ids / block ids as msgpack lists
  refs-inline  the same plan with those fields empty, the bulk in ArrayRefs that carry
               their bytes (the cross-host fallback), as a second frame
  refs-shm     likewise, the bulk in a shared-memory ring (ArrayWriter("shm")); the
               worker's release() rides on the ack and the leader calls acked()
  refs-auto    refs-shm with min_shm_bytes=16 KiB (small payloads go inline)
  shm+records  refs-shm, but running sequences keep one RunningSeq record each (their
               token / block lists empty) instead of becoming columns

Payloads (256 sequences, 16-token blocks):
  prefill      256 new sequences, 1,024-token prompts, 64-block tables
  decode       256 running sequences, 1 new token each, 1 in 16 gets a new block
  decode+tables 256 running sequences, 1 new token each, full 64-block tables resent

    python scripts/bench_plan_transport.py [--steps 200] [--markdown]
"""

from __future__ import annotations

import argparse
import itertools
import os
import platform
import statistics
import subprocess
import sys
import time

import msgpack
import numpy as np
import zmq

from nvllm.common import protocol
from nvllm.common.transport import ArrayReader, ArrayRef, ArrayWriter

NUM_SEQS, PROMPT, BLOCKS, VOCAB = 256, 1024, 64, 151_936
TRANSPORTS = ["lists", "refs-inline", "refs-shm", "refs-auto", "shm+records"]
PAYLOADS = ["prefill", "decode", "decode+tables"]


# ---- the engine's state, as Python lists --------------------------------------------------


def make_state(seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    sampling = protocol.WorkerSampling(temperature=0.7, top_p=0.9, stop_token_ids=[151645])
    return [{"seq_id": i, "tokens": rng.integers(0, VOCAB, PROMPT).tolist(),
             "table": rng.integers(0, 40_000, BLOCKS).tolist(), "sampling": sampling,
             "new_block": [int(rng.integers(0, 40_000))] if i % 16 == 0 else []}
            for i in range(NUM_SEQS)]


def plan_lists(payload: str, step: int, state: list[dict]) -> protocol.StepPlan:
    if payload == "prefill":
        new = [protocol.NewSeq(s["seq_id"], list(s["tokens"]), PROMPT, 0, PROMPT,
                               list(s["table"]), s["sampling"]) for s in state]
        return protocol.StepPlan(step, new, [], [])
    blocks = "table" if payload == "decode+tables" else "new_block"
    run = [protocol.RunningSeq(s["seq_id"], 1, list(s[blocks]))
           for s in state]
    return protocol.StepPlan(step, [], run, [])


def _csr(w: ArrayWriter, lists: list[list[list[int]]], scalars: list[list[int]]
         ) -> tuple[list[ArrayRef], int]:
    """One reservation: per-sequence scalar columns (the first, sequence ids, int64; the
    rest int32), then each list-of-lists as int32 values + int32 offsets. One chained list
    per column converts in a single C call, straight into the ring."""
    specs = [((len(c),), "int64" if i == 0 else "int32") for i, c in enumerate(scalars)]
    for ls in lists:
        specs += [((sum(map(len, ls)),), "int32"), ((len(ls) + 1,), "int32")]
    res = w.reserve(specs)
    arrays = iter(res.arrays)
    for c in scalars:
        next(arrays)[:] = c
    for ls in lists:
        vals, off = next(arrays), next(arrays)
        vals[:] = list(itertools.chain.from_iterable(ls))
        off[0] = 0
        np.cumsum([len(x) for x in ls], out=off[1:])
    return res.commit(), res.generation


def plan_refs(payload: str, step: int, state: list[dict], w: ArrayWriter,
              records: bool = False) -> tuple[protocol.StepPlan, list[ArrayRef], int]:
    """The same plan, columnar: new sequences keep a record with their scalars and
    sampling (token ids and block table empty); running sequences become columns (seq
    ids, tokens to compute); token ids and block ids travel as CSR arrays. records=True
    keeps one RunningSeq record per running sequence (lists empty) instead of columns."""
    if payload == "prefill":
        refs, gen = _csr(w, [[s["tokens"] for s in state], [s["table"] for s in state]], [])
        new = [protocol.NewSeq(s["seq_id"], [], PROMPT, 0, PROMPT, [], s["sampling"])
               for s in state]
        return protocol.StepPlan(step, new, [], []), refs, gen
    blocks = "table" if payload == "decode+tables" else "new_block"
    lists = [[s[blocks] for s in state]]
    if records:
        refs, gen = _csr(w, lists, [])
        run = [protocol.RunningSeq(s["seq_id"], 1, []) for s in state]
        return protocol.StepPlan(step, [], run, []), refs, gen
    refs, gen = _csr(w, lists, [[s["seq_id"] for s in state], [1] * len(state)])
    return protocol.StepPlan(step, [], [], []), refs, gen


# ---- the worker process ---------------------------------------------------------------


def worker(plan_ep: str, ack_ep: str) -> None:
    ctx = zmq.Context()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    pull.connect(plan_ep)
    push.connect(ack_ep)
    reader = ArrayReader()
    while True:
        frames = pull.recv_multipart()
        if frames[0] == b"quit":
            break
        t0 = time.perf_counter()
        plan = protocol.decode(frames[0])
        released, per_seq = 0, None
        if len(frames) > 1:  # refs: every array, then one view per sequence
            refs = [ArrayRef.decode(r) for r in msgpack.unpackb(frames[1], raw=False)]
            arrays = reader.get_many(refs)
            cols = [a.tolist() for a in arrays[:-4]]  # running: seq ids, tokens to compute
            toks, to, blks, bo = arrays[-4], arrays[-3].tolist(), arrays[-2], \
                arrays[-1].tolist()
            per_seq = [(toks[to[i]:to[i + 1]], blks[bo[i]:bo[i + 1]])
                       for i in range(len(to) - 1)]
            if cols:
                per_seq = list(zip(*cols, per_seq))
            assert len(per_seq) == len(plan.new_seqs) + len(plan.running) + \
                len(cols and cols[0])
            released = reader.release(max(r.generation for r in refs))
        dt = time.perf_counter() - t0
        push.send(msgpack.packb([plan.step_id, released, dt]))
        plan = per_seq = None  # freed here, not inside the next step's timing
    reader.close()
    ctx.destroy(linger=0)


# ---- the leader -------------------------------------------------------------------------


def step_once(payload: str, transport: str, step: int, w: ArrayWriter | None,
              sock: zmq.Socket, acks: zmq.Socket, state: list[dict]
              ) -> tuple[float, float, float, int]:
    t0 = time.perf_counter()
    if w is None:
        frames = [protocol.encode(plan_lists(payload, step, state))]
    else:
        plan, refs, _ = plan_refs(payload, step, state, w, transport == "shm+records")
        frames = [protocol.encode(plan),
                  msgpack.packb([r.encode() for r in refs], use_bin_type=True)]
    t1 = time.perf_counter()
    sock.send_multipart(frames, copy=False)
    step_id, released, worker_s = msgpack.unpackb(acks.recv())
    assert step_id == step
    if w is not None and released:
        w.acked(0, released)
    return time.perf_counter() - t0, t1 - t0, worker_s, sum(len(f) for f in frames)


def run(payload: str, steps: int, sock: zmq.Socket, acks: zmq.Socket, state: list[dict]
        ) -> list[dict]:
    """Every transport in turn at each step, starting with a different one each round,
    so background load (and the previous step's garbage) hits them alike."""
    writers = {"lists": None, "refs-inline": ArrayWriter("inline"),
               "refs-shm": ArrayWriter("shm", capacity_bytes=32 << 20),
               "refs-auto": ArrayWriter("shm", capacity_bytes=32 << 20,
                                        min_shm_bytes=16 << 10),
               "shm+records": ArrayWriter("shm", capacity_bytes=32 << 20)}
    samples: dict[str, list] = {t: [] for t in TRANSPORTS}
    try:
        for step in range(steps + 5):  # 5 warm-up rounds
            k = step % len(TRANSPORTS)
            for t in TRANSPORTS[k:] + TRANSPORTS[:k]:
                s = step_once(payload, t, step, writers[t], sock, acks, state)
                if step >= 5:
                    samples[t].append(s)
    finally:
        for w in writers.values():
            if w is not None:
                w.close()
    med = lambda xs: statistics.median(xs) * 1e6
    return [{"payload": payload, "transport": t, "step_us": med([x[0] for x in xs]),
             "encode_us": med([x[1] for x in xs]), "decode_us": med([x[2] for x in xs]),
             "wire": xs[-1][3]} for t, xs in samples.items()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--markdown", action="store_true", help="print a markdown table")
    ap.add_argument("--worker", nargs=2, metavar=("PLAN_EP", "ACK_EP"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(*args.worker)
    ctx = zmq.Context()
    sock, acks = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    plan_ep = f"tcp://127.0.0.1:{sock.bind_to_random_port('tcp://127.0.0.1')}"
    ack_ep = f"tcp://127.0.0.1:{acks.bind_to_random_port('tcp://127.0.0.1')}"
    child = subprocess.Popen([sys.executable, __file__, "--worker", plan_ep, ack_ep])
    state = make_state()
    rows = []
    try:
        for payload in PAYLOADS:
            n = max(20, args.steps // 4) if payload == "prefill" else args.steps
            rows += run(payload, n, sock, acks, state)
            print(f"{payload} done", file=sys.stderr, flush=True)
    finally:
        sock.send_multipart([b"quit"])
        child.wait(timeout=30)
        ctx.destroy(linger=0)
    base = {r["payload"]: r["step_us"] for r in rows if r["transport"] == "lists"}
    head = ("| payload | transport | bytes on the wire | leader build+encode µs | "
            "worker decode+views µs | step µs (send to ack) | vs lists |")
    lines = [head, "|" + "---|" * 7]
    for r in rows:
        lines.append(f"| {r['payload']} | {r['transport']} | {r['wire']:,} | "
                     f"{r['encode_us']:,.0f} | {r['decode_us']:,.0f} | {r['step_us']:,.0f} | "
                     f"{base[r['payload']] / r['step_us']:.2f}x |")
    print(f"# {platform.python_version()}, numpy {np.__version__}, pyzmq {zmq.__version__}, "
          f"{os.cpu_count()} CPUs; medians over {args.steps} steps ({max(20, args.steps // 4)}"
          " for prefill)")
    print("\n".join(lines) if args.markdown else "\n".join(
        f"{r['payload']:14s} {r['transport']:12s} {r['wire']:>10,} B  enc {r['encode_us']:8,.0f}"
        f"  dec {r['decode_us']:8,.0f}  step {r['step_us']:8,.0f} us" for r in rows))


if __name__ == "__main__":
    main()
