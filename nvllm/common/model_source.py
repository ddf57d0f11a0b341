"""What ``--model`` names, resolved once: where the config, the tokenizer and the weights
are, and in which format.

A folder is an HF checkpoint (config.json, tokenizer files, *.safetensors). A ``.gguf``
file (or the first of split files, ``name-00001-of-0000N.gguf``) carries its config,
tokenizer and chat template in its own metadata: transformers converts them once into an
HF-format folder in a cache (``$NVLLM_GGUF_DIR``, default ``~/.cache/nvllm/gguf``), keyed
by the file's resolved path, size and mtime and the transformers version, so nothing is
written beside the user's file. Every consumer (the config, the workers' model runner and
loader, the tokenizer, the grammar compiler, the gateway) reads ``ModelSource`` instead of
opening the user's path itself.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from nvllm.common.hf_config import save_resolved

logger = logging.getLogger(__name__)

FORMATS = ("hf", "gguf")
# llama.cpp's split files: name-00001-of-00003.gguf
_SPLIT = re.compile(r"^(?P<stem>.*)-(?P<i>\d{5})-of-(?P<n>\d{5})\.gguf$")


@dataclass(slots=True, frozen=True)
class ModelSource:
    """One resolved model: ``path`` as the user named it (expanded), its ``format`` ("hf" or
    "gguf"), the HF-format ``config_dir`` (config.json, generation_config.json; for GGUF the
    converted metadata in the cache), the ``tokenizer`` AutoTokenizer opens (``--tokenizer``
    or config_dir), and the ``weight_files`` (safetensors, or every GGUF split in order)."""

    path: str
    format: str
    config_dir: str
    tokenizer: str
    weight_files: tuple[str, ...]


def resolve_model_source(model: str | os.PathLike, tokenizer: str | None = None
                         ) -> ModelSource:
    """The ModelSource of a checkpoint folder or a .gguf file (converting a GGUF file's
    metadata on first use); ``tokenizer`` overrides where the tokenizer comes from."""
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        files = gguf_files(path)
        config_dir = str(gguf_metadata_dir(files[0]))
        return ModelSource(str(path), "gguf", config_dir, tokenizer or config_dir,
                           tuple(str(f) for f in files))
    if path.suffix == ".gguf":
        raise FileNotFoundError(f"GGUF file {path} does not exist")
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"{path} has no config.json: point --model at a local HF-format checkpoint "
            "folder or a .gguf file (nvllm does not download from a hub)")
    return ModelSource(str(path), "hf", str(path), tokenizer or str(path),
                       tuple(str(f) for f in safetensors_files(path)))


def safetensors_files(model_dir: str | os.PathLike) -> list[Path]:
    """An HF folder's weight files: the sharded index's, model.safetensors, or every
    *.safetensors (none: an empty list; the loader says so when it needs them)."""
    d = Path(model_dir)
    index = d / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [d / n for n in names]
    single = d / "model.safetensors"
    if single.is_file():
        return [single]
    return sorted(d.glob("*.safetensors"))


def gguf_files(path: str | os.PathLike) -> list[Path]:
    """Every part of a GGUF checkpoint, in order: ``path`` alone, or all N splits when it
    is one of ``stem-0000i-of-0000N.gguf`` (any of them may be named)."""
    path = Path(path)
    m = _SPLIT.match(path.name)
    if m is None:
        return [path]
    n = int(m["n"])
    parts = [path.with_name(f"{m['stem']}-{i:05d}-of-{n:05d}.gguf") for i in range(1, n + 1)]
    missing = [p.name for p in parts if not p.is_file()]
    if missing:
        raise FileNotFoundError(f"GGUF split files missing beside {path}: {missing}")
    return parts


# Bumped when _convert_gguf_metadata changes what it writes (folders made before are
# then converted again, not reused).
CONVERSION_VERSION = 1


def gguf_cache_root() -> Path:
    env = os.environ.get("NVLLM_GGUF_DIR")
    return Path(env) if env else Path.home() / ".cache" / "nvllm" / "gguf"


def gguf_metadata_dir(first: Path) -> Path:
    """The HF-format folder (config.json, generation_config.json, tokenizer files) made
    from a GGUF file's metadata by transformers, converted on first use. It is written to
    a temporary sibling and renamed into place, so concurrent processes (the leader, its
    workers, another engine) see a complete folder or none."""
    first = first.resolve()
    st = first.stat()
    # transformers' version from its metadata: importing it here would cost every process
    # that resolves the model (the leader, each worker) ~37 MiB it never uses again.
    key = hashlib.sha256(json.dumps(
        [str(first), st.st_size, st.st_mtime_ns, metadata.version("transformers"),
         CONVERSION_VERSION]).encode()).hexdigest()[:16]
    root = gguf_cache_root()
    target = root / f"{first.stem}-{key}"
    if (target / "config.json").is_file():
        return target
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{first.stem}.tmp-", dir=root))
    try:
        _convert_in_child(first, tmp)
        try:
            os.rename(tmp, target)
        except OSError:  # another process got there first: its folder is as good
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    logger.info("GGUF metadata of %s converted to %s", first, target)
    return target


# GGUF keys transformers 5's conversion leaves at the config class's default (Qwen3's
# head_dim 128, Qwen3-MoE's moe_intermediate_size 768) whatever the file says.
_MISSED_KEYS = {"attention.key_length": "head_dim",
                "expert_feed_forward_length": "moe_intermediate_size"}


_CONVERSION_ERROR = ".conversion-error.json"  # the child's exception, for the parent


def _convert_in_child(gguf_path: Path, out: Path) -> None:
    """_convert_gguf_metadata in a child process. transformers' GGUF config and tokenizer
    readers import transformers and torch: ~290 MiB that the first process to meet a file
    (a serving leader: 355 MiB instead of 63) would keep for its life. A ValueError in the
    child (an architecture nvllm does not read) is raised here as one."""
    error = out / _CONVERSION_ERROR
    r = subprocess.run([sys.executable, "-m", "nvllm.common.model_source", str(gguf_path),
                        str(out)], capture_output=True, text=True)
    if r.returncode == 0:
        return
    if error.is_file():
        e = json.loads(error.read_text())
        raise (ValueError if e["type"] == "ValueError" else RuntimeError)(e["message"])
    raise RuntimeError(f"converting the metadata of {gguf_path} failed (exit code "
                       f"{r.returncode}):\n{r.stderr[-4000:]}")


def _convert_gguf_metadata(gguf_path: Path, out: Path) -> None:
    from gguf import GGUFReader
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    reader = GGUFReader(gguf_path)
    arch = _field(reader, "general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(f"{gguf_path}: GGUF architecture {arch!r} is not supported; "
                         f"supported: {sorted(GGUF_ARCHITECTURES)}")
    d, name = str(gguf_path.parent), gguf_path.name
    cfg = AutoConfig.from_pretrained(d, gguf_file=name)
    for key, attr in _MISSED_KEYS.items():
        value = _field(reader, f"{arch}.{key}")
        if value is not None and hasattr(cfg, attr) and getattr(cfg, attr) != value:
            setattr(cfg, attr, int(value))
    del reader
    if not getattr(cfg, "architectures", None):
        cfg.architectures = [causal_lm_architecture(cfg.model_type)]
    if cfg.model_type == "mistral":
        # llama.cpp writes Mistral as "llama" and keeps no sliding window: like llama.cpp,
        # every layer attends to the whole context.
        cfg.sliding_window = None
    cfg.save_pretrained(out)
    save_resolved(out, cfg)  # workers read it without transformers' config classes
    tok = AutoTokenizer.from_pretrained(d, gguf_file=name)
    tok.save_pretrained(out)
    eos = tok.eos_token_id if tok.eos_token_id is not None else cfg.eos_token_id
    gen = GenerationConfig(bos_token_id=cfg.bos_token_id, eos_token_id=eos,
                           pad_token_id=getattr(cfg, "pad_token_id", None))
    gen.save_pretrained(out)
    (out / "nvllm_gguf_source.json").write_text(json.dumps({"gguf": str(gguf_path)}))


# The GGUF architectures (general.architecture) nvllm reads, and the HF model each is.
GGUF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
}


def _field(reader, key: str):
    field = reader.get_field(key)
    return None if field is None else field.contents()


def causal_lm_architecture(model_type: str) -> str | None:
    """The causal-LM class transformers' Auto classes pick for ``model_type``
    (``llama`` -> ``LlamaForCausalLM``), or None when it knows none."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)


if __name__ == "__main__":  # _convert_in_child's child: GGUF_PATH OUT_DIR
    try:
        _convert_gguf_metadata(Path(sys.argv[1]), Path(sys.argv[2]))
    except Exception as exc:
        (Path(sys.argv[2]) / _CONVERSION_ERROR).write_text(json.dumps(
            {"type": type(exc).__name__, "message": str(exc)}))
        raise
