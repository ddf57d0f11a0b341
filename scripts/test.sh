#!/usr/bin/env bash
# Install, then run the whole test suite (unit + multi-process end-to-end) on CPU.
# Two pytest-xdist workers (NVLLM_TEST_WORKERS=0: one process), each taking a whole test
# module at a time (--dist loadscope) so a module's shared engine or server starts once,
# the long modules first (tests/conftest.py orders them). Much of an end-to-end test is
# waiting (process start-up, polls), so two run side by side in well under the time of one
# after the other, even on 2 cores. The install also builds the narrower-ISA CPU ops the
# suite tests, beside the native ones.
set -euo pipefail
cd "$(dirname "$0")/.."
NVLLM_BUILD_ISA_VARIANT=1 bash scripts/install.sh
exec python -m pytest -n "${NVLLM_TEST_WORKERS:-2}" --dist loadscope --no-loadscope-reorder "$@"
