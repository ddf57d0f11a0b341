"""Where a streamed token's time goes, from the trace files ``NVLLM_TRACE=<prefix>`` wrote.

``python -m nvllm.launch.trace_report <prefix>`` reads every ``<prefix>.*.jsonl`` (one per
process, see nvllm/common/trace.py), joins the worker's and the leader's records by step
and the leader's and the gateway's by (request id, completion index, message ordinal),
and prints one row per hop: how many messages it joined and the median, p90 and maximum
in milliseconds.

    worker -> leader    worker result_sent  -> leader result_recv   (per step)
    leader              leader result_recv  -> leader out_sent      (scheduler update,
                                                                     detokenization, send)
    leader -> gateway   leader out_sent     -> gateway out_recv     (ZMQ, the gateway's loop)
    gateway             gateway out_recv    -> gateway sse_sent     (fan-out, JSON, HTTP)
    total               worker result_sent  -> gateway sse_sent

``summarize(prefix)`` returns the same figures as a dict for benchmarks, ``one_line`` a
compact line of them. One engine per
prefix: step ids restart with each engine, so two engines' records would join wrongly.
"""

from __future__ import annotations

import glob
import json
import math
import statistics
import sys
from typing import Any

HOPS = ("worker->leader", "leader", "leader->gateway", "gateway", "total")

Key = tuple[str, int, int]  # (request id, completion index, message ordinal)


def read_records(prefix: str) -> list[dict[str, Any]]:
    """Every record of every ``<prefix>.*.jsonl``; a torn last line (a killed process)
    is skipped."""
    records = []
    for path in sorted(glob.glob(glob.escape(prefix) + ".*.jsonl")):
        with open(path, encoding="utf-8") as f:
            for line in f:
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if isinstance(rec, dict) and "ev" in rec and "t" in rec:
                    records.append(rec)
    return records


def _quantile(sorted_ms: list[float], q: float) -> float:
    """The nearest-rank q-quantile of a sorted, non-empty list."""
    return sorted_ms[max(0, math.ceil(q * len(sorted_ms)) - 1)]


def _stats(ms: list[float]) -> dict[str, float]:
    if not ms:
        return {"count": 0}
    s = sorted(ms)
    return {"count": len(s), "median_ms": statistics.median(s), "p90_ms": _quantile(s, 0.9),
            "max_ms": s[-1]}


def join(records: list[dict[str, Any]]) -> dict[str, list[float]]:
    """Each hop's durations in milliseconds, from joined records."""
    sent: dict[int, float] = {}  # step -> worker result_sent
    recv: dict[int, float] = {}  # step -> leader result_recv
    out_sent: dict[Key, dict[str, Any]] = {}
    out_recv: dict[Key, float] = {}
    sse: list[tuple[Key, float]] = []
    for r in records:
        ev = r["ev"]
        if ev == "result_sent":
            sent.setdefault(r["step"], r["t"])
        elif ev == "result_recv":
            recv.setdefault(r["step"], r["t"])
        elif ev in ("out_sent", "out_recv", "sse_sent"):
            key = (str(r["rid"]), int(r.get("i", 0)), int(r["n"]))
            if ev == "out_sent":
                out_sent.setdefault(key, r)
            elif ev == "out_recv":
                out_recv.setdefault(key, r["t"])
            else:
                sse.append((key, r["t"]))
    ms: dict[str, list[float]] = {h: [] for h in HOPS}
    for step, t in recv.items():
        if step in sent:
            ms["worker->leader"].append((t - sent[step]) * 1e3)
    for key, r in out_sent.items():
        step = r.get("step")
        if step in recv:
            ms["leader"].append((r["t"] - recv[step]) * 1e3)
        if key in out_recv:
            ms["leader->gateway"].append((out_recv[key] - r["t"]) * 1e3)
    for key, t in sse:
        if key in out_recv:
            ms["gateway"].append((t - out_recv[key]) * 1e3)
        step = out_sent.get(key, {}).get("step")
        if step in sent:
            ms["total"].append((t - sent[step]) * 1e3)
    return ms


def summarize(prefix: str) -> dict[str, dict[str, float]]:
    """hop -> {"count", "median_ms", "p90_ms", "max_ms"} (only "count": 0 when nothing
    joined) for the traces under `prefix`."""
    return {hop: _stats(v) for hop, v in join(read_records(prefix)).items()}


def format_table(summary: dict[str, dict[str, float]]) -> str:
    rows = [f"{'hop':<17}{'count':>8}{'median ms':>12}{'p90 ms':>10}{'max ms':>10}"]
    for hop, s in summary.items():
        if s["count"]:
            rows.append(f"{hop:<17}{s['count']:>8}{s['median_ms']:>12.3f}{s['p90_ms']:>10.3f}"
                        f"{s['max_ms']:>10.3f}")
        else:
            rows.append(f"{hop:<17}{0:>8}{'-':>12}{'-':>10}{'-':>10}")
    return "\n".join(rows)


def one_line(summary: dict[str, dict[str, float]]) -> str:
    """The summary on one line: ``hop median/p90/max ms (count)``, hop after hop."""
    return "; ".join(
        f"{hop} {s['median_ms']:.2f}/{s['p90_ms']:.2f}/{s['max_ms']:.2f} ms ({s['count']})"
        if s["count"] else f"{hop} - (0)" for hop, s in summary.items())


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1 or argv[0] in ("-h", "--help"):
        print("usage: python -m nvllm.launch.trace_report PREFIX  (the NVLLM_TRACE value)",
              file=sys.stderr)
        return 2
    if not glob.glob(glob.escape(argv[0]) + ".*.jsonl"):
        print(f"no trace files {argv[0]}.*.jsonl", file=sys.stderr)
        return 1
    print(format_table(summarize(argv[0])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
