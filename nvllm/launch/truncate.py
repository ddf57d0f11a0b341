"""A checkpoint cut to its first N decoder layers: a draft model for speculative decoding
that shares its target's vocabulary, embeddings and head (the tests' draft is the tiny
target cut to one layer; the target itself, uncut, is the draft that agrees with it
everywhere).

Usage::

    python -m nvllm.launch.truncate SRC DST --layers 1
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import shutil

# A decoder layer's tensors: "model.layers.<i>." (HF Llama/Qwen/Mistral names).
LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def truncate_checkpoint(src: str | os.PathLike, dst: str | os.PathLike,
                        num_layers: int) -> pathlib.Path:
    """Write ``src`` (an HF safetensors folder) to ``dst`` with only its first
    `num_layers` decoder layers: config.json says so (and keeps the first `num_layers`
    ``layer_types``), every other file is copied as is. Returns ``dst``."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from nvllm.common.model_source import safetensors_files

    src, dst = pathlib.Path(src), pathlib.Path(dst)
    cfg = json.loads((src / "config.json").read_text())
    total = cfg["num_hidden_layers"]
    if not 1 <= num_layers <= total:
        raise ValueError(f"num_layers must be in 1..{total} (the checkpoint's layers), "
                         f"got {num_layers}")
    dst.mkdir(parents=True, exist_ok=True)
    weights = safetensors_files(src)
    if not weights:
        raise FileNotFoundError(f"{src} has no safetensors weights")
    skip = {p.name for p in weights} | {"config.json", "model.safetensors.index.json"}
    for f in src.iterdir():
        if f.is_file() and f.name not in skip:
            shutil.copy2(f, dst / f.name)
    cfg["num_hidden_layers"] = num_layers
    if isinstance(cfg.get("layer_types"), list):
        cfg["layer_types"] = cfg["layer_types"][:num_layers]
    (dst / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    tensors = {}
    for path in weights:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                m = LAYER.search(name)
                if m is None or int(m.group(1)) < num_layers:
                    tensors[name] = f.get_tensor(name)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("src", help="an HF checkpoint folder (safetensors)")
    ap.add_argument("dst", help="the folder to write")
    ap.add_argument("--layers", type=int, required=True, help="decoder layers to keep")
    a = ap.parse_args()
    print(truncate_checkpoint(a.src, a.dst, a.layers))


if __name__ == "__main__":
    main()
