"""Load an HF safetensors checkpoint (single file or sharded index) into a TP shard.

Each tensor is opened lazily (``safe_open(...).get_slice``) and the parameter's own
``weight_loader`` indexes just this rank's slice, so a worker reads only what it needs.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from tqdm import tqdm


def checkpoint_files(model_dir: str | Path) -> list[Path]:
    d = Path(model_dir)
    index = d / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [d / n for n in names]
    single = d / "model.safetensors"
    if single.is_file():
        return [single]
    files = sorted(d.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {d} (.bin is not supported)")
    return files


def _default_loader(param: nn.Parameter, src, shard_id=None) -> None:
    t = src[:]
    if tuple(t.shape) != tuple(param.shape):
        raise ValueError(f"shape {tuple(t.shape)} in checkpoint, {tuple(param.shape)} expected")
    param.data.copy_(t)


def load_weights(model: nn.Module, model_dir: str | Path, show_progress: bool = True) -> None:
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    files = checkpoint_files(model_dir)
    with tqdm(total=len(files), desc="Loading weights", unit="file",
              disable=not show_progress) as bar:
        for path in files:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                for hf_name in f.keys():
                    for name, shard_id in model.param_for(hf_name):
                        param = params.get(name)
                        if param is None:
                            raise KeyError(
                                f"checkpoint tensor {hf_name} has no place in the model "
                                f"({name}); is config.json the right one for these weights?")
                        loader = getattr(param, "weight_loader", _default_loader)
                        with torch.no_grad():
                            loader(param, f.get_slice(hf_name), shard_id)
                        loaded.add(name)
            bar.update(1)
    missing = sorted(set(params) - loaded)
    if missing:
        raise KeyError(f"checkpoint lacks weights for: {missing[:8]}"
                       f"{' ...' if len(missing) > 8 else ''}")
