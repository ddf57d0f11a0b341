"""A checkpoint's transformers config as plain attributes, read from a resolved copy so that
a worker need not import transformers' config classes.

Why: in transformers 5 every model config module (``configuration_llama`` and the rest)
imports ``utils.type_validators``, which pulls in its activations, hub kernels, attention
integrations and with them ``torch.export`` / ``torch.fx``: measured +70 MiB of resident
memory and +900 modules on top of ``import transformers`` (a bare worker is 225 MiB), in
every worker, for a dozen numbers. The model code reads those numbers as attributes
(``cfg.hidden_size``, ``getattr(cfg, "head_dim", None)``), nothing else.

What the worker reads is the *resolved* config: ``AutoConfig.from_pretrained(d).to_dict()``,
the class's defaults included (``save_pretrained`` leaves defaults out of config.json) and
the fields transformers standardizes at load in place (``rope_parameters`` from an older
file's ``rope_theta`` / ``rope_scaling``). It is computed by transformers itself, once per
(config.json bytes, transformers version), and cached as JSON under
``~/.cache/nvllm/hf-config`` (``$NVLLM_HF_CONFIG_DIR``). Whoever first meets a config
resolves it: the GGUF conversion, which has the config object in hand
(nvllm/common/model_source.py), or the first worker to load the folder, which then pays the
import once; every later start reads the JSON. So the attributes are transformers' values
by construction, not a copy of its defaults kept here. (Scaled rope types still call
transformers' rope initializers, with the base config class rebuilt from these
attributes: nvllm/worker/layers/rotary.py.)
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from importlib import metadata
from pathlib import Path
from types import SimpleNamespace
from typing import Any

logger = logging.getLogger(__name__)

CACHE_ENV = "NVLLM_HF_CONFIG_DIR"
# Bumped when what is cached changes meaning.
FORMAT = 1


def cache_dir() -> Path:
    root = os.environ.get(CACHE_ENV)
    return Path(root) if root else Path.home() / ".cache" / "nvllm" / "hf-config"


def cache_path(config_dir: str | os.PathLike) -> Path:
    """Where config_dir's resolved config lives: keyed by its config.json's bytes and the
    transformers version that resolves it."""
    h = hashlib.sha256(f"{FORMAT} {metadata.version('transformers')}\n".encode())
    h.update((Path(config_dir) / "config.json").read_bytes())
    return cache_dir() / f"{h.hexdigest()[:24]}.json"


def save_resolved(config_dir: str | os.PathLike, cfg: Any) -> dict[str, Any]:
    """Cache a transformers config object's full dict for config_dir (whose config.json it
    was loaded from or saved to); returns the dict."""
    return _save(cache_path(config_dir), cfg)


def _save(path: Path, cfg: Any) -> dict[str, Any]:
    """Written atomically: workers of one engine may resolve the same folder at once."""
    d = json.loads(json.dumps(cfg.to_dict(), default=str))
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".json")
        with os.fdopen(fd, "w") as f:
            json.dump(d, f)
        os.replace(tmp, path)
    except OSError as e:  # a read-only home: resolve again next time
        logger.warning("could not cache a resolved config in %s: %s", path.parent, e)
    return d


def resolved_dict(config_dir: str | os.PathLike) -> dict[str, Any]:
    """config_dir's resolved config as a dict: the cached JSON, else transformers'
    AutoConfig (imported here, once) and the result cached."""
    path = cache_path(config_dir)
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        pass
    from transformers import AutoConfig

    return _save(path, AutoConfig.from_pretrained(str(config_dir)))


def load_hf_config(config_dir: str | os.PathLike) -> SimpleNamespace:
    """The config's fields as attributes (what the model classes read)."""
    return SimpleNamespace(**resolved_dict(config_dir))
