"""A stand-in trainer on the far side of a weight-update process group
(nvllm/worker/weight_group.py), for tests/e2e/test_weight_sources.py: rank 0 of a gloo
group, it hosts the store, joins, and broadcasts a checkpoint's tensors in sorted name
order.

    python group_trainer.py PORT WORLD_SIZE CHECKPOINT_DIR update   # every tensor
    python group_trainer.py PORT WORLD_SIZE CHECKPOINT_DIR die      # exits after 5
"""

from __future__ import annotations

import os
import sys

from safetensors.torch import load_file

from nvllm.common.model_source import safetensors_files
from nvllm.worker.weight_group import TrainerWeightGroup


def main(port: str, world_size: str, folder: str, mode: str) -> None:
    tensors = {}
    for f in safetensors_files(folder):
        tensors.update(load_file(str(f)))
    group = TrainerWeightGroup("127.0.0.1", int(port), int(world_size), timeout_s=30)
    group.connect()
    print("joined", flush=True)
    names = sorted(tensors)
    if mode == "die":
        group.broadcast(tensors[n] for n in names[:5])
        os._exit(3)  # mid-update: the workers' next receive fails
    group.broadcast(tensors[n] for n in names)
    print("sent", flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:5])
