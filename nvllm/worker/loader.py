"""Load a checkpoint into a TP shard: HF safetensors (single file or sharded index; float,
or AWQ / GPTQ 4-bit: nvllm/worker/awq_gptq.py) or GGUF (one file or llama.cpp's splits;
nvllm/worker/gguf_weights.py).

Each tensor is opened lazily (``safe_open(...).get_slice``, or a GGUF tensor's
memory-mapped blocks) and the parameter's own ``weight_loader`` indexes just this rank's
slice, so a worker reads only what it needs.
"""

from __future__ import annotations

import logging
import resource
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn
from tqdm import tqdm

from nvllm.common.model_source import ModelSource, resolve_model_source, safetensors_files

logger = logging.getLogger(__name__)


def checkpoint_files(model_dir: str | Path) -> list[Path]:
    files = safetensors_files(model_dir)
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {model_dir} (.bin is not "
                                "supported)")
    return files


def _default_loader(param: nn.Parameter, src, shard_id=None) -> None:
    t = src[:]
    if tuple(t.shape) != tuple(param.shape):
        raise ValueError(f"shape {tuple(t.shape)} in checkpoint, {tuple(param.shape)} expected")
    param.data.copy_(t)


@contextmanager
def _safetensors(path: str) -> Iterator[Iterator[tuple[str, object]]]:
    with safe_open(path, framework="pt", device="cpu") as f:
        yield ((name, f.get_slice(name)) for name in f.keys())


def _tensor_sources(source: ModelSource):
    """Per weight file, a context giving its (HF name, lazy slice) pairs."""
    if source.format == "hf":
        from nvllm.worker.awq_gptq import checkpoint_quant_config, packed_int4_tensors

        files = [str(f) for f in source.weight_files] or \
            [str(f) for f in checkpoint_files(source.path)]
        packed = checkpoint_quant_config(source.config_dir or source.path)
        if packed is not None:  # AWQ / GPTQ: a module's tensors may span files
            return [(files[0], lambda: packed_int4_tensors(files, packed))]
        from nvllm.worker.fp8_checkpoint import fp8_checkpoint_config, fp8_tensors

        fp8 = fp8_checkpoint_config(source.config_dir or source.path)
        if fp8 is not None:  # a weight and its scale may sit in different files too
            return [(files[0], lambda: fp8_tensors(files, fp8))]
        return [(f, lambda f=f: _safetensors(f)) for f in files]
    from nvllm.worker.gguf_weights import gguf_tensors, open_gguf

    meta: dict = {}

    @contextmanager
    def gguf(path: str):
        reader, arch, heads, kv = open_gguf(path)
        if not meta:  # the first split holds the metadata
            meta.update(arch=arch, heads=heads, kv=kv)
        yield gguf_tensors(reader, meta["arch"], meta["heads"], meta["kv"])

    return [(f, lambda f=f: gguf(f)) for f in source.weight_files]


def load_tensors(model: nn.Module, tensors: Iterable[tuple[str, Any]],
                 params: dict[str, nn.Parameter] | None = None,
                 shapes: dict[str, tuple[int, ...]] | None = None) -> set[str]:
    """Hand each (HF name, lazy source) to the weight_loader of the parameter it feeds;
    returns the names of the parameters loaded. `shapes`, when given, gets each tensor's
    full shape (what a later weight update must match)."""
    params = dict(model.named_parameters()) if params is None else params
    loaded: set[str] = set()
    for hf_name, src in tensors:
        if shapes is not None:
            shapes[hf_name] = tuple(src.get_shape() if hasattr(src, "get_shape")
                                    else src.shape)
        for name, shard_id in model.param_for(hf_name):
            param = params.get(name)
            if param is None:
                raise KeyError(
                    f"checkpoint tensor {hf_name} has no place in the model "
                    f"({name}); is config.json the right one for these weights?")
            loader = getattr(param, "weight_loader", _default_loader)
            with torch.no_grad():
                loader(param, src, shard_id)
            loaded.add(name)
    return loaded


def load_weights(model: nn.Module, source: ModelSource | str | Path,
                 show_progress: bool = True,
                 shapes: dict[str, tuple[int, ...]] | None = None) -> tuple[float, float]:
    """Load ``source`` (a ModelSource, or a checkpoint folder / .gguf path) into
    ``model``, each parameter's weight_loader reading only its own shard; logs and
    returns the seconds it took and the process's peak RSS (MiB) by its end. `shapes`:
    as for load_tensors."""
    if not isinstance(source, ModelSource):
        source = resolve_model_source(source)
    t0 = time.perf_counter()
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    files = _tensor_sources(source)
    with tqdm(total=len(files), desc="Loading weights", unit="file",
              disable=not show_progress) as bar:
        for _path, open_file in files:
            with open_file() as tensors:
                loaded |= load_tensors(model, tensors, params, shapes)
            bar.update(1)
    missing = sorted(set(params) - loaded)
    if missing:
        raise KeyError(f"checkpoint lacks weights for: {missing[:8]}"
                       f"{' ...' if len(missing) > 8 else ''}")
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    seconds = time.perf_counter() - t0
    logger.info("weights of %s (%s, %d file(s)) loaded in %.2fs; peak RSS %.0f MiB",
                source.path, source.format, len(files), seconds, peak_mib)
    return seconds, peak_mib
