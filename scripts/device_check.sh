#!/usr/bin/env bash
# One command for a session that is lent a GPU (see docs/testing.md, "GPU checks"): kernel tests on
# CUDA, the engine's CUDA exactness tests (CUDA graphs included), the MoE and quantized-GEMM
# checks, the kernel benchmark and the engine throughput benchmark against HF; results
# go to ${OUT:-/tmp/nvllm-device} (device_check.log, bench_kernels.json, bench_gpu.json).
# Budget: < 8 minutes.
#
# The GPU image has torch, triton, transformers, msgpack, click, xxhash, pytest but no
# pyzmq and no prometheus_client (the leader's metrics import it): carry both as wheels
# in .whl/ (git-ignored), prepared on the CPU machine with
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#     --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
#     --platform manylinux2014_x86_64 -d .whl pyzmq prometheus_client
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/nvllm-device}
mkdir -p "$OUT"
LOG="$OUT/device_check.log"
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl
fi
# The project itself goes on the path as source: no install step, no dependency resolution.
export PYTHONPATH="$PWD:/tmp/site:${PYTHONPATH:-}" PYTHONUNBUFFERED=1 TRITON_INTERPRET=0
export NVLLM_TINY_DIR=/tmp/nvllm-tiny
status=0
run() {  # run NAME TIMEOUT CMD...: log it, keep going, remember failures
  local name=$1 limit=$2; shift 2
  echo "=== $name" | tee -a "$LOG"
  timeout "$limit" "$@" 2>&1 | tee -a "$LOG"
  local rc=${PIPESTATUS[0]}
  echo "=== $name: rc=$rc" | tee -a "$LOG"
  [ "$rc" = 0 ] || status=1
}
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
} 2>&1 | tee "$LOG"
PYTEST=(python3 -m pytest -q -p no:cacheprovider -o "addopts=--import-mode=importlib")
run kernel-tests 150 "${PYTEST[@]}" tests/kernels
# Triton fused MoE at a per-rank shape (T=256 H=1024 I=512 E=8 K=2): max error vs a float32
# torch reference (fails past tolerance) and time vs a torch grouped reference; seconds.
run moe-check 90 python3 scripts/moe_check.py
# Triton quantized GEMMs (int8, int4, int4+min, fp8 on sm_89+) at Llama-3.1-8B's MLP
# shapes, bf16: max error vs a float32 matmul of the dequantized weights (fails past
# tolerance); times at 1/16/256 rows vs dense bf16 torch.mm and the reference path.
run quant-check 150 python3 scripts/quant_check.py
run cuda-e2e 180 "${PYTEST[@]}" tests/e2e/test_cuda.py
# Weight updates by CUDA IPC handle (CuPy, else the same calls over libcudart) and over a
# gloo group into a CUDA engine: outputs equal HF on the new weights.
run cuda-ipc-check 120 python3 scripts/cuda_ipc_check.py
run cuda-sleep 120 "${PYTEST[@]}" tests/e2e/test_cuda_sleep.py
run bench-kernels 120 python3 scripts/bench_kernels.py --json "$OUT/bench_kernels.json"
# Engine throughput: Qwen3-0.6B-shaped bf16, nano-vllm's workload, vs HF on the same GPU.
run bench-gpu 300 python3 scripts/bench_gpu.py --json "$OUT/bench_gpu.json"
echo "device check: $([ $status = 0 ] && echo PASSED || echo FAILED); log in $LOG" | tee -a "$LOG"
exit $status
