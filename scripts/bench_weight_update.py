"""Time a full weight update by each path against restarting the engine on the new
checkpoint, which is what a trainer had to do before; prints each and its ratio to the
restart, from the same run:

- ``update_weights``: shared-memory chunks (the sender copies every byte once into its
  ring; each rank copies its shard out);
- ``from_distributed``: a gloo weight-update group, the trainer (rank 0) a thread of
  this process broadcasting every tensor whole to every rank (bytes x tp over TCP);
- ``from_path``: every rank reads its own shards of the checkpoint through the loader
  (nothing through the leader; the files are in the page cache after the first read).

    python scripts/bench_weight_update.py --preset qwen3-36m --tp 1 --repeats 3
"""

from __future__ import annotations

import argparse
import socket
import statistics
import tempfile
import threading
import time
from collections.abc import Callable

import torch
from safetensors.torch import load_file

from nvllm import LLM
from nvllm.common.model_source import safetensors_files
from nvllm.launch.tiny import ALL_PRESETS, ensure_tiny_checkpoint, make_tiny_checkpoint
from nvllm.worker.weight_group import TrainerWeightGroup, describe


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _group(llm: LLM, tp: int) -> TrainerWeightGroup:
    """A gloo weight-update group: this thread is the trainer."""
    port = _port()
    group = TrainerWeightGroup("127.0.0.1", port, 1 + tp, timeout_s=120)
    join = threading.Thread(target=llm.init_weight_update_group,
                            args=("127.0.0.1", port, 1, 1 + tp), kwargs={"timeout_s": 120})
    join.start()
    group.connect()
    join.join()
    return group


def _from_group(llm: LLM, group: TrainerWeightGroup,
                tensors: dict[str, torch.Tensor]) -> Callable[[int], None]:
    names, dtypes, shapes = describe(tensors.items())

    def update(i: int) -> None:
        errors: list[BaseException] = []

        def engine_side() -> None:
            try:
                llm.update_weights_from_distributed(names, dtypes, shapes, weight_version=i)
            except BaseException as e:  # noqa: BLE001 (reported below)
                errors.append(e)

        t = threading.Thread(target=engine_side)
        t.start()
        group.broadcast(tensors[n] for n in names)
        t.join()
        if errors:
            raise errors[0]

    return update


def _median_s(fn: Callable[[int], None], repeats: int) -> float:
    times = []
    for i in range(repeats):
        t0 = time.perf_counter()
        fn(i)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


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
        restart = _median_s(lambda i: LLM(str(b), tensor_parallel_size=args.tp,
                                          device="cpu").shutdown(), args.repeats)
        llm = LLM(a, tensor_parallel_size=args.tp, device="cpu")
        rows = {
            "update_weights": _median_s(lambda i: llm.update_weights(
                tensors, weight_version=i, chunk_bytes=args.chunk_mib << 20), args.repeats),
            "from_distributed": _median_s(_from_group(llm, _group(llm, args.tp), tensors),
                                          args.repeats),
            "from_path": _median_s(lambda i: llm.update_weights_from_path(
                str(b), weight_version=i), args.repeats),
        }
        llm.shutdown()
    print(f"{args.preset} tp={args.tp}: {len(tensors)} tensors, {nbytes / 2**20:.1f} MiB, "
          f"chunks of {args.chunk_mib} MiB; medians of {args.repeats}")
    print(f"restart: {restart * 1000:.0f} ms")
    for name, s in rows.items():
        print(f"{name}: {s * 1000:.0f} ms ({nbytes / 2**30 / s:.2f} GiB/s)  "
              f"/restart: {s / restart:.3f}x")


if __name__ == "__main__":
    main()
