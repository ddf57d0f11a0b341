#!/usr/bin/env bash
# Install nvllm and its test tools on a fresh CPU machine. torch is pinned to the CPU
# wheel first: an unpinned torch would pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore
python -m pip install -q "torch==2.13.0"
python -m pip install -q -e ".[dev]"
# The native CPU ops (nvllm/kernels/cpu_ops.py), compiled for this machine; nvllm runs
# without them (slower) where no compiler is found.
python -m nvllm.kernels.cpu_ops || echo "nvllm: running without the native CPU ops"
