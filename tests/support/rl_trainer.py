"""A stand-in RL trainer process for tests/e2e/test_weight_update.py: pushes a checkpoint's
tensors into a served engine through nvllm.Client (shared memory this process creates).

    python rl_trainer.py ENDPOINT CHECKPOINT_DIR update   # pause(wait), update, resume
    python rl_trainer.py ENDPOINT CHECKPOINT_DIR die      # dies after staging one chunk
"""

from __future__ import annotations

import os
import sys

from safetensors.torch import load_file

from nvllm import Client
from nvllm.common.model_source import safetensors_files

CHUNK = 16 << 10


def main(endpoint: str, folder: str, mode: str) -> None:
    tensors = {}
    for f in safetensors_files(folder):
        tensors.update(load_file(str(f)))
    with Client(endpoint, timeout_s=60) as client:
        if mode == "update":
            client.pause_generation(mode="wait")
            version = client.update_weights(tensors, weight_version="B", chunk_bytes=CHUNK)
            client.resume_generation()
            print(f"version={version}", flush=True)
            return

        def dying():
            for k, item in enumerate(tensors.items()):
                if k == 8:  # a few chunks are staged by now
                    os._exit(3)
                yield item

        client.update_weights(dying(), weight_version="never", chunk_bytes=CHUNK)


if __name__ == "__main__":
    main(*sys.argv[1:4])
