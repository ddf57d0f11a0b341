"""A stand-in trainer on the far side of a weight-update process group
(nvllm/worker/weight_group.py), for tests/e2e/test_weight_sources.py: rank 0 of a gloo
group, it hosts the store, joins, and broadcasts a checkpoint's tensors in sorted name
order; given a second checkpoint, it then starts broadcasting that one and dies.

    python group_trainer.py PORT WORLD_SIZE CHECKPOINT_DIR              # exit 0
    python group_trainer.py PORT WORLD_SIZE CHECKPOINT_DIR THEN_DIR     # exit 3
"""

from __future__ import annotations

import os
import sys

import torch
from safetensors.torch import load_file

from nvllm.common.model_source import safetensors_files
from nvllm.worker.weight_group import TrainerWeightGroup


def tensors(folder: str) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in safetensors_files(folder):
        out.update(load_file(str(f)))
    return out


def main(port: str, world_size: str, folder: str, then: str | None = None) -> None:
    group = TrainerWeightGroup("127.0.0.1", int(port), int(world_size), timeout_s=30)
    group.connect()
    first = tensors(folder)
    group.broadcast(first[n] for n in sorted(first))
    if then is not None:
        second = tensors(then)
        group.broadcast(second[n] for n in sorted(second)[:5])
        os._exit(3)  # mid-update: the workers' next receive fails


if __name__ == "__main__":
    main(*sys.argv[1:5])
