"""Time a full weight update (LLM.update_weights: shared-memory chunks, staged on every
rank, committed) against restarting the engine on the new checkpoint, which is what a
trainer had to do before; prints both and their ratio, from the same run.

    python scripts/bench_weight_update.py --preset qwen3-36m --tp 1 --repeats 3
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch
from safetensors.torch import load_file

from nvllm import LLM
from nvllm.common.model_source import safetensors_files
from nvllm.launch.tiny import ALL_PRESETS, ensure_tiny_checkpoint, make_tiny_checkpoint


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--preset", default="qwen3-36m")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--chunk-mib", type=int, default=64)
    args = ap.parse_args()
    a = str(ensure_tiny_checkpoint(args.preset))
    with tempfile.TemporaryDirectory() as tmp:
        b = make_tiny_checkpoint(tmp, **ALL_PRESETS[args.preset], seed=1)
        tensors: dict[str, torch.Tensor] = {}
        for f in safetensors_files(b):
            tensors.update(load_file(str(f)))
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        restarts = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            LLM(str(b), tensor_parallel_size=args.tp, device="cpu").shutdown()
            restarts.append(time.perf_counter() - t0)
        llm = LLM(a, tensor_parallel_size=args.tp, device="cpu")
        updates = []
        for i in range(args.repeats):
            t0 = time.perf_counter()
            llm.update_weights(tensors, weight_version=i, chunk_bytes=args.chunk_mib << 20)
            updates.append(time.perf_counter() - t0)
        llm.shutdown()
    up, rs = statistics.median(updates), statistics.median(restarts)
    print(f"{args.preset} tp={args.tp}: {len(tensors)} tensors, {nbytes / 2**20:.1f} MiB, "
          f"chunks of {args.chunk_mib} MiB")
    print(f"update_weights: {up * 1000:.0f} ms ({nbytes / 2**30 / up:.2f} GiB/s)  "
          f"restart: {rs * 1000:.0f} ms  update/restart: {up / rs:.3f}x")


if __name__ == "__main__":
    main()
